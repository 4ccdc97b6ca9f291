"""Data-plane links between nodes (issue 29 item 5, "cut links").

Each node agent probes the agents of the nodes it shares a job with (services/worker/
link_probe.py) and states a peer's link when it changes (``LinkStateChanged``: up, degraded,
down, or no longer probed). A link has two views, one per end; combined:

* both ends say down: the link is **down** (cut both ways: nothing of either reaches the other);
* one end says down and the other degraded: a one-way cut (one end still hears the other's
  probes): **degraded**; any degraded view: **degraded**;
* one end says down and the other has said nothing (up): undecided until the other end's
  view arrives (a two-way cut reaches both ends within a probe period): the state is kept.

A degraded link is reported for every monitored job with ranks on both nodes as
``link_degraded`` (MINOR: a warning; never held), once per change; once the link is up
again, each job told of it (degraded or down) gets that report ``cleared`` (its status lists
the link no more). A link both ends say is down for a job's heartbeat timeout, while both
ends' node agents and all of the job's ranks beat, is ``link_down`` for that job from the link
state alone (``_hold_down``: armed by the second end's statement, never polled). Before that, a
down link grades the collective that stalls or fails across it: a rank stalled in a collective
(its stall deadline, stalls.py) or whose collective failed (``comm_error``, attribution.py),
while a down link joins two nodes of its job whose ranks all still beat, is ``link_down``
(SEVERE) naming both nodes (``FaultReport.link_ends``, each with how many of its links are
down): a cause, published at once, and the job's other ranks waiting in a collective are
declared stalled with it (they wait for the same link). Once per link per incident round.
Which node a relaunch leaves out is L1-1's (services/control/fault_decision.link_endpoint).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from services.contract import Module, control_pb2
from services.control.fault_detector.rules import LINK_DEGRADED, LINK_DOWN, QUIET_PERIODS
from services.control.fault_detector.watch import RankPhase, _Job

_log = structlog.get_logger("fault_detector")

LinkState = control_pb2.LinkStateChanged.State
_UP, _DEGRADED, _DOWN = LinkState.UP, LinkState.DEGRADED, LinkState.DOWN
Pair = tuple[str, str]  # a link's two worker ids, sorted


@dataclass(frozen=True)
class _View:
    """One end's last statement of a link."""

    state: int
    round_trip_loss: float
    inbound_loss: float
    window_s: float
    silent_since: float = 0.0  # time.monotonic() here: since when this end has heard nothing of the peer


def combine(a: int, b: int) -> int | None:
    """The link's state from its two ends' views (``UP`` for an end that said nothing);
    None: undecided (one end down, the other up: see the module docstring)."""
    if a == _DOWN and b == _DOWN:
        return _DOWN
    if _DOWN in (a, b) and _UP in (a, b):
        return None
    return _DEGRADED if _DEGRADED in (a, b) or _DOWN in (a, b) else _UP


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


class Links:
    """Link views and their grading (a part of ``FaultDetector``, see detector.py). Its state,
    made in ``FaultDetector.__init__``: ``_link_views`` ((reporter, peer) -> _View),
    ``_link_states`` (pair -> combined state, absent: up), ``_link_reported`` ((job, pair)
    -> the incident round a link_down was reported in) and ``_link_told`` (pair -> job ->
    the class it was told of, until the link is up again: then that report ``cleared``)."""

    def on_link_state_changed(self, msg: control_pb2.LinkStateChanged, payload: Any = None) -> None:
        """A node agent states its view of the link to ``peer_worker_id``: the link's combined
        state is updated, and a change to degraded is reported to every job across it."""
        if not msg.worker_id or not msg.peer_worker_id or msg.worker_id == msg.peer_worker_id:
            return
        pair = _pair(msg.worker_id, msg.peer_worker_id)
        across = self._jobs_across(pair)  # (each job's nodes under its own lock, before _cluster)
        with self._cluster:
            key = (msg.worker_id, msg.peer_worker_id)
            if msg.state == LinkState.STATE_UNSPECIFIED:
                self._link_views.pop(key, None)
            else:
                silent_since = time.monotonic() - max(msg.silent_seconds, 0.0)
                self._link_views[key] = _View(
                    msg.state, msg.round_trip_loss, msg.inbound_loss, msg.window_seconds, silent_since
                )
            before = self._link_states.get(pair, _UP)
            now = self._combined(pair)
            if now is None or now == before:
                return
            if now == _UP:
                self._link_states.pop(pair, None)
            else:
                self._link_states[pair] = now
            jobs = across
            ends = self._link_ends(pair)
            told = self._link_told.pop(pair, {}) if now == _UP else {}
            probed = any(k in self._link_views for k in (pair, pair[::-1]))
        _log.warning(
            "link state", link=list(pair), state=LinkState.Name(now), was=LinkState.Name(before), jobs=jobs,
            reporter=msg.worker_id,
        )  # fmt: skip
        if now == _UP:
            # Up again: each job told of it hears that it ended (its status lists it no more).
            for job_id, fault_class in sorted(told.items()):
                # (or neither end probes it any more: the job left one of its nodes)
                detail = f"link {pair[0]} <-> {pair[1]} " + ("up again" if probed else "no longer probed by either end")
                self._emit_link(job_id, fault_class, pair, detail, ends, msg, cleared=True)
            return
        self._hold_link(pair, msg)

    def _hold_link(self, pair: Pair, msg: control_pb2.LinkStateChanged) -> None:
        """A link just turned degraded or down (or an end's quiet agent beat again while it was):
        held as its state says (a newer change arms a newer hold; the older one finds it stale)."""
        with self._cluster:
            state = self._link_states.get(pair, _UP)
        if state == _DEGRADED:
            self._hold_degraded(pair, msg)
        elif state == _DOWN:
            self._hold_down(pair, msg)

    def _hold_down(self, pair: Pair, msg: control_pb2.LinkStateChanged) -> None:
        """Both ends just said the link is down: each job with ranks on both nodes is told
        ``link_down`` once it has been silent for that job's heartbeat timeout (its liveness
        setting: as long as a rank's own silence may last before it is a fault), if both ends'
        node agents and all of the job's ranks beat meanwhile. The silence counts from the later
        of the two ends' last ping heard (``silent_seconds``: the agents needed ``down_probes``
        periods of it to say down) and of either agent's return from a quiet spell (a silence
        that overlapped an agent's pause proves nothing about the link). Why not at once: a
        brief outage (a switch reboot, a route flap) or an agent that was paused and just woke
        (its peer heard nothing, and it heard nothing while paused) shows both ends down for a
        moment; a cut that lasts a heartbeat timeout while everything else beats is the link's.
        Why not wait for the collective: its stall deadline (``stall_min_seconds``) is longer,
        and a collective that errors first is graded at once anyway (``_link_down_report``)."""
        token = object()
        now = time.monotonic()
        with self._cluster:
            self._link_holds[pair] = token
            views = [self._link_views.get(k) for k in (pair, pair[::-1])]
            returns = [self._agent_beats[w][2] for w in pair if w in self._agent_beats]
            since = min(now, max([v.silent_since for v in views if v is not None] + returns))
        for job_id in self._jobs_across(pair):
            with self._job_lock(job_id):
                job = self._jobs.get(job_id)
                window = job.heartbeat_timeout_s if job is not None else 0.0
            if window > 0:
                self._deadlines.after(max(0.0, since + window - now), self._down_due, (job_id, pair, token, msg, since))

    def _down_due(
        self, job_id: str, pair: Pair, token: object, msg: control_pb2.LinkStateChanged, since: float
    ) -> None:
        """A down link's hold for ``job_id`` ran out (a deadline callback): ``link_down``, unless
        an end sees the link again (a link back within the window is nothing), an end's agent
        is or was quiet within the window (its pause, not the link's: held again when it beats,
        ``_agent_back``), or a rank of the job is quiet (its own silence deadline decides)."""
        now = time.monotonic()
        with self._cluster:
            if self._link_holds.get(pair) is not token or self._combined(pair) != _DOWN:
                return  # (a newer change of the link armed its own, or an end hears the other again)
            paused = [w for w in pair if self._agent_paused(w, now, since)]
            if paused:
                self._link_waiting[pair] = msg
        if paused:
            _log.info("link down held: an end's node agent was quiet", link=list(pair), quiet=paused, job_id=job_id)
            return
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            report = self._link_state_report(job_id, job, pair, now - since) if job is not None else None
        if report is not None:
            self._publish_cause(job_id, report)

    def _link_state_report(self, job_id: str, job: _Job, pair: Pair, silent: float) -> control_pb2.FaultReport | None:
        """Under the job's lock: the ``link_down`` of a link silent for ``silent`` s by its state
        alone, when the job still has ranks on both ends, all of them beat (a quiet one: its
        silence deadline decides; after a control restart, ranks not heard since may be
        quiet), and none was reported for the link this round; else None."""
        on_ends = sorted(r for r, w in job.ranks.items() if w.worker_id in pair)
        if not set(pair) <= self._nodes(job) or job.reattaching:
            return None
        quiet = self._quiet(job, time.time())
        if quiet:
            _log.info("link down not graded: ranks are quiet", job_id=job_id, link=list(pair), quiet=quiet)
            return None
        with self._cluster:
            if self._link_reported.get((job_id, pair)) == job.round:
                return None
            self._link_reported[(job_id, pair)] = job.round
            ends = self._link_ends(pair)
        self._stalled_with_link(job)
        rank = on_ends[0]
        watch = job.ranks[rank]
        report = self._graded(
            job_id,
            LINK_DOWN,
            Module.EXT_HARDWARE,
            rank,
            f"link {pair[0]} <-> {pair[1]} is down: both ends heard nothing of each other for {silent:.1f} s (the "
            f"job's heartbeat timeout: {job.heartbeat_timeout_s:g} s) while both node agents and all {len(job.ranks)} "
            f"ranks beat; {_losses(ends)}",
            occurred=time.time() - silent,
            worker_id=watch.worker_id,
            step=max(watch.step, 0),
            phase=watch.phase,
        )
        if report is not None:
            report.link_ends.extend(ends)
            with self._cluster:
                self._link_told.setdefault(pair, {})[job_id] = LINK_DOWN
        return report

    @staticmethod
    def _stalled_with_link(job: _Job) -> None:
        """Under the job's lock: its ranks waiting in a collective are declared stalled with the
        link (they wait for it: their own stall deadlines would blame them next)."""
        for w in job.ranks.values():
            if w.phase == RankPhase.PHASE_COLLECTIVE and w.stepping and not w.stalled:
                if w.stall is not None:
                    w.stall.cancel()
                w.stall, w.stalled, w.waiting = None, True, False

    def _hold_degraded(self, pair: Pair, msg: control_pb2.LinkStateChanged) -> None:
        """A link just turned degraded: reported after a hold, if it still is and neither end's
        node agent was quiet meanwhile. Why: the probes live in the agents, so an agent paused
        (SIGSTOP, a debugger, a starved host) stops answering its peer's probes, and its peer
        sees loss on a link that is fine; its beats to control stop too, which tells the two
        apart. The hold is the probes' window and two of the agents' beat periods (an agent never
        heard adds nothing): a pause that began before the loss showed has shown in the beats
        as well, and the loss measured at its end is over a window after any pause before."""
        hold = msg.window_seconds + 2 * max(self._agent_period(w) for w in pair)
        token = object()
        with self._cluster:
            self._link_holds[pair] = token
        if hold <= 0:  # (neither end's agent heard, no window: nothing to wait for)
            self._degraded_due(pair, token, msg, hold)
            return
        self._deadlines.after(hold, self._degraded_due, (pair, token, msg, hold))

    def _degraded_due(self, pair: Pair, token: object, msg: control_pb2.LinkStateChanged, hold: float) -> None:
        """A degraded link's hold ran out (a deadline callback): each job across it is told,
        unless it is no longer degraded, or an end's agent is quiet or was within the probes'
        window: then it waits for that agent's next beat to be held again (a real
        loss outlasts the pause by a window; an agent that never beats again leaves it unsaid)."""
        now = time.monotonic()
        with self._cluster:
            if self._link_holds.get(pair) is not token:
                return  # (a newer change of the link armed its own)
            if self._link_states.get(pair) != _DEGRADED:
                self._link_holds.pop(pair, None)
                return
            paused = [w for w in pair if self._agent_paused(w, now, now - msg.window_seconds)]
            if not paused:
                self._link_holds.pop(pair, None)
                ends = self._link_ends(pair)
        if paused:  # (held again when the quiet agent beats again: on_agent_heartbeat, no polling)
            _log.info("link loss held: an end's node agent was quiet", link=list(pair), quiet=paused)
            with self._cluster:
                self._link_waiting[pair] = msg
            return
        detail = f"link {pair[0]} <-> {pair[1]} degraded: {_losses(ends)}"
        for job_id in self._jobs_across(pair):
            self._emit_link(job_id, LINK_DEGRADED, pair, detail, ends, msg)

    def _agent_back(self, worker_id: str) -> None:
        """``worker_id``'s agent beat again after a quiet spell: the degraded or down links that
        waited for it are held again (from its beat, an event: nothing polls)."""
        with self._cluster:
            waiting = [(p, m) for p, m in self._link_waiting.items() if worker_id in p]
            for p, _ in waiting:
                del self._link_waiting[p]
        for pair, msg in waiting:
            self._hold_link(pair, msg)

    def _agent_period(self, worker_id: str) -> float:
        """The beat period of ``worker_id``'s agent (0: never heard, nothing to wait for)."""
        with self._cluster:
            beat = self._agent_beats.get(worker_id)
        return beat[1] if beat is not None else 0.0

    def _agent_paused(self, worker_id: str, now: float, after: float) -> bool:
        """Under ``_cluster``: whether ``worker_id``'s agent is quiet now, or came back from a
        quiet spell after ``after`` (time.monotonic()). An agent never heard: not paused."""
        beat = self._agent_beats.get(worker_id)
        if beat is None:
            return False
        last, period, quiet_ended = beat
        last = max(last, self._stamps.last(worker_id) or last)  # (its beats taken on the loop)
        return now - last > QUIET_PERIODS * period or quiet_ended > after

    def _emit_link(
        self,
        job_id: str,
        fault_class: str,
        pair: Pair,
        detail: str,
        ends: list[control_pb2.LinkEnd],
        msg: control_pb2.LinkStateChanged,
        cleared: bool = False,
    ) -> None:
        """A link report for one job, published at once (never held: a warning, or its end)."""
        report = self._graded(
            job_id,
            fault_class,
            Module.EXT_HARDWARE,
            self._lowest_rank(job_id, pair[0]),
            detail,
            worker_id=pair[0],
            event=msg.DESCRIPTOR.name,
        )
        if report is None:
            return
        report.link_ends.extend(ends)
        report.cleared = cleared
        if not cleared:
            with self._cluster:
                self._link_told.setdefault(pair, {})[job_id] = fault_class
        self._emit(report)

    def _forget_link_views(self, worker_id: str) -> None:
        """Under ``_cluster``: a node agent registered anew: its views are restated after its
        registration (a new incarnation starts with none)."""
        for key in [k for k in self._link_views if k[0] == worker_id]:
            del self._link_views[key]
        for pair in [p for p in self._link_states if worker_id in p]:
            now = self._combined(pair)
            if now in (None, _UP):
                self._link_states.pop(pair, None)
            else:
                self._link_states[pair] = now

    def _link_down_report(
        self, job_id: str, job: _Job, rank: int, quiet: list[int], why: str
    ) -> control_pb2.FaultReport | None:
        """Under the job's lock: the ``link_down`` report of ``rank``'s collective (``why``:
        what it did), when a down link joins two nodes of the job whose ranks all still beat
        (none in ``quiet``), and none was reported for that link this round; else None. The
        job's other ranks waiting in a collective are declared stalled with it. The link state
        is read under ``_cluster`` (a leaf), released before the grading (which takes it too)."""
        beating: set[str] = set()
        silent: set[str] = set()
        for r, w in job.ranks.items():
            (silent if r in quiet else beating).add(w.worker_id)
        with self._cluster:
            down = [
                p
                for p, state in sorted(self._link_states.items())
                if state == _DOWN
                and set(p) <= beating
                and not set(p) & silent
                and self._link_reported.get((job_id, p)) != job.round
            ]
            if not down:
                return None
            pair = down[0]
            self._link_reported[(job_id, pair)] = job.round
            ends = self._link_ends(pair)
        self._stalled_with_link(job)
        watch = job.ranks.get(rank)
        report = self._graded(
            job_id,
            LINK_DOWN,
            Module.EXT_HARDWARE,
            rank,
            f"link {pair[0]} <-> {pair[1]} is down (both ends hear nothing of each other; every rank still "
            f"beats): rank {rank} on {watch.worker_id if watch else '?'} {why}; {_losses(ends)}",
            occurred=watch.last_progress_unix if watch is not None else time.time(),
            worker_id=watch.worker_id if watch is not None else pair[0],
            step=max(watch.step, 0) if watch is not None else 0,
            phase=watch.phase if watch is not None else 0,
        )
        if report is not None:
            report.link_ends.extend(ends)
            with self._cluster:
                self._link_told.setdefault(pair, {})[job_id] = LINK_DOWN
        return report

    def _combined(self, pair: Pair) -> int | None:
        a, b = pair
        up = _View(_UP, 0.0, 0.0, 0.0)
        return combine(self._link_views.get((a, b), up).state, self._link_views.get((b, a), up).state)

    def _link_ends(self, pair: Pair) -> list[control_pb2.LinkEnd]:
        """Under ``_cluster``: both ends of ``pair``, each with its links down and its view."""
        ends = []
        for me, other in (pair, pair[::-1]):
            view = self._link_views.get((me, other))
            ends.append(
                control_pb2.LinkEnd(
                    worker_id=me,
                    links_down=sum(1 for p, s in self._link_states.items() if s == _DOWN and me in p),
                    round_trip_loss=view.round_trip_loss if view else 0.0,
                    inbound_loss=view.inbound_loss if view else 0.0,
                )
            )
        return ends

    @staticmethod
    def _nodes(job: _Job) -> set[str]:
        return {w.worker_id for w in job.ranks.values() if w.worker_id}

    def _lowest_rank(self, job_id: str, worker_id: str) -> int:
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            ranks = [r for r, w in job.ranks.items() if w.worker_id == worker_id] if job is not None else []
        return min(ranks, default=0)

    def _jobs_across(self, pair: Pair) -> list[str]:
        """The jobs with ranks on both nodes of ``pair``, each read under its own lock (no
        lock held across jobs; none held when called)."""
        across = []
        for job_id, job in list(self._jobs.items()):  # (a copy: jobs start and end meanwhile)
            with self._job_lock(job_id):
                if set(pair) <= self._nodes(job):
                    across.append(job_id)
        return sorted(across)


def _losses(ends: list[control_pb2.LinkEnd]) -> str:
    """'gpu-1 -> gpu-2 lost 40% of round trips, heard 100% ...' for a report's detail."""
    return "; ".join(
        f"{e.worker_id}: {e.round_trip_loss:.0%} of its probes unanswered, {e.inbound_loss:.0%} of the peer's missing"
        for e in ends
    )
