"""L1-1's triage as a table (services/control/orchestrator/triage.py): what a graded fault
report is to its job, before any policy is read. No bus, no process: a job record and a
report in, one kind out, nothing of either changed."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from services.contract import control_pb2, route_pb2
from services.control.orchestrator.job import RESTORING, WAITING_STORE, _Incident, _Job
from services.control.orchestrator.triage import (
    CONSEQUENCE,
    JOB_ENDED,
    LATE,
    NEW_INCIDENT,
    NORMAL_END,
    RELEASED,
    RESUMED,
    STALE,
    STORE_WAIT,
    triage,
)
from services.jobspec import parse_job_spec

from .conftest import spec_yaml

JobState = control_pb2.JobState
SPEC = parse_job_spec(spec_yaml(dp=4))


def report(
    fault_class: str,
    rank: int,
    *,
    detected: float = 0.0,
    occurred: float = 0.0,
    replaced: bool = False,
    generation: int = 0,
    cause: int = 0,
) -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id="j",
        grade=control_pb2.SEVERE,
        fault_class=fault_class,
        rank=rank,
        detected_unix=detected,
        occurred_unix=occurred,
        replaced=replaced,
        generation=generation,
        cause=cause,
    )


def incident(action: str = "restart_ranks", *, dying: dict[int, int] | None = None, **kw) -> _Incident:
    return _Incident(
        cause=report("rank_exit", 1),
        fault_class="rank_exit",
        action=action,
        decided=0.0,
        dying=Counter(dying or {}),
        **kw,
    )


def job(state: int = JobState.RUNNING, **kw) -> _Job:
    return _Job(status=control_pb2.JobStatus(job_id="j", state=state, world_size=4), spec=SPEC, **kw)


def recovered(action: str = "restart_ranks", **kw) -> _Job:
    """A job whose last incident recovered at unix time 100."""
    return job(last_incident=incident(action, recovered_unix=100.0, **kw))


UNAVAILABLE, TIMEOUT = route_pb2.FailureCause.FAILURE_UNAVAILABLE, route_pb2.FailureCause.FAILURE_TIMEOUT


def restoring(action: str = "restart_ranks", **kw) -> _Incident:
    """A recovery whose ranks were relaunched to load a version and have not all reported ready."""
    return incident(action, relaunched=True, phase=RESTORING, **kw)


def load_failed(cause: int, rank: int = 1) -> control_pb2.FaultReport:
    """A rank's loop that failed loading its checkpoint (StoreUnavailable etc.), typed ``cause``."""
    return report("checkpoint_error", rank, cause=cause)


def relaunched_again() -> _Job:
    """A job whose restored recovery's relaunch was commanded again at unix time 100."""
    return job(activity=incident(repeated_unix=100.0))


# (name, job, report, the kind triage gives)
CASES = [
    ("a lost rank of a running job", job(), report("rank_exit", 1), NEW_INCIDENT),
    ("a silent rank", job(), report("rank_silent", 2), NEW_INCIDENT),
    ("anything once the job ended", job(JobState.TERMINATED), report("rank_exit", 1), JOB_ENDED),
    ("an exit control asked for", job(), report("rank_released", 0), RELEASED),
    ("the clean exit of a finished rank", job(finished={0: False}), report("rank_exit_clean", 0), NORMAL_END),
    ("the clean exit of a rank that never finished", job(finished={1: False}), report("rank_exit_clean", 0), NEW_INCIDENT),
    # A recovery in flight: the failed generation's ranks it kills are its consequences.
    ("a dying rank's exit", job(activity=incident(dying={2: 1})), report("rank_exit", 2), CONSEQUENCE),
    ("a dying rank's release", job(activity=incident(dying={2: 1})), report("rank_released", 2), CONSEQUENCE),
    ("a dying rank's broken collective", job(activity=incident(dying={0: 1})), report("comm_error", 0), CONSEQUENCE),
    # A restart before its relaunch is placed: a rank not dying had its end counted already (the
    # cause, an earlier exit), and nothing else of it runs: a second end is of that incarnation.
    ("a rank not dying ends again during a restart", job(activity=incident(dying={2: 1})), report("rank_exit", 3),
     CONSEQUENCE),
    ("a relaunched rank's exit", job(activity=incident(dying={2: 1}, relaunched=True)), report("rank_exit", 3),
     NEW_INCIDENT),
    # A restart relaunches every rank: before its relaunch is placed, a broken collective can
    # only be the failed generation's, even once that rank's exit was seen (CI, stop 43).
    ("a restart's killed rank's comm_error after its exit", job(activity=incident(dying={})), report("comm_error", 0),
     CONSEQUENCE),
    ("a restart's killed rank's stall after its exit", job(activity=incident(dying={})),
     report("rank_stalled_in_collective", 0), CONSEQUENCE),
    ("a relaunched rank's own comm_error", job(activity=incident(dying={}, relaunched=True)), report("comm_error", 0),
     NEW_INCIDENT),
    ("a replaced rank's comm_error after the relaunch", job(activity=incident(dying={}, relaunched=True)),
     report("comm_error", 0, replaced=True), CONSEQUENCE),
    # Admitted by the relay before the relaunch's launch reached it (not stated replaced), held
    # by L1-3 for its attribution window, triaged after the relaunch was placed: its generation
    # says it is the failed one's (test_recovery's SIGKILL case, decided as a second fault).
    ("a failed generation's comm_error triaged after the relaunch",
     job(activity=incident(dying={}, relaunched=True), generations={0: 2}), report("comm_error", 0, generation=1),
     CONSEQUENCE),
    ("the relaunched generation's own comm_error",
     job(activity=incident(dying={}, relaunched=True), generations={0: 2}), report("comm_error", 0, generation=2),
     NEW_INCIDENT),
    ("a rollback in place's live rank's comm_error", job(activity=incident("rollback", reload=True)),
     report("comm_error", 0), NEW_INCIDENT),
    # A rebuild in place: the survivors' collectives break under them.
    ("a rebuild's survivor's comm_error", job(activity=incident("rebuild", lost=[1])), report("comm_error", 0), CONSEQUENCE),
    ("a rebuild's survivor's stall", job(activity=incident("shrink", lost=[1])), report("rank_stalled_in_collective", 3), CONSEQUENCE),
    ("the rebuilt rank's own comm_error", job(activity=incident("rebuild", lost=[1], relaunched=True)),
     report("comm_error", 1), NEW_INCIDENT),
    ("a lost rank's comm_error before its replacement", job(activity=incident("rebuild", lost=[1])),
     report("comm_error", 1), CONSEQUENCE),
    ("a lost rank's comm_error after its replacement", job(activity=incident("rebuild", lost=[1], relaunched=True)),
     report("comm_error", 1, replaced=True), CONSEQUENCE),
    ("a rebuild's survivor's comm_error after the placement",
     job(activity=incident("rebuild", lost=[1], relaunched=True)), report("comm_error", 0), CONSEQUENCE),
    ("a survivor that dies", job(activity=incident("rebuild", lost=[1])), report("rank_exit", 0), NEW_INCIDENT),
    # Report order (session 38, order43): a rank's exit reaches L1-1 through its node agent's
    # process watcher, its own failure through its stream, L1-3's grade of its silence from a
    # deadline, a second end from a reconnecting agent or its node's closed session: any order.
    # The cause's exit (rank 1, not dying) first, then what that incarnation said: a consequence.
    ("restart: the cause's loop failure after its exit", job(activity=incident(dying={0: 1, 2: 1, 3: 1})),
     report("loop_failure", 1), CONSEQUENCE),
    ("restart: the cause's non-finite loss after its exit", job(activity=incident(dying={0: 1, 2: 1, 3: 1})),
     report("non_finite_loss", 1), CONSEQUENCE),
    ("restart: the cause's silence graded after its exit", job(activity=incident(dying={0: 1, 2: 1, 3: 1})),
     report("rank_silent", 1), CONSEQUENCE),
    ("restart: the cause's stall graded after its exit", job(activity=incident(dying={0: 1, 2: 1, 3: 1})),
     report("rank_stalled", 1), CONSEQUENCE),
    ("restart: the cause lost with its node after its exit", job(activity=incident(dying={0: 1, 2: 1, 3: 1})),
     report("worker_lost", 1), CONSEQUENCE),
    ("restart: a rank lost with its node, then its exit", job(activity=incident(dying={0: 1, 3: 1})),
     report("rank_exit", 2), CONSEQUENCE),
    ("restart: the cause's failure while waiting for capacity",
     job(activity=incident(dying={}, phase="waiting_capacity")), report("loop_failure", 1), CONSEQUENCE),
    # ... the other order: the failure first opens the incident, its exit is a dying rank's (above).
    ("restart: the cause's exit after its failure", job(activity=incident(dying={0: 1, 1: 1, 2: 1, 3: 1})),
     report("rank_exit", 1), CONSEQUENCE),
    # Once the relaunch is placed, a rank's report is its new incarnation's unless replaced.
    ("restart: a relaunched rank's loop failure", job(activity=incident(relaunched=True)), report("loop_failure", 1),
     NEW_INCIDENT),
    ("restart: the old cause's loop failure after the relaunch", job(activity=incident(relaunched=True)),
     report("loop_failure", 1, replaced=True), STALE),
    # A broken collective L1-3 held for its cause past the relaunch, its rank's exit (stated
    # replaced, published at once) having taken its dying count: its generation says it.
    ("restart: a held collective of the replaced generation", job(activity=incident(relaunched=True), generations={0: 2}),
     report("comm_error", 0, generation=1), CONSEQUENCE),
    ("restart: the relaunched generation's own collective", job(activity=incident(relaunched=True), generations={0: 2}),
     report("comm_error", 0, generation=2), NEW_INCIDENT),
    ("restart: a relaunched rank silent", job(activity=incident(relaunched=True)), report("rank_silent", 2),
     NEW_INCIDENT),
    # A rebuild: the lost rank's reports before its replacement is placed are of the one lost;
    # a survivor's own failure (not its broken collective) is a new loss.
    ("rebuild: the lost rank's loop failure after its exit", job(activity=incident("rebuild", lost=[1])),
     report("loop_failure", 1), CONSEQUENCE),
    ("rebuild: the lost rank's silence after its exit", job(activity=incident("rebuild", lost=[1])),
     report("rank_silent", 1), CONSEQUENCE),
    ("rebuild: the replacement's own failure", job(activity=incident("rebuild", lost=[1], relaunched=True)),
     report("loop_failure", 1), NEW_INCIDENT),
    ("rebuild: a survivor's loop failure", job(activity=incident("rebuild", lost=[1])), report("loop_failure", 0),
     NEW_INCIDENT),
    ("rebuild: a survivor's silence", job(activity=incident("shrink", lost=[1])), report("rank_silent", 2),
     NEW_INCIDENT),
    # A rollback in place kills no rank: a live rank's failure is its own.
    ("rollback in place: a live rank's loop failure", job(activity=incident("rollback", reload=True)),
     report("loop_failure", 1), NEW_INCIDENT),
    ("rollback in place: a live rank's exit", job(activity=incident("rollback", reload=True)),
     report("rank_exit", 1), NEW_INCIDENT),
    # After the recovery: a symptom that happened before it recovered is late, not new.
    ("a comm_error from before the recovery", recovered(), report("comm_error", 0, occurred=90.0), LATE),
    ("a comm_error after the recovery", recovered(), report("comm_error", 0, occurred=110.0), NEW_INCIDENT),
    ("a comm_error with no time", recovered(), report("comm_error", 0), NEW_INCIDENT),
    ("a rank exit is never late", recovered(), report("rank_exit", 0, occurred=90.0), NEW_INCIDENT),
    ("the rebuilt rank's comm_error after", recovered("rebuild", lost=[1]), report("comm_error", 1, occurred=90.0), NEW_INCIDENT),
    ("a rebuild's survivor, late", recovered("rebuild", lost=[1]), report("comm_error", 0, occurred=90.0), LATE),
    # A recovery restored from the journal after a control restart.
    ("resumed: a killed rank's exit", job(activity=incident(dying={1: 1}, resumed=True)), report("rank_exit", 1), CONSEQUENCE),
    ("resumed: a relaunched rank is silent", job(activity=incident(resumed=True)), report("rank_silent", 1), RESUMED),
    ("resumed: a release of a rank not dying", job(activity=incident(resumed=True)), report("rank_released", 3), RESUMED),
    ("relaunched again: a report graded before", relaunched_again(), report("rank_silent", 1, detected=90.0), CONSEQUENCE),
    ("relaunched again: a report graded after", relaunched_again(), report("rank_silent", 1, detected=110.0), NEW_INCIDENT),
    # The end of an incarnation the job replaced (its generation older than its rank's newest),
    # come up late: its agent was frozen past its deadline (session 36, F2), it reconnected, or
    # control restarted. Never a new incident, whatever its class or when it comes.
    ("a replaced rank's exit, running", job(), report("rank_exit", 0, replaced=True), STALE),
    ("a replaced rank's exit, after the recovery", recovered(), report("rank_exit", 0, occurred=90.0, replaced=True), STALE),
    ("a replaced rank's clean exit", job(finished={0: False}), report("rank_exit_clean", 0, replaced=True), STALE),
    ("a replaced rank's OOM kill", job(), report("rank_oom", 1, replaced=True), STALE),
    ("a replaced rank lost with its node", job(), report("worker_lost", 1, replaced=True), STALE),
    ("replaced, another recovery in flight", job(activity=incident(dying={2: 1})), report("rank_exit", 0, replaced=True), STALE),
    ("resumed: a replaced rank's exit", job(activity=incident(resumed=True)), report("rank_exit", 3, replaced=True), STALE),
    # ... unless an incident expects it (its kill) or control asked for it: as before.
    ("a dying rank's exit, replaced", job(activity=incident(dying={2: 1})), report("rank_exit", 2, replaced=True), CONSEQUENCE),
    ("resumed: a killed rank's exit, replaced", job(activity=incident(dying={1: 1}, resumed=True)), report("rank_exit", 1, replaced=True),
     CONSEQUENCE),
    ("a replaced rank's release", job(), report("rank_released", 0, replaced=True), RELEASED),
    # A relaunched rank's load the store did not answer (its typed cause), the ranks relaunched
    # to load a version: the store's outage, waited for; never a fault of the recovery.
    ("restart: a relaunched rank's load, store unreachable", job(activity=restoring()), load_failed(UNAVAILABLE),
     STORE_WAIT),
    ("restart: a relaunched rank's load, store timed out", job(activity=restoring()), load_failed(TIMEOUT), STORE_WAIT),
    ("rollback: a relaunched rank's load, store unreachable", job(activity=restoring("rollback")),
     load_failed(UNAVAILABLE), STORE_WAIT),
    ("restart: a relaunched rank's load, the version's bytes wrong", job(activity=restoring()),
     load_failed(route_pb2.FailureCause.FAILURE_DATA_CORRUPT), NEW_INCIDENT),
    ("restart: a relaunched rank's load, refused", job(activity=restoring()),
     load_failed(route_pb2.FailureCause.FAILURE_IO), NEW_INCIDENT),
    ("restart: a load failure while the store is asked", job(activity=incident(relaunched=True, phase=WAITING_STORE)),
     load_failed(UNAVAILABLE), NEW_INCIDENT),
    ("rebuild: the replacement's load, store unreachable", job(activity=restoring("rebuild", lost=[1])),
     load_failed(UNAVAILABLE), NEW_INCIDENT),
    ("rollback in place: a live rank's load, store unreachable",
     job(activity=restoring("rollback", reload=True)), load_failed(UNAVAILABLE), NEW_INCIDENT),
    ("running: a load failure with no recovery", job(), load_failed(UNAVAILABLE), NEW_INCIDENT),
    ("restart: a failed generation's load failure after the wait began", job(activity=incident(phase=WAITING_STORE)),
     load_failed(UNAVAILABLE), CONSEQUENCE),
]  # fmt: skip


@pytest.mark.parametrize(("j", "r", "kind"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triage(j: _Job, r: control_pb2.FaultReport, kind: str):
    before = copy.deepcopy(j)
    assert triage(r, j) == kind
    # Read only: no rank counted as exited, no dying entry made by a lookup.
    assert j == before
    if j.incident is not None:
        assert dict(j.incident.dying) == dict(before.incident.dying)
