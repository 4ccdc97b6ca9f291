"""`surgectl down`'s drain against a scripted control (no processes): which jobs are asked to
pause as a drain, when, and what is waited for; and, through control's real servicer on real
gRPC, that `down` and `up` act on control's typed refusal reasons, never on their words."""

from __future__ import annotations

import json
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from services.cli import drain
from services.cli.errors import CliError
from services.contract import control_pb2, control_pb2_grpc, route_pb2, store_pb2
from services.contract.bus import Reply
from services.control.orchestrator import IllegalTransition, InsufficientResources
from services.control.server import ControlServicer

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


class FakeControl:
    """GetJob answers each job's scripted states in turn (the last one repeats);
    PauseJob records the drain and answers the job's current state."""

    def __init__(self, scripts: dict[str, list[int]], operators: tuple[str, ...] = ()):
        self.scripts = {j: list(states) for j, states in scripts.items()}
        self.paused: list[str] = []
        self.operators = operators  # paused by the operator: `up` leaves them PAUSED (not drained)

    def _now(self, job_id: str) -> control_pb2.JobStatus:
        states = self.scripts[job_id]
        state = states.pop(0) if len(states) > 1 else states[0]
        return control_pb2.JobStatus(
            job_id=job_id,
            state=state,
            step=7,
            checkpoint_version=f"{job_id}:1",
            checkpoint_step=7,
            drained=state == JobState.PAUSED and job_id not in self.operators,
        )

    def GetJob(self, query, timeout=None):
        return self._now(query.job_id)

    def PauseJob(self, req, timeout=None):
        assert req.drain
        self.paused.append(req.job_id)
        return control_pb2.JobStatus(job_id=req.job_id, state=JobState.RUNNING)


def job(job_id: str, state: int) -> control_pb2.JobStatus:
    return control_pb2.JobStatus(job_id=job_id, state=state)


def test_running_and_paused_jobs_are_drained_a_warming_up_one_once_it_runs_a_recovering_one_not(monkeypatch):
    monkeypatch.setattr(drain, "POLL_S", 0.0)
    control = FakeControl(
        {
            "run": [JobState.RUNNING, JobState.RUNNING, JobState.PAUSED],
            "paused": [JobState.PAUSED],
            "warm": [JobState.WARMING_UP, JobState.WARMING_UP, JobState.RUNNING, JobState.RUNNING, JobState.PAUSED],
            "frozen": [JobState.FAULT_FROZEN],
        }
    )
    said: list[str] = []
    drained = drain.drain(
        control,
        [
            job("run", JobState.RUNNING),
            job("paused", JobState.PAUSED),
            job("warm", JobState.WARMING_UP),
            job("frozen", JobState.FAULT_FROZEN),
        ],
        10.0,
        said.append,
    )
    assert sorted(drained) == ["paused", "run", "warm"]
    assert sorted(control.paused) == ["paused", "run", "warm"]  # each asked once, frozen never
    assert any(line.startswith("frozen: FAULT_FROZEN") and "not drained" in line for line in said)
    assert "run: PAUSED at step 7 (run:1); `surgectl up` resumes it" in said


def test_a_job_that_does_not_pause_in_time_leaves_the_stack_running_with_one_line(monkeypatch):
    monkeypatch.setattr(drain, "POLL_S", 0.01)
    control = FakeControl({"stuck": [JobState.RUNNING]})
    with pytest.raises(CliError) as caught:
        drain.drain(control, [job("stuck", JobState.RUNNING)], 0.1, lambda line: None)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        "not drained within 0 s: stuck (RUNNING); the stack keeps running"
    )
    assert "--force" in message


def test_a_job_that_faults_while_it_drains_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(drain, "POLL_S", 0.0)
    control = FakeControl({"x": [JobState.RUNNING, JobState.RUNNING, JobState.FAULT_FROZEN]})
    assert drain.drain(control, [job("x", JobState.RUNNING)], 10.0, lambda line: None) == []
    assert control.paused == ["x"]


def _unsaved_drain_refusal(monkeypatch, failing=None) -> str:
    """`down`'s refusal of job "run", paused at step 7 with its newest checkpoint at step 4 (its
    drain checkpoint not saved; ``failing``: its JobStatus.save_failing)."""

    class Unsaved(FakeControl):
        def _now(self, job_id):
            status = super()._now(job_id)
            status.checkpoint_step, status.drained = 4, False
            if failing is not None:
                status.save_failing.CopyFrom(failing)
            return status

    control = Unsaved({"run": [JobState.PAUSED]})
    monkeypatch.setattr(drain.time, "sleep", lambda s: None)
    with pytest.raises(CliError) as e:
        drain.drain(control, [job("run", JobState.RUNNING)], timeout_s=5, say=lambda line: None)
    return str(e.value)


def test_a_job_paused_beyond_its_newest_checkpoint_keeps_the_stack_running(monkeypatch):
    # Its drain checkpoint could not be saved (the store away): stopping the stack would lose
    # the steps since the newest checkpoint, so down refuses in one line.
    message = _unsaved_drain_refusal(monkeypatch)
    assert "\n" not in message and message.startswith(
        "not drained: run (paused at step 7, newest checkpoint run:1 "
        "at step 4): its steps since that checkpoint would be lost"
    )


@pytest.mark.parametrize(
    "failing, why, again",
    [
        (  # the disk full: the store answered and refused the write
            control_pb2.SaveFailing(
                failed=2, step=7, cause=store_pb2.WRITE_REFUSED, write_error=route_pb2.WRITE_NO_SPACE, path="/s/ck"
            ),
            "; its save failed: the store answered but refused the write: no space at /s/ck",
            "`surgectl down` again once you free space at /s/ck, or `--force` to lose them",
        ),
        (  # the store stopped
            control_pb2.SaveFailing(failed=1, step=7, cause=store_pb2.UNREACHABLE),
            "; its save failed: the store did not answer (unreachable)",
            "`surgectl down` again once the store answers, or `--force` to lose them",
        ),
        (  # the store's timeout
            control_pb2.SaveFailing(failed=1, step=7, cause=store_pb2.TIMEOUT),
            "; its save failed: the store did not answer in time",
            "`surgectl down` again once the store answers, or `--force` to lose them",
        ),
    ],
)
def test_a_refused_drain_says_why_its_save_failed_in_the_state_the_stack_is_in(monkeypatch, failing, why, again):
    """The refusal names control's typed cause of the failed save: a store that answered and
    refused the write (the disk full) is not "once the store answers" (was said of every
    failure: a fresh SRE's trial, F1)."""

    message = _unsaved_drain_refusal(monkeypatch, failing)
    assert "\n" not in message and message.startswith(
        f"not drained: run (paused at step 7, newest checkpoint run:1 at step 4{why}): its steps since that "
        "checkpoint would be lost; the stack keeps running"
    ), message
    assert message.endswith(f"({again})"), message


class ScriptedOrchestrator:
    """What control's real servicer relays the operator's commands to (its user port):
    GetJob answers each job's scripted states in turn; PauseJob and ResumeJob raise the
    orchestrator's own refusals, one per call, then answer."""

    def __init__(self, states: dict[str, list[int]], refusals: dict[str, list[Exception]]):
        self.states, self.refusals = states, refusals
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request, payload=None):
        kind = type(request).__name__
        if kind == "JobQuery" and not request.job_id:
            return Reply(control_pb2.JobList(jobs=[control_pb2.JobStatus(job_id=j, drained=True) for j in self.states]))
        self.calls.append((kind, request.job_id))
        if kind != "JobQuery" and self.refusals.get(request.job_id):
            raise self.refusals[request.job_id].pop(0)
        states = self.states[request.job_id]
        state = states.pop(0) if len(states) > 1 else states[0]
        return Reply(control_pb2.JobStatus(job_id=request.job_id, state=state, outcome=JobOutcome.STOPPED))


@pytest.fixture
def control_server():
    """Control's real ControlServicer on real gRPC, relaying to a scripted orchestrator."""
    servers = []

    def serve(orchestrator):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        control_pb2_grpc.add_ControlServiceServicer_to_server(
            ControlServicer(orchestrator, watches=None, sessions=None), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        server.stop(grace=0)


def test_a_stop_in_flight_is_waited_for_by_control_s_typed_refusal_not_its_words(control_server, monkeypatch):
    monkeypatch.setattr(drain, "POLL_S", 0.0)
    words = "job {} is already stopping after step 9"
    control = ScriptedOrchestrator(
        {
            "typed": [JobState.RUNNING, JobState.RUNNING, JobState.TERMINATED],
            "words": [JobState.RUNNING, JobState.RUNNING, JobState.TERMINATED],
        },
        {
            "typed": [IllegalTransition(words.format("typed"), control_pb2.REFUSED_STOP_PENDING)],
            "words": [IllegalTransition(words.format("words")), IllegalTransition(words.format("words"))],
        },
    )
    with grpc_stub(control_server(control)) as stub:
        said: list[str] = []
        assert (
            drain.drain(stub, [job("typed", JobState.RUNNING), job("words", JobState.RUNNING)], 10.0, said.append) == []
        )
    pauses = [j for kind, j in control.calls if kind == "PauseJobRequest"]
    # The typed stop in flight is asked once and waited for; the same words without the reason
    # are an other refusal: asked again while the job runs.
    assert pauses.count("typed") == 1 and pauses.count("words") == 2
    assert "typed: ended meanwhile (STOPPED)" in said


def test_a_resume_waits_for_capacity_by_control_s_typed_refusal_not_its_words(control_server, monkeypatch):
    monkeypatch.setattr(drain.time, "sleep", lambda s: None)
    needs = "cannot resume {} now: it needs 2 ranks (parallel.dp=2) but 1 is free on 1 registered worker"
    control = ScriptedOrchestrator(
        {"typed": [JobState.WARMING_UP], "words": [JobState.WARMING_UP]},
        {"typed": [InsufficientResources(needs.format("typed"))], "words": [IllegalTransition(needs.format("words"))]},
    )
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", control_server(control))
    resumed, failed = drain.resume_drained(10.0, lambda line: None)
    # No capacity yet (typed): asked again, resumed; the same words untyped: one line, given up.
    assert resumed == ["typed"] and failed == [f"words: {needs.format('words')}"]
    assert [j for kind, j in control.calls if kind == "ResumeJobRequest"] == ["typed", "typed", "words"]


@contextmanager
def grpc_stub(address: str):
    with grpc.insecure_channel(address) as ch:
        yield control_pb2_grpc.ControlServiceStub(ch)


def test_a_forced_down_asks_control_to_park_each_live_job_and_says_what_became_of_each():
    class Parking:
        def __init__(self):
            self.asked: list[tuple[str, bool, bool]] = []

        def ListJobs(self, query, timeout=None):
            jobs = [job("ckpt", JobState.RUNNING), job("fresh", JobState.RUNNING), job("done", JobState.TERMINATED)]
            jobs.append(job("held", JobState.PAUSED))
            return control_pb2.JobList(jobs=jobs)

        def PauseJob(self, req, timeout=None):
            self.asked.append((req.job_id, req.drain, req.force))
            if req.job_id == "ckpt":  # a checkpoint to resume from: parked
                return control_pb2.JobStatus(
                    job_id="ckpt",
                    state=JobState.PAUSED,
                    step=12,
                    drained=True,
                    checkpoint_version="ckpt:2",
                    checkpoint_step=10,
                )
            if req.job_id == "held":  # the operator's pause, parked before (a `down` that stopped the stack)
                return control_pb2.JobStatus(
                    job_id="held", state=JobState.PAUSED, step=8, checkpoint_version="held:1", checkpoint_step=8
                )
            return control_pb2.JobStatus(job_id=req.job_id, state=JobState.RUNNING)  # none yet: left as it is

    control, said = Parking(), []
    live, parked = drain.park(control, said.append)
    assert live is True and [s.job_id for s in parked] == ["ckpt"]
    assert control.asked == [("ckpt", True, True), ("fresh", True, True), ("held", True, True)]  # (not the ended)
    assert said == [
        "ckpt: parked at step 12; its ranks stop with the stack",
        "fresh: RUNNING, not parked: control continues it after `up`",
        "held: PAUSED at step 8 by the operator, not drained: `surgectl up` leaves it PAUSED "
        "(`surgectl resume held` relaunches it from its newest checkpoint)",
    ]


def test_a_forced_down_names_the_version_up_resumes_from_read_once_the_ranks_are_gone(tmp_path):
    """A fresh user's `down --force` said "resumes it from :1", then `up` resumed from :2: a
    commit on its way when control answered the park landed before the ranks were killed.
    What `up` loads is the store's newest version that verifies, read after the stop."""
    from tests.cli.test_export import commit_version, spec_of

    spec = spec_of(mlp="swiglu")
    commit_version(tmp_path, spec, job="ckpt-1", step=10)
    commit_version(tmp_path, spec, job="ckpt-1", step=12)  # (its commit came after the park's answer)
    # Its replicas not yet found to agree (a check every N steps): `<job>:latest` passes it
    # over, an operator resume does not (it takes the newest whose verdict is ok).
    catalog = tmp_path / "store" / "checkpoints" / "catalog.json"
    doc = json.loads(catalog.read_text())
    doc["versions"][-1].update(replica_checked=True, replica_agreed_step=0)
    catalog.write_text(json.dumps(doc))
    answered = control_pb2.JobStatus(
        job_id="ckpt-1", state=JobState.PAUSED, step=13, drained=True, checkpoint_version="ckpt-1:1", checkpoint_step=10
    )
    assert drain.resume_points([answered], tmp_path / "store") == [
        "ckpt-1: `surgectl up` resumes it from ckpt-1:2 (step 12); step 13 is lost"
    ]
    # A store whose catalog is not on this machine: control's answer, said for what it is.
    assert drain.resume_points([answered], tmp_path / "elsewhere") == [
        "ckpt-1: `surgectl up` resumes it from its newest checkpoint that verifies (when parked: ckpt-1:1, "
        "step 10); the steps after it are lost"
    ]


def test_each_drained_job_says_what_up_does_with_it_from_controls_answer():
    """A fresh user's second `down` (the first refused: the store away) said "stays PAUSED
    after `surgectl up`" of the drain's own pause, read from its status before the drain; `up`
    resumed it. What `up` does is read from control's answer to the drain."""
    control = FakeControl({"own": [JobState.PAUSED], "held": [JobState.PAUSED]}, operators=("held",))
    said: list[str] = []
    drain.drain(control, [job("own", JobState.PAUSED), job("held", JobState.PAUSED)], 10.0, said.append)
    assert "own: PAUSED at step 7 (own:1); `surgectl up` resumes it" in said
    assert (
        "held: PAUSED at step 7 (held:1); stays PAUSED after `surgectl up` (`surgectl resume held` continues it)"
        in said
    )
