"""What a frozen node is to a job's recovery (issue 29 item 4): pure functions of the report,
the incident and the job's record (no I/O, no clock, no lock), table-tested in
tests/control/test_replacement_nodes.py.

Why: a rank and its node agent stopped together (a frozen node) under ``rebuild`` cost the job
its whole recovery deadline. First the replacement went to that node (the silent rank's own
worker is tried first, the agent's own silence is declared later than the rank's): no step
for 120 s (docs/LOG.md, session 29 measure29). Then, with the replacement placed elsewhere,
the survivors stayed blocked in their all-reduce with the stopped rank, whose process cannot
be ended while its agent is frozen (a survivor blocked in gloo is freed only by its peer's
death): the rebuilt group never formed, first step 124.9 s after the stop (session 29
frozen29). The rules:

- ``unkillable``: a rank silent whose node agent L1-3 did not hear from since
  (``FaultReport.agent_unheard``) cannot be ended, so a rebuild in place cannot free its
  survivors: the policy's rebuild (or shrink) becomes ``restart_ranks`` (triage's
  ``_no_rebuild``, said in the decision), whose survivors are killed by their own healthy
  agents. L1-3 reports that agent ``agent_silent`` with it (fault_detector/liveness.py), so
  the relaunch finds the node held (no rank placed there) until the agent's next beat lifts
  the hold: the node is left out of that relaunch, not of the job (an exclusion would last
  the job's life). With no slot elsewhere the refusal path decides (wait, as for any hold).
- ``waiting_on``: the replacements a recovery waits for on a worker just lost (or whose agent
  went silent): not a consequence of the incident but a fault of the recovery, decided anew
  (a rebuild again, placed elsewhere), never waited for until the node wakes.
"""

from __future__ import annotations

from services.contract import control_pb2
from services.control.orchestrator.job import _Job
from services.jobspec import IN_PLACE_ACTIONS

# L1-3's class of a rank silent past its deadline (fault_detector/rules.py RANK_SILENT).
RANK_SILENT = "rank_silent"
WORKER_LOST = "worker_lost"


def unkillable(report: control_pb2.FaultReport) -> str:
    """Why ``report``'s rank cannot be ended, so no rebuild in place can free its survivors
    ("": nothing says so): a silent rank whose node agent was not heard from since."""
    if report.fault_class not in (RANK_SILENT, WORKER_LOST) or not report.agent_unheard:
        return ""  # (worker_lost: L1-3 names the silent agent itself, subclass agent_silent)
    where = f" on {report.worker_id}" if report.worker_id else ""
    return (
        f"rank {report.rank}'s node agent{where} is unheard, its process cannot be ended "
        "(its survivors would wait in their collective with it)"
    )


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
