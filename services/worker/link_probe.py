"""Data-plane link probes (issue 29 item 5): this node agent's view of its links to the node
agents it shares a job with, stated as ``LinkStateChanged`` when a link's state changes.

Which peers: each launch names them (``LaunchRanks.link_probe``: ring neighbours in the job's
nodes and rank 0's node, services/control/resource_allocator/slots.py); the union over the
node's jobs is probed, at the shortest interval asked. A job released here drops its peers.

How: one UDP socket on the agent's own address and port number (UDP and TCP port spaces are
apart: the gRPC server keeps the TCP port, no new port to configure), one thread (per agent,
never per rank or per peer). Every ``interval`` it sends each peer a ping (``SGLP1 P <seq>
<worker_id>``); a peer answers every ping it gets with a pong (``SGLP1 A <seq> <worker_id>``)
to the address it came from. Over the last ``WINDOW_PROBES`` probes it measures, per peer:

* ``round_trip_loss``: of its pings old enough to be answered (two intervals, at least
  0.2 s), the fraction with no pong (a loss either way);
* ``inbound_loss``: of the peer's last pings (by its sequence numbers, since its first one
  heard: a peer that does not probe this node is no loss; those it should have sent since
  the newest heard, by the clock, count too), the fraction that never came (a loss on the
  way here only).

State: **down** when none of its last ``down_probes`` pings was answered and no ping of the
peer came for as long (nothing either way; the other end's view decides a one-way cut: L1-3
combines both, services/control/fault_detector/links.py); **degraded** when either loss is
at least ``degraded_loss`` over a window at least half full (left again below half that:
hysteresis, so a loss near the threshold does not flap; not while an up link has been
silent both ways for its last two probes: that is a cut on its way to down, stated once);
else **up**. Each change is stated
once; a peer no longer probed is stated ``STATE_UNSPECIFIED`` (forget my view) if its last
state was not up. The agent states facts; what a link's state means for a job is L1-3's.

Detection: a cut both ways is stated down ``down_probes`` intervals after it, plus at most
two intervals (3 s with the defaults: jobspec links.probe_seconds 1, links.down_probes 3).

Authentication: where the cluster has a secret (``SURGE_AUTH_TOKEN``, which every node agent
already holds to reach control), each packet carries an HMAC-SHA256 tag under a key derived
from it (``probe_key``), ``SGLA1 <kind> <seq> <tag> <worker_id>``, and a packet without a
valid tag is dropped unanswered and counted (``refused``, one warning per source address a
minute): a host that does not hold the secret can neither make a cut link look up (forged
pongs) nor use the agents to reflect traffic. Not replay-proof: a pong copied off the wire
within a window answers a ping that was sent. Without a secret the packets are the plain
``SGLP1`` form, as the cluster's gRPC is unauthenticated then too (mTLS alone gives the agents
no shared secret: said in the README).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from services.contract import Module, control_pb2
from services.contract.relay import pack

LinkState = control_pb2.LinkStateChanged.State
WINDOW_PROBES = 10  # the probes a loss is measured over
_MAGIC = b"SGLP1"
_MAGIC_AUTH = b"SGLA1"  # the authenticated form (a tag before the worker id)
_TAG_HEX = 32  # the HMAC-SHA256 tag's first 16 bytes, in hex
_REFUSED_LOG_SECONDS = 60.0  # one warning per source address this often
PROBES_REFUSED = Counter(
    "surge_link_probe_refused_packets_total", "Link probe packets dropped: malformed, or without a valid tag"
)
_MAX_PACKET = 512


@dataclass
class _Peer:
    worker_id: str
    address: tuple[str, int]
    since: float  # monotonic: probing began
    sent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4 * WINDOW_PROBES))
    answered: set[int] = field(default_factory=set)
    heard: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4 * WINDOW_PROBES))  # (seq, t)
    first_seq: int = 0  # the peer's first ping heard (0: none yet)
    state: int = LinkState.UP
    stated: bool = False  # a state other than up was stated to control


def _mature(interval: float) -> float:
    """How old a ping must be before its missing pong counts as lost (seconds): two periods,
    at least 0.2 s (a loaded host answers late, not never)."""
    return max(2 * interval, 0.2)


def probe_key(secret: str | None) -> bytes | None:
    """The probes' HMAC key from the cluster's secret (None: no secret, plain packets)."""
    if not secret:
        return None
    return hashlib.sha256(b"surge link probe\0" + secret.encode()).digest()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host[1:-1] if host.startswith("[") else host), int(port)


class LinkProber:
    """Probes this node's data-plane links (see the module docstring).

    Args:
        worker_id: this agent's id (in every packet and every statement).
        host, port: the address to bind (the agent's listen host and its gRPC port number).
        emit: sends one ``WorkerEvent`` up to control; must not block.
        log: a structlog logger.
        key: the HMAC key of the packets (``probe_key``; None: plain packets, none refused).
    """

    def __init__(
        self, worker_id: str, host: str, port: int, emit: Callable[[Any], None], log: Any, key: bytes | None = None
    ):
        self._worker_id = worker_id
        self._key = key
        self.refused = 0  # packets dropped for a missing or wrong tag
        self._refused_logged: dict[Any, float] = {}
        self._emit = emit
        self._log = log
        self._lock = threading.Lock()
        self._jobs: dict[str, control_pb2.LinkProbe] = {}
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, port))
        self._sock.setblocking(False)
        # stop() writes a byte here: the thread sleeps until its next tick or a packet, not
        # in 0.5 s slices to see a stop (a wake-up a second per agent for nothing).
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="link-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return  # (stopped before: its pipe is closed, its numbers maybe reused)
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------ from the agent

    def set_peers(self, job_id: str, probe: control_pb2.LinkProbe) -> None:
        """The peers a launch of ``job_id`` here names (replacing that job's earlier ones)."""
        with self._lock:
            if probe.peers:
                self._jobs[job_id] = probe
            else:
                self._jobs.pop(job_id, None)
            dropped = self._sync()
        self._state_dropped(dropped)

    def forget(self, job_id: str) -> None:
        """The job left this node: its peers are probed no more (unless another job shares them)."""
        with self._lock:
            if self._jobs.pop(job_id, None) is None:
                return
            dropped = self._sync()
        self._state_dropped(dropped)

    def restate(self) -> None:
        """After a (re-)registration: state again every link that is not up (control forgot
        this agent's views when it registered)."""
        now = time.monotonic()
        with self._lock:
            facts = [
                self._fact(p, p.state, *self._losses(p, now)) for p in self._peers.values() if p.state != LinkState.UP
            ]
        for fact in facts:
            self._send_up(fact)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self._tick(now)
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [], max(0.0, next_tick - now))
            except (OSError, ValueError):
                return  # closed
            if self._sock in ready:
                self._receive()

    def _interval(self) -> float:
        return min((p.interval_seconds for p in self._jobs.values() if p.interval_seconds > 0), default=1.0)

    def _tick(self, now: float) -> float:
        """Ping every peer and judge each link; returns the seconds to the next tick."""
        with self._lock:
            interval = self._interval()
            self._seq += 1
            seq = self._seq
            peers = list(self._peers.values())
            for p in peers:
                p.sent.append((seq, now))
        packet = self._packet(b"P", seq)
        for p in peers:
            try:
                self._sock.sendto(packet, p.address)
            except OSError:
                pass  # (unreachable: counted as a loss, as a dropped packet is)
        changes = []
        with self._lock:
            degraded_loss = min((j.degraded_loss for j in self._jobs.values() if j.degraded_loss > 0), default=0.2)
            down_probes = min((j.down_probes for j in self._jobs.values() if j.down_probes > 0), default=3)
            for p in self._peers.values():
                p.answered &= {s for s, _ in p.sent}  # (bounded: only the pings still kept)
                rt, inbound, _ = self._losses(p, now, interval)
                state = self._judge(p, now, interval, rt, inbound, degraded_loss, down_probes)
                if state != p.state:
                    p.state = state
                    p.stated = state != LinkState.UP or p.stated
                    changes.append(self._fact(p, state, rt, inbound, interval))
        for fact in changes:
            self._log.warning(
                "link state", peer=fact.peer_worker_id, state=LinkState.Name(fact.state),
                round_trip_loss=round(fact.round_trip_loss, 2), inbound_loss=round(fact.inbound_loss, 2),
            )  # fmt: skip
            self._send_up(fact)
        return interval

    def _receive(self) -> None:
        while True:
            try:
                data, source = self._sock.recvfrom(_MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            parsed = self._parse(data)
            if parsed is None:
                self._refuse(source)
                continue
            kind, seq, peer = parsed
            now = time.monotonic()
            if kind == b"P":
                try:  # every ping is answered, a peer's of any job (it judges its own link)
                    self._sock.sendto(self._packet(b"A", seq), source)
                except OSError:
                    pass
                with self._lock:
                    p = self._peers.get(peer)
                    if p is not None:
                        if p.heard and seq < p.heard[-1][0] - WINDOW_PROBES:
                            p.heard.clear()  # (a restarted peer counts from 1 again)
                            p.first_seq = 0
                        p.heard.append((seq, now))
                        p.first_seq = p.first_seq or seq
            elif kind == b"A":
                with self._lock:
                    p = self._peers.get(peer)
                    if p is not None:
                        p.answered.add(seq)

    # ------------------------------------------------------------ packets

    def _tag(self, kind: bytes, seq: int, worker_id: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, b"%s %d %s" % (kind, seq, worker_id), hashlib.sha256).hexdigest()[:_TAG_HEX].encode()

    def _packet(self, kind: bytes, seq: int) -> bytes:
        me = self._worker_id.encode()
        if self._key is None:
            return b"%s %s %d %s" % (_MAGIC, kind, seq, me)
        return b"%s %s %d %s %s" % (_MAGIC_AUTH, kind, seq, self._tag(kind, seq, me), me)

    def _parse(self, data: bytes) -> tuple[bytes, int, str] | None:
        """(kind, seq, peer) of a packet this prober accepts, else None (malformed, or not
        carrying a valid tag where this prober has a key)."""
        if self._key is None:
            parts = data.split(b" ", 3)
            if len(parts) != 4 or parts[0] != _MAGIC:
                return None
            kind, seq, peer = parts[1], parts[2], parts[3]
        else:
            parts = data.split(b" ", 4)
            if len(parts) != 5 or parts[0] != _MAGIC_AUTH:
                return None
            kind, seq, tag, peer = parts[1], parts[2], parts[3], parts[4]
            if not seq.isdigit() or not hmac.compare_digest(tag, self._tag(kind, int(seq), peer)):
                return None
        if kind not in (b"P", b"A") or not seq.isdigit():
            return None
        return kind, int(seq), peer.decode(errors="replace")

    def _refuse(self, source: Any) -> None:
        """A packet dropped: counted, and said once a minute per source address."""
        self.refused += 1
        PROBES_REFUSED.inc()
        now = time.monotonic()
        if now - self._refused_logged.get(source, -_REFUSED_LOG_SECONDS) >= _REFUSED_LOG_SECONDS:
            if len(self._refused_logged) > 1024:  # (bounded: a flood of sources forgets the oldest)
                self._refused_logged.clear()
            self._refused_logged[source] = now
            self._log.warning(
                "link probe packet refused: no valid tag" if self._key else "link probe packet refused: malformed",
                source=f"{source[0]}:{source[1]}", refused=self.refused,
            )  # fmt: skip

    # ------------------------------------------------------------ judging (under the lock)

    def _losses(self, p: _Peer, now: float, interval: float | None = None) -> tuple[float, float, float]:
        """(round_trip_loss, inbound_loss, interval) of ``p`` over the window."""
        interval = interval or self._interval()
        matured = [s for s, t in p.sent if now - t >= _mature(interval)][-WINDOW_PROBES:]
        rt = sum(1 for s in matured if s not in p.answered) / len(matured) if matured else 0.0
        # By the peer's sequence numbers (one per its tick, whatever its timing): of its last
        # WINDOW_PROBES pings, since its first one heard here (a peer that does not probe this
        # node is no inbound loss), the fraction missing; the pings it should have sent since
        # the newest heard (by the clock, one period of grace) count as missing too.
        if not p.heard:
            return rt, 0.0, interval
        newest, heard_at = max(p.heard)
        top = newest + max(0, int((now - heard_at) / interval) - 1)
        low = max(p.first_seq, top - WINDOW_PROBES + 1)
        got = len({s for s, _ in p.heard if s >= low})
        inbound = min(1.0, max(0.0, 1.0 - got / (top - low + 1)))
        return rt, inbound, interval

    def _judge(
        self, p: _Peer, now: float, interval: float, rt: float, inbound: float, degraded_loss: float, down_probes: int
    ) -> int:
        matured = [s for s, t in p.sent if now - t >= _mature(interval)]
        last = matured[-down_probes:]
        heard_last = p.heard[-1][1] if p.heard else p.since
        if (
            len(last) >= down_probes
            and not any(s in p.answered for s in last)
            and now - heard_last > down_probes * interval
        ):
            return LinkState.DOWN
        if len(matured[-WINDOW_PROBES:]) < WINDOW_PROBES // 2:
            return p.state if p.state != LinkState.DOWN else LinkState.UP
        if p.state == LinkState.UP and not any(s in p.answered for s in last[-2:]) and now - heard_last > 2 * interval:
            return p.state  # silent both ways so far: a cut on its way to down, no degraded first
        worst = max(rt, inbound)
        if worst >= degraded_loss or (p.state == LinkState.DEGRADED and worst >= degraded_loss / 2):
            return LinkState.DEGRADED
        return LinkState.UP

    def _fact(self, p: _Peer, state: int, rt: float, inbound: float, interval: float) -> control_pb2.LinkStateChanged:
        return control_pb2.LinkStateChanged(
            worker_id=self._worker_id,
            peer_worker_id=p.worker_id,
            peer_address=f"{p.address[0]}:{p.address[1]}",
            state=state,
            round_trip_loss=rt,
            inbound_loss=inbound,
            window_seconds=WINDOW_PROBES * interval,
            unix_time=time.time(),
            # (the peer's last ping heard, or since probing began: how long the link is silent)
            silent_seconds=max(0.0, time.monotonic() - (p.heard[-1][1] if p.heard else p.since)),
        )

    def _sync(self) -> list[_Peer]:
        """The probed peers made the union of the jobs'; returns the ones dropped."""
        wanted: dict[str, str] = {}
        for probe in self._jobs.values():
            for peer in probe.peers:
                if peer.worker_id != self._worker_id:
                    wanted.setdefault(peer.worker_id, peer.address)
        dropped = [p for w, p in self._peers.items() if w not in wanted]
        for p in dropped:
            del self._peers[p.worker_id]
        now = time.monotonic()
        for worker_id, address in wanted.items():
            try:
                where = _split(address)
            except ValueError:
                self._log.warning("link peer address unusable", peer=worker_id, address=address)
                continue
            known = self._peers.get(worker_id)
            if known is None or known.address != where:
                self._peers[worker_id] = _Peer(worker_id, where, since=now)
        return dropped

    def _state_dropped(self, dropped: list[_Peer]) -> None:
        for p in dropped:
            if p.stated:
                self._send_up(self._fact(p, LinkState.STATE_UNSPECIFIED, 0.0, 0.0, self._interval()))

    def _send_up(self, fact: control_pb2.LinkStateChanged) -> None:
        self._emit(control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))
