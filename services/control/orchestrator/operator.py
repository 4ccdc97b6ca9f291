"""Operator commands on a live job: pause (and drain), resume, stop, delete, revoke a standing
order. Each is a refusal or a command at an agreed step boundary."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.contract import control_pb2, engine_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.activity import REFUSE, ForceDownAsk, PauseAsk, ResumeAsk, StopAsk, admit, begin, end
from services.control.orchestrator.job import (
    FROZEN,
    ORCH,
    JobOutcome,
    JobState,
    _Job,
    _numbered,
    _Reload,
    _Resume,
    _where,
    checkpoint_step,
)
from services.control.orchestrator.layout import _layout_asked, _layout_flags, _new_layout
from services.control.orchestrator.refusals import IllegalTransition, NoStandingOrder
from services.control.orchestrator.texts import _newest
from services.control.orchestrator.undos import Before

_log = structlog.get_logger("orchestrator")


class OperatorCommands:
    """Operator commands on a live job (a part of ``Orchestrator``, see core.py)."""

    def pause_job_request(self, msg: control_pb2.PauseJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Ask every rank to pause after step latest+2, checkpointing that step first (unless
        ``no_checkpoint``); PAUSED once all have paused (after the commit).

        ``drain`` (`surgectl down`: the stack stops once the job is PAUSED): always with a
        checkpoint; once paused the job is ``drained`` (the next `up` resumes it) and parked
        (its ranks are gone after the stop: nothing is waited for after a control restart).
        A PAUSED job is only parked (it stays PAUSED after `up`); a pause in flight becomes a
        drain. Idempotent: a drain asked again (a `down` run again after one cut short)
        answers the job's status. With ``force`` (`surgectl down --force`) see
        ``_park_at_once``.

        A plain pause of a job pausing or PAUSED already answers its status (idempotent).

        Raises:
            JobNotFound, IllegalTransition (the job is not RUNNING, or a stop or resize is in flight).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if msg.drain and msg.force:
                return self._park_at_once(job)
            if msg.drain and job.status.state == JobState.PAUSED and not job.pending:
                if not job.parked and checkpoint_step(job) < job.status.step:
                    return self._drain_unsaved_pause(job)
                if not job.parked:
                    before = Before.of(job)
                    job.parked = job.parked_live = True
                    # Undo if its record fails at its commit: not parked (`up` would resume it).
                    self._undo_if_lost(job.status.job_id, lambda e: self._drain_undone(job, before))
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"drain: PAUSED at step {job.status.step}; its ranks stop with the stack; "
                        f"`surgectl resume {job.status.job_id}` relaunches them from {_newest(job)}",
                    )
                return self._snapshot(job)
            if msg.drain and job.pending == "pause":
                job.resume_after_pause = False  # (a `down` again after an `up` or resume undid the drain)
                if not job.draining:
                    before = Before.of(job)
                    job.draining = job.status.drained = True
                    job.drain_own_pause = False  # (the operator asked this pause: a fault keeps it)
                    job.drain_save_step = 0  # (its ranks pause at the boundary the pause asked)
                    # Undo if its record fails at its commit: the pause in flight stays a pause.
                    self._undo_if_lost(job.status.job_id, lambda e: self._drain_undone(job, before))
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"drain: the pause in flight ({_where(job)}) becomes a drain (the stack stops once it is PAUSED)",
                    )
                return self._snapshot(job)
            if not msg.drain and (job.pending == "pause" or (job.status.state == JobState.PAUSED and not job.pending)):
                # Asked again (a `surgectl pause` repeated, or cut short and run again): it is
                # pausing or paused already; a resume asked meanwhile is dropped (the last word wins).
                job.resume_after_pause = False
                return self._snapshot(job)
            self._require(job, JobState.RUNNING)
            self._require_idle(job, PauseAsk())
            checkpoint = msg.drain or not msg.no_checkpoint
            before = Before.of(job)
            cmd = self._in_flight(job, "pause", engine_pb2.PauseTraining(checkpoint=checkpoint))
            job.boundary_failed = job.resume_after_pause = False
            job.draining = job.status.drained = msg.drain  # (drained from now: `up` undoes it if `down` is cut short)
            job.drain_own_pause = msg.drain
            job.drain_save_step = 0  # (a boundary not agreed yet)
            job.paused.clear()
            what = "drain (pause, then the stack stops)" if msg.drain else "pause"
            how = "checkpoint their step and pause" if checkpoint else "pause (no checkpoint)"
            # Journaled before it goes: a restarted control sends it again with its number.
            self._record(job, ORCH, "decision", f"{what} requested: ranks {how} {_where(job)}")
            self._loop(cmd)
            # Undo if its record fails at its commit: no pause in flight (its PauseTraining,
            # behind the record, is dropped), the drain's flags as before (undos.py).
            self._undo_if_lost(job.status.job_id, lambda e: self._boundary_undone(job, cmd, before))
            return self._snapshot(job)

    def _drain_unsaved_pause(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock: a drain of a job PAUSED without a checkpoint of its step (its pause's
        save failed, the store away; or `pause --no-checkpoint`): parking it would lose the steps
        since its newest checkpoint when the stack stops (`surgectl down` refused, again and
        again). Its paused ranks checkpoint the step they are paused at, in place, and report
        paused again (a PauseTraining with ``checkpoint`` to a paused loop: boundary.py
        ``_save_while_paused``; was: they resumed and paused at the next agreed boundary, one
        step more trained before the save), as a drain. A pause the operator asked stays the operator's (``drained`` False: `up`
        leaves it PAUSED); the pause of a drain whose save failed (``drain_unsaved_step``: an
        earlier `surgectl down`, refused) is that drain, finished now (``drained``: `up` resumes
        it; was: the operator's pause, a fresh operator's trial)."""
        before = Before.of(job)
        job_id, step = job.status.job_id, job.status.step
        # RUNNING while its ranks save (the paused ranks' reports of the drain's pause are a
        # running job's, as at any pause's boundary).
        self._transition(
            job, JobState.RUNNING, ORCH, f"checkpointing for a drain: its pause at step {step} has no checkpoint"
        )
        cmd = self._in_flight(job, "pause", engine_pb2.PauseTraining(checkpoint=True))
        # Its boundary is known: the step the ranks are paused at (no step is trained, so none
        # is agreed). Named now, so that a failure of this save is the boundary's
        # (faults.py ``_save_failed``: not drained, `down` refuses again); was: left unnamed
        # until the ranks' pause reports, a failed save read as a periodic one and the job
        # taken as drained, its steps since the newest checkpoint lost (fresh SRE's trial, F1).
        job.pending_at = step
        job.boundary_failed = job.resume_after_pause = False
        # The drain's own pause (its save failed): drained, `up` resumes it once parked; the
        # operator's pause: parked once paused, PAUSED after `up`.
        job.draining, job.status.drained = True, job.drain_unsaved_step == step
        job.drain_save_step = step  # (`status`: "RUNNING (draining: saving step N)", not a job that trains)
        whose = "pause (an earlier drain's)" if job.status.drained else "pause"
        job.paused.clear()
        self._record(
            job,
            ORCH,
            "decision",
            f"drain requested: its {whose} at step {step} has no checkpoint of it (newest: {_newest(job)}): "
            f"the paused ranks checkpoint step {step} and pause again there",
        )
        self._loop(cmd)  # (behind the decision's record: lost with it, it does not go)
        # Undo if its record fails at its commit: PAUSED as it was (its PauseTraining, behind
        # the record, is dropped with it; undos.py).
        self._undo_if_lost(job_id, lambda e: self._unsaved_drain_undone(job, cmd, before))
        return self._snapshot(job)

    def _park_at_once(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock, `surgectl down --force`: a RUNNING or PAUSED job is parked now
        (PAUSED, drained: the next `up` resumes it from its newest checkpoint), its ranks
        not asked to pause: the stack kills them next, and control, stopped first, never
        sees them go. Their loss is the operator's act: no fault, no restart spent (was: the
        restored job's ranks were declared lost after `up`, a `worker_lost` restart spent).
        Any other job is left as it is (a recovering one is continued after `up`), and so is
        one without a checkpoint (a resume would have nothing to load: after `up` its fault
        policy's ``no_checkpoint`` decides)."""
        state = job.status.state
        if state not in (JobState.RUNNING, JobState.PAUSED) or job.parked:  # (parked already: asked again)
            return self._snapshot(job)
        if not [v for _, v in job.versions if v not in job.unusable]:
            return self._snapshot(job)
        admission = admit(job.status.job_id, job.activity, ForceDownAsk())
        if admission.verdict == REFUSE:
            raise IllegalTransition(admission.reason)
        lost = f"; its steps after {_newest(job)} are lost"
        before = Before.of(job)
        job.pending, job.pending_at, job.pending_seq = "", 0, 0
        end(job, _Reload)  # (a rollback's pause in flight: the ranks it would load into are killed)
        job.in_flight.clear()  # (its ranks are killed: nothing is sent again)
        job.draining = job.resume_after_pause = False
        job.parked = job.parked_live = job.status.drained = True
        text = (
            f"forced down by the operator at step {job.status.step}: its ranks are killed with the stack{lost}; "
            f"`surgectl up` resumes it from {_newest(job)} (no fault, no restart spent)"
        )
        if state == JobState.PAUSED:
            self._record(job, ORCH, "decision", text, status_message=text)
        else:
            self._transition(job, JobState.PAUSED, ORCH, text)
        # Undo if its record fails at its commit: as the journal has it, what was in flight
        # with it (undos.py); the operator's `down --force` is told it failed.
        self._undo_if_lost(job.status.job_id, lambda e: self._forced_down_undone(job, before))
        return self._snapshot(job)

    def resume_job_request(self, msg: control_pb2.ResumeJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Resume a job. A PAUSED one whose ranks run: RUNNING at once (ranks send nothing
        until their next step). A STOPPED or FAILED (TERMINATED) one, or a PAUSED one whose
        ranks are gone (parked: drained by `surgectl down`): from its newest checkpoint the
        store verifies (or ``from_version``), on ranks allocated again (a new generation,
        WARMING_UP, restart budgets reset), bit-exactly where that checkpoint left off.

        A new data-parallel layout (``dp``, ``micro_batch_size``, ``grad_accum``; 0 = the
        job's own) is validated before anything else is asked or changed: the global batch
        (micro_batch_size x grad_accum x dp rows) stays the job's, tp and pp stay, the spec's
        rules hold; then the allocator places the new world size. Accepted, the job's spec
        (journaled, with the decision) becomes the new one and the ranks load the checkpoint
        resharded (the data position is global: the same global batches follow). Only for a
        relaunch: a PAUSED job whose ranks run is refused ("stop it first").

        A job held for inspection (FAULT_FROZEN before its decided relaunch, freeze.py) is
        thawed: the relaunch runs now. ``thaw_only`` (`surgectl thaw`): only that.
        ``rollback_in_place`` (`surgectl rollback`): a RUNNING job's live ranks load
        ``from_version`` (rollback.py).

        Raises:
            JobNotFound; IllegalTransition (one line): ``thaw_only`` and the job is not held;
            the job is live, FINISHED, already
            resuming, has no checkpoint ("no checkpoint to resume from; submit again"), none
            that verifies, an unknown ``from_version``, or the store could not be asked;
            JobSpecError (one line naming the field): the new layout changes the global
            batch or breaks a rule of the spec; InsufficientResources: its ranks do not fit
            now (nothing changed).
        """
        with self._lock:
            job = self._get(msg.job_id)
            job_id = job.status.job_id
            if self._thaw_request(job):  # (held for inspection: the decided action runs now; freeze.py)
                return self._snapshot(job)
            if msg.rollback_in_place:  # `surgectl rollback` (rollback.py)
                return self._rollback_in_place(job, msg)
            if msg.thaw_only:
                raise IllegalTransition(
                    f"job {job_id} is {JobState.Name(job.status.state)}, not held for inspection "
                    "(fault_policy.freeze_seconds); nothing to thaw"
                )
            if job.queued is not None:  # (a resume that did not fit, asked again: it waits where it is)
                return self._asked_again_while_queued(job, msg)
            if job.status.state == JobState.RUNNING and job.pending == "pause" and not _new_layout(job.spec, msg):
                return self._resume_after_pause(job)
            if not self._relaunchable(job):
                if job.status.state == JobState.TERMINATED:
                    raise IllegalTransition(
                        f"job {job_id} is TERMINATED (FINISHED): all {job.status.total_steps} "
                        "steps done; nothing to resume"
                    )
                if job.status.state != JobState.PAUSED:
                    running = job.status.state in (JobState.RUNNING, JobState.WARMING_UP)
                    plain = not msg.from_version and not _layout_asked(msg)
                    raise IllegalTransition(
                        f"job {job_id} is {JobState.Name(job.status.state)}, not PAUSED: resume continues a "
                        "PAUSED job, or relaunches a STOPPED or FAILED one from its checkpoint",
                        # (a plain resume asked again once it ran: done already, as a stop asked again)
                        control_pb2.REFUSED_ALREADY_RUNNING if running and plain else control_pb2.REFUSAL_UNSPECIFIED,
                    )
                if msg.from_version:
                    raise IllegalTransition(
                        f"--from: job {job_id} is PAUSED with its ranks running; "
                        f"`surgectl resume {job_id}` continues it where it paused"
                    )
                if _new_layout(job.spec, msg) is not None:  # (its own layout named: a plain resume)
                    raise IllegalTransition(
                        f"{_layout_flags(msg)}: job {job_id} is PAUSED with its ranks running; a new layout needs new "
                        f"ranks: `surgectl stop {job_id}` first (it checkpoints), then resume it with {_layout_flags(msg)}"
                    )
                if job.start_held:  # recovered while paused: its ready ranks never started
                    job.start_held = False
                    self._start_group(job)
                else:
                    self._loop(engine_pb2.ResumeTraining(job_id=job_id))
                # Parked by a `surgectl down` that did not stop the stack (cut short): its paused
                # ranks are still there, holding their slots; they simply continue (was: a
                # relaunch the allocator refused, the job PAUSED with its slots held).
                undone = (
                    ": the drain is undone (the stack was not stopped, its ranks were still there)"
                    if job.parked
                    else ""
                )
                job.parked = job.parked_live = job.draining = job.status.drained = False
                self._transition(job, JobState.RUNNING, ORCH, f"resumed at step {job.status.step}{undone}")
                if undone:
                    self._start_soon()  # (the queue no longer waits for it)
                return self._snapshot(job)
            admission = admit(job_id, job.activity, ResumeAsk())
            if admission.verdict == REFUSE:
                raise IllegalTransition(admission.reason)
            spec = _new_layout(job.spec, msg)  # (refused: nothing asked, nothing changed)
            resume = _Resume(since=time.monotonic())
            begin(job, resume)
        try:
            verdicts = self._ask_versions(job_id)  # outside the lock: the store answers on the applier thread
            with self._lock:
                return self._relaunch(job, msg.from_version, verdicts, spec)
        finally:
            with self._lock:
                end(job, _Resume)  # (its state, moved by resume_machine; not a recovery that superseded it)

    def _resume_after_pause(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock: a resume while the job's ranks pause (a pause just asked, or the
        drain of a `surgectl down` cut short): the pause completes (with its checkpoint) and
        the ranks continue at once (``on_training_loop_paused``); a drain is undone (the
        stack is not stopped after it). Asked again: the same answer."""
        if not job.resume_after_pause:
            job.resume_after_pause = True
            undone = "; the drain is undone" if job.draining else ""
            job.draining = job.status.drained = False
            self._record(
                job,
                ORCH,
                "decision",
                f"resume requested while the ranks pause ({_where(job)}): they continue once every rank "
                f"has paused{undone}",
            )
        return self._snapshot(job)

    def delete_job_request(self, msg: control_pb2.DeleteJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Forget a TERMINATED job: its journaled status, event log and steps go, and it is
        no longer listed. Answers its last status. Its checkpoints and metrics are the
        store's (not touched here).

        Raises:
            JobNotFound, IllegalTransition (the job is live: not TERMINATED; nothing changed).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if job.status.state != JobState.TERMINATED:
                raise IllegalTransition(
                    f"job {msg.job_id} is {JobState.Name(job.status.state)}: only an ended job's records can be "
                    f"deleted (`surgectl stop {msg.job_id}` first)"
                )
            self._queued(msg.job_id, self._journal.delete_job(msg.job_id, wait=False))
            del self._jobs[msg.job_id]
            self._changed.add(msg.job_id)  # (forgotten as the decision ends)
            _log.info("job deleted", job_id=msg.job_id)
            return self._copy(job)  # (not published: it has no view any more)

    def stop_job_request(self, msg: control_pb2.StopJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Stop a job, checkpointing its boundary step first (unless ``no_checkpoint``).
        RUNNING: ranks stop at the step boundary they agree on (``_in_flight``); PAUSED: where
        they paused;
        TERMINATED with outcome STOPPED once every rank finished (after the commit). A job
        whose ranks are gone (FAULT_FROZEN, STANDBY, PAUSED and parked) or still starting
        (WARMING_UP: no step to checkpoint; they are killed) is released and terminated
        now. Stopping a job already stopping returns its status. A
        queued job leaves the queue (see ``_cancel``); with ``queued_only`` (`surgectl
        cancel`) any other job is refused.

        Raises:
            JobNotFound, IllegalTransition (the job is already TERMINATED).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if msg.queued_only or job.queued is not None:
                return self._cancel(job)
            state = job.status.state
            if state == JobState.TERMINATED:
                outcome = JobOutcome.Name(job.status.outcome)
                raise IllegalTransition(
                    f"job {job.status.job_id} is already TERMINATED ({outcome})", control_pb2.REFUSED_ALREADY_ENDED
                )
            # WARMING_UP: the ranks are still starting (importing, building or loading the
            # model); a rank reads StopTraining only once its set-up is done, which a model too
            # large for its host never is. Nothing was trained since they launched, so there
            # is no step to checkpoint: they are killed now, like ranks being recovered.
            if state in (JobState.FAULT_FROZEN, JobState.STANDBY, JobState.WARMING_UP) or (
                state == JobState.PAUSED and job.parked
            ):
                why = (
                    "its ranks were held for inspection (killed; the decided recovery did not run)"
                    if job.incident and job.incident.phase == FROZEN
                    else "its ranks were being recovered"
                    if job.incident
                    else "its paused ranks were killed (parked by `surgectl down`, which did not stop the stack)"
                    if job.parked_live
                    else "its ranks were stopped with the stack"
                    if job.parked
                    else "its ranks were still starting (killed; nothing trained since they launched)"
                    if state == JobState.WARMING_UP
                    else "its ranks were gone"
                )
                job.parked = job.parked_live = job.draining = False
                job.status.drained = False
                self._terminate(job, JobOutcome.STOPPED, f"stopped by the operator; {why}", kill=True)
                return self._snapshot(job)
            if job.pending == "stop":
                return self._snapshot(job)
            admission = admit(job.status.job_id, job.activity, StopAsk())
            if admission.verdict == REFUSE:
                raise IllegalTransition(admission.reason)
            checkpoint = not msg.no_checkpoint
            # Paused at a step no committed checkpoint holds (the pause's save failed): saved again
            # by the paused ranks, which may have marked it saved (was: the stop saved nothing).
            again = checkpoint and state == JobState.PAUSED and checkpoint_step(job) < job.status.step
            cmd = self._in_flight(job, "stop", engine_pb2.StopTraining(checkpoint=checkpoint, save_again=again))
            job.boundary_failed = job.resume_after_pause = False
            where = _where(job) if state == JobState.RUNNING else f"where they paused (step {job.status.step})"
            how = "checkpoint and stop" if checkpoint else "stop (no checkpoint)"
            self._record(job, ORCH, "decision", f"stop requested: ranks {how} {where}")
            self._loop(cmd)
            self._arm_stop_deadline(job.status.job_id, cmd.seq)  # (stop_deadline.py: ranks that never stop)
            # Undo if its record fails at its commit: the stop is no longer in flight (its
            # StopTraining, behind the record, is dropped), the job goes on as before; the
            # operator is told and may ask again.
            self._undo_if_lost(job.status.job_id, lambda e: self._stop_undone(job, cmd))
            return self._snapshot(job)

    def _stop_undone(self, job: _Job, cmd: engine_pb2.StopTraining) -> None:
        """Under the lock: a stop whose record was lost at its commit is not in flight."""
        job.in_flight.pop(cmd.seq, None)
        if job.pending == "stop" and job.pending_seq == cmd.seq:
            job.pending, job.pending_at, job.pending_seq = "", 0, 0
        self._keep(job)

    def revoke_order_request(self, msg: control_pb2.RevokeOrderRequest, payload: Any = None) -> control_pb2.JobStatus:
        """`surgectl revoke JOB CLASS`: withdraw the job's standing order for step faults of
        ``fault_class`` (see ``_withdraw_standing_order``); answers the job's status.

        Idempotent: the same class again answers the same (the order is withdrawn once).

        Raises:
            JobNotFound, IllegalTransition (not RUNNING or PAUSED), NoStandingOrder (the job's
            policy has no standing order for that class: one line naming those it has).
        """
        with self._lock:
            job = self._get(msg.job_id)
            orders = {fd.STEP_FAULT_CLASS[o.kind]: o.id for o in fd.standing_orders(job.spec.fault_policy)}
            if msg.fault_class not in orders:
                held = ", ".join(f"{c} (withdrawn)" if o in job.revoked else c for c, o in orders.items()) or "none"
                raise NoStandingOrder(
                    f"fault_class {msg.fault_class!r}: job {msg.job_id} holds no standing order for it "
                    f"(its standing orders: {held})"
                )
            self._withdraw_standing_order(msg.job_id, orders[msg.fault_class])
            return self._snapshot(job)

    def _withdraw_standing_order(self, job_id: str, order: int) -> int:
        """Withdraw the job's standing order ``order`` (StandingOrder.id) at the step boundary
        its ranks agree on (as a pause's, see ``_in_flight``); returns the command's sequence
        number (the boundary is recorded once rank 0 reports it: ``on_step_completed``). A
        fault of its kind after it is decided by the policy, one verdict per fault.

        L1-1's one producer of RevokeStandingOrder (the loop's side: tests/engine), reached
        from the operator's `surgectl revoke` (``revoke_order_request``). A generation relaunched
        whole gets the policy's orders again in its InitJob (said in the recovery's events); ranks
        kept by a rebuild or a reload in place keep it withdrawn, and a rank launched beside them
        (a replacement, a grown rank) is launched without it (``job.withdrawn``).

        Raises:
            JobNotFound, IllegalTransition: no such job, or it is not RUNNING or PAUSED.
        """
        with self._lock:
            job = self._get(job_id)
            if job.status.state not in (JobState.RUNNING, JobState.PAUSED):
                raise IllegalTransition(
                    f"job {job_id} is {JobState.Name(job.status.state)}: no ranks to revoke an order of"
                )
            if order in job.revoked:  # (these ranks have it already; journaled: also after a control restart)
                return job.revoked[order][0]
            cmd = _numbered(job, engine_pb2.RevokeStandingOrder(order=order))
            job.revoked[order] = (cmd.seq, 0)
            self._record(
                job,
                ORCH,
                "decision",
                f"standing order {fd.order_name(job.spec.fault_policy, order)} revoked at the next step boundary "
                "every rank agrees on "
                f"(command #{cmd.seq} to the ranks)",
            )
            self._loop(cmd)
            # Undo if its record fails at its commit: the order is held again (undos.py).
            self._undo_if_lost(job_id, lambda e: self._revoke_undone(job, order, cmd))
            return cmd.seq
