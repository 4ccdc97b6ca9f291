"""What a fault report is to a job, before any policy is read: pure functions of the report and
the job's record (no I/O, no clock, no lock, nothing written), table-tested without a bus
(tests/control/test_triage.py).

:func:`triage` sorts a graded ``FaultReport`` of a job into one of:

- ``NEW_INCIDENT``: a fault of its own; the fault policy decides (``fault_decision.decide``),
  also the loss of a node holding a replacement a rebuild waits for (replacement_nodes.py);
- ``CONSEQUENCE``: of the incident being recovered from (a rank of the failed generation that
  the recovery kills, a rebuild's survivor whose collective broke under it): recorded only;
- ``LATE``: a failed collective the last incident caused, reported after it recovered: recorded;
- ``RELEASED``: an exit control asked for (``rank_released``): recorded, nothing to decide;
- ``STALE``: the end of an incarnation the job already replaced (``FaultReport.replaced``: its
  generation older than the newest launched of its rank), come up late (through an agent that
  was frozen, a reconnecting agent, a control restart) and expected by no incident: recorded
  as that incarnation's end, nothing to decide, no fault counted (its loss was decided when
  it was replaced);
- ``NORMAL_END``: the clean exit of a rank whose loop reported finished: no fault;
- ``RESUMED``: a report during a recovery restored from the journal, which says its relaunch
  is not all there (``Orchestrator._on_resumed_fault``: relaunched again, no restart spent);
- ``STORE_WAIT``: a relaunched rank's load that failed because the store could not be asked
  (``checkpoint_error`` typed unavailable or timeout: the store down or paused, nothing of the
  version's bytes): the recovery waits for the store and relaunches again
  (``Orchestrator._load_outage``), no new fault, no restart spent;
- ``JOB_ENDED``: the job is TERMINATED, or PAUSED and parked (ranks exiting after the end, or
  after their job was paused with its ranks gone): nothing at all.
"""

from __future__ import annotations

from typing import Literal

from services.contract import control_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.job import RESTORING, JobState, _Incident, _Job
from services.control.orchestrator.replacement_nodes import unkillable, waiting_on
from services.jobspec import (
    IN_PLACE_ACTIONS,
    rebuild_refusal,
)

# Fault classes that state a rank process ended (FaultReport.fault_class, see the detector).
_EXITS = frozenset(
    {
        "rank_exit",
        "rank_exit_clean",
        "rank_oom",
        "rank_memory_error",
        "rank_not_started",
        "rank_released",
        "worker_lost",
        "worker_departed",
    }
)


# Failure events routed to L1-1 as well as to L1-3 that L1-1 handles and records itself as
# they arrive (FaultReport.event): SnapshotFailed, a skipped save ("training continues"), a
# failed load or verification. L1-3's grade of one is decided like any report, but an ignore
# leaves no second record: see Orchestrator._handled_on_receipt.
_HANDLED_ON_RECEIPT = frozenset({"SnapshotFailed"})


def _no_rebuild(job: _Job, report: control_pb2.FaultReport) -> str:
    """Why the job's ranks cannot rebuild their group in place now for ``report`` ("": they
    can). During a rebuild another lost rank is rebuilt again as long as a rank that held
    the state before the first loss survives (a replacement that dies while it starts, or a
    second survivor lost, costs nothing of the training); only when none is left, or during
    another kind of recovery, is every rank relaunched from the checkpoint. Nor when a rank
    went silent with its node agent unheard (replacement_nodes.py ``unkillable``)."""
    if why := unkillable(report):
        return why
    i = job.incident
    if i is not None and i.action in IN_PLACE_ACTIONS:
        holders = set(range(job.status.world_size)) - set(i.lost) - set(_lost_ranks(job, report))
        if holders:
            return ""
        return f"no rank that held the state survives (rebuild after {i.fault_class} of rank {i.cause.rank})"
    if i is not None:
        return f"a recovery is in flight ({i.action} after {i.fault_class} of rank {i.cause.rank})"
    if job.status.state != JobState.RUNNING:
        return f"the job is {JobState.Name(job.status.state)}, not training"
    if job.pending:
        return f"a {job.pending} is in flight"
    return rebuild_refusal(job.spec)


def _no_reload(job: _Job) -> str:
    """Why a rollback cannot load its version into the job's live ranks now ("": it can:
    every rank of the running job waits in its loop, none gone, nothing else in flight)."""
    i = job.incident
    if i is not None:
        return f"a recovery is in flight ({i.action} after {i.fault_class} of rank {i.cause.rank})"
    if job.status.state != JobState.RUNNING:
        return f"the job is {JobState.Name(job.status.state)}, not training"
    if job.exited:
        return f"rank(s) {', '.join(map(str, sorted(job.exited)))} exited"
    if job.pending:
        return f"a {job.pending} is in flight"
    if job.spec.precision.dtype == "fp16":  # (InitPrecision is pushed once: L2-4's scaler keeps its state)
        return "the job trains in fp16, whose loss scaler's state cannot be given to live ranks again"
    return ""


def _lost_ranks(job: _Job, report: control_pb2.FaultReport) -> list[int]:
    """The ranks a rebuild replaces: the rank the fault names, and for a lost node agent
    every rank it ran. A failed collective alone (comm_error) loses no rank: every rank
    survives and the group is rebuilt with the same processes."""
    if report.fault_class == "comm_error":
        return []
    lost = {report.rank}
    if report.fault_class in ("worker_lost", "worker_departed") and report.worker_id:
        lost |= {r for r, w in job.placement.items() if w == report.worker_id}
    return sorted(lost)


# Fault classes that say a rank's node went away under it (its agent's session closed, or
# the node leaves): a replacement placed there will not start (replacement_nodes.py).
_NODE_GONE = frozenset({"worker_lost", "worker_departed"})


# What a survivor of a rebuild reports as its group breaks under it: consequences of the
# incident, not faults of their own.
_SURVIVOR_SYMPTOMS = frozenset({"comm_error", "rank_stalled_in_collective"})


CONSEQUENCE_DETAIL_CHARS = 160


def _consequence(report: control_pb2.FaultReport, of: str) -> str:
    """The event line of a report recorded as a consequence of an incident, not decided on:
    without L1-3's grade (SEVERE after every rebuild read as a new failure) and with the
    first ``CONSEQUENCE_DETAIL_CHARS`` of its detail (a broken collective's text runs to
    hundreds of characters and repeats in the report of every module it went through)."""
    return f"{report.fault_class}, expected: {_clipped(report.detail)} (consequence of {of})"


def consequence_event(report: control_pb2.FaultReport, of: str) -> tuple[str, str]:
    """(event type, line) of a consequence recorded, not decided on. A rank the recovery
    killed (``rank_released``: the exit control asked for) is the rank's end, type ``rank``
    as every released rank's ("rank N ended after its release: ..."), never a ``fault``:
    `surgectl events --type fault` lists real faults only (fresh36 F8)."""
    if report.fault_class == "rank_released":
        return "rank", f"rank {report.rank} ended after its release: {_clipped(report.detail)} (consequence of {of})"
    return "fault", _consequence(report, of)


def _stale_text(report: control_pb2.FaultReport) -> str:
    """The record of a replaced incarnation's end, or of a failure it reported (``STALE``):
    without L1-3's grade (no fault)."""
    if report.fault_class not in _EXITS:
        return f"rank {report.rank} ({report.fault_class}) of a replaced generation failed: {report.detail}"
    return f"rank {report.rank} ({report.fault_class}) ended after its generation was replaced: {report.detail}"


def _clipped(detail: str) -> str:
    """``detail`` on one line, its first ``CONSEQUENCE_DETAIL_CHARS``."""
    detail = " ".join(detail.split())
    if len(detail) > CONSEQUENCE_DETAIL_CHARS:
        detail = detail[: CONSEQUENCE_DETAIL_CHARS - 1].rstrip() + "…"
    return detail


def _survivor_symptom(incident: _Incident, report: control_pb2.FaultReport, job: _Job) -> bool:
    """Whether ``report`` is a collective that broke under the incident: a rebuild's
    survivor's (its group is rebuilt under it until the recovery ends), or one of a rank the
    incident replaces, of its failed generation: before the relaunch is placed nothing else
    of that rank runs; after it, its incarnation was replaced. Its exit may come first (CI,
    stop 43: a killed rank's exit was applied before its comm_error, which was then decided
    as a second fault). A rollback in place (``reload``) kills no rank: its ranks'
    collectives are their own."""
    if report.fault_class not in _SURVIVOR_SYMPTOMS or incident.reload:
        return False
    if incident.action in IN_PLACE_ACTIONS and report.rank not in incident.lost:
        return True
    return not incident.relaunched or _replaced(report, job)


def _ended_already(incident: _Incident, report: control_pb2.FaultReport) -> bool:
    """Whether ``report`` is of a rank the incident replaces whose end was already counted
    (its exit was the cause, or came before this: ``dying`` holds no exit of it any more),
    arriving before the relaunch is placed: nothing of that rank runs but the failed
    incarnation, so whatever it says is about that one, which ended. Its reports travel
    other paths than its exit (its loop's failure through its own stream, L1-3's grade of
    its silence, a second end from an agent reconnecting or its node's session closing), so
    they may come after it: each was decided as a second fault (a second restart spent, the
    new decision's cause the failed rank's own words). A restart relaunches every rank, a
    rebuild its lost ones; a rollback in place (``reload``) kills none."""
    return awaits_relaunch(incident, report.rank)


def awaits_relaunch(incident: _Incident, rank: int) -> bool:
    """Whether ``rank`` is one ``incident`` relaunches and its relaunch is not placed yet:
    whatever of it reports now is of the failed incarnation (the placement's reply is applied
    under the orchestrator's lock, so nothing a relaunch started is read before it). A
    restored recovery (``resumed``) or its relaunch commanded again (``repeated_unix``) may
    have relaunched already: their own rules (``triage``, ``on_training_loop_started``)."""
    if incident.reload or incident.relaunched or incident.resumed or incident.repeated_unix:
        return False
    return incident.action not in IN_PLACE_ACTIONS or rank in incident.lost


def _relaunch_load_outage(incident: _Incident, report: control_pb2.FaultReport) -> bool:
    """Whether ``report`` is a relaunched rank's load that failed because the store could not be
    asked, while ``incident`` restores from a version (the ranks were relaunched to load it; a
    rebuild or a rollback in place loads nothing from a relaunch): the store's outage, not a
    fault of the recovery (a paused store was decided as ``checkpoint_error``: a restart spent,
    the job rolled back)."""
    return (
        fd.load_outage(report)
        and incident.phase == RESTORING
        and incident.relaunched
        and not incident.reload
        and incident.action not in IN_PLACE_ACTIONS
    )


def _late_symptom(incident: _Incident, report: control_pb2.FaultReport) -> bool:
    """Whether ``report``, arriving after ``incident`` recovered, is a failed collective it
    caused before that: a rebuild's survivor's, or any rank's of a relaunched generation
    (every rank was replaced: seen when a rank died during a resize's pause, the survivors'
    comm_error came after the relaunch and was decided as a second fault)."""
    if report.fault_class not in _SURVIVOR_SYMPTOMS or not 0 < report.occurred_unix <= incident.recovered_unix:
        return False
    return incident.action not in IN_PLACE_ACTIONS or report.rank not in incident.lost


Triage = Literal[
    "new_incident", "consequence", "late", "released", "stale", "normal_end", "resumed", "store_wait", "job_ended"
]
NEW_INCIDENT: Triage = "new_incident"
CONSEQUENCE: Triage = "consequence"
LATE: Triage = "late"
RELEASED: Triage = "released"
STALE: Triage = "stale"
NORMAL_END: Triage = "normal_end"
RESUMED: Triage = "resumed"
STORE_WAIT: Triage = "store_wait"
JOB_ENDED: Triage = "job_ended"


def _replaced(report: control_pb2.FaultReport, job: _Job) -> bool:
    """The report's incarnation was replaced: the relay says so (its fence saw the newer
    launch), or its generation is older than the newest this job launched of the rank
    (journaled: after a control restart the fence knows only what it saw since, so an old
    agent's exit that comes up before the newer incarnation's agent re-registers is not
    stated replaced)."""
    return report.replaced or 0 < report.generation < job.generations.get(report.rank, 0)


def triage(report: control_pb2.FaultReport, job: _Job) -> Triage:
    """What ``report`` is to ``job`` (read only: nothing of either is changed). The order is
    the order of precedence: a consequence of the incident in flight is never a new fault,
    whatever its class."""
    if job.status.state == JobState.TERMINATED or (job.status.state == JobState.PAUSED and job.parked):
        return JOB_ENDED  # (parked: its ranks are gone, drained or paused by the policy)
    ended = report.fault_class in _EXITS
    incident = job.incident
    if incident is not None and (
        incident.resumed
        or (incident.repeated_unix and report.detected_unix and report.detected_unix <= incident.repeated_unix)
    ):
        # A recovery restored from the journal (or its relaunch commanded again): the exit of
        # a rank it kills, or a report graded before the relaunch went again (about the ranks
        # it replaced), is a consequence; anything else says the relaunch is not all there.
        if incident.repeated_unix or (ended and incident.dying[report.rank] > 0):
            return CONSEQUENCE
        return STALE if _replaced(report, job) else RESUMED  # (a replaced incarnation says nothing of the relaunch)
    late = job.last_incident if incident is None else None  # (a symptom from before it recovered)
    if late is not None and _late_symptom(late, report):
        return LATE
    if (
        incident is not None
        and report.fault_class in _NODE_GONE
        and not _replaced(report, job)
        and waiting_on(job, report.worker_id)
    ):
        # A replacement the rebuild waits for went with its node (its old rank's exit may be
        # due too): the recovery's own fault, decided anew (placed elsewhere), never waited out.
        return NEW_INCIDENT
    if incident is not None and (incident.dying[report.rank] > 0 or _survivor_symptom(incident, report, job)):
        return CONSEQUENCE
    if report.fault_class == "rank_released":
        return RELEASED
    if _replaced(report, job):
        return STALE  # (its generation was replaced: nothing of it is the job's now)
    if report.fault_class == "rank_exit_clean" and report.rank in job.finished:
        return NORMAL_END  # its loop reported finished first: the normal end of that rank
    if incident is not None and _ended_already(incident, report):
        return CONSEQUENCE  # (its exit came first: what it reports is of the incarnation that ended)
    if incident is not None and _relaunch_load_outage(incident, report):
        return STORE_WAIT
    return NEW_INCIDENT
