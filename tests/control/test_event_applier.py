"""Node agent sessions on control's asyncio server: the applier's bursts (effect-less events
write nothing, acks cover no unjournaled effect), sessions that cost no thread, and the
``--max-sessions`` admission limit, over real loopback gRPC against `python -m services.control`."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from services.contract import Module, control_pb2, control_pb2_grpc, worker_pb2
from services.contract.relay import pack
from services.control.event_applier import NODE, EventApplier, job_of
from services.control.server import BATCHES_HEADER, LAST_SEQ_HEADER, REGISTERED_HEADER
from tests.callers import metadata
from tests.conftest import free_ports

from .conftest import registration
from .test_worker_events import acks, open_plane, running_job, step_event

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def heartbeat_event(job_id: str, rank: int, step: int, seq: int) -> control_pb2.WorkerEvent:
    beat = worker_pb2.RankHeartbeat(job_id=job_id, rank=rank, step=step, stepping=True, step_seconds=1.0)
    return control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id=job_id, rank=rank, heartbeat=beat), seq=seq)


# ------------------------------------------------------------------ in process: the burst


def journal_commits() -> float:
    return REGISTRY.get_sample_value("surge_control_journal_commits_total") or 0.0


def test_effectless_events_write_nothing_and_a_restarted_control_skips_their_seqs(tmp_path):
    """Beats are acked once applied, with no journal write (issue 28: one write per burst was
    ~730 commits/s at 1,000 agents); a step's write carries the cursor as it stands. After a
    restart the journaled watermark is behind the agent's ack: the agent resends from its
    ack on and control skips the seqs between (they had no effect to lose)."""
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, session, launch = running_job(plane)
    hub = plane.c.sessions
    before = journal_commits()
    hub.on_worker_events([(session, heartbeat_event(job_id, 0, 1, 1)), (session, heartbeat_event(job_id, 0, 1, 2))])
    assert journal_commits() == before  # two beats: no write
    assert session.durable == 2 and acks(plane, session) == [2]
    assert journal.worker_cursor("wa") == ("", 0)

    # step (journaled: rank 0's step row, with the cursor), beat, beat
    hub.on_worker_events(
        [
            (session, step_event(job_id, 1, 3)),
            (session, heartbeat_event(job_id, 0, 1, 4)),
            (session, heartbeat_event(job_id, 0, 2, 5)),
        ]
    )
    assert [s for s, _ in journal.steps(job_id)] == [1]
    # (the step's row is computed at its commit: the beats after it are in it if marked by then)
    incarnation, journaled = journal.worker_cursor("wa")
    assert incarnation == "i1" and 3 <= journaled <= 5
    assert session.durable == 5 and acks(plane, session) == [5]
    hub.on_worker_events([(session, heartbeat_event(job_id, 0, 2, 6))])
    assert acks(plane, session) == [6] and journal.worker_cursor("wa") == ("i1", journaled)
    journal.close()  # control is killed; the agent holds nothing up to 6 (acked)

    plane, journal = open_plane(db)
    reg = registration("wa")
    reg.incarnation = "i1"
    reg.running.append(launch)
    session = plane.c.sessions.open(reg)
    assert session.applied == journaled  # the surge-last-seq header; the agent resends from 7
    plane.c.sessions.on_worker_events(
        [(session, step_event(job_id, 2, 7)), (session, heartbeat_event(job_id, 0, 2, 8))]
    )
    assert [s for s, _ in journal.steps(job_id)] == [1, 2]
    assert plane.c.sessions.duplicates == 0
    assert session.durable == 8 and acks(plane, session) == [8]  # the gap 4..6 skipped
    assert journal.worker_cursor("wa")[1] >= 7
    journal.close()


def test_no_ack_covers_a_seq_whose_effect_the_journal_did_not_take(tmp_path):
    plane, journal = open_plane(tmp_path / "control.db")
    job_id, session, _ = running_job(plane)
    real_submit = journal._writer.submit

    def disk_full(statements, cursors=(), on_commit=None):  # a write carrying a cursor fails
        if not cursors:
            return real_submit(statements, cursors, on_commit)
        failed: Future = Future()
        failed.set_exception(sqlite3.OperationalError("database or disk is full"))
        return failed

    journal._writer.submit = disk_full
    with pytest.raises(sqlite3.OperationalError):
        plane.c.sessions.on_worker_events(
            [(session, step_event(job_id, 1, 1)), (session, heartbeat_event(job_id, 0, 1, 2))]
        )
    assert (session.applied, session.durable) == (2, 0)  # the beat after it is done, the step is not
    assert set(acks(plane, session)) <= {0}  # (an ack of nothing, if any)
    assert journal.worker_cursor("wa") == ("", 0)  # after a restart the agent resends 1 and 2
    journal.close()


# ------------------------------------------------------------------ the real process


class Control:
    """``python -m services.control`` with extra flags; stopped by PID."""

    def __init__(self, tmp: Path, *flags: str):
        self.port, data, store = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(tmp / f"control-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.control",
                "--port",
                str(self.port),
                "--db",
                str(tmp / "control.db"),
                "--data",
                f"127.0.0.1:{data}",
                "--store",
                f"127.0.0.1:{store}",
                *flags,
            ],
            cwd=REPO,
            env={**os.environ, "SURGE_HOME": str(tmp), "PYTHONUNBUFFERED": "1"},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        with grpc.insecure_channel(self.address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="surge.v1.ControlService"), timeout=30, wait_for_ready=True
            )
            for reply in watch:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    watch.cancel()
                    break

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def control(tmp_path):
    started: list[Control] = []

    def start(*flags: str) -> Control:
        started.append(Control(tmp_path, *flags))
        return started[-1]

    yield start
    for c in started:
        c.stop()


class Agent:
    """One node agent's session, as an asyncio gRPC client."""

    def __init__(self, channel: grpc.aio.Channel, worker_id: str):
        self.worker_id = worker_id
        reg = registration(worker_id)
        reg.incarnation = f"{worker_id}-1"
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.outgoing.put_nowait(control_pb2.WorkerEvent(register=reg))
        self.call = control_pb2_grpc.ControlServiceStub(channel).WorkerSession(
            self._requests(), metadata=metadata(Module.EXT_HARDWARE)
        )  # as a node agent

    async def _requests(self):
        while (ev := await self.outgoing.get()) is not None:
            yield ev

    async def registered(self) -> dict:
        return dict(await self.call.initial_metadata())

    async def next_ack(self) -> int:
        async for cmd in self.call:
            if cmd.WhichOneof("command") == "ack":
                return cmd.ack.seq
        raise AssertionError(f"{self.worker_id}: the session ended without an ack")


def test_two_hundred_sessions_are_served_without_a_thread_each_and_every_event_is_acked(control):
    c = control()
    before = c.threads()

    async def run() -> tuple[list[dict], list[int], int]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            agents = [Agent(ch, f"w{i}") for i in range(200)]
            headers = await asyncio.gather(*(a.registered() for a in agents))
            for a in agents:  # a memory report: a sequenced event with no journaled effect
                pressure = control_pb2.MemoryPressure(available_bytes=1 << 30, total_bytes=2 << 30)
                a.outgoing.put_nowait(control_pb2.WorkerEvent(memory_pressure=pressure, seq=1))
            seqs = await asyncio.wait_for(asyncio.gather(*(a.next_ack() for a in agents)), 60)
            during = c.threads()
            for a in agents:
                a.outgoing.put_nowait(None)
            return headers, seqs, during

    headers, seqs, during = asyncio.run(run())
    assert [h[REGISTERED_HEADER] for h in headers] == [f"w{i}" for i in range(200)]
    assert {h[LAST_SEQ_HEADER] for h in headers} == {"0"}
    assert seqs == [1] * 200
    # The sync server held two threads per session (400 here); now the loop and the
    # applier serve them all. The margin is for gRPC's and the pool's own threads.
    assert during - before < 20, (before, during)


def test_the_session_past_max_sessions_is_refused_and_one_closing_makes_room(control):
    c = control("--max-sessions", "2")

    async def run() -> tuple[grpc.StatusCode, str, str]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            a, b = Agent(ch, "wa"), Agent(ch, "wb")
            await asyncio.gather(a.registered(), b.registered())
            third = Agent(ch, "wc")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.next_ack()
            a.outgoing.put_nowait(None)  # half-close: wa's session ends
            async for _ in a.call:
                pass
            fourth = Agent(ch, "wd")
            header = (await asyncio.wait_for(fourth.registered(), 30))[REGISTERED_HEADER]
            for agent in (b, fourth):
                agent.outgoing.put_nowait(None)
            return refused.value.code(), refused.value.details(), header

    code, details, header = asyncio.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == "WorkerSession: control holds 2 node agent sessions (--max-sessions); wc refused"
    assert header == "wd"


def test_max_sessions_below_one_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.control",
            "--port",
            "1",
            "--data",
            "a:1",
            "--store",
            "b:1",
            "--max-sessions",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--max-sessions must be >= 1, got 0")


def test_the_applier_applies_a_sessions_exit_report_before_its_close(tmp_path):
    """One queue, one thread: a session's messages and its close are applied in the order
    read, so an exit sent just before the stream ends is the rank's exit, not a lost node."""
    plane, journal = open_plane(tmp_path / "control.db")
    applier = EventApplier(plane.c.sessions)
    job_id, session, _ = running_job(plane)
    applier.event(session, step_event(job_id, 1, 1))
    exited = control_pb2.RankExited(job_id=job_id, rank=0, exit_code=3, detail="exit code 3")
    applier.event(session, control_pb2.WorkerEvent(rank_exited=exited, seq=2))
    applier.close(session, reason="stream closed")
    drained = threading.Event()
    applier.call(drained.set)
    assert drained.wait(10)
    applier.stop()
    assert session.closed and journal.worker_cursor("wa") == ("i1", 2)
    assert [s for s, _ in journal.steps(job_id)] == [1]
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    # The exit first (the recovery then relaunches rank 0 on wa, which the close loses).
    assert faults[0] == "SEVERE rank_exit: rank 0 on worker wa ended (exit code 3): exit code 3", faults
    assert "worker_lost:" not in faults[0]
    journal.close()


def test_a_deadline_posted_while_the_servers_loop_is_behind_is_applied_after_what_that_loop_had_received():
    # 1,024 simulated agents on a saturated control: their beats waited in the server loop's
    # reads while their silence deadlines fired; posted straight onto the applier's queue, a
    # deadline's decision overtook the beat that had arrived before it fired. Posted through
    # the loop (InOrder), it queues behind what the loop has ready by then.
    from services.control.event_applier import InOrder

    applier = EventApplier(hub=None, workers=2)  # (calls only: no session message is applied)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    applier.receive_on(loop)
    order: list[str] = []
    done = threading.Event()
    behind, release = threading.Event(), threading.Event()
    try:
        loop.call_soon_threadsafe(lambda: (behind.set(), release.wait(5)))  # the loop, starved
        assert behind.wait(5)
        # A beat the server had received (its read ready on the loop) before the deadline fired...
        loop.call_soon_threadsafe(applier.call, lambda: order.append("beat"), "j")
        # ...and the deadline, fired on the deadlines' thread meanwhile.
        InOrder(applier)(lambda: (order.append("deadline"), done.set()), "j")
        release.set()
        assert done.wait(5)
        assert order == ["beat", "deadline"]
    finally:
        release.set()
        applier.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_batch_of_events_is_applied_event_by_event_each_once_and_acknowledged_to_its_last_seq(control):
    # A node's launch stated each rank's process and start in a message of its own: 16,384
    # messages for 8,192 ranks, all on control's one loop (issue 28). A batch carries them in
    # one message, each with its own seq: applied as if sent alone, a resent one once.
    metrics_port = free_ports(1)[0]
    c = control("--metrics-port", str(metrics_port))

    def worker_events() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        return {
            s.labels["outcome"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "surge_worker_events_total"
        }

    def pressure(seq: int) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(
            memory_pressure=control_pb2.MemoryPressure(available_bytes=seq << 20, total_bytes=2 << 30), seq=seq
        )

    def batch(*events: control_pb2.WorkerEvent) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(batch=control_pb2.WorkerEvents(events=events))

    async def run() -> tuple[dict, int, dict, int]:
        async with grpc.aio.insecure_channel(c.address) as ch:
            a = Agent(ch, "wa")
            first = await a.registered()
            a.outgoing.put_nowait(batch(pressure(1), pressure(2), pressure(3)))
            acked = await asyncio.wait_for(a.next_ack(), 30)
            # The same incarnation again (its stream broke, control has not seen it end; the new
            # session replaces it and keeps its cursor): 2 and 3 resent with 4 and 5, and
            # a registration and a batch inside the batch, which no agent sends: refused alone.
            b = Agent(ch, "wa")
            await b.registered()
            nested = batch(pressure(6))
            b.outgoing.put_nowait(
                batch(
                    pressure(2), pressure(3), pressure(4), control_pb2.WorkerEvent(register=registration("wa")), nested
                )
            )
            b.outgoing.put_nowait(pressure(5))
            again = [await asyncio.wait_for(b.next_ack(), 30)]
            while again[-1] < 5:  # (acks are paced: 4's may come alone first)
                again.append(await asyncio.wait_for(b.next_ack(), 30))
            for agent in (a, b):
                agent.outgoing.put_nowait(None)
            return first, acked, None, again

    first, acked, second, again = asyncio.run(run())
    assert first[BATCHES_HEADER] == "1"  # (an agent batches only for a control that says so)
    assert acked == 3
    assert worker_events() == {"applied": 5.0, "duplicate": 2.0}  # each seq once: 1-5; 2 and 3 again dropped
    # 4 and 5 applied after the duplicates 2 and 3 (the batch went on past what it refused)
    assert again[-1] == 5 and all(3 <= s <= 5 for s in again)


def test_a_ranks_process_state_is_applied_on_its_jobs_queue_not_ahead_of_every_agents_beat():
    # 8,192 process states of a launch on the node queue held every agent's own beat behind
    # them (its silence declared while control worked through them, issue 28): they are facts
    # of a job's rank, applied in order with its beats and exit on the job's queue.
    state = control_pb2.RankProcessState(job_id="j1", rank=3, worker_id="wa", pid=7, state=1)
    ev = control_pb2.WorkerEvent(routed=pack(state, Module.EXT_HARDWARE), seq=1)
    assert job_of(ev) == "j1"
    link = control_pb2.LinkStateChanged(worker_id="wa", peer_worker_id="wb")
    assert job_of(control_pb2.WorkerEvent(routed=pack(link, Module.EXT_HARDWARE), seq=2)) == NODE
    assert job_of(control_pb2.WorkerEvent(heartbeat=control_pb2.AgentHeartbeat())) == NODE


class RecordingHub:
    """What the applier hands a session hub: every message applied, in order (the applier is
    the part under test; the hub's own work is tested with the real one above)."""

    def __init__(self):
        self.applied: list[control_pb2.WorkerEvent] = []

    def admit(self, session, ev) -> bool:
        return True

    def on_worker_events(self, burst, admitted=False, wait=True) -> None:
        self.applied.extend(ev for _, ev in burst)


def rank_beats(job_id: str, step: int, ranks=(0, 1)) -> control_pb2.WorkerEvent:
    beats = [
        worker_pb2.RankEvent(
            job_id=job_id, rank=r, heartbeat=worker_pb2.RankHeartbeat(job_id=job_id, rank=r, step=step)
        )
        for r in ranks
    ]
    agent = control_pb2.AgentHeartbeat(interval_seconds=1.0, unix_time=float(step))
    return control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id=job_id, beats=beats, agent=agent))


def test_a_sessions_beats_waiting_behind_a_backlog_fold_into_one_newest_beat_rank_by_rank():
    # 10,000 agents on a control seconds behind: every beat of every agent queued, applied
    # late one after the other, the newest behind the stale ones, and control's memory grew
    # until the kernel killed it (13 GB, session 34). A waiting beat is superseded by the
    # session's next one; a rank missing from the newer keeps its own; a sequenced event
    # between two beats keeps both in order.
    from services.control.session_hub import AgentSession

    hub = RecordingHub()
    applier = EventApplier(hub, workers=2)
    release = threading.Event()
    try:
        busy = {NODE: threading.Event(), "j": threading.Event()}
        for key, started in busy.items():  # the node and the job queue busy (control behind)
            applier.call(lambda started=started: (started.set(), release.wait(10)), key)
        assert all(started.wait(10) for started in busy.values())
        a, b = AgentSession("wa"), AgentSession("wb")
        for step in range(1, 51):
            applier.event(a, rank_beats("j", step))
        applier.event(a, rank_beats("j", 51, ranks=(1,)))  # rank 0 silent in the newest
        applier.event(b, rank_beats("j", 7))
        applier.event(b, step_event("j", 7, seq=1))  # sequenced: b's rank beats around it stay apart
        applier.event(b, rank_beats("j", 8))
        assert applier.depth() == (4, 2)  # job: a's beats; b's beat, step, beat. node: a's, b's agent beat
        release.set()
        drained = {NODE: threading.Event(), "j": threading.Event()}
        for key, done in drained.items():
            applier.call(done.set, key)
        assert all(done.wait(10) for done in drained.values())
    finally:
        release.set()
        applier.stop()
    kinds = [(ev.WhichOneof("event"), ev.seq) for ev in hub.applied]
    assert kinds.count(("rank_beats", 0)) == 3 and kinds.count(("heartbeat", 0)) == 2, kinds
    beats = [ev.rank_beats for ev in hub.applied if ev.HasField("rank_beats")]
    assert {(b.rank, b.heartbeat.step) for b in beats[0].beats} == {(0, 50), (1, 51)}  # a: each rank's newest
    assert [[x.heartbeat.step for x in b.beats] for b in beats[1:]] == [[7, 7], [8, 8]]  # b: apart, in order
    assert sorted(ev.heartbeat.unix_time for ev in hub.applied if ev.HasField("heartbeat")) == [8.0, 51.0]
