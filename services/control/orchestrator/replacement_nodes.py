"""Where a rebuild in place may put its replacements, and which of them a lost node holds
(issue 29 item 4): pure functions of the incident and the job's record (no I/O, no clock, no
lock), table-tested in tests/control/test_replacement_nodes.py.

Why: a rank and its node agent stopped together (a frozen node) were rebuilt with the
replacement on that same node, because the silent rank's own worker is tried first and the
agent's own silence is declared later than the rank's. The replacement then waited for the
node to wake, and the node's later ``worker_lost`` (and ``agent_silent``) were taken as
consequences of the open incident, so nothing placed it again: no step for 120 s (measured,
docs/LOG.md, session 29 measure29). Two rules end that:

- ``left_out``: a rebuild in place puts no replacement on the silent rank's worker when L1-3
  said its agent was not heard from since the rank went silent (``FaultReport.agent_unheard``);
  the others are tried (as a relaunch of every rank does once the agent is held), and with no
  slot elsewhere the policy's refusal path decides (relaunch every rank, shrink, or wait).
- ``waiting_on``: the replacements a recovery waits for on a worker just lost (or whose agent
  went silent): not a consequence of the incident but a fault of the recovery, decided anew
  (a rebuild again, placed elsewhere), never waited for until the node wakes.
"""

from __future__ import annotations

from services.contract import control_pb2
from services.control.orchestrator.job import _Incident, _Job
from services.jobspec import IN_PLACE_ACTIONS

# L1-3's class of a rank silent past its deadline (fault_detector/rules.py RANK_SILENT).
RANK_SILENT = "rank_silent"


def left_out(incident: _Incident) -> list[str]:
    """The workers ``incident``'s placement leaves out: those the decision excluded, and for
    a rebuild in place of a silent rank whose node agent was not heard from since, that
    rank's worker (for this placement only: the allocator keeps no exclusion of a rebuild in
    place, and a relaunch of every rank instead finds the node held once its agent is
    declared silent)."""
    out = list(incident.exclude)
    cause = incident.cause
    frozen = cause.fault_class == RANK_SILENT and cause.agent_unheard and cause.worker_id
    if incident.action in IN_PLACE_ACTIONS and frozen and cause.worker_id not in out:
        out.append(cause.worker_id)
    return out


def waiting_on(job: _Job, worker_id: str) -> list[int]:
    """The ranks ``job``'s rebuild in place relaunched on ``worker_id`` and still waits for
    (not reported ready): [] when no rebuild is in flight, it placed nothing there yet, or
    its replacements there are ready. Where each one went is not known rank by rank (the
    relaunch's reply names the workers), so every replacement not ready is counted: the
    rebuild decided anew replaces them all (a rebuild during a rebuild does)."""
    incident = job.incident
    if incident is None or incident.action not in IN_PLACE_ACTIONS or not incident.relaunched:
        return []
    if not worker_id or worker_id not in incident.placed_on:
        return []
    return [r for r in incident.lost if r not in job.started]


def held_detail(ranks: list[int], silent: control_pb2.FaultReport) -> str:
    """The detail of the ``worker_lost`` a job is decided on when the node agent of a worker
    holding its waited-for replacements ``ranks`` is reported silent (``silent``)."""
    names = ", ".join(map(str, ranks))
    return (
        f"the replacement of rank(s) {names} waits on {silent.worker_id}, whose node agent is silent: {silent.detail}"
    )
