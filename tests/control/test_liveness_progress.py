"""A rank's beats that only move its progress ride its node agent's liveness datagram
(services/common/liveness_progress.py, ``AgentLiveness.progress``) and control takes them as a
``RankBeats`` read off the session (services/control/liveness_datagrams.py); what changes state
stays on the session, and a datagram's beat that overtook it changes nothing. And the fallback's
damper: a session's resume waits twice as long after each fallback, and control tells at most so
many fallbacks a second. In process: the real liveness socket on 127.0.0.1, the agent's sender,
the real applier and detector; a hub that relays what it applies as the real one does."""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest

from services.common.liveness_mac import liveness_mac
from services.common.liveness_progress import PROGRESS_BYTES, ProgressSplit, pack
from services.contract import Module, control_pb2, worker_pb2
from services.contract.bus import Bus
from services.control import liveness_datagrams as ld
from services.control.beat_stamps import BeatStamps
from services.control.event_applier import EventApplier
from services.control.fault_detector import FaultDetector
from services.control.liveness_datagrams import LivenessDatagrams
from services.control.metrics import LIVENESS_RANK_BEATS
from services.control.session_hub import AgentSession
from services.worker.liveness_sender import LivenessSender

from .test_fault_detector import Reports

pytestmark = pytest.mark.timeout(60)

JOB = "j"
TIMEOUT_S = 4.0  # the rank's silence deadline (its job's heartbeat timeout)


class RelayHub:
    """What the applier hands a session hub: each rank's beat on to L1-3 as the real hub's relay
    sends it (job id, rank and worker set from the envelope and the session), an exit too."""

    def __init__(self, detector: FaultDetector):
        self._detector = detector

    def admit(self, session, ev) -> bool:
        return True

    def on_worker_events(self, burst, admitted=False, wait=True) -> None:
        for session, ev in burst:
            if ev.HasField("rank_beats"):
                for one in ev.rank_beats.beats:
                    beat = one.heartbeat
                    beat.job_id, beat.rank, beat.worker_id = beat.job_id or one.job_id, one.rank, session.worker_id
                    self._detector.on_rank_heartbeat(beat)
            elif ev.HasField("rank_exited"):
                self._detector.on_rank_exited(ev.rank_exited)


class Control:
    def __init__(self):
        self.bus = Bus()
        self.detector = FaultDetector(emit=self.bus.emitter(Module.L1_FAULT_DETECTOR))
        self.bus.subscribe(
            Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, self.detector.start_fault_monitoring
        )
        self.reports = Reports()
        self.bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, self.reports.add)
        monitor = control_pb2.StartFaultMonitoring(job_id=JOB, heartbeat_timeout_seconds=TIMEOUT_S)
        self.bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, monitor)
        self.applier = EventApplier(RelayHub(self.detector), workers=2, stamps=BeatStamps())
        self.liveness = LivenessDatagrams(BeatStamps(), self.applier.events, "127.0.0.1", 0)
        self.liveness.start()
        self.session = AgentSession("w")
        self.sender = LivenessSender(self.liveness.grant(self.session), "127.0.0.1")
        self.split = ProgressSplit()

    def beat(self, rank: int, step: int, phase=worker_pb2.PHASE_FORWARD, unix_time: float | None = None):
        """The node agent's flush of one rank's beat: riding a datagram if it may (the agent's
        rule), else on the session (the applier's ``event``, as the session's reader calls it)."""
        ev = worker_pb2.RankEvent(
            job_id=JOB,
            rank=rank,
            generation=1,
            heartbeat=worker_pb2.RankHeartbeat(
                job_id=JOB,
                rank=rank,
                step=step,
                stepping=True,
                interval_seconds=0.3,
                phase=phase,
                unix_time=time.time() if unix_time is None else unix_time,
            ),
        )
        riding, on_session = self.split.split(JOB, [ev])
        if riding:
            packed, unfit = pack(JOB, riding)
            assert not unfit
            self.sender.send(1.0, time.time(), packed)
        if on_session:
            self.applier.event(
                self.session, control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id=JOB, beats=on_session))
            )
        return "datagram" if riding else "session"

    def watch(self, rank: int):
        return self.detector._jobs[JOB].ranks.get(rank)

    def close(self):
        self.liveness.close()
        self.sender.close()
        self.detector.close()
        self.applier.stop()


def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def test_a_ranks_progress_riding_the_datagram_keeps_it_unsilent_with_its_session_beats_gone_quiet():
    # 10,000 agents, each with a stepping rank: their RankBeats were 10,000 gRPC messages a
    # second, ~2 cores of grpc aio reads at control, and a rank_silent cascade at the jobs' start.
    control = Control()
    read_before = LIVENESS_RANK_BEATS._value.get()
    try:
        assert control.beat(0, step=1) == "session"  # its first of the session: control learns it there
        until(lambda: control.watch(0) is not None, 10, "rank 0 not watched from its session beat")
        ways, step, ends = [], 1, time.monotonic() + 2 * TIMEOUT_S
        while time.monotonic() < ends:  # twice its deadline with nothing on its session
            step += 1
            ways.append(
                control.beat(0, step=step, phase=(worker_pb2.PHASE_FORWARD, worker_pb2.PHASE_COLLECTIVE)[step % 2])
            )
            time.sleep(0.3)
        assert set(ways) == {"datagram"}
        until(lambda: control.watch(0).step == step, 10, f"rank 0's progress never reached step {step}")
        assert list(control.reports) == []  # never silent, never stalled
        assert LIVENESS_RANK_BEATS._value.get() - read_before >= len(ways) - 2  # (its last may be in flight)
        # Its datagrams stop too: now it is silent (what kept it alive were the datagrams)
        (silent,) = control.reports.wait(1, timeout=3 * TIMEOUT_S)
        assert (silent.fault_class, silent.job_id, silent.rank) == ("rank_silent", JOB, 0), silent
    finally:
        control.close()


def test_what_changes_state_goes_on_the_session_and_a_datagram_beat_that_overtook_the_exit_revives_nothing():
    control = Control()
    try:
        assert control.beat(0, step=1) == "session"
        assert control.beat(0, step=2) == "datagram"
        # A phase L1-3 gives a deadline of its own (and its stepping or generation changing): the session
        assert control.beat(0, step=2, phase=worker_pb2.PHASE_CHECKPOINT_STAGING) == "session"
        assert control.beat(0, step=2, phase=worker_pb2.PHASE_CHECKPOINT_STAGING) == "datagram"  # (within it)
        assert control.beat(0, step=2, phase=worker_pb2.PHASE_FORWARD) == "session"  # (leaving it)
        assert control.beat(0, step=2, phase=worker_pb2.PHASE_COLLECTIVE) == "datagram"
        until(
            lambda: control.watch(0) is not None and control.watch(0).step == 2,
            10,
            lambda: f"rank 0: {control.watch(0)}",
        )
        sent = time.time()  # a beat built now, delayed on the way (a starved sender, a queue)
        # The rank exits: stated on the session, in order after its beats
        exited = control_pb2.RankExited(job_id=JOB, rank=0, exit_code=0, worker_id="w", generation=1)
        control.applier.event(control.session, control_pb2.WorkerEvent(seq=1, rank_exited=exited))
        until(lambda: control.watch(0) is None, 10, "rank 0's exit never applied")
        clean = len(control.reports)  # (its exit graded: rank_exit_clean)
        # The delayed datagram arrives after the exit: it must not arm a deadline for a rank gone
        assert control.beat(0, step=3, unix_time=sent) == "datagram"
        read = LIVENESS_RANK_BEATS._value.get()
        until(lambda: LIVENESS_RANK_BEATS._value.get() >= read, 10, "the late datagram never read")
        time.sleep(TIMEOUT_S + 1.5)  # (past the deadline it would have armed)
        assert control.watch(0) is None
        assert [r.fault_class for r in list(control.reports)[clean:]] == []  # no rank_silent of a rank gone
    finally:
        control.close()


def test_a_datagram_beat_older_than_the_last_taken_is_not_taken():
    control = Control()
    try:
        control.beat(0, step=1)
        control.beat(0, step=5)  # (riding)
        until(lambda: control.watch(0) is not None and control.watch(0).step == 5, 10, "step 5 never taken")
        control.beat(0, step=4, unix_time=time.time() - 5.0)  # reordered on the way: an older one
        time.sleep(1.0)
        assert control.watch(0).step == 5
    finally:
        control.close()


def test_the_packing_stays_under_its_bound_and_the_rest_goes_on_the_session():
    beats = [
        worker_pb2.RankEvent(
            job_id="job-" + "x" * 32,
            rank=r,
            generation=7,
            heartbeat=worker_pb2.RankHeartbeat(
                job_id="job-" + "x" * 32,
                rank=r,
                step=10**6 + r,
                stepping=True,
                step_seconds=1.5,
                unix_time=time.time(),
                interval_seconds=1.0,
                worker_id="a-long-worker-name-0001",
                phase=worker_pb2.PHASE_BACKWARD,
                phase_seconds=0.25,
                forward_compute_seconds=1e5,
                backward_compute_seconds=2e5,
                optimizer_compute_seconds=3e4,
            ),
        )
        for r in range(64)
    ]
    packed, left = pack("job-" + "x" * 32, beats)
    assert 0 < len(packed) <= PROGRESS_BYTES and len(left) > 0
    progress = control_pb2.LivenessProgress.FromString(packed)
    assert len(progress.jobs[0].beats) + len(left) == 64 and len(progress.jobs[0].beats) >= 8
    # The whole datagram under an IPv6 minimum MTU's UDP payload (1,232 bytes)
    msg = control_pb2.AgentLiveness(slot=2**31, session=2**63, seq=2**40, interval_seconds=1.0, unix_time=time.time())
    msg.progress = packed
    msg.mac = liveness_mac(b"k" * 32, msg)
    assert msg.ByteSize() <= 1232


# ------------------------------------------------------------------ the fallback's damper


class FakeSession:
    def __init__(self, worker_id: str):
        self.worker_id, self.commands = worker_id, queue.Queue()

    def told(self) -> list[bool]:
        """Each BeatOnSession told so far: True a fallback, False a resume."""
        out = []
        while not self.commands.empty():
            out.append(not self.commands.get_nowait().beat_on_session.datagrams_heard)
        return out


def datagram(grant: control_pb2.LivenessGrant, seq: int) -> bytes:
    msg = control_pb2.AgentLiveness(
        slot=grant.slot, session=grant.session, seq=seq, interval_seconds=1.0, unix_time=time.time()
    )
    msg.mac = liveness_mac(grant.key, msg)
    return msg.SerializeToString()


def test_each_fallback_doubles_the_steady_time_before_the_session_resumes_up_to_its_cap():
    # 10,000 starved agents: 79,691 fallbacks and as many resumes in 5 minutes (udp36), a
    # command each way and the agent's gRPC beats between. The reader's own clock is driven here
    # (its sweep and its reads take the time they act at): no sleep, no load sensitivity.
    liveness = LivenessDatagrams(BeatStamps(), lambda beats: None, "127.0.0.1", 0)  # (not started)
    try:
        session = FakeSession("w")
        grant = liveness.grant(session)
        t, seq, waits = time.monotonic(), 0, []
        for _flip in range(8):
            t += 3.0  # quiet for 3 periods (a starved spell)
            liveness._fall_back(t)
            assert session.told() == [True]
            heard_from = None
            for _period in range(200):  # then heard every period until told to resume
                t += 1.0
                seq += 1
                liveness._take(datagram(grant, seq), t, [])
                heard_from = heard_from or t
                if session.told() == [False]:
                    waits.append(round(t - heard_from))
                    break
                liveness._fall_back(t)  # (the sweeps meanwhile tell nothing)
                assert session.told() == []
        assert waits == [2, 4, 8, 16, 32, 64, 64, 64]
    finally:
        liveness.close()


def test_fallbacks_are_told_at_most_at_the_bound_a_second_and_the_rest_later():
    liveness = LivenessDatagrams(BeatStamps(), lambda beats: None, "127.0.0.1", 0)
    try:
        sessions = [FakeSession(f"w{i}") for i in range(200)]
        for s in sessions:
            liveness.grant(s)
        t = time.monotonic() + 3.0  # every session unheard for 3 periods, nothing read: not a mass hold
        told = []
        for _sweep in range(12):  # a sweep every 0.25 s
            liveness._fall_back(t)
            told.append(sum(len(s.told()) for s in sessions))
            t += 0.25
        # the bound: max(50, 5 % of 200) = 50 a second, a second's worth at once
        assert told[0] == ld.FLIPS_MIN_PER_S
        assert all(n <= ld.FLIPS_MIN_PER_S * 0.25 + 1 for n in told[1:])
        assert 50 + 11 * 12 <= sum(told) <= 50 + 11 * 13  # (12.5 tokens a sweep: 12 or 13 told)
        assert sum(told) < len(sessions)
    finally:
        liveness.close()


def test_a_datagrams_beats_never_fold_into_the_sessions_waiting_ones():
    # Found by the test above under load: the rank's first beat (on the session) waiting in the
    # job's queue was replaced by its next, from a datagram, which starts no watch: the rank was
    # never watched (and its agent, having told it, sent only datagrams from then on).
    from services.common.liveness_progress import unpack
    from services.control.event_applier import _fold

    def session_beats(step: int) -> control_pb2.WorkerEvent:
        beat = worker_pb2.RankEvent(job_id=JOB, rank=0, heartbeat=worker_pb2.RankHeartbeat(step=step, stepping=True))
        return control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id=JOB, beats=[beat]))

    def datagram_beats(step: int) -> control_pb2.WorkerEvent:
        packed, _ = pack(JOB, session_beats(step).rank_beats.beats)
        (batch,) = unpack(packed)
        return control_pb2.WorkerEvent(rank_beats=batch)

    waiting = session_beats(1)
    assert not _fold(waiting, datagram_beats(2))  # queued behind it instead
    assert waiting.rank_beats.beats[0].heartbeat.step == 1
    riding = datagram_beats(2)
    assert not _fold(riding, session_beats(3))
    assert _fold(riding, datagram_beats(3)) and riding.rank_beats.beats[0].heartbeat.step == 3
    assert _fold(waiting, session_beats(3)) and waiting.rank_beats.beats[0].heartbeat.step == 3


@pytest.mark.skipif(ld.DatagramReads is None, reason="no recvmmsg here: the reader takes one datagram a read")
def test_the_datagrams_of_one_read_go_to_the_applier_in_one_hand_over_each_sessions_in_order():
    # At 3,000 agents the reader handed each datagram to the applier alone: a take of the lock,
    # a pool thread woken and the GIL passed back and forth per beat (~150 us of control's CPU
    # a datagram). What queued behind the datagram that woke it now goes over in one call, in
    # the order read. The datagrams are queued before the reader starts: one read takes them all.
    calls: list[list] = []
    got = threading.Event()

    def apply(beats):
        calls.append([(session.worker_id, ev.heartbeat.unix_time) for session, ev in beats])
        if sum(len(c) for c in calls) >= 100:
            got.set()

    liveness = LivenessDatagrams(BeatStamps(), apply, "127.0.0.1", 0)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        grants = [liveness.grant(FakeSession(f"w{i}")) for i in range(50)]
        for seq in (1, 2):
            for grant in grants:
                sender.sendto(datagram(grant, seq), ("127.0.0.1", liveness.port))
        liveness.start()
        assert got.wait(20), calls
        assert len(calls) == 1, [len(c) for c in calls]
        (read,) = calls
        assert [w for w, _ in read] == [f"w{i}" for i in range(50)] * 2  # as sent
        for i in range(50):  # each session's second beat after its first
            first, second = (t for w, t in read if w == f"w{i}")
            assert first <= second
    finally:
        sender.close()
        liveness.close()


@pytest.mark.parametrize("ranks", [8, 12])
def test_a_datagram_carrying_a_whole_nodes_ranks_is_read_whole_never_cut(ranks):
    # Control read each datagram into 512 bytes: a node's datagram with 8 ranks' beats (~650
    # bytes) was cut, failed to parse and was dropped as malformed, every second, for every
    # such node: its agent was unheard and told to beat on its session (1,024 x 8 bench: 28,108
    # dropped, an agent declared lost at the job's start).
    got: list = []
    arrived = threading.Event()

    def apply(beats):
        got.extend(beats)
        if sum(ev.HasField("rank_beats") for _, ev in got) >= 2:
            arrived.set()

    liveness = LivenessDatagrams(BeatStamps(), apply, "127.0.0.1", 0)
    sender = None
    try:
        sender = LivenessSender(liveness.grant(FakeSession("w")), "127.0.0.1")
        beats = [
            worker_pb2.RankEvent(
                job_id=JOB, rank=r, generation=1,
                heartbeat=worker_pb2.RankHeartbeat(
                    job_id=JOB, rank=r, step=123456, stepping=True, interval_seconds=1.0, phase=worker_pb2.PHASE_FORWARD,
                    phase_seconds=0.25, step_seconds=0.9, forward_compute_seconds=0.3, backward_compute_seconds=0.5,
                    unix_time=time.time(),
                ),
            )
            for r in range(ranks)
        ]  # fmt: skip
        packed, unfit = pack(JOB, beats)
        assert not unfit and len(packed) > 512
        malformed = ld._DROPPED["malformed"]._value.get()
        sender.send(1.0, time.time(), packed)  # (read by the reader's first, blocking read)
        sender.send(1.0, time.time(), packed)  # (read behind it, in the batch)
        liveness.start()
        assert arrived.wait(10), (got, ld._DROPPED["malformed"]._value.get() - malformed)
        assert ld._DROPPED["malformed"]._value.get() == malformed
        progress = [ev.rank_beats for _, ev in got if ev.HasField("rank_beats")]
        assert [[b.rank for b in batch.beats] for batch in progress] == [list(range(ranks))] * 2
    finally:
        if sender is not None:
            sender.close()
        liveness.close()


def test_datagrams_the_kernel_dropped_in_control_s_full_socket_are_counted():
    # 10,000 agents at 1 Hz against a control that read ~6,000 a second: the rest was dropped in
    # its socket by the kernel and counted nowhere (surge_liveness_datagrams_dropped_total had
    # only control's own reasons). Every datagram sent is now either read or counted dropped.
    reasons = ("malformed", "unknown_slot", "stale_session", "bad_mac", "stale_seq", "socket_full")
    before = {r: ld._DROPPED[r]._value.get() for r in reasons}
    liveness = LivenessDatagrams(BeatStamps(), lambda beats: None, "127.0.0.1", 0)  # (nothing reads yet)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        liveness._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # (fills in ~100 datagrams)
        sent = 3000
        for _ in range(sent):
            sender.sendto(b"\xff" * 100, ("127.0.0.1", liveness.port))  # (never parses: malformed)

        def counted() -> dict[str, float]:
            return {r: ld._DROPPED[r]._value.get() - before[r] for r in reasons}

        liveness.start()
        # The kernel's count rides the datagrams queued after a drop (those queued before it say
        # nothing): the agents' next beats carry it, as these do.
        deadline = time.monotonic() + 15
        while not counted()["socket_full"]:
            assert time.monotonic() < deadline, f"no drop counted: {counted()} of {sent}"
            sender.sendto(b"\xff" * 100, ("127.0.0.1", liveness.port))
            sent += 1
            time.sleep(0.05)
        until(lambda: sum(counted().values()) >= sent, 15, lambda: f"{counted()} of {sent} sent")
        got = counted()
        assert sum(got.values()) == sent, (got, sent)
        assert got["socket_full"] > 0 and got["malformed"] > 0, got
        assert all(got[r] == 0 for r in reasons if r not in ("malformed", "socket_full")), got
    finally:
        sender.close()
        liveness.close()
