"""A node agent's liveness beat as one UDP datagram: read on one thread, taken as a stamp.

Why: at 10,000 agents beating at 1 Hz a beat read off the agent's gRPC session cost ~200 us at
control (grpc aio's C-core read, its futures, the guard) before ``BeatStamps`` took it in a few:
control read ~2,500 of the 10,000 beats a second on a 2-core host (issue 28, session 35). A
beat that says only "alive, same period" needs none of a stream's order or delivery, so it goes
as a datagram, as SWIM/Serf-style cluster managers send theirs: one ``AgentLiveness`` of ~60
bytes, an HMAC-SHA256 and a dict look-up to read (a few us).

The route is AgentHeartbeat's (EXT_HARDWARE -> L1_FAULT_DETECTOR) over another transport:

* ``grant`` (on a session's registration, over the authenticated gRPC session): a slot, a
  session number and 32 random bytes of key (``LivenessGrant``, the ``surge-liveness-bin``
  header). ``release`` at the session's end: its datagrams are unknown from then on.
* One thread reads the socket (blocking ``recvfrom``): a datagram whose slot is not granted,
  whose session is not the slot's, whose mac is not the key's, or whose seq is not above the last
  taken is dropped and counted (``surge_liveness_datagrams_dropped_total{reason}``). A good one
  is taken exactly as the session's beat would be: ``BeatStamps.beat`` (armed, same period: a
  stamp, the deadline moved); otherwise it goes to the event applier as the session's
  ``AgentHeartbeat`` (the first beat, a new period, the first after a quiet spell: in order on
  the node queue, as a gRPC beat).
* The fallback: a session none of whose datagrams was heard for ``FALLBACK_PERIODS`` of its beat
  periods (UDP blocked by a firewall, a port not published; or the agent paused or starved) is
  told ``BeatOnSession`` on its stream, once, and beats on its session too (its datagrams still
  going). So losing the datagram path costs a healthy agent a switch ~2 periods in, well inside
  its silence deadline (5 periods); a paused agent reads the switch only once it runs again, and
  is declared silent at its deadline as before. Once a session told so is heard again steadily
  (``FALLBACK_PERIODS`` without a quiet gap), it is told ``BeatOnSession{datagrams_heard}``:
  datagrams alone again (a starved spell does not leave thousands of agents on gRPC for good). Unheard sessions are looked for only
  while the socket is drained: after the reader itself was starved, the datagrams waiting in the
  socket are read first (they are no one's silence). Decided here (control's side), never by
  the agent.

* The ranks' progress (``AgentLiveness.progress``, services/common/liveness_progress.py): the
  beats of the agent's ranks whose only news is their progress ride in its datagram (a
  ``RankBeats`` a second per agent was ~200 us of grpc aio reads each at control). Each job's is
  applied exactly as that ``RankBeats`` read off the session (the applier's ``event``), its beats
  marked ``by_datagram``: L1-3 takes them only for a rank it watches and not older than its last
  (they may overtake the session, where everything that changes state stays).
* The fallback is damped: a session's n-th resume waits ``FALLBACK_PERIODS`` x 2^(n-1) periods
  heard steadily (at most ``RESUME_CAP_PERIODS``), and fallbacks and resumes together are told at
  most ``max(FLIPS_MIN_PER_S, FLIPS_SHARE x sessions)`` a second (the rest at a later sweep or
  datagram): 10,000 starved agents flipped 79,691 times in 5 minutes without it (udp36).

No lock per agent: one lock over the slot table (grant, release, the reader's look-up).
Nothing reachable here decides a fault: a beat goes where a session's beat goes.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from google.protobuf.message import DecodeError

from services.common.liveness_mac import liveness_mac
from services.common.liveness_progress import DATAGRAM_BYTES, unpack
from services.contract import control_pb2
from services.control.beat_stamps import BeatStamps
from services.control.datagram_reads import DatagramReads
from services.control.loop_queue import put_all
from services.control.metrics import (
    LIVENESS_DELAY,
    LIVENESS_DROPPED,
    LIVENESS_FALLBACKS,
    LIVENESS_HELD_FLIPS,
    LIVENESS_RANK_BEATS,
    LIVENESS_READ,
    LIVENESS_RESUMED,
)

# Initial-metadata key of WorkerSession (binary: a serialized LivenessGrant). Mirrored by
# services/worker/control_link.py, which does not import control's code.
LIVENESS_HEADER = "surge-liveness-bin"
# A session whose datagrams control has not heard for this many beat periods beats on its
# session from then on: later than a beat's ordinary jitter on a loaded host (1.5 periods is
# "quiet"), well before its silence deadline (AGENT_MISSED_BEATS = 5 periods).
FALLBACK_PERIODS = 2.0
QUIET_PERIODS = 1.5  # a gap this long between a session's datagrams: not steady (rules.QUIET_PERIODS)
# More than this share of 10 or more sessions unheard at once while others' datagrams are read:
# the machine or control is starved, not each of their paths blocked (a path down for all reads
# nothing at all). No fallback then: switching thousands of sessions (a command each, and their
# gRPC beats) feeds the starvation (10,000 simulated agents at load 21: 92,020 fallbacks in 5
# minutes). L1-3's disruption hold keeps their verdicts meanwhile.
MASS_SHARE = 0.5
# The fallback's damper (issue 28: 79,691 fallbacks and as many resumes at 10,000 starved agents):
# a session told to fall back for the n-th time resumes only after FALLBACK_PERIODS x 2^(n-1) of
# its periods heard steadily (2, 4, 8, ... periods), at most RESUME_CAP_PERIODS; and control tells
# at most max(FLIPS_MIN_PER_S, FLIPS_SHARE x sessions) fallbacks and resumes a second overall
# (a token bucket: one second's worth at most in a burst), the rest at a later sweep or datagram.
# A whole path lost (a firewall) still switches 10,000 sessions within ~20 s; meanwhile L1-3's
# disruption hold keeps their verdicts (the socket failing at control tells all at once).
RESUME_CAP_PERIODS = 64.0
FLIPS_MIN_PER_S = 50.0
FLIPS_SHARE = 0.05
SWEEP_S = 0.25  # how often the reader looks for unheard sessions (and the longest a recv blocks)
# After a datagram wakes the reader, how long it lets others queue behind it before it reads
# them all: a beat waits at most this (its deadline is seconds), the reader wakes ~1/COALESCE_S
# times a second however many agents beat (10,000 at 1 Hz: ~50 datagrams a read, well in RCVBUF).
COALESCE_S = 0.005
# A read's buffer: above the largest datagram an agent sends, so none is cut (a cut one does not
# parse: read into 512 bytes, every datagram of a node of 8 ranks, ~650, was dropped as malformed:
# its agent unheard, told to beat on its session; an agent declared lost in the 1,024 x 8 bench).
READ_BYTES = 2 * DATAGRAM_BYTES
# The socket's receive buffer: a second of 10,000 agents' datagrams (~1 KiB of kernel memory
# each) while the reader waits for the GIL; capped by net.core.rmem_max (4 MiB here, so ~4,000).
RCVBUF_BYTES = 16 << 20
# Why a datagram was dropped (each exported from the start, at 0); ``socket_full``: by the kernel,
# the socket's receive buffer full (control reads slower than the agents send; SO_RXQ_OVFL)
_DROPPED = {
    r: LIVENESS_DROPPED.labels(r)
    for r in ("malformed", "unknown_slot", "stale_session", "bad_mac", "stale_seq", "socket_full")
}
# The kernel's count of datagrams it dropped on this socket since it was made, as a control message
# on each read (Linux; a uint32): 10,000 agents at 1 Hz against a control that read 6,000 a second
# lost the rest in the socket, counted nowhere before.
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
_OVERFLOW_SPACE = socket.CMSG_SPACE(4)
_OVERFLOW_LOG_S = 60.0  # said at most this often (the counter has every drop)


@dataclass(eq=False)
class _Slot:
    session: Any  # the AgentSession granted (its worker_id, its commands queue)
    number: int  # LivenessGrant.session
    key: bytes
    heard: float  # time.monotonic() of its last datagram taken (its grant's, before any)
    period: float = 1.0  # its beat period, as its last datagram stated it
    seq: int = 0  # the last seq taken
    fallen: bool = False  # told BeatOnSession: it beats on its session too, until heard again
    steady: float = 0.0  # time.monotonic() since which its datagrams came without a quiet gap
    flips: int = 0  # times told BeatOnSession this session (its resume waits 2^(flips-1) as long)

    def resume_periods(self) -> float:
        """Periods heard steadily before a fallen session is told to beat as datagrams alone."""
        return min(RESUME_CAP_PERIODS, FALLBACK_PERIODS * 2.0 ** max(0, self.flips - 1))


class LivenessDatagrams:
    """Control's liveness socket (see the module docstring).

    Args:
        stamps: the composition root's BeatStamps (L1-3 arms them).
        apply: the event applier's ``events([(session, WorkerEvent), ...])``: the beats the stamps
            do not take, of one read, in order.
        host: the address to listen on (control's gRPC host).
        port: the UDP port to bind (0: any free one; ``port`` says which).
        advertise_port: the port the agents are told (a NAT's published port; 0: the bound one).
    """

    def __init__(
        self,
        stamps: BeatStamps,
        apply: Callable[[list[tuple[Any, control_pb2.WorkerEvent]]], None],
        host: str,
        port: int,
        advertise_port: int = 0,
    ):
        self._stamps, self._apply = stamps, apply
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(SWEEP_S)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            self._overflow_counted: bool = True
        except OSError:  # (not Linux: drops in the socket go uncounted)
            self._overflow_counted = False
        self._overflowed = 0  # the kernel's drops counted so far
        self._overflow_said = float("-inf")  # time.monotonic() it was last logged
        self.port = self._sock.getsockname()[1]
        self._advertised = advertise_port or self.port
        self._lock = threading.Lock()  # the slot table; nothing is called under it
        self._slots: dict[int, _Slot] = {}
        self._slot_of: dict[int, int] = {}  # id(session) -> its slot (the slot holds the session: its id stays its own)
        self._free: list[int] = []
        self._next_slot = 1  # (slot 0: an unset field, never granted)
        self._sessions = secrets.randbits(48)  # session numbers: a restarted control's differ
        self._last_read = float("-inf")  # time.monotonic() of the last datagram taken (any session)
        self._mass = False  # fallbacks held: most sessions unheard while others are heard
        # Datagrams taken and rank beats read since the counters were last added to (once a
        # read, not once a datagram: a counter's inc takes its lock; the reader's alone)
        self._read_n = self._rank_beats_n = 0
        # The bound on fallbacks and resumes a second (a token bucket, the reader thread's alone):
        # tokens left, and when (monotonic) they were counted
        self._tokens, self._tokens_at = FLIPS_MIN_PER_S, time.monotonic()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-datagrams", daemon=True)
        self._log = structlog.get_logger("control.liveness")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop reading and close the socket (idempotent); no more fallbacks are sent."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * SWEEP_S + 1.0)
        self._sock.close()

    def grant(self, session: Any) -> control_pb2.LivenessGrant:
        """A slot, a session number and a key for ``session`` (on its registration)."""
        key = secrets.token_bytes(32)
        self.release(session)  # (a session holds one slot: granted again, its old one is free)
        with self._lock:
            slot = self._free.pop() if self._free else self._take_slot()
            self._sessions += 1
            number = self._sessions
            now = time.monotonic()
            self._slots[slot] = _Slot(session, number, key, heard=now, steady=now)
            self._slot_of[id(session)] = slot
        return control_pb2.LivenessGrant(port=self._advertised, slot=slot, session=number, key=key)

    def release(self, session: Any) -> None:
        """``session`` ended: its slot is free, its datagrams unknown from now on."""
        with self._lock:
            slot = self._slot_of.pop(id(session), None)
            if slot is not None:  # (a look-up: a scan of every slot made 3,000 sessions' ends O(n^2))
                del self._slots[slot]
                self._free.append(slot)

    # ------------------------------------------------------------ private

    def _take_slot(self) -> int:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return slot

    def _run(self) -> None:
        recvmsg, sock, last_sweep = self._sock.recvmsg, self._sock, time.monotonic()
        space = _OVERFLOW_SPACE if self._overflow_counted else 0
        # What queued behind the datagram a recv waited for, read in one call that keeps the GIL
        # (datagram_reads.py: a recv per datagram waited for the GIL per datagram).
        reads = DatagramReads(size=READ_BYTES) if DatagramReads is not None else None
        while not self._stopping.is_set():
            try:
                data, ancillary, _, _ = recvmsg(READ_BYTES, space)
                if ancillary:
                    self._overflow(ancillary)
            except TimeoutError:
                data = None
            except OSError:  # closed under us: the path is gone; every session told to beat on its own
                if not self._stopping.is_set():
                    self._log.warning("liveness socket failed; sessions beat on their streams")
                    self._fall_back(float("inf"))
                return
            now = time.monotonic()
            if data is not None:
                out: list[tuple[Any, control_pb2.WorkerEvent]] = []
                self._take(data, now, out)
                if reads is not None:
                    # Let the next ones queue behind it: a wake-up, a read and one hand-over to
                    # the applier per COALESCE_S, not per datagram (each cost a thread switch
                    # and a take of the GIL: ~150 us of control's CPU a datagram at 3,000 agents)
                    time.sleep(COALESCE_S)
                while reads is not None:
                    queued = reads.take(sock)
                    now = time.monotonic()
                    for one in queued:
                        self._take(one, now, out)
                    if len(queued) < reads.batch:
                        break
                if out:
                    self._apply(out)
                self._count()
            # (here the socket was drained: what waited in it was read before anyone is unheard)
            if now - last_sweep >= SWEEP_S:
                last_sweep = now
                self._fall_back(now)

    def _take(self, data: bytes, received: float, out: list[tuple[Any, control_pb2.WorkerEvent]]) -> None:
        """Check and take one datagram; what goes to the applier is appended to ``out``."""
        msg = control_pb2.AgentLiveness()
        try:
            msg.ParseFromString(data)
        except DecodeError:
            _DROPPED["malformed"].inc()
            return
        with self._lock:
            slot = self._slots.get(msg.slot)
        if slot is None:
            _DROPPED["unknown_slot"].inc()
            return
        if msg.session != slot.number:  # an older session's (its slot granted again since)
            _DROPPED["stale_session"].inc()
            return
        if not hmac.compare_digest(msg.mac, liveness_mac(slot.key, msg)):
            _DROPPED["bad_mac"].inc()
            return
        if msg.seq <= slot.seq:  # a replay, or reordered behind a later one: the later said more
            _DROPPED["stale_seq"].inc()
            return
        period = msg.interval_seconds if msg.interval_seconds > 0 else 1.0
        if received - slot.heard > QUIET_PERIODS * period:
            slot.steady = received  # (after a gap: heard again from now)
        slot.seq, slot.heard = msg.seq, received  # (this thread alone writes them)
        slot.period = period
        self._read_n += 1
        self._last_read = received
        session = slot.session
        if (
            slot.fallen and received - slot.steady >= slot.resume_periods() * period and self._flip(received)
        ):  # heard again, steadily, for longer after each fallback; within the bound a second
            # (not at the first one after a starved spell: a machine that starves both ends in
            # waves would flip thousands of sessions back and forth, a command each time)
            with self._lock:
                slot.fallen = False
            LIVENESS_RESUMED.inc()
            session.commands.put(
                control_pb2.WorkerCommand(beat_on_session=control_pb2.BeatOnSession(datagrams_heard=True))
            )
        taken = self._stamps.beat(session.worker_id, period, received)
        LIVENESS_DELAY.observe(max(0.0, time.time() - msg.unix_time))
        if not taken:
            # Changes something L1-3 holds (its first, a new period, after a quiet spell): applied
            # as the session's own AgentHeartbeat, in order on the node queue.
            beat = control_pb2.AgentHeartbeat(interval_seconds=period, unix_time=msg.unix_time)
            out.append((session, control_pb2.WorkerEvent(heartbeat=beat)))
        if msg.progress:
            self._progress(session, msg.progress, out)

    def _progress(self, session: Any, data: bytes, out: list[tuple[Any, control_pb2.WorkerEvent]]) -> None:
        """The ranks' beats riding the datagram (LivenessProgress): each job's applied exactly
        as a RankBeats read off the session (the applier's ``event``: stamped with its receipt,
        on the job's queue), its beats marked ``by_datagram`` (L1-3 takes them only for a rank
        it watches and not older than its last: they may overtake the session's messages)."""
        try:
            jobs = unpack(data)
        except DecodeError:
            _DROPPED["malformed"].inc()  # (signed by the key's holder: its agent's bug, counted)
            return
        for batch in jobs:
            if batch.beats:
                self._rank_beats_n += len(batch.beats)
                out.append((session, control_pb2.WorkerEvent(rank_beats=batch)))

    def _overflow(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        """Count the datagrams the kernel dropped since the last read (its running total rides
        the read as SO_RXQ_OVFL); said in the log at most once a minute."""
        for level, kind, data in ancillary:
            if level != socket.SOL_SOCKET or kind != SO_RXQ_OVFL or len(data) < 4:
                continue
            total = int.from_bytes(data[:4], "little")
            new = (total - self._overflowed) % (1 << 32)  # (the kernel's uint32 wraps)
            self._overflowed = total
            if not new:
                continue
            _DROPPED["socket_full"].inc(new)
            now = time.monotonic()
            if now - self._overflow_said >= _OVERFLOW_LOG_S:
                self._overflow_said = now
                self._log.warning(
                    "liveness datagrams dropped in control's socket: it reads slower than the agents send",
                    dropped=new,
                    dropped_total=total,
                )

    def _count(self) -> None:
        """Add what the last read took to the counters."""
        if self._read_n:
            LIVENESS_READ.inc(self._read_n)
        if self._rank_beats_n:
            LIVENESS_RANK_BEATS.inc(self._rank_beats_n)
        self._read_n = self._rank_beats_n = 0

    def _flip(self, now: float) -> bool:
        """Whether one more fallback or resume may be told now (the bound a second); takes it."""
        rate = max(FLIPS_MIN_PER_S, FLIPS_SHARE * len(self._slots))
        if now > self._tokens_at:
            self._tokens = min(rate, self._tokens + (now - self._tokens_at) * rate)
            self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _fall_back(self, now: float) -> None:
        """Tell each session unheard for FALLBACK_PERIODS (all of them when ``now`` is inf) to
        beat on its stream: once per session."""
        told = []
        with self._lock:
            late = [s for s in self._slots.values() if now - s.heard > FALLBACK_PERIODS * s.period]
            mass = (
                len(self._slots) >= 10
                and len(late) > MASS_SHARE * len(self._slots)
                and now - self._last_read <= FALLBACK_PERIODS  # (others' datagrams are read)
            )
            deferred = 0
            for slot in late if not mass else ():
                if slot.fallen:
                    continue
                if now != float("inf") and not self._flip(now):  # (the socket failed: all at once)
                    deferred += 1
                    continue
                slot.fallen, slot.flips = True, slot.flips + 1
                told.append((slot.session, now - slot.heard))
            total = len(self._slots)
        if deferred:
            LIVENESS_HELD_FLIPS.inc(deferred)
        if mass != self._mass:
            self._mass = mass
            self._log.warning(
                "liveness fallbacks held: most sessions unheard while others are read" if mass else "fallbacks resumed",
                unheard=len(late),
                sessions=total,
            )
        if not told:
            return
        LIVENESS_FALLBACKS.inc(len(told))
        self._log.info("liveness datagrams unheard; beating on sessions", sessions=len(told))
        put_all(
            [
                (s.commands, control_pb2.WorkerCommand(beat_on_session=control_pb2.BeatOnSession(unheard_seconds=u)))
                for s, u in told
            ]
        )
