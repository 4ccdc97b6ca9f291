"""Liveness: each rank's silence deadline (re-armed by its heartbeats, lengthened or counted
from a stop by what its node agent states of its process, re-attached after a control
restart) and each node agent's own (``agent_silent``); a heartbeat also re-arms the rank's
progress deadline (stalls.py) and feeds the slow-rank comparison (slow_ranks.py)."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.contract import Module, control_pb2, worker_pb2
from services.control import metrics
from services.control.fault_detector.rules import (
    _STALLS,
    AGENT_MISSED_BEATS,
    AGENT_SILENT,
    AGENT_SILENT_MIN_SECONDS,
    QUIET_PERIODS,
    RANK_SILENT,
    SLOW_RANK,
    SLOW_RANK_CLEARED,
    UNHEARD_PERIODS,
    WORKER_LOST,
)
from services.control.fault_detector.watch import _Job, _RankWatch
from services.control.slow_ranks import Finding

_log = structlog.get_logger("fault_detector")

# How often a restored job's re-attach window may be pushed out by its workers registering again
# (each push moves every unheard rank's deadline: at most one a second per job).
REATTACH_PUSH_S = 1.0


class Liveness:
    """Rank and node agent liveness (a part of ``FaultDetector``, see detector.py)."""

    def on_agent_heartbeat(self, msg: control_pb2.AgentHeartbeat, payload: Any = None) -> None:
        """A node agent is alive: re-arm its silence deadline (``AGENT_MISSED_BEATS`` of its
        beat periods, at least ``AGENT_SILENT_MIN_SECONDS``, from the beat's receipt). If it
        fires, the node is reported ``agent_silent`` (no job: L1-1 holds the worker out of
        placement); the first beat after that reports it ``cleared``."""
        mono = time.monotonic()
        received = msg.received_monotonic or mono
        wait = max(AGENT_MISSED_BEATS * (msg.interval_seconds or 1.0), AGENT_SILENT_MIN_SECONDS)
        with self._cluster:
            armed = self._agents.get(msg.worker_id)
            quiet_since = self._silent_agents.pop(msg.worker_id, None)
            self._held_agents.pop(msg.worker_id, None)  # (a verdict held while control was behind: heard)
            period = msg.interval_seconds or 1.0
            last, _, quiet_ended = self._agent_beats.get(msg.worker_id, (received, period, 0.0))
            last = max(last, self._stamps.last(msg.worker_id) or last)  # (its beats taken on the loop)
            back = received - last > QUIET_PERIODS * period  # (it was quiet: paused, stopped, starved)
            if back:
                quiet_ended = received
            self._agent_beats[msg.worker_id] = (max(last, received), period, quiet_ended)
            # Moved later in place, as a rank's (one heap entry, at most one decision posted per
            # agent): armed anew per beat, a beat applied later than its deadline (control's
            # backlog) armed one already due, whose posted decision joined the backlog: 1,024
            # agents' beats made ~2,000 posted calls/s on the node queue, which fed the backlog.
            if armed is None or not armed[1].move(wait - (mono - received)):
                if armed is not None:
                    armed[1].cancel()
                token = object()  # which arming fires (a re-armed one is stale)
                args = (msg.worker_id, token, wait)
                self._agents[msg.worker_id] = (
                    token,
                    self._deadlines.after(
                        wait - (mono - received), self._agent_silence_passed, args, post=self._in_order("")
                    ),
                )
            # Its next beats of this period are taken on the loop that reads them (beat_stamps.py).
            self._stamps.arm(
                msg.worker_id, period, wait, QUIET_PERIODS * period, received, self._agents[msg.worker_id][1]
            )
        if quiet_since is not None:
            self._agent_heard_again(msg.worker_id, f"beats again after {received - quiet_since:.1f} s")
        if back:
            self._agent_back(msg.worker_id)  # (a degraded link held while it was quiet: held again)

    def on_worker_registration(self, msg: control_pb2.WorkerRegistration, payload: Any = None) -> None:
        """A node agent's registration or withdrawal (heard here before L1-2 offers or
        withdraws its slots): either ends the agent silence deadline of the worker id. A
        deadline armed by the last beat of the agent whose session this one replaced (killed,
        restarted, back after its stream broke) is not this agent's: it fired, in CI, after a
        restarted agent registered and before its first beat (a period after its start), and
        held the node a grow-back had just been decided on. The agent registering is heard
        from (a report of it silent is ``cleared``); its own beats arm its deadline (an agent
        that never beats is never held, as before any beat). A withdrawal (zero slots: the
        agent's stream closed) takes the node out of placement itself: a gone agent is no
        silent one. A departing agent still beats until its stream closes."""
        if msg.departing:
            return
        mono = time.monotonic()
        if msg.slots > 0:
            self._reattach_progress(msg.worker_id, mono)
        with self._cluster:
            armed = self._agents.pop(msg.worker_id, None)
            if armed is not None:
                armed[1].cancel()
            self._unstamp(msg.worker_id)
            self._held_agents.pop(msg.worker_id, None)
            quiet_since = self._silent_agents.pop(msg.worker_id, None) if msg.slots > 0 else None
            self._forget_link_views(msg.worker_id)  # (its agent restates them after registering)
        if quiet_since is not None:
            self._agent_heard_again(msg.worker_id, f"registered again after {mono - quiet_since:.1f} s")

    def _reattach_progress(self, worker_id: str, now: float) -> None:
        """A worker a restored job's ranks ran on registered again after a control restart:
        the reconnect storm is still being absorbed, so the job's re-attach window is pushed
        out to ``reattach_s`` from now (its unheard ranks' deadlines moved; at most once per
        ``REATTACH_PUSH_S`` or a quarter window, whichever is shorter, and each awaited worker
        once: the pushes end when its workers are back or stop coming). Why: with 3,000 agents on
        a loaded control their registrations took 88 s to come in against a 15 s window, and
        4,766 healthy ranks were declared worker_lost. A push only in the window's second half
        (session 34's rule) missed a storm that came early and paused: 1,500 agents registered in
        the first 7 s, the other 1,500 from 21 s on (hb37, load 45): 1,853 ranks lost at 15 s."""
        for job_id, job in list(self._jobs.items()):
            if worker_id not in job.reattach_awaited:
                continue
            with self._job_lock(job_id):
                if worker_id not in job.reattach_awaited:
                    continue
                job.reattach_awaited.discard(worker_id)
                if not job.reattaching or now - job.reattach_pushed < min(REATTACH_PUSH_S, job.reattach_s / 4):
                    continue
                job.reattach_until, job.reattach_pushed = now + job.reattach_s, now
                for rank in job.reattaching:
                    watch = job.ranks.get(rank)
                    if watch is not None and watch.unheard and watch.silence is not None:
                        watch.silence.move(job.reattach_s)

    def _agent_heard_again(self, worker_id: str, how: str) -> None:
        """A node agent reported silent spoke: its report ``cleared`` (L1-1 lifts its hold)."""
        now = time.time()
        self._emit(
            control_pb2.FaultReport(
                grade=self._grade(AGENT_SILENT),
                fault_class=AGENT_SILENT,
                source=Module.EXT_HARDWARE,
                detail=f"the node agent of {worker_id} {how}",
                detected_unix=now,
                occurred_unix=now,
                worker_id=worker_id,
                event=control_pb2.AgentHeartbeat.DESCRIPTOR.name,
                cleared=True,
            )
        )

    def _agent_silence_passed(self, worker_id: str, token: object, wait: float) -> None:
        """The agent's silence deadline passed (decided in order on the node queue, behind
        the beats control read before it fired): declared ``agent_silent``, unless a beat
        stamped since moved it (armed again for the rest), or control itself is behind or
        most agents went quiet at once (the verdict is held: disruption.py)."""
        now = time.monotonic()
        with self._cluster:
            armed = self._agents.get(worker_id)
            if armed is None or armed[0] is not token:
                return  # re-armed meanwhile
            beat = self._agent_beats.get(worker_id)  # its last beat applied (the deadline moved with each)
            stamped = self._stamps.last(worker_id)  # (the receipt its deadline counts from, or a later stamp)
            received = max(beat[0] if beat is not None else now - wait, stamped or 0.0)
            # A beat stamped on the loop as the deadline was being run (it moves the deadline
            # otherwise: ``Deadline.run`` arms it again): held like a verdict while control is
            # behind; the agent's next beat is applied and arms it anew, or the hold's end
            # declares it then, if it beats no more.
            heard = stamped is not None and now - stamped < wait
        if self._hold_agent_verdict(worker_id, token, wait, heard=heard):
            return
        with self._cluster:
            armed = self._agents.get(worker_id)
            if armed is None or armed[0] is not token:
                return  # heard meanwhile
            del self._agents[worker_id]
            self._unstamp(worker_id)  # (its next beat is applied: it reports it cleared)
            self._silent_agents[worker_id] = received
        quiet = time.monotonic() - received
        self._report_agent_silent(worker_id, quiet, f" (its deadline {wait:.1f} s)")

    def _unstamp(self, worker_id: str) -> None:
        """Under ``_cluster``: the agent's next beat goes to the applier (beat_stamps.py); the
        receipt of its last one taken on the loop is kept as its last beat heard."""
        stamped = self._stamps.forget(worker_id)
        beat = self._agent_beats.get(worker_id)
        if stamped is not None and beat is not None and stamped > beat[0]:
            self._agent_beats[worker_id] = (stamped, beat[1], beat[2])

    def _agent_unheard_with(self, worker_id: str, rank: int) -> None:
        """Rank ``rank`` of ``worker_id`` went silent and that node's agent was not heard from
        since (``_agent_quiet``): the agent is reported ``agent_silent`` now, not at its own
        deadline (longer: AGENT_MISSED_BEATS periods), and its next beat reports it ``cleared``
        as after any silence. Why: L1-1 relaunches every rank of the job then (a process there
        cannot be ended, so its survivors could not rebuild around it), and the relaunch must
        find the node held, not place a rank on it that waits for the node to wake (measured
        under rebuild: rank_silent 4.0 s after the stop, the agent's own silence later); the
        hold ends with the agent's next beat, so the node is usable again once it wakes. An
        agent reported silent already is left as it is."""
        with self._cluster:
            if worker_id in self._silent_agents:
                return
            armed = self._agents.pop(worker_id, None)
            if armed is not None:
                armed[1].cancel()  # (declared here: its deadline would declare it a second time)
            self._held_agents.pop(worker_id, None)
            self._unstamp(worker_id)
            beat = self._agent_beats.get(worker_id)
            last = beat[0] if beat is not None else time.monotonic()
            self._silent_agents[worker_id] = last
        quiet = time.monotonic() - last
        self._report_agent_silent(
            worker_id, quiet, f", not since before rank {rank} there went silent (the node may be frozen)"
        )

    def _report_agent_silent(self, worker_id: str, quiet: float, why: str) -> None:
        """Report ``worker_id``'s agent ``agent_silent``: quiet for ``quiet`` s, ``why`` ending the detail."""
        now = time.time()
        self._emit(
            control_pb2.FaultReport(
                grade=self._grade(AGENT_SILENT),
                fault_class=AGENT_SILENT,
                source=Module.EXT_HARDWARE,
                detail=f"the node agent of {worker_id} sent no AgentHeartbeat for {quiet:.1f} s{why}",
                detected_unix=now,
                occurred_unix=now - quiet,
                worker_id=worker_id,
                event=control_pb2.AgentHeartbeat.DESCRIPTOR.name,
            )
        )

    def on_rank_heartbeat(self, msg: worker_pb2.RankHeartbeat, payload: Any = None) -> None:
        """A rank is alive (at step ``msg.step``, in ``msg.phase``): re-arm its silence
        deadline, and its progress deadline when it moved on (a new step, a new phase, or
        more of its phase done) or just started stepping.

        Deadlines count from when control received the beat (``received_monotonic``, stamped
        by the session relay before the event applier's queue), not from now: a beat that
        waited in that queue does not extend the rank's life."""
        mono = time.monotonic()
        lag = max(0.0, mono - msg.received_monotonic) if msg.received_monotonic else 0.0
        now = time.time() - lag  # the receipt, on the wall clock the reports use
        # Re-attached: a beat the rank sent after the restart (a resent older one says
        # nothing about what its agent has still to resend).
        with self._job_lock(msg.job_id):
            job = self._jobs.get(msg.job_id)
            fresh = job is not None and (not msg.unix_time or msg.unix_time >= job.restored_unix)
        if fresh and self._reattached(msg.job_id, msg.rank):
            self._release_held(msg.job_id)
        with self._job_lock(msg.job_id):
            job = self._jobs.get(msg.job_id)
            if job is None:
                return
            watch = job.ranks.get(msg.rank)
            if msg.by_datagram and (watch is None or msg.unix_time < watch.sent_unix):
                # It rode its agent's liveness datagram (progress only) and may have overtaken
                # the session: the rank's start (no watch yet), its exit (watch gone: a beat
                # must not arm a deadline for a rank already gone) or a later beat.
                return
            if watch is None:
                watch = job.ranks[msg.rank] = _RankWatch()
                _log.debug(  # (debug: one line per rank is 8,192 lines at a large job's every start)
                    "watching rank",
                    job_id=msg.job_id,
                    rank=msg.rank,
                    worker_id=msg.worker_id,
                    heartbeat_timeout_s=job.heartbeat_timeout_s,
                    stepping=msg.stepping,
                    step=msg.step,
                )
            watch.worker_id = msg.worker_id or watch.worker_id
            watch.last_beat_unix, watch.unheard = now, False
            watch.sent_unix = max(watch.sent_unix, msg.unix_time)
            job.back.add(watch.worker_id)
            watch.interval_s = msg.interval_seconds or watch.interval_s
            # Longer while its node agent states its process running: late beats are not a
            # dead rank (a stop the agent states brings it back to the job's heartbeat
            # timeout, counted from the stop: on_rank_process_state).
            wait = self._silence_timeout(msg.job_id, job, msg.rank, watch, msg.phase, msg.phase_total) - lag
            watch.silence_due = time.monotonic() + wait
            # Moved later in place (no heap push per beat: services/common/deadlines.py), else
            # cancelled and armed anew (a first beat, or a deadline that must come sooner).
            if watch.silence is None or not watch.silence.move(wait):
                if watch.silence is not None:
                    watch.silence.cancel()
                watch.silence = self._deadlines.after(
                    wait, self._silence_passed, (msg.job_id, msg.rank, watch), post=self._in_order(msg.job_id)
                )
            progressed = msg.step != watch.step
            # Progress within a step or a long phase: a new phase, or more of it done.
            moved = progressed or msg.phase != watch.phase or msg.phase_progress != watch.phase_progress
            if moved and any(r.rank == msg.rank and r.fault_class in _STALLS for r in job.held):
                # A stall held for attribution that moved on was transient: not reported.
                job.held = [r for r in job.held if not (r.rank == msg.rank and r.fault_class in _STALLS)]
                if not job.held and job.held_timer is not None:
                    job.held_timer.cancel()
                    job.held_timer = None
            if progressed and watch.step >= 0 and msg.step_seconds > 0:
                job.step_times.append(msg.step_seconds)
            if (
                moved
                and msg.phase == worker_pb2.PHASE_EVALUATION
                and msg.phase_progress > 0
                and msg.phase_progress != watch.phase_progress
            ):
                job.eval_batch_times.append(msg.phase_seconds / msg.phase_progress)
            watch.step, watch.stepping = msg.step, msg.stepping
            watch.phase, watch.phase_progress, watch.phase_total = msg.phase, msg.phase_progress, msg.phase_total
            if moved:
                watch.last_progress_unix = now
                watch.stalled = watch.waiting = watch.deferred = False
            # (waiting for L1-1's verdict, or held by it for inspection: FreezeTraining)
            if not msg.stepping or msg.phase in (worker_pb2.PHASE_FAULT_WAIT, worker_pb2.PHASE_FROZEN):
                if watch.stall is not None:
                    watch.stall.cancel()
                watch.stall, watch.deferred = None, False
            elif moved or (watch.stall is None and not watch.stalled and not watch.waiting):
                if watch.stall is None and not watch.deferred:
                    watch.last_progress_unix = now  # stepping starts now: the clock starts now
                watch.deferred = False
                budget = job.phase_deadline_s(msg.phase, msg.phase_total, watch.data_outage)
                if watch.stall is None or not watch.stall.move(budget - lag):  # (as the silence above)
                    if watch.stall is not None:
                        watch.stall.cancel()
                    watch.stall = self._deadlines.after(
                        budget - lag, self._stall_passed, (msg.job_id, msg.rank, watch), post=self._in_order(msg.job_id)
                    )
            finding = None
            if msg.stepping:  # (a paused or finished rank's beats repeat its last step)
                compute = (msg.forward_compute_seconds, msg.backward_compute_seconds, msg.optimizer_compute_seconds)
                finding = job.slow.observe(msg.rank, msg.step, compute, msg.unix_time or now)
                ratio = job.slow.ratio(msg.rank)
                if ratio is not None:
                    metrics.set_rank_slowdown(msg.job_id, msg.rank, ratio)
        if finding is not None:  # (published outside the lock)
            self._report_slow(msg.job_id, finding, job.slow.settings.window)

    def _report_slow(self, job_id: str, finding: Finding, window: int) -> None:
        """Report a slow-rank finding (``slow_rank``) or its end (``slow_rank_cleared``)."""
        if finding.slow:
            metrics.SLOW_RANK_FINDINGS.inc()
        fault_class = SLOW_RANK if finding.slow else SLOW_RANK_CLEARED
        # (the rank's process, as for a stall: its beats say how it computes)
        self._report(job_id, fault_class, Module.EXT_HARDWARE, finding.rank, finding.text(window), step=finding.step)

    def on_rank_process_state(self, msg: control_pb2.RankProcessState, payload: Any = None) -> None:
        """A node agent states a rank process RUNNING (watched from now on, or continued) or
        STOPPED by a signal. A stop explains a silence, it never shortens it: a rank stated
        stopped that beats no more is declared silent ``heartbeat_timeout_seconds`` after
        control heard the stop, never later than the deadline it had (a running one), so a
        stop and continue within the job's timeout (^Z and fg, a py-spy dump, a debugger's
        attach) is no fault. (A cgroup freeze is no stop ``waitid`` reports: running.) A rank that beat until it was stopped stops at
        most a beat period after its last beat: it is declared at most the timeout plus one
        beat period after that beat (the slack). One stated running (continued) gets
        ``heartbeat_timeout_running_seconds`` from its last beat (see ``_silence_passed``)."""
        with self._job_lock(msg.job_id):
            ranks = self._processes.setdefault(msg.job_id, {})
            ranks.setdefault(msg.rank, {})[(msg.worker_id, msg.pid)] = (msg.state, msg.detail, msg.unix_time)
            job = self._jobs.get(msg.job_id)
            watch = job.ranks.get(msg.rank) if job is not None else None
            if job is not None and msg.state == control_pb2.RankProcessState.STOPPED:
                job.slow.stopped(msg.rank)  # (a stop inside a phase is no compute: no slowness either)
            if watch is None or watch.silence is None or watch.unheard:
                return  # not beating yet, declared already, or on its re-attach deadline
            if watch.worker_id and watch.worker_id != msg.worker_id:
                return  # another process of the rank, elsewhere (a relaunch): not the one watched
            now = time.monotonic()
            if msg.state == control_pb2.RankProcessState.STOPPED:
                # Counted from the stop, not from the last beat (which may precede it by a beat
                # period: a 2 s stop would look like 2 s + a period); capped by the deadline
                # it had, so stops that come and go never keep a rank that beats no more alive.
                wait = min(watch.silence_due - now, job.heartbeat_timeout_s)
            else:  # running (continued): its deadline counts from its last beat again
                quiet = self._silence_timeout(msg.job_id, job, msg.rank, watch, watch.phase, watch.phase_total)
                wait = quiet - (time.time() - watch.last_beat_unix)
            watch.silence.cancel()
            watch.silence_due = now + wait
            watch.silence = self._deadlines.after(
                wait, self._silence_passed, (msg.job_id, msg.rank, watch), post=self._in_order(msg.job_id)
            )

    def _agent_quiet(self, worker_id: str, silent_for: float) -> float | None:
        """How long the node agent of ``worker_id`` has been quiet, when it has not been heard
        from since a rank of it went silent ``silent_for`` seconds ago or is quiet now (no
        beat for ``UNHEARD_PERIODS`` of its periods): a rank and its agent silent together (a
        stopped or cut-off node, or the agent alone hung: the rank's beats go through it),
        whose agent is not yet declared silent (its own deadline is longer), or is. A
        replacement placed there would wait for the node to wake (issue 29 item 4, measured:
        no step in 120 s). None: heard from, or never heard (none beats here: not known unheard)."""
        if not worker_id:
            return None
        with self._cluster:
            beat = self._agent_beats.get(worker_id)
            stamped = self._stamps.last(worker_id)
        if beat is None:
            return None
        last, period, _ = beat
        last = max(last, stamped or last)
        now = time.monotonic()
        if last <= now - silent_for or now - last > UNHEARD_PERIODS * period:
            return now - last
        return None

    # ------------------------------------------------------------ deadlines (timer threads)

    def _silence_passed(self, job_id: str, rank: int, watch: _RankWatch) -> None:
        """The rank's silence deadline passed (``heartbeat_timeout_s`` after its last beat,
        ``running_timeout_s`` while its node agent states its process running,
        ``heartbeat_timeout_s`` after control heard the agent state it stopped): it is
        declared silent, saying which. Unless the party at fault is another: a rank restored
        after a control restart whose worker (as journaled) sent nothing since is lost with it;
        a rank whose node agent, which relays its beats, went quiet with it (and did not state
        it stopped) is that agent's fault: ``worker_lost`` with ``subclass`` ``agent_silent``,
        naming the agent (a healthy rank behind a hung agent was named silent, session 34).
        Held while control itself is behind (disruption.py): slowness is no one's death."""
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None or job.ranks.get(rank) is not watch:
                return  # the rank exited (or a new process of it beats) meanwhile
        if self._hold_rank_verdict(job_id, rank, watch):
            return
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None or job.ranks.get(rank) is not watch or watch.silence_due > time.monotonic():
                return  # the rank exited, or beat, meanwhile
            state, stopped_how = self._process_state(job_id, rank, watch.worker_id)
            del job.ranks[rank]  # declared once; a new heartbeat starts a new watch
            watch.cancel()
            timeout = job.heartbeat_timeout_s
            # Nothing of it since the restart (its deadline was the re-attach window's, not a
            # heartbeat timeout), nor of another rank of the worker it ran on (as journaled):
            # that worker is gone. Where it ran is unknown: only not re-attached.
            restored = watch.unheard and rank in job.reattaching
            lost = restored and bool(watch.worker_id) and watch.worker_id not in job.back
            # A rank unheard since the restart sent this control no step: the job's journaled one.
            step = watch.step if watch.step >= 0 else (job.restored_step if restored else 0)
            # Peers that waited in a collective, without a deadline, while it still looked
            # alive and working: they waited for it. Its consequences, reported after it.
            waiting = [
                (r, w) for r, w in sorted(job.ranks.items()) if w.waiting and w.phase == worker_pb2.PHASE_COLLECTIVE
            ]
            for _, w in waiting:
                w.waiting, w.stalled = False, True
            # Its own stalls held meanwhile (judged from the last state it stated, e.g. "in a
            # collective", before its reports stopped): its silence is the verdict, not them.
            job.held = [r for r in job.held if not (r.rank == rank and r.fault_class in _STALLS)]
            window = max(job.attribution_s, 0.1)
        now = time.time()
        silent_for = now - watch.last_beat_unix
        agent_quiet = self._agent_quiet(watch.worker_id, silent_for)
        subclass = ""
        if lost:
            fault_class = WORKER_LOST
            detail = (
                f"rank {rank} lost with worker {watch.worker_id}: no node agent re-attached it "
                f"within {silent_for:.1f} s of the control restart, after step {step}"
            )
        elif agent_quiet is not None and state != control_pb2.RankProcessState.STOPPED:
            # Its beats come through its node agent, silent too (typed from the agent's own
            # beats, AgentHeartbeat): the agent's fault, not the rank's (it may well be
            # training). To the job that worker is lost, as when an agent silent holds a
            # rebuild's replacements (L1-1's _replacements_held): ``subclass`` names the agent.
            fault_class, subclass = WORKER_LOST, AGENT_SILENT
            detail = (
                f"the node agent of {watch.worker_id} sent no AgentHeartbeat for {agent_quiet:.1f} s: "
                f"rank {rank}'s heartbeats, which it relays, stopped with it ({silent_for:.1f} s) after step {step}"
            )
        elif restored:
            fault_class = RANK_SILENT
            where = (
                f"on worker {watch.worker_id}" if watch.worker_id else "(the worker it was launched on is not known)"
            )
            detail = (
                f"rank {rank} {where} not re-attached: no heartbeat within {silent_for:.1f} s of the control "
                f"restart (its re-attach deadline) after step {step}"
            )
        elif state == control_pb2.RankProcessState.STOPPED:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s: its process "
                f"is {stopped_how or 'stopped'} (stated by its node agent) after step {step}"
            )
        elif state == control_pb2.RankProcessState.RUNNING:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s "
                f"(deadline {job.running_timeout_s:g} s for a process its node agent states running) "
                f"after step {step}"
            )
        else:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s "
                f"(deadline {timeout:g} s) after step {step}"
            )
        unheard = agent_quiet is not None and fault_class in (RANK_SILENT, WORKER_LOST) and not lost
        if unheard:
            self._agent_unheard_with(watch.worker_id, rank)  # (before the rank's report: L1-1 holds first)
        self._report(
            job_id,
            fault_class,
            Module.EXT_HARDWARE,
            rank,
            detail,
            occurred=watch.last_beat_unix,
            worker_id=watch.worker_id,
            step=step,
            phase=watch.phase,
            subclass=subclass,
            agent_unheard=unheard,
        )
        followers = self._waiting_reports(job_id, waiting, rank, "silent", now)
        if followers:
            self._hold(job_id, followers[0], window=window, followers=followers[1:])
        if self._reattached(job_id, rank):
            self._release_held(job_id)

    # ------------------------------------------------------------ process states, re-attach

    def _process_state(self, job_id: str, rank: int, worker_id: str) -> tuple[int, str]:
        """What the node agent of ``worker_id`` last stated of the rank's process there:
        (RankProcessState.State, its detail); (STATE_UNSPECIFIED, "") where it stated nothing
        (a rank not launched by a node agent, a worker unknown). Of two processes of the rank
        there (one released, not yet reaped), the newest: the one that beats. The job's lock held."""
        states = [v for (w, _), v in self._processes.get(job_id, {}).get(rank, {}).items() if w == worker_id]
        if not worker_id or not states:
            return control_pb2.RankProcessState.STATE_UNSPECIFIED, ""
        state, detail, _ = states[-1]  # (keys keep the order in which each process was first stated)
        return state, detail

    def _forget_process(self, job_id: str, rank: int, worker_id: str, pid: int) -> None:
        """The process ended (pid 0: every process of the rank on that worker). The job's lock held."""
        ranks = self._processes.get(job_id, {})
        known = ranks.get(rank)
        if known is None:
            return
        for key in [k for k in known if k[0] == worker_id and (not pid or k[1] == pid)]:
            del known[key]
        if not known:
            del ranks[rank]
        if not ranks:
            del self._processes[job_id]

    def _silence_timeout(
        self, job_id: str, job: _Job, rank: int, watch: _RankWatch, phase: int = 0, phase_total: int = 0
    ) -> float:
        """How long the rank may stay without a beat, its last one stating ``phase`` (of
        ``phase_total`` units): longer while its node agent states its process runs, the job's
        heartbeat timeout otherwise (nothing stated, or stopped: a beat from a process still
        stated stopped came before the agent's word that it continued) (the job's lock held).
        A profile's export holds the rank's interpreter lock, so its beats may stop for as long
        as the export may take: a rank that announced one has that long (a stopped process
        exports nothing: the stop still decides)."""
        state, _ = self._process_state(job_id, rank, watch.worker_id)
        if state == control_pb2.RankProcessState.STOPPED:
            return job.heartbeat_timeout_s
        timeout = job.running_timeout_s if state == control_pb2.RankProcessState.RUNNING else job.heartbeat_timeout_s
        if phase == worker_pb2.PHASE_PROFILE_EXPORT:
            return max(timeout, job.profile_export_allowance_s(phase_total))
        return timeout

    def _reattached(self, job_id: str, rank: int) -> bool:
        """The rank was heard from after a control restart; True when it was the last one
        the job waited for and symptoms are held (they may go now)."""
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None or rank not in job.reattaching:
                return False
            job.reattaching.discard(rank)
            return not job.reattaching and bool(job.held)
