"""The node agent as a real process, against a real ControlService on loopback.

Each test starts ``python -m services.worker`` with ``SURGE_RANK_MODULE`` pointing at
``tests/worker/fake_rank.py`` (a rank that speaks the real RankSession protocol) and a
small ControlService written here that records what the agent sends and pushes commands.
Every process started is killed by PID at the end (agent, ranks, grandchildren).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.cpu_list import format_cpu_list
from services.common.grpc_server import ServiceServer, channel
from services.contract import (
    Module,
    audit_pb2,
    audit_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
    engine_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.contract.bus import BoundaryViolation, Bus, Traffic
from services.contract.relay import pack, unpack
from services.worker.step_summaries import StepSummaries
from tests.ports import free_port

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
FAKE_RANK = "tests.worker.fake_rank"
WORKER_ID = "w-test"
START_TIMEOUT = 20.0  # seconds for an agent or a rank to start on a loaded 2-core machine


# ---------------------------------------------------------------- processes


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_ours(pid: int, marker: str) -> None:
    """SIGKILL ``pid`` only if it still runs our command (never a recycled PID)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if marker in cmd:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Agent:
    """One ``python -m services.worker`` process with its log under ``tmp``."""

    def __init__(
        self,
        tmp: Path,
        control_port: int,
        *extra: str,
        worker_id: str | None = WORKER_ID,
        port: int | None = None,
        env: dict | None = None,
    ):
        self.port = port if port is not None else free_port()
        self.run_dir = tmp / "run"
        self.log = tmp / f"agent-{self.port}.log"
        extra_env = env or {}
        env = {**os.environ, "SURGE_RANK_MODULE": FAKE_RANK, "SURGE_HOME": str(tmp / "home"), "PYTHONUNBUFFERED": "1"}
        for var in (
            "SURGE_WORKER_ID",
            "SURGE_WORKER_SLOTS",
            "SURGE_WORKER_PORT",
            "SURGE_CONTROL_ADDRESS",
            "CUDA_VISIBLE_DEVICES",
            "SURGE_WORKER_MEMINFO",
            "SURGE_WORKER_HOST_SHARE",
            "SURGE_WORKER_SYSFS",
            "SURGE_WORKER_MEMORY_PRESSURE_FRACTION",
        ):
            env.pop(var, None)
        # The memory sampler is off unless a test turns it on: a test machine short of
        # memory would otherwise slip a memory_pressure report between the events a test
        # expects.
        env["SURGE_WORKER_MEMORY_CHECK_SECONDS"] = "0"
        env.update(extra_env)
        argv = [
            sys.executable,
            "-m",
            "services.worker",
            "--port",
            str(self.port),
            "--control",
            f"127.0.0.1:{control_port}",
            "--run-dir",
            str(self.run_dir),
        ]
        if worker_id:
            argv += ["--worker-id", worker_id]
        argv += extra
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def rank_log(self, job: str, rank: int) -> str:
        path = self.run_dir / "logs" / f"{job}.rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class FakeControl(control_pb2_grpc.ControlServiceServicer):
    """WorkerSession only: acknowledges like control (``surge-registered`` header), records
    registrations and events (RankProcessState facts apart, in ``process_states``; the
    agent's own beats in ``beats``), pushes commands to the newest session."""

    def __init__(self):
        self.registrations: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.process_states: queue.Queue = queue.Queue()
        self.beats: queue.Queue = queue.Queue()
        self._sessions: list[queue.Queue] = []
        self._lock = threading.Lock()

    def WorkerSession(self, request_iterator, context):  # noqa: N802
        commands: queue.Queue = queue.Queue()
        with self._lock:
            self._sessions.append(commands)
        context.send_initial_metadata((("surge-registered", "ack"),))  # as control acknowledges

        def read() -> None:
            try:
                for event in request_iterator:
                    if event.WhichOneof("event") == "register":
                        self.registrations.put(event.register)
                    elif event.WhichOneof("event") == "heartbeat":
                        self.beats.put(event.heartbeat)
                    elif event.WhichOneof("event") == "routed" and event.routed.type.endswith(".RankProcessState"):
                        self.process_states.put(unpack(event.routed))
                    else:
                        self.events.put(event)
            except grpc.RpcError:
                pass
            finally:
                commands.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (cmd := commands.get()) is not None:
            yield cmd

    def push(self, **command) -> None:
        with self._lock:
            self._sessions[-1].put(control_pb2.WorkerCommand(**command))

    def registration(self, timeout: float = START_TIMEOUT) -> control_pb2.WorkerRegistration:
        return self.registrations.get(timeout=timeout)

    def next_event(self, timeout: float = START_TIMEOUT) -> control_pb2.WorkerEvent:
        return self.events.get(timeout=timeout)

    def rank_event(self, kind: str, timeout: float = START_TIMEOUT) -> worker_pb2.RankEvent:
        event = self.next_event(timeout)
        assert event.WhichOneof("event") == "rank_event", event
        assert event.rank_event.WhichOneof("event") == kind, event
        return event.rank_event

    def rank_exited(self, timeout: float = START_TIMEOUT) -> control_pb2.RankExited:
        event = self.next_event(timeout)
        assert event.WhichOneof("event") == "rank_exited", event
        return event.rank_exited


class ControlServer:
    def __init__(self, port: int = 0):
        self.servicer = FakeControl()
        self._server = ServiceServer("control-test", "127.0.0.1", port)
        control_pb2_grpc.add_ControlServiceServicer_to_server(self.servicer, self._server.server)
        self._server.start(["surge.v1.ControlService"])
        self.port = self._server.port

    def stop(self) -> None:
        self._server.server.stop(0).wait()


@pytest.fixture
def cluster(tmp_path):
    """Starts control servers and agents on demand; kills every process by PID after."""
    servers: list[ControlServer] = []
    agents: list[Agent] = []
    pids: list[int] = []  # ranks and grandchildren the tests learnt about

    class Cluster:
        def control(self, port: int = 0) -> ControlServer:
            servers.append(ControlServer(port))
            return servers[-1]

        def agent(self, control_port: int, *extra: str, **kw) -> Agent:
            agents.append(Agent(tmp_path, control_port, *extra, **kw))
            return agents[-1]

        def track(self, *more: int) -> None:
            pids.extend(more)

    try:
        yield Cluster()
    finally:
        for a in agents:
            if a.proc.poll() is None:
                os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(timeout=10)
            for leftover in Path("/dev/shm").glob(f"surge-memory-*-{a.proc.pid}"):  # (its memory copies)
                shutil.rmtree(leftover, ignore_errors=True)
        for pid in pids:
            kill_ours(pid, FAKE_RANK)
            kill_ours(pid, "sleep 300")
        for s in servers:
            s.stop()


def assignment(
    rank: int, world_size: int = 1, threads: int = 1, device: str = "cpu", generation: int = 0
) -> engine_pb2.RankAssignment:
    return engine_pb2.RankAssignment(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=29500,
        backend="gloo",
        device=device,
        num_threads=threads,
        worker_id=WORKER_ID,
        generation=generation,
    )


def launch(
    control: FakeControl,
    job: str,
    modes,
    world_size: int = 1,
    threads: int = 1,
    device: str = "cpu",
    generation: int = 0,
) -> None:
    control.push(
        launch=control_pb2.LaunchRanks(
            job_id=job,
            ranks=[assignment(r, world_size, threads, device, generation) for r in range(world_size)],
            init=engine_pb2.InitJob(job_id=job, spec_json=json.dumps({"fake": modes}), data_address="127.0.0.1:1"),
        )
    )


def started_ranks(cluster, control: FakeControl, count: int) -> dict[int, int]:
    """Consume hello + started of ``count`` ranks; returns rank -> pid."""
    pids, started = {}, set()
    while len(started) < count:
        event = control.next_event().rank_event
        kind = event.WhichOneof("event")
        if kind == "hello":
            pids[event.rank] = event.hello.pid
            cluster.track(event.hello.pid)
        else:
            assert kind == "routed" and event.routed.type == "surge.v1.TrainingLoopStarted" and event.rank in pids, (
                event
            )
            started.add(event.rank)
    return pids


def wait_for_line(agent: Agent, text: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while text not in agent.output():
        assert time.monotonic() < deadline and agent.proc.poll() is None, agent.output()
        time.sleep(0.05)


def fake_nvidia_smi(tmp: Path) -> Path:
    """A directory holding an ``nvidia-smi`` that prints two H200s the way the real one
    answers the agent's query (index, name, MiB, PCI bus id)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(
        "#!/bin/sh\nprintf '0, NVIDIA H200, 143771, 00000000:1B:00.0\\n1, NVIDIA H200, 143771, 00000000:9C:00.0\\n'\n"
    )
    exe.chmod(0o755)
    return bin_dir


def fake_sysfs(tmp: Path, cpus: str) -> Path:
    """A sysfs tree placing both fake GPUs on NUMA node 0 with local CPUs ``cpus``."""
    for bus_id in ("0000:1b:00.0", "0000:9c:00.0"):
        d = tmp / "sys" / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text("0\n")
        (d / "local_cpulist").write_text(f"{cpus}\n")
    return tmp / "sys"


# ---------------------------------------------------------------- tests


def test_registration_reports_the_nodes_hardware_address_and_slots(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port, "--slots", "3")
    reg = control.servicer.registration()

    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    mem_bytes = int(meminfo["MemTotal"].split()[0]) * 1024
    assert reg.worker_id == WORKER_ID
    assert reg.host == socket.gethostname()
    assert reg.address == f"127.0.0.1:{agent.port}"
    assert reg.memory_bytes == mem_bytes
    assert reg.cpu_count == len(os.sched_getaffinity(0))
    assert reg.slots == 3
    assert [(d.kind, d.index, d.memory_bytes) for d in reg.devices] == [
        ("cpu", 0, mem_bytes)
    ]  # this machine has no GPU
    with grpc.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="surge.v1.WorkerService"), timeout=5
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_every_step_of_rank_0_goes_up_and_of_another_rank_only_its_first_per_control_session(cluster):
    """Coalesced step traffic (step_summaries.py): rank 0's StepCompleted is the job's step
    summary; another rank's only says it was heard from, once per session with control."""
    control = cluster.control()
    cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "j1", "train3", world_size=2)
    started_ranks(cluster, control.servicer, 2)
    start = pack(engine_pb2.StartTraining(job_id="j1"), Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)
    control.servicer.push(routed=start, job_id="j1")
    steps: dict[int, list[int]] = {0: [], 1: []}
    finished = set()
    while finished != {0, 1}:
        event = control.servicer.next_event()
        if event.WhichOneof("event") != "rank_event" or event.rank_event.WhichOneof("event") != "routed":
            continue
        routed = event.rank_event.routed
        if routed.type == "surge.v1.StepCompleted":
            steps[event.rank_event.rank].append(unpack(routed).step)
        elif routed.type == "surge.v1.TrainingLoopFinished":
            finished.add(event.rank_event.rank)
    assert steps == {0: [1, 2, 3], 1: [1]}


def test_step_summaries_send_each_other_ranks_first_step_again_after_a_new_session():
    summaries = StepSummaries()
    step = pack(engine_pb2.StepCompleted(job_id="j", step=1), Module.L2_TRAINING_LOOP)
    other = pack(engine_pb2.TrainingLoopFinished(job_id="j", step=1), Module.L2_TRAINING_LOOP)
    assert [summaries.send_up("j", 0, step) for _ in range(3)] == [True] * 3  # rank 0: every one
    assert [summaries.send_up("j", 2, step) for _ in range(3)] == [True, False, False]
    assert summaries.send_up("j", 2, other) and summaries.send_up("k", 2, step)  # another event, job
    assert summaries.kept == 2
    summaries.new_session()  # a registration with control (it may have restarted)
    assert [summaries.send_up("j", 2, step) for _ in range(2)] == [True, False]


def test_worker_id_defaults_to_host_and_port_and_slots_to_one_without_gpu(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port, worker_id=None)
    reg = control.servicer.registration()
    assert reg.worker_id == f"{socket.gethostname()}-{agent.port}"
    assert reg.slots == 1


def test_launched_ranks_get_init_then_assignment_and_their_events_go_up_in_order(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "j1", "train", world_size=2, threads=2)
    pids = started_ranks(cluster, control.servicer, 2)

    start = pack(engine_pb2.StartTraining(job_id="j1"), Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)
    control.servicer.push(routed=start, job_id="j1")  # by its name: the agent has no field for it
    seen: dict[int, list[str]] = {0: [], 1: []}
    exits: dict[int, control_pb2.RankExited] = {}
    while len(exits) < 2:
        event = control.servicer.next_event()
        if event.WhichOneof("event") == "rank_exited":
            exits[event.rank_exited.rank] = event.rank_exited
        else:
            rank_event = event.rank_event
            assert rank_event.job_id == "j1"
            assert rank_event.rank not in exits, "an event went up after its rank's exit"
            assert rank_event.WhichOneof("event") == "routed", rank_event  # relayed as it came, by name
            seen[rank_event.rank].append(rank_event.routed.type.rsplit(".", 1)[-1])
            if rank_event.routed.type == "surge.v1.StepCompleted":
                step = unpack(rank_event.routed)
                assert (step.step, step.loss) == (1, 5.5)

    assert seen == {0: ["StepCompleted", "TrainingLoopFinished"], 1: ["StepCompleted", "TrainingLoopFinished"]}
    for rank in (0, 1):
        assert (exits[rank].job_id, exits[rank].exit_code, exits[rank].worker_id) == ("j1", 0, WORKER_ID)
        log = agent.rank_log("j1", rank)
        assert "init job=j1 data=127.0.0.1:1 mode=train" in log
        assert (
            f"assignment rank={rank} world=2 device=cpu OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 CUDA_VISIBLE_DEVICES=-"
            in log
        )
        assert "start job=j1 from=L1_ORCHESTRATOR" in log
        assert not alive(pids[rank])


def test_a_routed_command_whose_sender_may_not_send_it_is_refused_reported_and_never_reaches_a_rank(tmp_path):
    import structlog

    from services.worker.node_agent import NodeAgent

    reported: list[BoundaryViolation] = []
    bus = Bus(traffic=Traffic(), on_violation=reported.append)
    agent = NodeAgent(WORKER_ID, "127.0.0.1:1", tmp_path, emit=lambda ev: None, log=structlog.get_logger(), bus=bus)
    start = pack(engine_pb2.StartTraining(job_id="j1"), Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)
    forged = type(start)()
    forged.CopyFrom(start)
    forged.sender = Module.L1_FAULT_DETECTOR  # not a sender of StartTraining
    with pytest.raises(BoundaryViolation):
        agent.execute(control_pb2.WorkerCommand(routed=forged, job_id="j1"))
    release = pack(control_pb2.ReleaseRanks(job_id="j1"), Module.L1_RESOURCE_ALLOCATOR, Module.EXT_HARDWARE)
    release.sender = Module.L2_TRAINING_LOOP  # a rank module, speaking for control
    with pytest.raises(BoundaryViolation):
        agent.execute(control_pb2.WorkerCommand(routed=release))
    assert [(v.sender, v.message) for v in reported] == [
        (Module.L1_FAULT_DETECTOR, "surge.v1.StartTraining"),
        (Module.L2_TRAINING_LOOP, "surge.v1.ReleaseRanks"),
    ]
    # The allocator's own ReleaseRanks runs on the agent's bus (nothing to release here).
    release.sender = Module.L1_RESOURCE_ALLOCATOR
    agent.execute(control_pb2.WorkerCommand(routed=release))
    assert bus.snapshot().sent == {(Module.L1_RESOURCE_ALLOCATOR, "surge.v1.ReleaseRanks", Module.EXT_HARDWARE): 1}


def test_an_audit_asks_every_live_rank_and_sums_their_route_counts_keeping_them_from_control(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port, "--slots", "3")
    control.servicer.registration()
    launch(control.servicer, "ja", ["audited", "audited", "sleep"], world_size=3)
    started_ranks(cluster, control.servicer, 3)
    with channel(f"127.0.0.1:{agent.port}", module=Module.EXT_USER) as ch:
        report = audit_pb2_grpc.AuditServiceStub(ch).Audit(audit_pb2.AuditRequest(), timeout=30)
    assert report.process == WORKER_ID
    assert [(c.sender, c.message, c.receiver, c.count) for c in report.routes] == [
        (Module.L2_TRAINING_LOOP, "surge.v1.RunForward", Module.L3_FORWARD_UNIT, 5 + 6)
    ]
    # The sleeping rank reads no command: the audit waits its 2 s for it, then says so.
    assert len(report.notes) == 1 and "rank 2 of job ja did not answer" in report.notes[0]
    with pytest.raises(queue.Empty):  # the ranks' answers stay with the agent
        control.servicer.next_event(timeout=0.5)


def test_a_rank_killed_by_sigkill_is_reported_with_exit_code_minus_9_within_one_second(cluster):
    control = cluster.control()
    cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "k", "sleep", generation=7)
    pid = started_ranks(cluster, control.servicer, 1)[0]

    t0, killed = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    exited = control.servicer.rank_exited(timeout=5)
    elapsed = time.monotonic() - t0
    assert (exited.job_id, exited.rank, exited.exit_code, exited.worker_id) == ("k", 0, -9, WORKER_ID)
    assert elapsed < 1.0, f"RankExited took {elapsed:.3f} s"
    assert "killed by SIGKILL" in exited.detail
    assert not exited.released and 0 <= exited.unix_time - killed < 0.5  # when it was reaped
    # Typed from the evidence: a SIGKILL the agent did not send, with no OOM-kill count rise
    # (where no counter is readable it says so, and an OOM kill could not be told apart).
    assert (exited.cause, exited.signal_sender_pid) == (control_pb2.EXIT_KILLED, 0)
    assert "sender unknown" in exited.detail
    assert exited.generation == 7  # the launch it was: a node's sick count takes a launch once


def test_a_rank_stopped_and_continued_by_signals_is_stated_at_once_and_again_to_a_new_control(cluster):
    """The agent states each rank process RUNNING when it starts watching it, STOPPED (with
    the signal) the moment the kernel tells it of a SIGSTOP, RUNNING again on SIGCONT, and a
    restarted control hears the current state of every live rank after the registration."""
    first = cluster.control()
    port = first.port
    agent = cluster.agent(port)
    first.servicer.registration()
    launch(first.servicer, "st", "sleep")
    pid = started_ranks(cluster, first.servicer, 1)[0]
    states = first.servicer.process_states
    watched = states.get(timeout=5)
    RPS = control_pb2.RankProcessState
    assert (watched.job_id, watched.rank, watched.pid, watched.state, watched.worker_id) == (
        "st",
        0,
        pid,
        RPS.RUNNING,
        WORKER_ID,
    )
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    stopped = states.get(timeout=5)
    took = time.monotonic() - t0
    assert (stopped.state, stopped.signal, stopped.pid, stopped.detail) == (
        RPS.STOPPED,
        signal.SIGSTOP,
        pid,
        "stopped by SIGSTOP",
    )
    assert took < 1.0, f"STOPPED stated {took:.3f} s after the SIGSTOP"
    os.kill(pid, signal.SIGCONT)
    assert states.get(timeout=5).state == RPS.RUNNING
    os.kill(pid, signal.SIGSTOP)
    assert states.get(timeout=5).state == RPS.STOPPED

    first.stop()  # control restarts while the rank is stopped
    wait_for_line(agent, "control session down; retrying")
    second = cluster.control(port)
    assert [a.rank for job in second.servicer.registration(timeout=15).running for a in job.ranks] == [0]
    restated = second.servicer.process_states.get(timeout=5)
    assert (restated.pid, restated.state, restated.signal) == (pid, RPS.STOPPED, signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL; its exit names it
    exited = second.servicer.rank_exited(timeout=5)
    assert (exited.exit_code, exited.pid) == (-9, pid)


def test_release_terminates_sleeping_ranks_and_kills_one_that_ignores_sigterm_after_grace(cluster):
    control = cluster.control()
    cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "rel", ["sleep", "stubborn"], world_size=2)
    pids = started_ranks(cluster, control.servicer, 2)

    t0 = time.monotonic()
    control.servicer.push(release=control_pb2.ReleaseRanks(job_id="rel", grace_seconds=1.0))
    first = control.servicer.rank_exited(timeout=5)
    second = control.servicer.rank_exited(timeout=5)
    assert (first.rank, first.exit_code, first.released) == (0, -signal.SIGTERM, True)
    assert (second.rank, second.exit_code, second.released) == (1, -signal.SIGKILL, True)
    # The agent sent both signals itself: each exit names it as the sender.
    for exited in (first, second):
        assert exited.cause == control_pb2.EXIT_KILLED and exited.signal_sender_pid not in (0, os.getpid())
        assert "sent by its node agent" in exited.detail
    assert time.monotonic() - t0 >= 1.0  # the stubborn rank had its grace period
    assert not any(alive(p) for p in pids.values())

    # kill=True does not wait for anything.
    launch(control.servicer, "rel2", "stubborn")
    pid = started_ranks(cluster, control.servicer, 1)[0]
    t0 = time.monotonic()
    control.servicer.push(release=control_pb2.ReleaseRanks(job_id="rel2", kill=True, grace_seconds=30))
    exited = control.servicer.rank_exited(timeout=5)
    assert (exited.job_id, exited.exit_code) == ("rel2", -signal.SIGKILL)
    assert time.monotonic() - t0 < 1.0
    assert not alive(pid)


def test_sigterm_of_the_agent_kills_every_rank_and_its_children_then_exits_zero(cluster):
    control = cluster.control()
    # Without notice (0 s): a departure with a deadline is tests/worker/test_departure_agent.py's.
    agent = cluster.agent(control.port, env={"SURGE_WORKER_DEPARTURE_SECONDS": "0"})
    control.servicer.registration()
    launch(control.servicer, "fam", "family", world_size=2)
    pids = list(started_ranks(cluster, control.servicer, 2).values())
    grandchildren = []
    for rank in (0, 1):
        line = next(text for text in agent.rank_log("fam", rank).splitlines() if text.startswith("grandchild "))
        grandchildren.append(int(line.split()[1]))
    cluster.track(*grandchildren)
    assert all(alive(p) for p in pids + grandchildren)

    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=20) == 0, agent.output()
    assert gone_within(pids + grandchildren, 2.0), [p for p in pids + grandchildren if alive(p)]


def test_the_agent_retries_until_control_comes_up_then_registers(cluster):
    port = free_port()
    agent = cluster.agent(port)
    wait_for_line(agent, "control session down; retrying")  # its first failed attempt
    time.sleep(1.0)  # a few more attempts: it must keep trying, not exit
    assert agent.proc.poll() is None, agent.output()
    control = cluster.control(port)
    reg = control.servicer.registration(timeout=10)
    assert reg.worker_id == WORKER_ID


def test_a_broken_session_reconnects_with_the_same_worker_id_and_delivers_what_happened_meanwhile(cluster):
    first = cluster.control()
    port = first.port
    agent = cluster.agent(port)
    assert first.servicer.registration().worker_id == WORKER_ID
    launch(first.servicer, "keep", ["sleep", "sleep"], world_size=2)
    pids = started_ranks(cluster, first.servicer, 2)

    first.stop()
    wait_for_line(agent, "control session down; retrying")
    assert all(alive(p) for p in pids.values())  # ranks keep running while control is away
    os.kill(pids[1], signal.SIGKILL)  # a fact that happens while nobody listens
    second = cluster.control(port)
    assert second.servicer.registration(timeout=15).worker_id == WORKER_ID
    exited = second.servicer.rank_exited(timeout=5)
    assert (exited.job_id, exited.rank, exited.exit_code) == ("keep", 1, -9)
    assert alive(pids[0])
    second.servicer.push(release=control_pb2.ReleaseRanks(job_id="keep", kill=True))
    exited = second.servicer.rank_exited(timeout=5)
    assert (exited.job_id, exited.rank, exited.exit_code) == ("keep", 0, -9)


def test_a_launch_right_after_a_release_starts_the_rank_once_the_old_process_ended(cluster):
    control = cluster.control()
    cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "re", "stubborn")
    old_pid = started_ranks(cluster, control.servicer, 1)[0]

    control.servicer.push(release=control_pb2.ReleaseRanks(job_id="re", grace_seconds=0.5))
    launch(control.servicer, "re", "sleep")  # recovery: same job, same rank, fresh process
    exited = control.servicer.rank_exited()
    assert (exited.rank, exited.exit_code) == (0, -signal.SIGKILL)
    new_pid = started_ranks(cluster, control.servicer, 1)[0]
    assert new_pid != old_pid and not alive(old_pid) and alive(new_pid)


def test_cuda_devices_from_nvidia_smi_are_registered_and_a_cuda_rank_is_told_the_device_it_sees(cluster, tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    sysfs = fake_sysfs(tmp_path, format_cpu_list(cpus))
    control = cluster.control()
    agent = cluster.agent(
        control.port, env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SURGE_WORKER_SYSFS": str(sysfs)}
    )
    reg = control.servicer.registration()
    assert [(d.kind, d.index, d.name, d.memory_bytes, d.pci_bus_id, d.numa_node) for d in reg.devices] == [
        ("cuda", 0, "NVIDIA H200", 143771 * 2**20, "0000:1b:00.0", 0),
        ("cuda", 1, "NVIDIA H200", 143771 * 2**20, "0000:9c:00.0", 0),
    ]
    assert reg.slots == 2  # one per device by default

    launch(control.servicer, "gpu", "sleep", device="cuda:1")
    started_ranks(cluster, control.servicer, 1)
    # GPU 1 of the node is the only device the rank sees, as cuda:0; it runs on GPU 1's
    # share of the CPUs the two GPUs share (the second half).
    second_half = cpus[(len(cpus) + 1) // 2 :] if len(cpus) > 1 else cpus
    assert (
        "device=cuda:0 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 "
        f"SURGE_CPU_AFFINITY={format_cpu_list(second_half)} SURGE_NUMA_NODE=0"
    ) in agent.rank_log("gpu", 0)


def test_cuda_visible_devices_of_the_agent_restricts_the_reported_devices(tmp_path, monkeypatch):
    from services.worker.hardware import detect_cuda_devices

    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [d.index for d in detect_cuda_devices()] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_cuda_devices() == []


def test_a_hello_for_a_rank_not_launched_here_is_refused(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port)
    control.servicer.registration()
    hello = worker_pb2.RankEvent(job_id="nope", rank=0, hello=worker_pb2.RankHello(job_id="nope", rank=0, pid=1))
    with channel(f"127.0.0.1:{agent.port}", module=Module.L2_TRAINING_LOOP) as ch:
        with pytest.raises(grpc.RpcError) as err:
            next(iter(worker_pb2_grpc.WorkerServiceStub(ch).RankSession(iter([hello]), timeout=5)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_port_in_use_fails_with_one_line_and_a_nonzero_exit(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.worker",
                "--port",
                str(port),
                "--control",
                "127.0.0.1:1",
                "--run-dir",
                str(tmp_path),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0], err


# ---------------------------------------------------------------- memory pressure

GIB = 2**30


def write_meminfo(path: Path, available: int, total: int = 24 * GIB) -> None:
    """A /proc/meminfo lookalike (kB values), replaced atomically so the agent never reads
    half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        f"MemTotal:       {total // 1024} kB\n"
        f"MemFree:        {available // 2048} kB\n"
        f"MemAvailable:   {available // 1024} kB\n"
        "Buffers:          1024 kB\n"
    )
    os.replace(tmp, path)


def no_event_within(control: FakeControl, seconds: float) -> bool:
    try:
        event = control.next_event(timeout=seconds)
    except queue.Empty:
        return True
    raise AssertionError(f"unexpected event: {event}")


def test_memory_pressure_is_reported_once_on_entering_and_once_when_relieved(cluster, tmp_path):
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available=12 * GIB)
    control = cluster.control()
    cluster.agent(
        control.port,
        "--memory-check-seconds",
        "0.05",
        "--memory-pressure-fraction",
        "0.10",
        env={"SURGE_WORKER_MEMINFO": str(meminfo)},
    )
    reg = control.servicer.registration()
    assert reg.memory_bytes == 24 * GIB  # the registration reads the same file
    assert no_event_within(control.servicer, 0.3)  # 50% available: nothing to say

    write_meminfo(meminfo, available=int(1.2 * GIB))  # 5%
    event = control.servicer.next_event()
    assert event.WhichOneof("event") == "memory_pressure", event
    p = event.memory_pressure
    assert (p.worker_id, p.available_bytes, p.total_bytes, p.under_pressure) == (
        WORKER_ID,
        int(1.2 * GIB) // 1024 * 1024,
        24 * GIB,
        True,
    )
    assert no_event_within(control.servicer, 0.5)  # ~10 more samples, still low: silent

    write_meminfo(meminfo, available=int(0.11 * 24 * GIB))  # above 10%, inside the hysteresis
    assert no_event_within(control.servicer, 0.5)

    write_meminfo(meminfo, available=12 * GIB)
    event = control.servicer.next_event()
    assert event.WhichOneof("event") == "memory_pressure", event
    p = event.memory_pressure
    assert (p.worker_id, p.available_bytes, p.total_bytes, p.under_pressure) == (WORKER_ID, 12 * GIB, 24 * GIB, False)
    assert no_event_within(control.servicer, 0.5)


def test_memory_check_seconds_zero_disables_the_sampler(cluster, tmp_path):
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available=GIB)  # 4%: would be reported at once
    control = cluster.control()
    cluster.agent(control.port, env={"SURGE_WORKER_MEMINFO": str(meminfo), "SURGE_WORKER_MEMORY_CHECK_SECONDS": "0"})
    control.servicer.registration()
    assert no_event_within(control.servicer, 0.5)


# ---------------------------------------------------------------- rank log tails (StreamLogs plumbing)


def log_answer(control: FakeControl, request_id: str, timeout: float = START_TIMEOUT, until: str | None = None):
    """RankLogLines of ``request_id`` until its done (or, with ``until``, a line holding that
    text): (rank -> lines, done seen, other events seen meanwhile)."""
    lines: dict[int, list[str]] = {}
    others = []
    deadline = time.monotonic() + timeout
    while True:
        event = control.next_event(max(0.1, deadline - time.monotonic()))
        if event.WhichOneof("event") != "rank_log_lines":
            others.append(event)
            continue
        batch = event.rank_log_lines
        assert batch.request_id == request_id, batch
        if batch.done:
            return lines, True, others
        lines.setdefault(batch.rank, []).extend(batch.lines)
        if until is not None and any(until in line for line in batch.lines):
            return lines, False, others


def test_tail_rank_logs_sends_the_lines_then_follows_until_the_rank_exits_or_stop_tailing(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "tl", ["sleep", "sleep"], world_size=2)
    started_ranks(cluster, control.servicer, 2)
    path = agent.run_dir / "logs" / "tl.rank1.log"
    existing = [line for line in agent.rank_log("tl", 1).splitlines() if line.strip()]
    assert existing

    # Without follow: what the files hold, rank 1 only, then done.
    control.servicer.push(tail_rank_logs=control_pb2.TailRankLogs(request_id="r1", job_id="tl", follow=False, rank=1))
    lines, done, _ = log_answer(control.servicer, "r1")
    assert done and set(lines) == {1} and lines[1][: len(existing)] == existing

    # With follow: a line appended later arrives, a partial line only once complete.
    control.servicer.push(tail_rank_logs=control_pb2.TailRankLogs(request_id="r2", job_id="tl", follow=True, rank=-1))
    with open(path, "a") as f:
        f.write("appended by the test\npartial ")
    lines, done, _ = log_answer(control.servicer, "r2", until="appended by the test")
    assert not done and set(lines) <= {0, 1}
    with open(path, "a") as f:
        f.write("now complete\n")
    lines, done, _ = log_answer(control.servicer, "r2", until="partial now complete")
    assert not done and lines[1][-1] == "partial now complete"

    # The ranks exit: the tail drains the files and says done.
    control.servicer.push(release=control_pb2.ReleaseRanks(job_id="tl", kill=True))
    lines, done, others = log_answer(control.servicer, "r2", timeout=10)
    assert done
    assert sorted(e.rank_exited.rank for e in others if e.WhichOneof("event") == "rank_exited") == [0, 1]


def test_stop_tailing_ends_a_followed_tail_of_a_live_rank(cluster):
    control = cluster.control()
    cluster.agent(control.port)
    control.servicer.registration()
    launch(control.servicer, "st", "sleep")
    started_ranks(cluster, control.servicer, 1)
    control.servicer.push(tail_rank_logs=control_pb2.TailRankLogs(request_id="s1", job_id="st", follow=True, rank=-1))
    with pytest.raises(queue.Empty):
        log_answer(control.servicer, "s1", timeout=1.0)  # the rank lives: no done
    control.servicer.push(stop_tailing=control_pb2.StopTailing(request_id="s1"))
    _, done, _ = log_answer(control.servicer, "s1", timeout=5)
    assert done


def test_an_agent_sharing_its_host_registers_its_share_of_the_hosts_memory(cluster, tmp_path):
    """`surgectl up --workers 2` runs two agents on one host: each registering all of it let the
    allocator admit two ranks whose estimates summed past the host (fresh37 #7c)."""
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, available=12 * GIB)  # MemTotal 24 GiB
    control = cluster.control()
    cluster.agent(control.port, "--host-share", "2", env={"SURGE_WORKER_MEMINFO": str(meminfo)})
    reg = control.servicer.registration()
    assert reg.memory_bytes == 12 * GIB
    assert [(d.kind, d.memory_bytes) for d in reg.devices] == [("cpu", 12 * GIB)]
