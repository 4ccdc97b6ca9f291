"""A data service that is down is no training fault: the job waits for it (its ranks alive, their
relays reconnecting) up to ``fault_policy.data_outage_seconds``, says so in its status, goes on
when it is back, and is PAUSED (never FAILED) with a hint once the wait is over. The decision as
a table (services/control/fault_decision.py), the detector's grading, and the orchestrator driven
in-process through the real bus, with the test standing in for the node agents."""

from __future__ import annotations

import time

import pytest

from services.contract import Module, control_pb2, data_pb2, engine_pb2, route_pb2, worker_pb2
from services.control.__main__ import build
from services.control.fault_decision import DATA_OUTAGE, JobView, decide, give_up, wait_seconds
from services.control.fault_detector import DEFAULT_RULES, failure_class
from services.control.job_store import JobStore
from services.engine.training_loop import _data_fault_class
from services.jobspec import FaultPolicySpec, JobSpecError, parse_job_spec

from . import test_fault_policy
from .conftest import Plane, drain, spec_yaml, stop_plane
from .test_fault_policy import QUICK, decisions, resumes, running, saved

JobState, JobOutcome, FaultGrade = control_pb2.JobState, control_pb2.JobOutcome, control_pb2.FaultGrade
pytestmark = pytest.mark.timeout(30)
FRESH = JobView(restarts={}, ignored={}, job_id="j1")
store = test_fault_policy.store  # the store's verdicts, stood in for (a fixture)


@pytest.fixture
def plane(tmp_path, store):
    control = build(JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    yield Plane(control)
    stop_plane(control)


def outage_report() -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        fault_class=DATA_OUTAGE, grade=FaultGrade.SEVERE, rank=1, step=7, detail="data service at d:1 unreachable"
    )


# ------------------------------------------------------------------ the decision (pure)


def test_a_data_outage_past_its_wait_pauses_the_job_with_a_hint_by_default():
    policy = FaultPolicySpec()
    assert wait_seconds(policy, DATA_OUTAGE) == 300.0  # the documented default
    d = give_up(policy, DATA_OUTAGE, "the data service stayed unreachable for 300 s", "j1")
    assert (d.action, d.verdict, d.outcome) == ("pause", engine_pb2.STEP_STOP, JobOutcome.OUTCOME_UNSPECIFIED)
    assert d.final == (
        "paused: the data service stayed unreachable for 300 s; bring the data service back (`surgectl up` starts "
        "what is down, or `surgectl restart data`), then `surgectl resume j1` continues it from its newest checkpoint"
    )
    # The ranks' own report, once their reconnection is spent (the backstop), decides the same.
    d = decide(policy, FRESH, outage_report())
    assert (d.action, d.counted) == ("pause", "pause") and d.final.startswith("paused: SEVERE data_outage: ")
    assert d.final.endswith("then `surgectl resume j1` continues it from its newest checkpoint")
    assert d.restart == 0  # no restart budget is spent on waiting


@pytest.mark.parametrize(
    "action, expected, outcome",
    [("stop", "stop", JobOutcome.FAILED), ("restart_ranks", "restart_ranks", JobOutcome.OUTCOME_UNSPECIFIED)],
)
def test_the_policy_may_fail_or_relaunch_a_job_whose_data_service_stays_down(action, expected, outcome):
    policy = FaultPolicySpec(actions={DATA_OUTAGE: action}, data_outage_seconds=5)
    assert wait_seconds(policy, DATA_OUTAGE) == 5
    d = decide(policy, FRESH, outage_report())
    assert (d.action, d.outcome) == (expected, outcome)


def test_data_outage_seconds_and_the_pause_action_are_validated_naming_the_field():
    spec = parse_job_spec(spec_yaml(extra="fault_policy: {data_outage_seconds: 42}"), "job.yaml")
    assert spec.fault_policy.data_outage_seconds == 42
    for bad, said in [
        ("fault_policy: {data_outage_seconds: 0}", "fault_policy.data_outage_seconds"),
        ("fault_policy: {data_outage_seconds: -3}", "fault_policy.data_outage_seconds"),
        (
            "fault_policy: {actions: {rank_exit: pause}}",
            "actions.rank_exit: pause applies only to data_outage, data_corrupt",
        ),
        ("fault_policy: {actions: {SEVERE: pause}}", "actions.SEVERE: pause applies only to data_outage, data_corrupt"),
    ]:
        with pytest.raises(JobSpecError, match=said.replace(".", r"\.")):
            parse_job_spec(spec_yaml(extra=bad), "job.yaml")


def test_an_unreachable_data_service_is_graded_data_outage_never_fatal():
    assert failure_class("DatasetUnavailable", route_pb2.FAILURE_UNAVAILABLE) == DATA_OUTAGE
    assert DEFAULT_RULES[DATA_OUTAGE] == FaultGrade.SEVERE
    # A missing or refused dataset is still what it was (the same on every retry).
    assert failure_class("DatasetUnavailable", route_pb2.FAILURE_INVALID_INPUT) == "config_error"
    # The loop repeats the relay's failure by its typed cause, so either report decides the same.
    unreachable = data_pb2.DatasetUnavailable(failure=route_pb2.Failure(cause=route_pb2.FAILURE_UNAVAILABLE))
    assert _data_fault_class(unreachable) == DATA_OUTAGE
    assert _data_fault_class(data_pb2.DatasetUnavailable(reason="no such dataset")) == "data_unavailable"


# ------------------------------------------------------------------ the wait (orchestrator)


def unreachable(plane: Plane, session, job_id: str, rank: int, *, back: bool = False) -> None:
    msg = data_pb2.DataServiceUnreachable(
        job_id=job_id,
        rank=rank,
        split="train",
        address="127.0.0.1:7001",
        reason="data service unreachable at 127.0.0.1:7001: connection refused",
        back=back,
        waited_seconds=2.5 if back else 0.0,
    )
    plane.rank_event(session, job_id, rank, unreachable=msg)


def records(plane: Plane, job_id: str, kind: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == kind]


def wait_until(read, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := read()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def released(session) -> list:
    """The commands sent on ``session`` until a release is among them (waited for)."""
    sent: list = []
    wait_until(lambda: sent.extend(drain(session)) or any(c.WhichOneof("command") == "release" for c in sent))
    return sent


def test_a_job_waits_for_its_data_service_and_goes_on_when_it_is_back_with_no_decision(plane):
    job_id, w = running(plane, "wa", "wb")
    unreachable(plane, w["wa"], job_id, 0)
    unreachable(plane, w["wb"], job_id, 1)
    s = plane.get(job_id)
    assert s.state == JobState.RUNNING  # ranks alive, nothing relaunched
    assert s.message.startswith("waiting for the data service: data service at 127.0.0.1:7001 unreachable")
    assert "`surgectl up` starts what is down (or `surgectl restart data`)" in s.message
    assert s.message.endswith("the fault policy decides after 300 s (fault_policy.data_outage_seconds)")
    assert len(records(plane, job_id, "data")) == 1  # one record for the job, not one per rank
    unreachable(plane, w["wa"], job_id, 0, back=True)
    assert len(records(plane, job_id, "data")) == 1  # rank 1 still waits
    unreachable(plane, w["wb"], job_id, 1, back=True)
    s = plane.get(job_id)
    back = records(plane, job_id, "data")[-1]
    assert back.startswith("data service back after ") and "at the batch where it stopped" in back
    assert (s.state, s.message) == (JobState.RUNNING, back)
    assert decisions(plane, job_id) == [] and records(plane, job_id, "fault") == []
    assert [c for s in w.values() for c in drain(s) if c.WhichOneof("command") in ("release", "launch")] == []


def test_a_data_service_down_past_data_outage_seconds_pauses_the_job_and_a_resume_relaunches_it(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {data_outage_seconds: 0.5}")
    store.verdicts = [(saved(plane, w["wa"], job_id, 1, step=4), 4, True)]
    t0 = time.monotonic()
    unreachable(plane, w["wa"], job_id, 0)
    s = wait_until(lambda: (s := plane.get(job_id)).state == JobState.PAUSED and s)
    assert time.monotonic() - t0 >= 0.5
    assert s.outcome == JobOutcome.OUTCOME_UNSPECIFIED  # never FAILED
    assert s.message.startswith("paused: SEVERE data_outage: the data service stayed unreachable for 0.5 s")
    assert s.message.endswith(
        "bring the data service back (`surgectl up` starts what is down, or `surgectl restart data`), then "
        f"`surgectl resume {job_id}` continues it from its newest checkpoint"
    )
    assert decisions(plane, job_id)[-1].startswith("pause after data_outage of rank 0: fault policy")
    for session in w.values():  # the waiting ranks are ended, their slots freed
        # (the release follows the decision's journal commit, on another thread: waited for; read
        # at once it was not there yet once, at load ~25)
        sent = released(session)
        (release,) = [c for c in sent if c.WhichOneof("command") == "release"]
        assert release.release.kill
    # The ranks' reports as they go (their relays' failure, their exits) are no new fault.
    plane.rank_event(
        w["wb"],
        job_id,
        1,
        failed=data_pb2.DatasetUnavailable(
            name="x", version="v1", failure=route_pb2.Failure(cause=route_pb2.FAILURE_UNAVAILABLE, rank=1)
        ),
    )
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True)
    assert plane.get(job_id).state == JobState.PAUSED and len(decisions(plane, job_id)) == 1
    # Once the data service is up the operator resumes it: relaunched from its newest checkpoint.
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert s.state == JobState.WARMING_UP
    assert resumes(w["wa"]) == [f"{job_id}:1"]


def test_a_job_paused_by_the_operator_whose_data_service_stays_down_is_parked_with_the_hint(plane):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {data_outage_seconds: 0.3}")
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=3))
    assert plane.get(job_id).state == JobState.PAUSED
    unreachable(plane, w["wa"], job_id, 0)
    wait_until(lambda: plane.get(job_id).message.startswith("paused: SEVERE data_outage"))
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.PAUSED, JobOutcome.OUTCOME_UNSPECIFIED)
    sent: list = []  # (the release follows the decision's journal commit: on another thread)
    wait_until(
        lambda: (
            sent.extend(drain(w["wa"])) or any(c.WhichOneof("command") == "release" and c.release.kill for c in sent)
        )
    )


def test_a_job_whose_start_waits_for_the_data_service_is_paused_not_failed(plane):
    sessions = {w: plane.register(w) for w in ("wa", "wb")}
    job_id = plane.submit(dp=2, steps=20, extra=QUICK + "\nfault_policy: {data_outage_seconds: 0.3}").job_id
    assert plane.get(job_id).state == JobState.WARMING_UP
    msg = data_pb2.DataServiceUnreachable(job_id=job_id, rank=0, address="127.0.0.1:7001", reason="refused")
    plane.rank_event(sessions["wa"], job_id, 0, unreachable=msg)  # (its mount: no split)
    assert "rank 0's mount" in plane.get(job_id).message
    s = wait_until(lambda: (s := plane.get(job_id)).state == JobState.PAUSED and s)
    assert s.outcome == JobOutcome.OUTCOME_UNSPECIFIED and s.message.startswith("paused: ")


def test_the_detector_gives_a_waiting_rank_the_outage_on_top_of_its_data_wait_budget():
    from services.control.fault_detector import _Job

    job = _Job(heartbeat_timeout_s=3, stall_min_s=30, stall_step_factor=5, attribution_s=0, data_outage_s=300)
    wait = worker_pb2.RankPhase.PHASE_DATA_WAIT
    assert job.phase_deadline_s(wait) == 30
    assert job.phase_deadline_s(wait, data_outage=True) == 330
    assert job.phase_deadline_s(worker_pb2.RankPhase.PHASE_FORWARD, data_outage=True) == 30
    # An evaluation's batches come from the data service too.
    evaluation = worker_pb2.RankPhase.PHASE_EVALUATION
    assert job.phase_deadline_s(evaluation, 2, data_outage=True) == job.phase_deadline_s(evaluation, 2) + 300


def test_the_detector_reports_a_relay_waiting_and_back_as_data_outage_for_the_orchestrator():
    from services.control.fault_detector import FaultDetector

    reports: list[control_pb2.FaultReport] = []
    detector = FaultDetector(reports.append)
    try:
        detector.start_fault_monitoring(control_pb2.StartFaultMonitoring(job_id="j", data_outage_seconds=60))
        msg = data_pb2.DataServiceUnreachable(job_id="j", rank=1, split="train", address="d:1", reason="refused")
        detector.on_data_service_unreachable(msg)
        msg.back, msg.waited_seconds = True, 4.0
        detector.on_data_service_unreachable(msg)
    finally:
        detector.close()
    assert [(r.fault_class, r.event, r.rank, r.cleared) for r in reports] == [
        (DATA_OUTAGE, "DataServiceUnreachable", 1, False),
        (DATA_OUTAGE, "DataServiceUnreachable", 1, True),
    ]
    assert reports[0].source == Module.L4_DATASET_VERSIONS
    assert reports[1].detail == "data service at d:1 answers again after 4.0 s (rank 1's train stream)"


def test_a_peer_waiting_in_a_collective_for_a_rank_that_waits_for_data_is_no_stall_even_if_its_beat_is_late():
    """Rank 0 waits for the data service (its relay reconnects), rank 1 for rank 0 in the step's
    all-reduce, past its stall deadline (0.5 s), while rank 0's beats are late for a moment (a
    loaded host): rank 1 waits, nothing is reported but the outage."""
    import threading

    from services.control.fault_detector import FaultDetector

    reports: list[control_pb2.FaultReport] = []
    detector = FaultDetector(reports.append)
    late = threading.Event()
    done = threading.Event()

    def beat(rank: int, phase: int) -> None:
        detector.on_rank_heartbeat(
            worker_pb2.RankHeartbeat(
                job_id="j",
                rank=rank,
                step=3,
                stepping=True,
                step_seconds=0.01,
                worker_id="w",
                interval_seconds=0.1,
                phase=phase,
            )  # fmt: skip
        )

    def beats(rank: int, phase: int, pause: threading.Event | None = None) -> None:
        while not done.wait(0.1):
            if pause is None or not pause.is_set():
                beat(rank, phase)

    try:
        detector.start_fault_monitoring(
            control_pb2.StartFaultMonitoring(
                job_id="j",
                heartbeat_timeout_seconds=1.0,
                heartbeat_timeout_running_seconds=1.0,
                stall_min_seconds=0.5,
                stall_step_factor=0.01,
                data_outage_seconds=60,
            )  # fmt: skip
        )
        beat(0, worker_pb2.PHASE_DATA_WAIT)
        detector.on_data_service_unreachable(
            data_pb2.DataServiceUnreachable(job_id="j", rank=0, split="train", address="d:1", reason="refused")
        )
        beat(1, worker_pb2.PHASE_COLLECTIVE)
        threads = [
            threading.Thread(target=beats, args=(0, worker_pb2.PHASE_DATA_WAIT, late), daemon=True),
            threading.Thread(target=beats, args=(1, worker_pb2.PHASE_COLLECTIVE), daemon=True),
        ]
        late.set()  # rank 0's beats stop for 0.8 s, across rank 1's deadline
        for t in threads:
            t.start()
        time.sleep(0.8)
        late.clear()
        time.sleep(2.0)  # past any hold of a stall for rank 0's silence deadline (1 s)
    finally:
        done.set()
        detector.close()
    assert [r.fault_class for r in reports] == [DATA_OUTAGE], [(r.fault_class, r.detail) for r in reports]


def test_a_rank_whose_data_service_is_back_gets_its_whole_budget_from_then_not_a_stall_at_once():
    """CI's once-seen extra restart (ci27, tests/faults/test_data_outage.py): rank 0 waited for the
    data service longer than its data wait's budget without the outage; when its relay said
    ``back`` the deadline was re-armed from its last progress, before the outage, so it fired at
    once. Rank 0's next beat (a new phase) dropped its held stall, but rank 1, waiting in the
    all-reduce for rank 0's paced step, stayed held as its consequence and was released as the
    incident once the hold (1.5 beats) passed before its own beat moved on (a loaded host).
    Now the budget counts from ``back``: rank 0 moves on within it and nothing is reported."""
    from services.control.fault_detector import FaultDetector

    reports: list[control_pb2.FaultReport] = []
    detector = FaultDetector(reports.append)

    def beat(rank: int, step: int, phase: int) -> None:
        detector.on_rank_heartbeat(
            worker_pb2.RankHeartbeat(
                job_id="j",
                rank=rank,
                step=step,
                stepping=True,
                step_seconds=0.01,
                worker_id=f"w{rank}",
                interval_seconds=0.2,
                phase=phase,
            )  # fmt: skip
        )

    outage = data_pb2.DataServiceUnreachable(job_id="j", rank=0, split="train", address="d:1", reason="refused")
    try:
        detector.start_fault_monitoring(
            control_pb2.StartFaultMonitoring(
                job_id="j",
                heartbeat_timeout_seconds=30.0,
                heartbeat_timeout_running_seconds=30.0,
                stall_min_seconds=0.6,
                stall_step_factor=0.01,
                attribution_seconds=0.1,
                data_outage_seconds=60,
            )  # fmt: skip
        )
        beat(0, 3, worker_pb2.PHASE_DATA_WAIT)
        beat(1, 3, worker_pb2.PHASE_COLLECTIVE)
        detector.on_data_service_unreachable(outage)
        for _ in range(6):  # 1.2 s down, twice rank 0's budget without the outage; both beat on
            time.sleep(0.2)
            beat(0, 3, worker_pb2.PHASE_DATA_WAIT)
            beat(1, 3, worker_pb2.PHASE_COLLECTIVE)
        outage.back, outage.waited_seconds = True, 1.2
        detector.on_data_service_unreachable(outage)  # (before rank 0's next beat: it comes with a batch)
        time.sleep(0.2)
        beat(0, 3, worker_pb2.PHASE_FORWARD)  # rank 0 has its batch: its paced step runs
        beat(1, 3, worker_pb2.PHASE_COLLECTIVE)
        time.sleep(0.4)  # longer than a hold (1.5 beats: 0.3 s) while rank 1 still waits
        beat(0, 4, worker_pb2.PHASE_DATA_WAIT)
        beat(1, 4, worker_pb2.PHASE_DATA_WAIT)
        time.sleep(0.3)
    finally:
        detector.close()
    assert [(r.fault_class, r.cleared) for r in reports] == [(DATA_OUTAGE, False), (DATA_OUTAGE, True)], [
        (r.fault_class, r.rank, r.detail) for r in reports
    ]
