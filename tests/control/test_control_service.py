"""The real `python -m services.control` process over loopback gRPC, with node agents
written here as real gRPC clients of WorkerSession."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import EXIT_PORT_IN_USE, channel
from services.contract import Module, control_pb2, control_pb2_grpc, engine_pb2, worker_pb2
from services.contract.relay import pack
from services.control.orchestrator import REATTACH_MESSAGE
from services.control.server import REGISTERED_HEADER
from tests.ports import free_port
from tests.store.test_store_service import store  # noqa: F401 (a real store process)

from .conftest import registration, spec_yaml

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class ControlProcess:
    """One `control` process; stopped by PID."""

    def __init__(self, db: Path, home: Path, port: int | None = None, store_address: str = "127.0.0.1:7002"):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "SURGE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        # A file, not a pipe: nobody reads a pipe while the test runs, and a full one
        # would block the service.
        self.log = home / f"control-{self.port}-{os.urandom(2).hex()}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.control",
                    "--port",
                    str(self.port),
                    "--db",
                    str(db),
                    "--data",
                    "127.0.0.1:7001",
                    "--store",
                    store_address,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.channel = channel(self.address, module=Module.EXT_USER)
        self.stub = control_pb2_grpc.ControlServiceStub(self.channel)

    def wait_serving(self, timeout: float = 30.0) -> None:
        # Health Watch streams status changes: no polling; it answers SERVING once started.
        watch = health_pb2_grpc.HealthStub(self.channel).Watch(
            health_pb2.HealthCheckRequest(service="surge.v1.ControlService"), timeout=timeout, wait_for_ready=True
        )
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class NodeAgent:
    """A fake node agent: registers, and answers commands with the rank events a real
    node would relay. ``finish=False`` keeps its ranks running after StartTraining."""

    def __init__(self, address: str, worker_id: str, *, slots: int = 1, steps: int = 3, finish: bool = True):
        self.worker_id, self.steps, self.finish = worker_id, steps, finish
        self.commands: list[control_pb2.WorkerCommand] = []
        self.ranks: dict[str, list[int]] = {}
        self._out: queue.Queue = queue.Queue()
        self._channel = channel(address, module=Module.EXT_HARDWARE)
        self._out.put(control_pb2.WorkerEvent(register=registration(worker_id, slots)))
        self._call = control_pb2_grpc.ControlServiceStub(self._channel).WorkerSession(iter(self._out.get, None))
        # Blocks until control acknowledges the registration: its slots are allocatable.
        assert dict(self._call.initial_metadata())[REGISTERED_HEADER] == worker_id
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def loss(self, step: int) -> float:
        return 5.0 - 0.5 * step

    def wait_for(self, kind: str, timeout: float = 10.0) -> None:
        """Until a command of ``kind`` came: control's commands to an agent and its job events to
        a watcher go on two streams, so a release may come after the TERMINATED event is read."""
        deadline = time.monotonic() + timeout
        while not any(c.WhichOneof("command") == kind for c in self.commands):
            assert time.monotonic() < deadline, [c.WhichOneof("command") for c in self.commands]
            time.sleep(0.01)

    def close(self) -> None:
        self._out.put(None)  # half-close: the session ends
        self._thread.join(timeout=10)
        self._channel.close()

    def memory_pressure(self, under: bool, available: int, total: int) -> None:
        msg = control_pb2.MemoryPressure(
            worker_id=self.worker_id, available_bytes=available, total_bytes=total, under_pressure=under
        )
        self._out.put(control_pb2.WorkerEvent(memory_pressure=msg))

    def _send(self, job_id: str, rank: int, **event) -> None:
        (msg,) = event.values()  # as a rank sends it: by its name, from the training loop
        ev = worker_pb2.RankEvent(job_id=job_id, rank=rank, routed=pack(msg, Module.L2_TRAINING_LOOP))
        self._out.put(control_pb2.WorkerEvent(rank_event=ev))

    def _run(self) -> None:
        try:
            for cmd in self._call:
                self.commands.append(cmd)
                kind = cmd.WhichOneof("command")
                if kind == "launch":
                    job_id = cmd.launch.job_id
                    self.ranks[job_id] = [r.rank for r in cmd.launch.ranks]
                    for rank in self.ranks[job_id]:
                        self._send(job_id, rank, started=engine_pb2.TrainingLoopStarted(job_id=job_id, rank=rank))
                elif kind == "routed" and cmd.routed.type == "surge.v1.StartTraining":
                    job_id = cmd.job_id
                    for rank in self.ranks[job_id]:
                        for n in range(1, self.steps + 1):
                            step = engine_pb2.StepCompleted(
                                job_id=job_id, rank=rank, step=n, loss=self.loss(n), tokens=64, tokens_per_second=640.0
                            )
                            self._send(job_id, rank, step=step)
                        if self.finish:
                            done = engine_pb2.TrainingLoopFinished(job_id=job_id, rank=rank, step=self.steps)
                            self._send(job_id, rank, finished=done)
                elif kind == "release":
                    job_id = cmd.release.job_id
                    for rank in self.ranks.pop(job_id, []):  # the ranks exit when released
                        exited = control_pb2.RankExited(job_id=job_id, rank=rank, exit_code=0)
                        self._out.put(control_pb2.WorkerEvent(rank_exited=exited))
        except grpc.RpcError:
            pass  # control went away


@pytest.fixture
def start_control(tmp_path):
    started: list[ControlProcess] = []

    def start(port: int | None = None, wait: bool = True, store_address: str = "127.0.0.1:7002") -> ControlProcess:
        c = ControlProcess(tmp_path / "control.db", tmp_path, port, store_address)
        started.append(c)
        if wait:
            c.wait_serving()
        return c

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def agents():
    made: list[NodeAgent] = []

    def make(address: str, worker_id: str, **kw) -> NodeAgent:
        made.append(NodeAgent(address, worker_id, **kw))
        return made[-1]

    yield make
    for a in made:
        a.close()


def submit(control: ControlProcess, **spec) -> control_pb2.JobStatus:
    return control.stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(**spec), spec_path="job.yaml"))


def running_watch(control: ControlProcess, job_id: str):
    """The job's event stream (follow), read up to its RUNNING; the rest is the caller's."""
    watch = control.stub.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=True), timeout=60)
    for ev in watch:
        if ev.status.state == JobState.RUNNING:
            return watch
    raise AssertionError(f"{job_id} never ran")


def follow(control: ControlProcess, job_id: str) -> list[control_pb2.JobEvent]:
    """The job's whole event log, streamed until it terminates."""
    return list(
        control.stub.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=True), timeout=180)
    )  # (a real two-rank job: 60 s ran out on a loaded host)


def test_a_dp2_job_runs_to_finished_on_two_node_agents(start_control, agents):
    control = start_control()
    a, b = agents(control.address, "wa"), agents(control.address, "wb")
    submitted = submit(control, name="demo", dp=2, steps=3)
    assert (submitted.state, submitted.world_size) == (JobState.WARMING_UP, 2)

    events = follow(control, submitted.job_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].status.state == JobState.TERMINATED
    status = control.stub.GetJob(control_pb2.JobQuery(job_id=submitted.job_id))
    assert (status.state, status.outcome, status.step) == (JobState.TERMINATED, JobOutcome.FINISHED, 3)
    assert status.train_loss == a.loss(3) and status.tokens_seen == 3 * 64
    assert status.message == "FINISHED: all ranks finished at step 3"

    a.wait_for("release"), b.wait_for("release")
    a.close(), b.close()
    la, lb = a.commands[0].launch, b.commands[0].launch
    assert ([r.rank for r in la.ranks], [r.rank for r in lb.ranks]) == ([0], [1])
    assert la.ranks[0].master_port == lb.ranks[0].master_port and la.init.job_id == submitted.job_id
    for agent in (a, b):
        kinds = [c.WhichOneof("command") for c in agent.commands]
        assert kinds == ["launch", "routed", "release"]
    listed = control.stub.ListJobs(control_pb2.JobQuery())
    assert [j.job_id for j in listed.jobs] == [submitted.job_id]
    tail = list(control.stub.WatchJob(control_pb2.JobQuery(job_id=submitted.job_id, from_seq=3), timeout=10))
    assert [e.seq for e in tail] == [e.seq for e in events[2:]]


def test_a_session_must_open_with_a_registration(start_control):
    control = start_control()
    first = control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id="j"))
    # Opened as a node agent (EXT_HARDWARE): the only caller the identity check lets open one.
    with channel(control.address, module=Module.EXT_HARDWARE) as ch, pytest.raises(grpc.RpcError) as e:
        list(control_pb2_grpc.ControlServiceStub(ch).WorkerSession(iter([first]), timeout=10))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "WorkerSession: the first WorkerEvent must be register",
    )


def test_a_job_needing_more_ranks_than_registered_is_queued_and_starts_when_a_worker_joins(start_control, agents):
    control = start_control()
    agents(control.address, "wa"), agents(control.address, "wb")
    job = submit(control, dp=3)
    assert (job.state, job.queue_position) == (JobState.STANDBY, 1)
    assert (
        job.message
        == "queued: needs 3 ranks (parallel.dp=3), more than the 2 registered: can never run as things stand; waits for workers to join"
    )
    agents(control.address, "wc")  # its registration (L1-2's ResourcesReady) starts the queue's head
    events = follow(control, job.job_id)
    assert [e.status.state for e in events if e.type == "state"][:2] == [JobState.WARMING_UP, JobState.RUNNING]
    assert events[-1].status.outcome == JobOutcome.FINISHED


def test_malformed_yaml_is_invalid_argument_and_unknown_job_not_found(start_control):
    control = start_control()
    with pytest.raises(grpc.RpcError) as e:
        control.stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml="name: [unclosed\n", spec_path="bad.yaml"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("bad.yaml: line") and "malformed YAML" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        control.stub.GetJob(control_pb2.JobQuery(job_id="nope-000000"))
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "job nope-000000 not found")


@pytest.mark.timeout(60)
def test_a_malformed_request_to_any_method_is_invalid_argument_and_control_lives_on(start_control):
    """Unary and server-streaming handlers alike (the streaming ones run as sync generators
    on control's asyncio server): one line naming the method, and control still answers."""
    control = start_control()
    with channel(control.address, module=Module.EXT_USER) as ch:
        for method, call in (
            ("GetJob", ch.unary_unary),
            ("WatchJob", ch.unary_stream),
            ("StreamLogs", ch.unary_stream),
        ):
            with pytest.raises(grpc.RpcError) as e:
                reply = call(f"/surge.v1.ControlService/{method}")(b"\xff\xff\xff\x01garbage", timeout=10)
                list(reply) if method != "GetJob" else reply
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
            assert f"/surge.v1.ControlService/{method}: malformed request" in e.value.details()
    assert list(control.stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs) == []


def test_a_lost_node_agent_with_no_spare_waits_for_capacity_then_the_policy_fails_the_job(start_control, agents, store):  # noqa: F811
    control = start_control(store_address=f"127.0.0.1:{store.port}")
    holder = agents(control.address, "wa", finish=False)
    job_id = submit(control, dp=1, steps=100, extra="fault_policy: {capacity_wait_seconds: 1.5}").job_id
    watch = running_watch(control, job_id)
    holder.close()
    rest = list(watch)
    assert rest[-1].status.state == JobState.TERMINATED
    assert any(ev.message.startswith("SEVERE worker_lost") for ev in rest)
    waits = [ev.message for ev in rest if ev.type == "recovery" and "waiting for capacity" in ev.message]
    assert len(waits) == 1 and "needs 1 ranks, 0 free" in waits[0], waits
    decisions = [ev.message for ev in rest if ev.type == "decision"]
    assert decisions[0].startswith("restart_ranks after worker_lost of rank 0 on wa (restart 1 of 3")
    assert decisions[-1].startswith("stop after no_capacity: waiting for capacity")
    status = control.stub.GetJob(control_pb2.JobQuery(job_id=job_id))
    assert status.outcome == JobOutcome.FAILED and "every checkpoint is kept" in status.message


def test_a_lost_node_agent_that_comes_back_gets_its_ranks_relaunched_and_the_job_finishes(start_control, agents, store):  # noqa: F811
    control = start_control(store_address=f"127.0.0.1:{store.port}")
    holder = agents(control.address, "wa", finish=False)
    job_id = submit(control, dp=1, steps=3).job_id
    watch = running_watch(control, job_id)
    holder.close()
    for ev in watch:  # the recovery waits: nowhere to place the rank
        if ev.type == "recovery" and "waiting for capacity" in ev.message:
            break
    back = agents(control.address, "wa", steps=3)  # the same worker, restarted in place
    rest = list(watch)
    assert rest[-1].status.outcome == JobOutcome.FINISHED
    decisions = [ev.message for ev in rest if ev.type == "decision"]
    assert decisions == [], decisions  # one decision for the incident (before the wait)
    assert [c.launch.job_id for c in back.commands if c.WhichOneof("command") == "launch"] == [job_id]


def test_a_lost_node_agents_ranks_are_relaunched_on_another_and_the_job_runs_again(start_control, agents, store):  # noqa: F811
    control = start_control(store_address=f"127.0.0.1:{store.port}")
    holder = agents(control.address, "wa", finish=False)
    spare = agents(control.address, "wb", steps=3)  # finishes its rank's steps once started
    job_id = submit(control, dp=1, steps=3).job_id
    watch = running_watch(control, job_id)
    holder.close()
    rest = list(watch)
    states = [ev.status.state for ev in rest if ev.type == "state"]
    assert states == [JobState.FAULT_FROZEN, JobState.RUNNING, JobState.TERMINATED]
    decisions = [ev.message for ev in rest if ev.type == "decision"]
    assert decisions == ["restart_ranks after worker_lost of rank 0 on wa (restart 1 of 3 for worker_lost)"]
    assert rest[-1].status.outcome == JobOutcome.FINISHED
    assert [c.launch.job_id for c in spare.commands if c.WhichOneof("command") == "launch"] == [job_id]


def test_memory_pressure_sent_by_a_node_agent_appears_in_its_jobs_event_log(start_control, agents):
    control = start_control()
    holder = agents(control.address, "wa", finish=False)
    job_id = submit(control, dp=1, steps=100).job_id
    watch = running_watch(control, job_id)
    holder.memory_pressure(True, 3 << 29, 24 << 30)
    holder.memory_pressure(False, 6 << 30, 24 << 30)
    got = []
    for ev in watch:  # step summaries may interleave; the resource events come in order
        if ev.type == "resource":
            got.append((ev.type, ev.message, ev.status.state))
            if len(got) == 2:
                break
    watch.cancel()
    assert got == [
        ("resource", "memory pressure on wa: 1.5 GiB of 24.0 GiB available", JobState.RUNNING),
        ("resource", "memory pressure relieved on wa: 6.0 GiB of 24.0 GiB available", JobState.RUNNING),
    ]


def test_follows_their_callers_left_hold_nothing_operator_calls_answer_and_sigterm_stops_control(start_control, agents):
    """A caller leaving a follow (Ctrl-C on `surgectl events --follow`) ends its handler at
    once, even while the job is quiet: more abandoned follows than control's 64 pool threads
    leave the operator RPCs answering, and SIGTERM still stops control cleanly (code 0, not
    the SIGKILL after stop()'s 15 s)."""
    control = start_control()
    agent = agents(control.address, "wa", finish=False)
    job_id = submit(control, dp=1, steps=3).job_id  # the fake agent's 3 steps, then quiet: no event
    watch = control.stub.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=True), timeout=60)
    assert any(ev.status.state == JobState.RUNNING for ev in watch)
    watch.cancel()
    for _ in range(80):
        call = control.stub.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=True), timeout=60)
        next(call)  # the follow is served (its history) ...
        call.cancel()  # ... and its caller leaves
    assert control.stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10).state == JobState.RUNNING

    def commanded(kind: str) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(c.WhichOneof("command") == kind for c in list(agent.commands)):
                return True
            time.sleep(0.05)
        return False

    logs = control.stub.StreamLogs(control_pb2.LogQuery(job_id=job_id, follow=True, rank=-1), timeout=60)
    assert commanded("tail_rank_logs")  # the agent (which answers nothing) was asked to tail ...
    logs.cancel()
    assert commanded("stop_tailing")  # ... and told to stop as soon as the caller left
    assert control.stop() == 0


def test_restart_keeps_jobs_and_the_running_one_waits_for_its_ranks(start_control, agents):
    control = start_control()
    agents(control.address, "hold", finish=False)
    # The long job is placed on "hold" before "done" exists: two agents started together may
    # register in either order under load, and the short job on "hold" would never finish.
    running = submit(control, name="long", dp=1, steps=100).job_id  # (queued until "hold" registers)
    running_watch(control, running).cancel()
    agents(control.address, "done")
    finished = submit(control, name="short", dp=1, steps=3).job_id
    assert follow(control, finished)[-1].status.outcome == JobOutcome.FINISHED
    with pytest.raises(grpc.RpcError) as e:
        control.stub.ResumeJob(control_pb2.ResumeJobRequest(job_id=running))
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"job {running} is RUNNING, not PAUSED: resume continues a PAUSED job, or relaunches a STOPPED or FAILED "
        "one from its checkpoint",
    )
    assert control.stop() == 0  # SIGTERM: a clean stop

    control = start_control()
    s = control.stub.GetJob(control_pb2.JobQuery(job_id=finished))
    assert (s.state, s.outcome, s.step, s.train_loss) == (JobState.TERMINATED, JobOutcome.FINISHED, 3, 3.5)
    s = control.stub.GetJob(control_pb2.JobQuery(job_id=running))
    assert (s.state, s.message) == (JobState.RUNNING, REATTACH_MESSAGE)  # its node agent may re-attach it


def test_a_port_in_use_is_one_line_and_a_nonzero_exit(start_control):
    control = start_control()
    second = start_control(port=control.port, wait=False)
    assert second.proc.wait(timeout=30) == EXIT_PORT_IN_USE  # typed: another socket holds it
    err = second.log.read_text()
    assert err.strip().splitlines() == [
        f"error: control: cannot listen on 127.0.0.1:{control.port} (port already in use?)"
    ]
