"""The control-plane bench (issue 28 item 7): simulated node agents against the real control.

    .venv/bin/python bench/control_bench.py [--nodes 1024] [--ranks-per-node 8] [--agents 10000]
        [--restart-agents 3000] [--seconds 30] [--procs N] [--agents-per-channel 100] [--all-steps]
        [--tick-ms 10]
        [--only steps,heartbeats,restart]
        [--out bench/results/control.json]                        # `make bench-control`
    BENCH_QUICK=1: 128 x 8 ranks, 1,000 agents, 1,000 through the restart, 20 s windows

Starts control, store and data (``surgectl up`` with no worker, a fresh SURGE_HOME under
$SURGE_HOME/bench, the clone's .surge/bench when SURGE_HOME is unset) and then simulated node
agents: real gRPC clients speaking the node agent's
side of ``ControlService.WorkerSession`` as services/worker/control_link.py does (register,
every event sequenced and kept until acknowledged, re-register after a broken stream with
the ranks still running and resend what control has not applied; each rank's process stated
RUNNING at launch and to every new session, as node_agent.py does; a launch's reports and a
resend as ``WorkerEvent.batch`` messages of up to 64 events to a control that reads them, as
control_link.Outbox sends what piled up), no torch and no rank
process. Many agents share one asyncio loop (a process per core, ``--procs``): a stream is
a coroutine, never a thread. A process's agents beat from one ticker (``Schedule``: each
agent still at its own phase within the second, at most ``--tick-ms`` late; the loop wakes at most
1,000/tick-ms times a second, where a sleep per agent woke it at every agent's phase: ~100 us of
the agents' CPU per beat before session 41, ~40 after, at 3,000 agents on 2 cores). Each scenario
runs on a fresh stack.

* ``steps``: ``--nodes`` agents of ``--ranks-per-node`` ranks, one job over all of them at
  1 step/s. Every rank beats once a second (each agent on its own phase within the second,
  as independent hosts); at the step boundary (all ranks within ``--step-spread`` seconds:
  they leave the same all-reduce) rank 0's StepCompleted goes up, and of the other ranks
  only the first per session, as the node agent sends them (services/worker/step_summaries.py;
  ``--all-steps``: every rank's, as before). Then one rank's process exits
  (``RankExited``, exit code 1) and the bench waits for the orchestrator's ``fault`` and
  ``decision`` job events on WatchJob.
* ``heartbeats``: ``--agents`` agents of one rank each, one job over all of them, each rank
  beating at 1 Hz (its step advancing), no StepCompleted.

Beats go up as the node agent sends them (services/worker/rank_beats.py): one unsequenced
``RankBeats`` per node and second (a fact of now: never acknowledged, so their handling is
control's ``handling_ms``, not an ack latency; sequenced and acked before session 32) with every local rank's beat and the agent's own
``AgentHeartbeat`` riding in it; an agent with no stepping rank sends its beat alone,
unsequenced. (Before session 29 the simulated agent sent one message per rank beat and no
agent beat: 8,192 messages/s at 1,024 x 8 where the real agents send 1,024.) Where control
grants it (the ``surge-liveness-bin`` header, services/control/liveness_datagrams.py), the agent's
own beat goes as a signed ``AgentLiveness`` UDP datagram instead (one socket per agent process),
not riding, as the node agent sends it; a session told ``BeatOnSession`` beats on its stream.
Reported: ``datagrams_read_per_s`` (control's count), ``handling_ms.datagram_delay`` (the
agent's send -> taken at control) and the agents' own counts (``agents_datagrams``...).
* ``restart``: ``--restart-agents`` agents as in ``heartbeats``; after the steady window
  control is SIGKILLed and started again with the same command line (``stack.restart``), the
  agents re-register on their own, and for ``--after-restart`` seconds (beyond control's
  re-attach deadline, 15 s) every ``fault`` job event is a false death: every simulated
  rank is healthy and beating.

Measured per scenario, over the steady window (``--seconds``):
- event -> decision: send -> acknowledgement of every sequenced event, by kind (control
  acknowledges an event once applied and its effect, if any, journaled: rank 0's step is a
  journal row, a beat re-arms the rank's deadlines); in ``steps`` also RankExited sent ->
  the ``fault`` job event (graded, L1-3 -> L1-1) and -> the ``decision`` job event;
- control's CPU in cores (utime + stime from /proc/<pid>/stat over the window), and the
  simulated agents' (they share this machine's cores with control);
- journal writes/s (``surge_control_journal_commits_total``: SQLite commits) and messages
  and bytes per second in and out of control (``surge_control_messages_total`` /
  ``surge_control_bytes_total``), read from control's /metrics;
- ``restart``: seconds from the SIGKILL until every agent is registered again, and the
  false deaths (fault events after the kill), with their messages.

Results: bench/results/control.json and a markdown table on stdout. The figures are of this
machine: on a machine shared with other work, the agents' own CPU competes with control's
(both are reported).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from services.common import liveness_progress  # noqa: E402
from services.common.liveness_mac import liveness_mac  # noqa: E402
from services.contract import Module, control_pb2, control_pb2_grpc, engine_pb2, worker_pb2  # noqa: E402
from services.contract.relay import pack as relay_pack  # noqa: E402

FULL = {"nodes": 1024, "agents": 10_000, "restart_agents": 3000, "seconds": 30.0}
QUICK_SIZES = {"nodes": 128, "agents": 1000, "restart_agents": 1000, "seconds": 20.0}
REGISTERED_HEADER, LAST_SEQ_HEADER = "surge-registered", "surge-last-seq"  # services/control/server.py
LIVENESS_HEADER = "surge-liveness-bin"  # services/control/liveness_datagrams.py: the agent's grant
BATCHES_HEADER = "surge-batches"  # services/control/server.py: control reads WorkerEvent.batch
# The agents' ticker's resolution (``_ticker``, ``--tick-ms``): each agent beats at its own phase
# within the second, at most this late; its process's loop wakes at most 1/TICK_S times a second
# for them (a wake-up cost ~100 us of CPU here, session 41: 5 ms cost ~0.03 cores more than 10 ms
# at 3,000 agents). The coarser, the burstier the datagrams reach control: ~agents x TICK_S / procs
# at once (control's reader coalesces 5 ms after a wake-up anyway).
TICK_S = 0.01


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ simulated node agents


class Shared:
    """What the driver and the agent processes share (multiprocessing values)."""

    def __init__(self, ctx):
        self.registered = ctx.Value("i", 0)  # sessions acknowledged (a re-registration counts again)
        self.measuring = ctx.Value("i", 0)  # 1: record send -> ack latencies
        self.fault_rank = ctx.Value("i", -1)  # >= 0: that rank's process exits (RankExited) once
        self.fault_sent = ctx.Value("d", 0.0)  # when its RankExited was queued
        self.silent_agent = ctx.Value("i", -1)  # >= 0: that agent sends nothing more (its stream open)
        self.silent_since = ctx.Value("d", 0.0)  # when it sent its last beat
        self.stop = ctx.Event()


def agent_process(address: str, ids: list[int], cfg: dict, shared: Shared, out_q) -> None:
    """One process of simulated node agents: one asyncio loop, many streams."""
    asyncio.run(_agents(address, ids, cfg, shared, out_q))


async def _agents(address: str, ids: list[int], cfg: dict, shared: Shared, out_q) -> None:
    # The node agent's channel settings (control_link.py): reconnect 200 ms doubling to 2 s.
    options = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    channels = [
        grpc.aio.insecure_channel(address, options=options)
        for _ in range(max(1, len(ids) // cfg["agents_per_channel"]))
    ]
    stats = {
        "latency": collections.defaultdict(list),
        "errors": [],
        "error_workers": set(),
        "sessions": 0,
        "resent": 0,
        "datagrams": 0,
        "datagrams_failed": 0,
        "beat_on_session": 0,
    }
    # The agents' liveness datagrams (one socket for the process's agents: each signs its own).
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setblocking(False)
    host = address.rsplit(":", 1)[0]
    agents = [SimAgent(i, cfg, channels[k % len(channels)], shared, stats, (udp, host)) for k, i in enumerate(ids)]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    tasks.append(asyncio.create_task(_ticker(agents, cfg, shared, stats)))
    while not shared.stop.is_set():
        await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    out_q.put(
        {
            "latency": dict(stats["latency"]),
            "errors": stats["errors"][:10],
            "n_errors": len(stats["errors"]),
            "error_workers": sorted(stats["error_workers"]),
            "sessions": stats["sessions"],
            "resent": stats["resent"],
            "datagrams": stats["datagrams"],
            "datagrams_failed": stats["datagrams_failed"],
            "beat_on_session": stats["beat_on_session"],
        }
    )
    udp.close()
    for ch in channels:
        await ch.close()


class Schedule:
    """The process's agents' clock: each agent's beat once a second at its own phase within the
    second (``i / nodes``: as independent hosts) and, in ``steps``, its step boundary (within the
    spread). A heap of each agent's next beat and step boundary, absolute times: ``due(now)``
    gives each entry due by ``now`` once however late (one behind by seconds skips what it missed;
    a look a moment early acts on nothing), in time order, a beat before a step boundary at the
    same time."""

    def __init__(self, agents: list, cfg: dict, now: float):
        second = now - (now % 1.0) + 1.0
        self.heap: list[tuple[float, int, object, bool]] = []
        for a in agents:
            self.heap.append((second + (a.i / cfg["nodes"]) % 1.0, len(self.heap), a, False))
            if cfg["mode"] == "steps":
                step_phase = (a.i * 0.6180339887 % 1.0) * cfg["step_spread"]
                self.heap.append((second + step_phase, len(self.heap), a, True))
        heapq.heapify(self.heap)

    def due(self, now: float) -> list[tuple[object, bool]]:
        """(agent, is_step) of every entry due by ``now``, each rescheduled a second on (or
        more: to its first time after ``now``)."""
        heap, out = self.heap, []
        while heap and heap[0][0] <= now:
            at, k, agent, is_step = heap[0]
            heapq.heapreplace(heap, (at + 1.0 + max(0, int(now - at)), k, agent, is_step))
            out.append((agent, is_step))
        return out

    def next_at(self) -> float:
        return self.heap[0][0] if self.heap else float("inf")


async def _ticker(agents: list[SimAgent], cfg: dict, shared: Shared, stats: dict) -> None:
    """Every agent's beats and step boundaries (``Schedule``), from one coroutine per process
    that wakes at most every ``--tick-ms``. (Before session 41 each agent slept to its own next
    time: ~1,500 timer wake-ups a second per process at 3,000 agents, most of the agents' CPU.)
    The processes' wake-ups interleave (process k of n on its own grid, k/n of a tick on), so
    control gets the agents' datagrams in bursts of ~agents x tick / n, not all processes' at once."""
    schedule, tick = Schedule(agents, cfg, time.time()), cfg["tick_s"]
    offset = tick * cfg.get("proc", 0) / cfg.get("procs", 1)
    while agents:
        # The shared flags, read once a wake-up (each read takes their lock).
        silent, fault = shared.silent_agent.value, shared.fault_rank.value
        for agent, is_step in schedule.due(time.time()):
            try:
                if agent.tick(is_step, silent == agent.i, fault):
                    fault = -1  # (taken)
            except Exception as e:  # noqa: BLE001 - the agent's bug, counted: the others beat on
                stats["errors"].append(f"{agent.worker_id}: tick: {e!r}")
                stats["error_workers"].add(agent.worker_id)
        now = time.time()
        grid = offset + (((now - offset) // tick) + 1) * tick  # (the next wake-up on its grid)
        await asyncio.sleep(max(grid, schedule.next_at()) - now)


class SimAgent:
    """One simulated node agent: a WorkerSession stream with an outbox of sequenced events
    kept until acknowledged, re-opened when it breaks (as control_link.ControlSession)."""

    def __init__(self, index: int, cfg: dict, channel, shared: Shared, stats: dict, udp: tuple):
        self.i, self.cfg, self.shared, self.stats = index, cfg, shared, stats
        self.worker_id = f"sim-{index}"
        self.incarnation = f"sim-{index}-{os.getpid()}-{time.time_ns()}"
        self.stub = control_pb2_grpc.ControlServiceStub(channel)
        self.pb = control_pb2
        self.seq = 0
        self.outbox: collections.deque = collections.deque()  # (seq, event, sent time, kind)
        self.queue: asyncio.Queue | None = None  # the open session's requests
        self.launches: dict[str, object] = {}  # job -> LaunchRanks (declared in `running`)
        self.job, self.ranks, self.stepping, self.step = "", set(), False, 0
        self.heard: set[int] = set()  # ranks whose StepCompleted went up this session
        self.batches = False  # the session's control reads WorkerEvent.batch
        self.held: list | None = None  # events emitted while a launch is stated (one batch)
        self.last_beat = 0.0  # when this agent last sent a beat (its own or its ranks')
        # Its own beat as a datagram (services/worker/liveness_sender.py) while control's grant
        # holds: (the process's socket, control's host); the session's grant; its seq.
        self.udp, self.grant, self.lseq = udp, None, 0
        self.on_session = False  # control hears none of its datagrams: its beat on the stream too
        # Which of its ranks' beats ride its datagram (services/common/liveness_progress.py)
        self.split = liveness_progress.ProgressSplit()
        # Its ranks' beats, built once each and refreshed per beat (job, rank -> RankEvent):
        # a message that carries one is a copy (protobuf), so reusing it changes no message sent.
        self.beats: dict[tuple[str, int], object] = {}

    # ---- the stream

    async def run(self) -> None:
        """Its session, again after each break (its beats come from the process's ``_ticker``)."""
        delay = 0.2
        while not self.shared.stop.is_set():
            try:
                await self._session()
                delay = 0.2
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.stats["errors"].append(f"{self.worker_id}: {e.code().name}: {e.details()}")
                    self.stats["error_workers"].add(self.worker_id)
            finally:
                self.queue = None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    async def _session(self) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        reg = self.pb.WorkerRegistration(
            worker_id=self.worker_id,
            host="127.0.0.1",
            address=f"127.0.0.1:{1 + self.i}",
            slots=self.cfg["ranks_per_node"],
            cpu_count=self.cfg["ranks_per_node"],
            memory_bytes=self.cfg["ranks_per_node"] << 33,
            incarnation=self.incarnation,
            running=list(self.launches.values()),
        )
        queue.put_nowait(self.pb.WorkerEvent(register=reg))

        async def requests():
            while (ev := await queue.get()) is not None:
                yield ev

        call = self.stub.WorkerSession(
            requests(), metadata=(("x-surge-module", Module.Name(Module.EXT_HARDWARE)),), wait_for_ready=True
        )
        try:
            header = dict(await call.initial_metadata())
            if REGISTERED_HEADER not in header:
                await call  # raises the call's status
                return
            applied = int(header.get(LAST_SEQ_HEADER, "0"))
            grant = header.get(LIVENESS_HEADER)
            self.grant = self.pb.LivenessGrant.FromString(grant) if grant else None
            self.lseq, self.on_session = 0, False
            self.split.reset()  # (a new session learns each rank from the session first)
            self.batches = header.get(BATCHES_HEADER) == "1"
            while self.outbox and self.outbox[0][0] <= applied:
                self.outbox.popleft()
            self.queue = queue
            if self.batches:  # (batched as the agent's outbox sends what is queued: each keeps its seq)
                self.held = [ev for _seq, ev, _, _ in self.outbox]
            for _seq, ev, _, _ in self.outbox if not self.batches else ():  # not applied: again, in order
                queue.put_nowait(ev)
            self.stats["resent"] += len(self.outbox)
            for r in sorted(self.ranks):  # as the agent's restate_processes: a new control has not heard it
                self._process_running(r)
            if self.held is not None:
                self._send_held()
            self.heard.clear()
            self.stats["sessions"] += 1
            with self.shared.registered.get_lock():
                self.shared.registered.value += 1
            async for cmd in call:
                self._command(cmd)
        finally:
            self.queue = None
            self.grant = None  # (this session's)
            queue.put_nowait(None)
            call.cancel()

    def _emit(self, kind: str, **event) -> None:
        self.seq += 1
        ev = self.pb.WorkerEvent(seq=self.seq, **event)
        self.outbox.append((self.seq, ev, time.time(), kind))
        if self.held is not None:
            self.held.append(ev)
        elif self.queue is not None:
            self.queue.put_nowait(ev)

    def _send_held(self) -> None:
        """What the launch stated, as the node agent's outbox sends what piled up since its
        last send (control_link.Outbox): one batch per 64 events, each with its own seq."""
        held, self.held = self.held or [], None
        if self.queue is None:
            return
        for k in range(0, len(held), 64):
            part = held[k : k + 64]
            self.queue.put_nowait(
                part[0] if len(part) == 1 else self.pb.WorkerEvent(batch=self.pb.WorkerEvents(events=part))
            )

    def _command(self, cmd) -> None:
        kind = cmd.WhichOneof("command")
        if kind == "ack":
            now, measuring = time.time(), self.shared.measuring.value
            while self.outbox and self.outbox[0][0] <= cmd.ack.seq:
                _, _, sent, what = self.outbox.popleft()
                if measuring:
                    self.stats["latency"][what].append(now - sent)
        elif kind == "launch":
            self._launch(cmd.launch)
        elif kind == "release":
            self._release(cmd.release)
        elif kind == "routed" and cmd.routed.type == "surge.v1.StartTraining":  # to the job's ranks
            self.stepping = True
        elif kind == "beat_on_session":  # control's word on its datagrams (heard again: datagrams alone)
            self.on_session = not cmd.beat_on_session.datagrams_heard
            self.stats["beat_on_session"] += self.on_session

    def _launch(self, launch) -> None:
        old = self.launches.get(launch.job_id)
        if old is not None:  # a relaunch of some ranks: declared with the others after a restart
            merged = self.pb.LaunchRanks()
            merged.CopyFrom(launch)
            kept = {a.rank for a in launch.ranks}
            merged.ranks.extend(a for a in old.ranks if a.rank not in kept)
            launch = merged
        self.launches[launch.job_id] = launch
        self.job = launch.job_id
        if self.batches:
            self.held = []
        for a in launch.ranks:
            if a.rank in self.ranks:
                continue
            self.ranks.add(a.rank)
            self._process_running(a.rank)
            started = engine_pb2.TrainingLoopStarted(
                job_id=self.job, rank=a.rank, start_step=self.step, num_parameters=1, startup_seconds=0.1
            )
            self._emit(
                "started",
                rank_event=worker_pb2.RankEvent(
                    job_id=self.job, rank=a.rank, routed=relay_pack(started, Module.L2_TRAINING_LOOP)
                ),
            )
        if self.held is not None:
            self._send_held()

    def _process_running(self, rank: int) -> None:
        """The rank's process runs (``RankProcessState``, as the node agent states it when its
        waiter starts and again to every new control session): a late beat is then late, not
        gone (the fault detector's ``heartbeat_timeout_running_seconds``)."""
        fact = self.pb.RankProcessState(
            job_id=self.job,
            rank=rank,
            worker_id=self.worker_id,
            pid=100_000 + rank,
            state=self.pb.RankProcessState.RUNNING,
            unix_time=time.time(),
            detail="running",
        )
        self._emit("process_state", routed=relay_pack(fact, Module.EXT_HARDWARE))

    def _release(self, release) -> None:
        gone = set(release.ranks) or set(self.ranks)
        launch = self.launches.get(release.job_id)
        if launch is not None:
            kept = [a for a in launch.ranks if a.rank not in gone]
            del launch.ranks[:]
            launch.ranks.extend(kept)
        for r in sorted(gone & self.ranks):
            self.ranks.discard(r)
            exited = self.pb.RankExited(
                job_id=release.job_id, rank=r, exit_code=-9, worker_id=self.worker_id, released=True
            )
            self._emit("exited", rank_exited=exited)
        if not self.ranks:
            self.stepping = False

    # ---- the ranks' traffic

    def tick(self, is_step: bool, silent: bool, fault: int) -> bool:
        """Its beat now (``is_step``: its step boundary), from the process's ``_ticker``: each
        rank's heartbeat and, in ``steps``, its StepCompleted at the boundary. ``silent``: it
        sends nothing more (its stream stays open); ``fault``: the rank whose process exits now
        (``RankExited``) if it is one of this agent's. Returns whether it took the fault."""
        if silent:  # silent from now on: the stream stays open
            if not self.shared.silent_since.value:
                self.shared.silent_since.value = self.last_beat
            return False
        if not self.ranks:
            if not is_step:
                self._agent_beat_alone()
            return False
        if not self.stepping:  # launched, StartTraining not here yet: a real rank beats from its start
            if not is_step:
                self._rank_beats(time.time(), stepping=False)
            return False
        took = fault in self.ranks
        if took:
            self.shared.fault_rank.value = -1
            self.shared.fault_sent.value = time.time()
            self.ranks.discard(fault)
            exited = self.pb.RankExited(
                job_id=self.job, rank=fault, exit_code=1, worker_id=self.worker_id, detail="exit code 1"
            )
            self._emit("exited", rank_exited=exited)
        t = time.time()
        if is_step:
            self.step += 1
            for r in sorted(self.ranks):
                if not self.cfg["all_steps"] and r != 0 and r in self.heard:
                    continue  # as the node agent's StepSummaries: rank 0's, others' first per session
                self.heard.add(r)
                step = engine_pb2.StepCompleted(
                    job_id=self.job,
                    rank=r,
                    step=self.step,
                    loss=2.0,
                    tokens=4096,
                    tokens_per_second=4096.0,
                    step_seconds=1.0,
                    unix_time=t,
                    world_size=self.cfg["world"],
                )
                self._emit(
                    "step_rank0" if r == 0 else "step",
                    rank_event=worker_pb2.RankEvent(
                        job_id=self.job, rank=r, routed=relay_pack(step, Module.L2_TRAINING_LOOP)
                    ),
                )
            return took
        if self.cfg["mode"] != "steps":
            self.step += 1  # a beat that shows progress (the rank trains)
        self._rank_beats(t, stepping=True)
        return took

    def _rank_beats(self, t: float, stepping: bool) -> None:
        """As the node agent's RankBeats (services/worker/rank_beats.py): the node's ranks'
        beats of the period in one unsequenced message, with the agent's own beat riding in it
        (its period is the ranks' here, 1 s), not one message per rank."""
        phase = worker_pb2.PHASE_FORWARD if stepping else worker_pb2.PHASE_IDLE
        beats = []
        for r in sorted(self.ranks):
            ev = self.beats.get((self.job, r))
            if ev is None:
                ev = self.beats[(self.job, r)] = worker_pb2.RankEvent(
                    job_id=self.job,
                    rank=r,
                    heartbeat=worker_pb2.RankHeartbeat(job_id=self.job, rank=r, step_seconds=1.0, interval_seconds=1.0),
                )
            hb = ev.heartbeat
            hb.step, hb.stepping, hb.unix_time, hb.phase = self.step, stepping, t, phase
            # a real rank's compute so far (1 s steps: 0.3/0.6/0.1 s per phase), so L1-3's
            # slow-rank comparison does its real work
            hb.forward_compute_seconds = 0.3 * self.step
            hb.backward_compute_seconds = 0.6 * self.step
            hb.optimizer_compute_seconds = 0.1 * self.step
            beats.append(ev)
        self.last_beat = time.time()
        if self.grant is not None:  # its own beat as a datagram (as the node agent's)
            # with the ranks' beats that repeat what the session told riding in it; the rest (a
            # rank's first of the session, a change of stepping) on the session
            every = beats
            riding, beats = self.split.split(self.job, beats)
            packed, unfit = liveness_progress.pack(self.job, riding) if riding else (b"", [])
            self._datagram(t, packed)
            if not self.on_session:
                if beats or unfit:
                    self._fact(self.pb.WorkerEvent(rank_beats=self.pb.RankBeats(job_id=self.job, beats=beats + unfit)))
                return
            beats = every  # (told to beat on the stream too: all of them, its own beat riding as well)
        agent = self.pb.AgentHeartbeat(interval_seconds=1.0, unix_time=t)
        self._fact(self.pb.WorkerEvent(rank_beats=self.pb.RankBeats(job_id=self.job, beats=beats, agent=agent)))

    def _fact(self, ev) -> None:
        """A node's ranks' beats: in stream order, unsequenced, never kept, acknowledged or
        resent (control_link.Outbox's FACTS); dropped while no session is open."""
        if self.queue is not None:
            self.queue.put_nowait(ev)

    def _agent_beat_alone(self) -> None:
        """An idle node's agent beat (no rank beats to ride with): unsequenced, never kept
        or resent (control_link.Outbox.beat); a datagram while control's grant holds."""
        if self.grant is not None:
            self.last_beat = time.time()
            self._datagram(self.last_beat)
        if (self.grant is None or self.on_session) and self.queue is not None:
            beat = self.pb.AgentHeartbeat(interval_seconds=1.0, unix_time=time.time())
            self.last_beat = time.time()
            self.queue.put_nowait(self.pb.WorkerEvent(heartbeat=beat))

    def _datagram(self, t: float, progress: bytes = b"") -> None:
        """The agent's own beat as one signed AgentLiveness datagram (liveness_sender.py), its
        ranks' ``progress`` riding."""
        grant = self.grant
        self.lseq += 1
        msg = self.pb.AgentLiveness(
            slot=grant.slot, session=grant.session, seq=self.lseq, interval_seconds=1.0, unix_time=t, progress=progress
        )
        msg.mac = liveness_mac(grant.key, msg)
        sock, host = self.udp
        try:
            sock.sendto(msg.SerializeToString(), (host, grant.port))
            self.stats["datagrams"] += 1
        except OSError:  # (a full send buffer: dropped, as the kernel would on the way)
            self.stats["datagrams_failed"] += 1


# ------------------------------------------------------------------ control's side


def scrape(port: int) -> dict:
    """Control's message, byte and journal counters from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {"messages": {}, "bytes": {}, "journal_commits": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "surge_control_messages_total":
                out["messages"][f"{s.labels['direction']}:{s.labels['kind']}"] = s.value
            elif s.name == "surge_control_bytes_total":
                out["bytes"][f"{s.labels['direction']}:{s.labels['kind']}"] = s.value
            elif s.name == "surge_control_journal_commits_total":
                out["journal_commits"] = s.value
            elif s.name == "surge_liveness_datagrams_read_total":
                out["datagrams_read"] = s.value
            elif s.name == "surge_liveness_datagrams_dropped_total":
                out["datagrams_dropped"] = out.get("datagrams_dropped", 0.0) + s.value
                if s.labels["reason"] == "socket_full":  # (by the kernel: control read too slowly)
                    out["datagrams_socket_full"] = s.value
            elif s.name == "surge_liveness_fallbacks_total":
                out["beat_on_session"] = s.value
            elif s.name == "surge_liveness_resumed_total":
                out["datagrams_resumed"] = s.value
            elif s.name == "surge_liveness_rank_beats_total":
                out["datagram_rank_beats"] = s.value
            elif s.name == "surge_liveness_flips_deferred_total":
                out["flips_deferred"] = s.value
            elif s.name == "surge_liveness_datagram_delay_seconds_bucket":
                out.setdefault("datagram_delay", {})[float(s.labels["le"])] = s.value
            elif s.name in ("surge_control_applier_lag_seconds_bucket", "surge_control_apply_seconds_bucket"):
                key = f"{s.name.removesuffix('_seconds_bucket').removeprefix('surge_control_')}:{s.labels['queue']}"
                out.setdefault(key, {})[float(s.labels["le"])] = s.value
    return out


def handling(before: dict, after: dict) -> dict:
    """Control's own handling time over the window, from its histograms (per burst of a
    queue: ``applier_lag``, receipt on the gRPC loop -> a pool thread starts applying the
    burst's oldest message; ``apply``, the burst's apply): p50/p99 as the bucket's upper
    bound, in ms. The send -> ack latency (``ack_ms``) includes the ack pacer's interval
    (services/control/ack_pacer.py: at most one ack per session per second), so it is
    not control's handling time; these are."""
    out = {}
    for key, buckets in after.items():
        if not key.startswith(("applier_lag:", "apply:", "datagram_delay")):
            continue
        counts = sorted((le, n - before.get(key, {}).get(le, 0.0)) for le, n in buckets.items())
        total = counts[-1][1] if counts else 0.0
        if total <= 0:
            continue
        row = {"n": int(total)}
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            le = next(le for le, n in counts if n >= q * total)
            row[name] = "inf" if le == float("inf") else round(1e3 * le, 1)
        out[key] = row
    return out


def rates(before: dict, after: dict, seconds: float) -> dict:
    """Per second between two scrapes: journal commits, messages and bytes in and out."""

    def per_s(key: str, direction: str) -> float:
        return sum(v - before[key].get(k, 0.0) for k, v in after[key].items() if k.startswith(direction)) / seconds

    return {
        "journal_writes_per_s": (after["journal_commits"] - before["journal_commits"]) / seconds,
        "messages_in_per_s": per_s("messages", "in:"),
        "messages_out_per_s": per_s("messages", "out:"),
        "bytes_in_per_s": per_s("bytes", "in:"),
        "bytes_out_per_s": per_s("bytes", "out:"),
        "datagrams_read_per_s": (after.get("datagrams_read", 0.0) - before.get("datagrams_read", 0.0)) / seconds,
        "datagrams_dropped": after.get("datagrams_dropped", 0.0) - before.get("datagrams_dropped", 0.0),
        "datagrams_dropped_socket_full": after.get("datagrams_socket_full", 0.0)
        - before.get("datagrams_socket_full", 0.0),
        "beat_on_session_in_window": after.get("beat_on_session", 0.0) - before.get("beat_on_session", 0.0),
        "beat_on_session_total": after.get("beat_on_session", 0.0),
        "datagrams_resumed_total": after.get("datagrams_resumed", 0.0),
        "datagram_rank_beats_per_s": (after.get("datagram_rank_beats", 0.0) - before.get("datagram_rank_beats", 0.0))
        / seconds,
        "flips_deferred_total": after.get("flips_deferred", 0.0),
    }


class Watch:
    """Every JobEvent of a job (WatchJob, follow), re-subscribed when control comes back."""

    def __init__(self, job: str):
        self.job, self.events, self._stop = job, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from services.cli import clients

        while not self._stop.is_set():
            last = self.events[-1].seq if self.events else 0
            try:
                with clients.stub("control") as s:
                    for ev in s.WatchJob(control_pb2.JobQuery(job_id=self.job, follow=True, from_seq=last + 1)):
                        self.events.append(ev)
            except Exception:  # noqa: BLE001 - control restarted (or the stack went down): again
                self._stop.wait(0.5)

    def first(self, kind: str, after: float, timeout_s: float):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = [e for e in list(self.events) if e.type == kind and e.unix_time >= after]
            if found:
                return found[0]
            time.sleep(0.05)
        return None

    def close(self) -> None:
        self._stop.set()


class OperatorProbe:
    """An operator while steps flow: every 0.25 s a note on a job (AnnotateJob: a decision
    whose reply waits for its journal commit) and its status (GetJob: a published view),
    each timed send -> reply."""

    def __init__(self, job: str):
        self.job, self.ms = job, {"note": [], "status": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from services.cli import clients

        with clients.stub("control") as s:
            while not self._stop.wait(0.25):
                for kind, call in (
                    ("note", lambda: s.AnnotateJob(control_pb2.AnnotateJobRequest(job_id=self.job, note="bench"))),
                    ("status", lambda: s.GetJob(control_pb2.JobQuery(job_id=self.job))),
                ):
                    t = time.perf_counter()
                    try:
                        call()
                    except Exception:  # noqa: BLE001 - counted as missing, not timed
                        continue
                    self.ms[kind].append(1e3 * (time.perf_counter() - t))

    def close(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        return {
            k: {"p50": round(pct(v, 0.5), 1), "p99": round(pct(v, 0.99), 1), "n": len(v)}
            for k, v in self.ms.items()
            if v
        }


# ------------------------------------------------------------------ one scenario


def scenario(name: str, nodes: int, ranks_per_node: int, args) -> dict:
    """Run one scenario on a fresh stack; returns its figures."""
    from services.cli import stack as stack_mod

    mode = "steps" if name == "steps" else "heartbeats"
    world = nodes * ranks_per_node
    cfg = {
        "mode": mode,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "world": world,
        "step_spread": args.step_spread,
        "all_steps": args.all_steps,
        "agents_per_channel": args.agents_per_channel,
        "tick_s": args.tick_ms / 1e3,
    }
    out: dict = {"scenario": name, "nodes": nodes, "ranks_per_node": ranks_per_node, "ranks": world}
    c.setup_env()
    # Control admits 8,192 sessions by default (--max-sessions): 10,000 agents need room, or
    # the last 1,808 are refused and retry for ever (session 33: 8,192 of 10,000 in 420 s).
    os.environ["SURGE_CONTROL_MAX_SESSIONS"] = str(max(8192, nodes + 64))
    # The agents' liveness datagrams (opt-in in control; --no-datagrams measures without them).
    os.environ["SURGE_CONTROL_LIVENESS_DATAGRAMS"] = "off" if args.no_datagrams else "on"
    with c.Stack(workers=0) as stack:
        control_pid, address = stack.pid("control"), stack.procs["control"].address
        metrics_port = stack.procs["control"].metrics_port
        ctx = mp.get_context("spawn")
        shared, out_q = Shared(ctx), ctx.Queue()
        nproc = max(1, min(args.procs, (nodes + 249) // 250))
        procs = [
            ctx.Process(
                target=agent_process,
                args=(address, list(range(k, nodes, nproc)), dict(cfg, proc=k, procs=nproc), shared, out_q),
                daemon=True,
            )
            for k in range(nproc)
        ]
        t0 = time.time()
        for p in procs:
            p.start()
        while shared.registered.value < nodes and time.time() - t0 < args.register_timeout:
            time.sleep(0.2)
        out["registered"], out["register_wall_s"] = shared.registered.value, round(time.time() - t0, 2)
        watch, watches = None, []
        try:
            if shared.registered.value < nodes:
                out["error"] = f"{shared.registered.value}/{nodes} agents registered in {args.register_timeout:.0f} s"
                return out
            # ``--jobs``: the steps scenario's ranks as that many equal jobs (whole nodes each).
            jobs = max(1, args.jobs)
            out["jobs"] = jobs
            t_submit = time.time()
            for k in range(jobs):
                spec = c.write_spec(
                    c.REPO / "bench/jobs/throughput.yaml",
                    f"control-{name}-{world}" + (f"-{k}" if jobs > 1 else ""),
                    steps=1_000_000,
                    parallel={"dp": world // jobs, "backend": "auto", "threads_per_rank": 1},
                    checkpoint={"every_steps": 0, "at_end": False},
                    eval={"every_steps": 0, "at_end": False},
                    liveness={"heartbeat_interval_seconds": 1.0, "heartbeat_timeout_seconds": 3.0},
                )
                job, _ = c.submit(spec)
                watches.append(Watch(job))
            watch = watches[0]
            while time.time() - t_submit < args.register_timeout and not all(
                any("training started" in e.message for e in list(w.events)) for w in watches
            ):
                time.sleep(0.2)
            out["submit_to_running_s"] = round(time.time() - t_submit, 2)
            time.sleep(3.0)  # past the start's burst
            before, cpu0, t1 = scrape(metrics_port), cpu_seconds(control_pid), time.time()
            sim0 = sum(cpu_seconds(p.pid) for p in procs)
            shared.measuring.value = 1
            probe = OperatorProbe(watches[-1].job) if name == "steps" else None
            time.sleep(args.seconds)
            shared.measuring.value = 0
            if probe is not None:
                out["operator_ms"] = probe.close()
            wall = time.time() - t1
            out["control_cores"] = round((cpu_seconds(control_pid) - cpu0) / wall, 3)
            out["agents_cores"] = round((sum(cpu_seconds(p.pid) for p in procs) - sim0) / wall, 3)
            out["control_threads"] = len(os.listdir(f"/proc/{control_pid}/task"))
            # The machine's 1-minute load at the window's end: above its core count, control
            # waited for a core (its figures are then the machine's, not control's).
            out["loadavg_1m"] = round(os.getloadavg()[0], 1)
            after = scrape(metrics_port)
            out.update({k: round(v, 1) for k, v in rates(before, after, wall).items()})
            out["handling_ms"] = handling(before, after)
            out["faults_in_window"] = [e.message for w in watches for e in list(w.events) if e.type == "fault"][:5]
            if name == "steps" and jobs == 1:  # (with more, the rank that exits may be any job's)
                _inject_fault(out, shared, watch, world)
            elif name == "restart":
                _restart(out, shared, watches, stack_mod, stack, nodes, args)
            elif name == "heartbeats":
                _silence(out, shared, watches, nodes)
        finally:
            shared.stop.set()
            results = []
            for _ in procs:
                try:
                    results.append(out_q.get(timeout=60))
                except Exception:  # noqa: BLE001 - a process that hung: its figures are missing
                    pass
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            for w in watches:
                w.close()
    lat: dict[str, list[float]] = collections.defaultdict(list)
    for r in results:
        for k, v in r["latency"].items():
            lat[k].extend(v)
    out["ack_ms"] = {
        k: {"p50": round(1e3 * pct(v, 0.5), 1), "p99": round(1e3 * pct(v, 0.99), 1), "n": len(v)}
        for k, v in sorted(lat.items())
    }
    out["client_errors"] = sum(r["n_errors"] for r in results)
    out["client_error_samples"] = [e for r in results for e in r["errors"]][:5]
    # The agents whose stream broke with an error other than UNAVAILABLE (a fault event naming
    # one of them may be the simulated agent's, not control's).
    workers = sorted(w for r in results for w in r["error_workers"])
    out["client_error_workers"], out["client_error_worker_count"] = workers[:20], len(workers)
    out["events_resent"] = sum(r["resent"] for r in results)
    for key in ("datagrams", "datagrams_failed", "beat_on_session"):  # the agents' own counts, whole run
        out[f"agents_{key}"] = sum(r.get(key, 0) for r in results)
    return out


def _inject_fault(out: dict, shared: Shared, watch: Watch, world: int) -> None:
    """One rank's process exits; when do the fault report and the decision reach the job's log?"""
    t = time.time()
    shared.fault_rank.value = world // 2 + 1
    while shared.fault_sent.value == 0.0 and time.time() - t < 5:
        time.sleep(0.01)
    sent = shared.fault_sent.value
    if not sent:
        out["fault_error"] = "the rank's RankExited was never sent"
        return
    fault, decision = watch.first("fault", sent, 30), watch.first("decision", sent, 30)
    out["fault_to_fault_event_ms"] = round(1e3 * (fault.unix_time - sent), 1) if fault else None
    out["fault_to_decision_event_ms"] = round(1e3 * (decision.unix_time - sent), 1) if decision else None
    out["decision"] = decision.message if decision else None


def _silence(out: dict, shared: Shared, watches: list[Watch], nodes: int) -> None:
    """One agent (its rank's process too) goes silent, its stream open: how long from its last
    beat until the first ``fault`` job event (its rank declared silent, graded by L1-3)?"""
    t = time.time()
    shared.silent_agent.value = nodes // 2 + 1
    while not shared.silent_since.value and time.time() - t < 5:
        time.sleep(0.01)
    last = shared.silent_since.value
    if not last:
        out["silent_error"] = "the agent never went silent"
        return
    deadline = time.time() + 60
    found = None
    while found is None and time.time() < deadline:
        faults = sorted(
            (e for w in watches for e in list(w.events) if e.type == "fault" and e.unix_time >= last),
            key=lambda e: e.unix_time,
        )
        found = faults[0] if faults else None
        time.sleep(0.05)
    out["silent_to_fault_event_s"] = round(found.unix_time - last, 2) if found else None
    out["silent_fault"] = found.message if found else None


def _restart(out: dict, shared: Shared, watches: list[Watch], stack_mod, stack: c.Stack, nodes: int, args) -> None:
    """SIGKILL control with every agent connected, start it again, count false deaths."""
    before = shared.registered.value
    pid = stack.pid("control")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    try:
        stack_mod.restart("control", grace_s=0.0)
    except Exception as e:  # noqa: BLE001 - its health wait broke (seen: a reset under load): wait here
        out["restart_wait_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not _serving(stack_mod, args.register_timeout):
            out["error"] = f"control did not come back after the SIGKILL ({out['restart_wait_error']})"
            return
    stack.procs["control"] = stack_mod.read_stack()["control"]
    out["control_restart_s"] = round(time.time() - t_kill, 2)
    while shared.registered.value < before + nodes and time.time() - t_kill < args.register_timeout:
        time.sleep(0.1)
    back = shared.registered.value - before
    out["reregistered"] = back
    out["kill_to_all_reregistered_s"] = round(time.time() - t_kill, 2) if back >= nodes else None
    time.sleep(max(0.0, args.after_restart - (time.time() - t_kill)))
    faults = [e for w in watches for e in list(w.events) if e.type == "fault" and e.unix_time >= t_kill]
    out["false_deaths"] = len(faults)
    out["false_death_samples"] = [e.message for e in faults[:5]]
    # What the watch saw after the kill (it re-subscribed: the count above is of a live log).
    out["job_events_after_restart"] = [
        f"{e.type}: {e.message}" for w in watches for e in list(w.events) if e.unix_time >= t_kill
    ][:5]
    out["watched_after_restart_s"] = round(time.time() - t_kill, 1)


def _serving(stack_mod, timeout_s: float) -> bool:
    """Whether the control recorded in stack.json reports SERVING within ``timeout_s``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        proc = stack_mod.read_stack()["control"]
        try:
            with grpc.insecure_channel(proc.address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    return False


# ------------------------------------------------------------------ driver


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        ack = r.get("ack_ms", {})

        def lat(kind: str, ack: dict = ack) -> str:
            a = ack.get(kind)
            return f"{a['p50']:.0f} / {a['p99']:.0f}" if a else "-"

        extra = ""
        if r["scenario"] == "steps":
            extra = f"fault->decision {r.get('fault_to_decision_event_ms')} ms"
            op = r.get("operator_ms", {})
            if op:
                extra += "; operator note / status p50/p99 ms " + ", ".join(
                    f"{v['p50']:.0f}/{v['p99']:.0f}" for v in (op.get("note"), op.get("status")) if v
                )
        elif r["scenario"] == "restart":
            extra = f"false deaths {r.get('false_deaths')}, all back in {r.get('kill_to_all_reregistered_s')} s"
        h = r.get("handling_ms", {})
        if h:
            extra += "; handling p50/p99 ms " + ", ".join(f"{k} {v['p50']}/{v['p99']}" for k, v in sorted(h.items()))
        rows.append(
            (
                r["scenario"],
                f"{r['nodes']} x {r['ranks_per_node']}",
                f"{r['registered']}",
                lat("step_rank0"),
                lat("step"),
                f"{r.get('control_cores', float('nan')):.2f}",
                f"{r.get('agents_cores', float('nan')):.2f}",
                f"{r.get('journal_writes_per_s', float('nan')):.0f}",
                f"{r.get('messages_in_per_s', float('nan')):.0f} / {r.get('messages_out_per_s', float('nan')):.0f}",
                f"{r.get('datagrams_read_per_s', float('nan')):.0f}",
                f"{r.get('loadavg_1m', float('nan')):.1f}",
                r.get("error") or extra,
            )
        )
    header = (
        "scenario",
        "agents x ranks",
        "registered",
        "rank-0 step ack p50/p99 ms (with the ack pacer's <= 1 s)",
        "step ack ms",
        "control cores",
        "agents cores",
        "journal writes/s",
        "msgs in / out per s",
        "liveness datagrams read/s",
        "load avg 1 min",
        "",
    )
    return c.table(rows, header)


def main() -> None:
    sizes = QUICK_SIZES if c.QUICK else FULL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=sizes["nodes"], help="steps: node agents")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="steps: ranks per node agent")
    ap.add_argument("--agents", type=int, default=sizes["agents"], help="heartbeats: node agents of one rank")
    ap.add_argument("--restart-agents", type=int, default=sizes["restart_agents"], help="restart: node agents")
    ap.add_argument("--seconds", type=float, default=sizes["seconds"], help="steady window per scenario")
    ap.add_argument("--jobs", type=int, default=1, help="the ranks as this many equal jobs (whole nodes)")
    ap.add_argument("--after-restart", type=float, default=30.0, help="restart: seconds watched after the kill")
    ap.add_argument("--step-spread", type=float, default=0.05, help="steps: seconds over which ranks end a step")
    ap.add_argument(
        "--all-steps",
        action="store_true",
        help="steps: every rank's StepCompleted goes up (the node agent before coalescing); default: rank 0's, "
        "and each other rank's first per session (services/worker/step_summaries.py)",
    )
    ap.add_argument(
        "--agents-per-channel",
        type=int,
        default=100,
        help="agent streams per HTTP/2 connection (a real node agent has its own: 1)",
    )
    ap.add_argument(
        "--tick-ms",
        type=float,
        default=1e3 * TICK_S,
        help="the agents' beats' resolution within the second (a process's loop wakes at most 1,000/this a second)",
    )
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 2, help="agent processes (one asyncio loop each)")
    ap.add_argument("--register-timeout", type=float, default=120.0)
    ap.add_argument(
        "--no-datagrams", action="store_true", help="control without the agents' liveness datagrams (its default)"
    )
    ap.add_argument("--only", default="steps,heartbeats,restart", help="comma-separated scenarios")
    ap.add_argument("--out", default=str(c.RESULTS / "control.json"))
    args = ap.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in ("steps", "heartbeats", "restart")]
    if bad:
        sys.exit(f"--only: unknown scenario {bad[0]!r} (steps, heartbeats, restart)")
    for flag in ("nodes", "ranks_per_node", "agents", "restart_agents", "procs", "agents_per_channel"):
        if getattr(args, flag) < 1:
            sys.exit(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.seconds <= 0:
        sys.exit(f"--seconds: must be > 0, got {args.seconds}")
    if not 0 < args.tick_ms <= 100:
        sys.exit(f"--tick-ms: must be in (0, 100], got {args.tick_ms}")
    sizes = {
        "steps": (args.nodes, args.ranks_per_node),
        "heartbeats": (args.agents, 1),
        "restart": (args.restart_agents, 1),
    }
    results = []
    for name in only:
        print(f"[control bench] {name}: {sizes[name][0]} agents x {sizes[name][1]} ranks", flush=True)
        try:
            results.append(scenario(name, *sizes[name], args))
        except Exception as e:  # noqa: BLE001 - one scenario's failure is its figure; the others run
            nodes, per_node = sizes[name]
            results.append(
                {"scenario": name, "nodes": nodes, "ranks_per_node": per_node, "registered": 0, "error": repr(e)[:300]}
            )
        print(json.dumps(results[-1], default=str), flush=True)
    doc = {
        "machine": c.machine(),
        "full_sizes": all(
            sizes[n][0] >= {"steps": FULL["nodes"], "heartbeats": FULL["agents"], "restart": FULL["restart_agents"]}[n]
            for n in only
        ),
        "args": vars(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print(table(results))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
