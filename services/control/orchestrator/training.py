"""Rank events (L2-1 and L5-1 via the relay): a loop started, a step, an eval, a save, a pause,
the end, a failure, a step fault waiting for its verdict."""

from __future__ import annotations

import time
from typing import Any

from services.common import save_failing
from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.activity import RECOVERED, RELOADED, SCALED, end, ready_for
from services.control.orchestrator.departure_plan import save_seconds
from services.control.orchestrator.job import FROZEN, ORCH, JobOutcome, JobState, _Job, _Recovered
from services.control.orchestrator.recovery import _step_verdict
from services.control.orchestrator.texts import _newest, _usable, checkpoint_text
from services.control.orchestrator.triage import awaits_relaunch
from services.jobspec import (
    IN_PLACE_ACTIONS,
)


class RankEvents:
    """Rank events (L2-1 and L5-1 via the relay) (a part of ``Orchestrator``, see core.py)."""

    # ------------------------------------------------------------ rank events (L2-1, L5-1)

    def on_training_loop_started(self, msg: engine_pb2.TrainingLoopStarted, payload: Any = None) -> None:
        """A rank is initialised (restored, after a recovery) and waits for StartTraining;
        when all have, start them all. Applied by the event applier, the decision does not wait
        for its journal commit (commit_later.py): a start is one record per rank."""
        with self._lock:
            self._commit_later(msg)
            self._heard_from(msg.job_id, msg.rank)
            known = self._jobs.get(msg.job_id)
            ready = ready_for(known.activity if known is not None else None)  # whose event "all ready" is
            scaling = ready == SCALED
            # (a resize's or a rollback's ranks report ready while the job runs)
            states = (JobState.WARMING_UP, JobState.FAULT_FROZEN) + (
                (JobState.RUNNING,) if ready in (SCALED, RELOADED) else ()
            )
            job = self._live(msg.job_id, states, msg)
            if job is None:
                return
            if job.status.state == JobState.FAULT_FROZEN and job.incident is None:
                return  # frozen by a control restart: these ranks are not known here
            if job.incident is not None and awaits_relaunch(job.incident, msg.rank):
                # A rank of the failed generation, ready a moment after the fault (its report
                # came behind the exit that opened the incident): counted, the relaunch's group
                # was "all ready" before its own rank reported, and started without it.
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "rank",
                    f"rank {msg.rank} of the failed generation reported ready after the fault: not counted "
                    "(the recovery relaunches it)",
                )
                return
            if job.incident is not None and job.incident.resumed:
                # Only a relaunched rank reports ready during a recovery (the failed
                # generation's ready reports were applied before the fault): the relaunch
                # reached the node agents before control went down; it is not repeated.
                job.incident.relaunched, job.incident.resumed = True, False
                self._record(
                    job,
                    ORCH,
                    "recovery",
                    f"the relaunch commanded before the restart happened: rank {msg.rank} of the "
                    "relaunched ranks is ready; not relaunched again",
                )
            job.started.add(msg.rank)
            job.finished.pop(msg.rank, None)  # (an old generation's, kept by an operator resume)
            if job.incident is not None:
                job.incident.restored_from.update(dict(msg.restored_bytes_from))
                if msg.healed:
                    job.incident.healed_from[msg.rank] = msg.healed_from_rank
            elif scaling and msg.healed:
                job.scale.healed_from[msg.rank] = msg.healed_from_rank
            if msg.worker_id:  # journaled: a restarted control knows where each rank ran
                job.placement[msg.rank] = msg.worker_id
            if job.launched and len(job.started) >= job.status.world_size:
                job.launched = {}  # (every rank ready: ``placement`` says where each one is)
            if msg.rank == 0 and msg.peak_tflops:  # what the job's MFU divides by (rank 0's device)
                job.status.peak_tflops, job.status.peak_source = msg.peak_tflops, msg.peak_source
            incident = job.incident
            if incident is not None and incident.action in IN_PLACE_ACTIONS and msg.rank not in incident.lost:
                # A survivor: its process never restarted; its seconds are the rebuild's (a trial read start-up).
                how = f"kept its process, rejoined in {msg.startup_seconds:.1f} s"
            else:
                how = f"{msg.startup_seconds:.1f} s start-up"
            self._record(
                job,
                Module.L2_TRAINING_LOOP,
                "rank",
                f"rank {msg.rank} ready at step {msg.start_step} ({msg.num_parameters} parameters, {how})",
            )
            if len(job.started) < job.status.world_size or job.pending == "stop":
                return
            if msg.start_step != job.status.step:  # (restored at another step: its loss is not this step's)
                job.status.train_loss = 0.0
            job.status.step = msg.start_step
            # Every rank is ready: the event of the activity's machine (activity.ready_for).
            if ready == SCALED:
                self._scaled(job, msg)
            elif ready == RELOADED:
                self._reloaded(job, msg)
            elif ready == RECOVERED:
                self._recovered(job, incident, msg.start_step)
            else:
                self._started(job)

    def _started(self, job: _Job) -> None:
        """Under the lock: every rank of a job's first start (or of an operator resume's
        relaunch) is ready: the group starts."""
        self._start_group(job)
        job.running_since = time.time()
        self._transition(job, JobState.RUNNING, ORCH, _ready_text(job.status.world_size))
        self._preemption_on_run()

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        """Rank 0's step summary (global loss, all-rank tokens) updates the status; it is
        journaled at most every ``persist_interval_s``. A new step that arrives after a fault
        that is being rebuilt in place counts too: the survivors keep it (the job goes on
        from the highest step every rank completed), so its tokens and its journal record
        would otherwise be missing (the trial's "tokens seen" was one step short).

        The decision lock is held for the status only: the step's journal writes (its step
        row, the status at most every ``persist_interval_s``) are queued after it, under the
        job's journal lock (``_write_later``), as one write with the applying event's cursor,
        and not waited for: the journal's writer commits them with every other job's (a
        group commit), then emits their JobEvents, and the event's ack goes down once it is
        durable (services/control/exactly_once.py)."""
        if msg.rank != 0:
            if self._reattaching.waits_for(msg.job_id):  # (else nothing to decide: no lock)
                with self._lock:
                    self._heard_from(msg.job_id, msg.rank)
            return  # every rank reports the same global numbers; rank 0 speaks for them
        later: list = []
        journal_lock = None
        try:
            with self._lock:
                journal_lock = self._step(msg, later)
            if journal_lock is not None:
                # Every applied step, in order (the journal of progress a restart resumes
                # from; an event applied twice would show here as a repeated step).
                # (after the job's steps whose write the journal refused: held_steps.py)
                self._last_write[msg.job_id] = self._write_step(msg, later)
        finally:
            if journal_lock is not None:
                journal_lock.release()

    def _step(self, msg: engine_pb2.StepCompleted, later: list) -> Any:
        """Under the lock: rank 0's step applied to the job's status; returns the job's
        journal lock, taken (None: the step is not the job's), its writes in ``later``."""
        self._heard_from(msg.job_id, msg.rank)
        job = self._jobs.get(msg.job_id)
        kept = (
            job is not None
            and job.status.state == JobState.FAULT_FROZEN
            and job.incident is not None
            and job.incident.action in IN_PLACE_ACTIONS
            and msg.step > job.status.step
        )
        if not kept:
            job = self._live(msg.job_id, (JobState.RUNNING, JobState.PAUSED), msg)
        if job is None:
            return None
        s = job.status
        last_step, last_unix = job.last_step_unix
        if msg.unix_time and last_unix and msg.step > last_step:
            rate = (msg.unix_time - last_unix) / (msg.step - last_step)
            job.step_seconds = rate if not job.step_seconds else 0.8 * job.step_seconds + 0.2 * rate
        job.last_step_unix = (msg.step, msg.unix_time)
        s.step, (s.tokens_per_second, s.mfu) = msg.step, self._throughput(job, msg)
        self._agreed(job, msg)
        if not msg.skipped:
            s.train_loss = msg.loss
        s.tokens_seen += msg.tokens
        if msg.skipped:
            reason = getattr(msg, "skip_reason", "") or "overflow"  # (field 22: "overflow" | "non_finite_loss")
            self._metrics.step_skipped(reason)
            self._record(
                job,
                Module.L2_TRAINING_LOOP,
                "skip",
                f"step {msg.step} skipped ({reason}): no update applied; loss {msg.loss}",
                later=later,
            )
        if isinstance(job.activity, _Recovered):  # (the recovery's last phase: its first step)
            incident = job.activity.incident
            end(job, job.activity)
            seconds = time.monotonic() - incident.decided
            self._metrics.recovered(incident.fault_class, seconds)
            # The status says what is true now (the recovery's own words, its restore's
            # details, stayed for as long as the job ran on: fresh36 F7); the events keep them.
            s.message = (
                f"{_training_text(s.world_size)} since step {msg.step}, after the recovery from "
                f"{incident.fault_class} of rank {incident.cause.rank}"
            )
            self._record(
                job,
                ORCH,
                "recovery",
                f"first step after the recovery from {incident.fault_class} of rank {incident.cause.rank}: "
                f"step {msg.step}, {seconds:.1f} s after the decision "
                f"({time.time() - incident.cause.occurred_unix:.1f} s after the fault)",
                later=later,
            )
        if time.monotonic() - job.last_persist >= self._persist_interval_s:
            self._record(
                job,
                Module.L2_TRAINING_LOOP,
                "step",
                f"step {msg.step}/{s.total_steps} loss {msg.loss:.4f} {s.tokens_per_second:.0f} tok/s",
                later=later,
            )
        else:
            self._publish(job)  # (a step not journaled yet: the queries see its progress)
        return self._write_later(job)

    @staticmethod
    def _throughput(job: _Job, msg: engine_pb2.StepCompleted) -> tuple[float, float]:
        """The job's (tokens/s, MFU) after ``msg``, over the same steps: those but the first
        this control saw (``_Job.throughput``); that step's own figures until there is another
        (or when the steps carry no step time). The MFU is each step's weighted by its seconds,
        i.e. the window's model FLOPs over its seconds x peak x world: the figure beside the
        window's tokens/s, not the last step's (fresh37 #4: 27.9 % shown, 11.4 % for the run).
        Under the lock."""
        if msg.step_seconds > 0:
            if job.throughput_warm:
                tokens, seconds, mfu_seconds = job.throughput
                job.throughput = (
                    tokens + msg.tokens,
                    seconds + msg.step_seconds,
                    mfu_seconds + msg.mfu * msg.step_seconds,
                )
            job.throughput_warm = True
        tokens, seconds, mfu_seconds = job.throughput
        if seconds > 0:
            return tokens / seconds, mfu_seconds / seconds
        return msg.tokens_per_second, msg.mfu

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        if msg.rank != 0:
            return
        with self._lock:
            job = self._live(msg.job_id, (JobState.RUNNING, JobState.PAUSED), msg)
            if job is None:
                return
            job.status.eval_loss = msg.loss
            self._record(job, Module.L2_TRAINING_LOOP, "eval", f"step {msg.step} eval loss {msg.loss:.4f}")

    def on_save_completed(self, msg: store_pb2.SaveCompleted, payload: Any = None) -> None:
        with self._lock:
            # FAULT_FROZEN too: a commit that completed while its ranks were being killed is a
            # verified version all the same.
            job = self._live(
                msg.job_id, (JobState.RUNNING, JobState.PAUSED, JobState.WARMING_UP, JobState.FAULT_FROZEN), msg
            )
            if job is None or any(v == msg.version for _, v in job.versions):
                return  # every rank relays the same commit; record it once
            job.status.checkpoint_version = msg.version
            job.versions.append((msg.step, msg.version))
            if msg.step >= job.status.save_failing.step:  # (not an older save's late commit)
                job.status.ClearField("save_failing")
            if msg.removed_versions:  # (its retention deleted them: no rollback or resume offers them)
                gone = set(msg.removed_versions)
                job.versions = [(s, v) for s, v in job.versions if v not in gone]
            job.save_seconds = save_seconds(job.last_step_unix, msg, time.time()) or job.save_seconds
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                checkpoint_text(msg),
            )
            # After the commit's event: a hook's "no evaluation of this version" follows it.
            self._hooks_on_version(job, msg.version)  # (eval.hooks: eval_hooks.py)
            incident = job.incident
            if incident is not None and incident.fault_class == fd.REPLICA_DIVERGENCE and incident.bound is not None:
                # A commit of the diverged ranks that completed as they were being killed.
                self._never_load_diverged(job, incident.bound, [(msg.step, msg.version)])

    def on_training_loop_paused(self, msg: engine_pb2.TrainingLoopPaused, payload: Any = None) -> None:
        """A rank paused at the boundary of a pause, a scale, a rollback, a drain, a departure or
        a preemption; when every rank has, the activity goes on. Applied by the event applier,
        the decision does not wait for its journal commit (commit_later.py): every rank
        reports, one record each (the last rank's decision waits where it registers an undo)."""
        with self._lock:
            self._commit_later(msg)
            self._heard_from(msg.job_id, msg.rank)
            job = self._live(msg.job_id, (JobState.RUNNING,), msg)
            if job is None or job.pending not in ("pause", "scale", "reload"):
                return
            job.pending_at = job.pending_at or msg.step  # (the boundary the ranks agreed on)
            job.paused.add(msg.rank)
            if job.pending == "reload":  # a rollback in place (rollback.py)
                if len(job.paused) < job.status.world_size:
                    self._keep(job)
                else:
                    self._reload_paused(job, msg.step)
                return
            if job.pending == "scale":
                if len(job.paused) < job.status.world_size:
                    self._keep(job)
                else:
                    self._resize(job, msg.step)
                return
            if len(job.paused) < job.status.world_size:
                self._keep(job)
            elif job.departure:  # a node leaves: its checkpoint is committed, the ranks move (departure.py)
                self._departure_paused(job, msg.step)
            elif job.status.preempted_by:  # preempted: its checkpoint is committed, the slots go (preemption.py)
                self._preemption_paused(job, msg.step)
            else:
                job.pending = ""
                job.status.step = msg.step
                text = f"all ranks paused after step {msg.step}"
                if job.draining and job.boundary_failed:
                    # Not parked: stopping its ranks now would lose the steps since the newest
                    # checkpoint (`surgectl down` sees it and keeps the stack running).
                    # (the drain's own pause, not the operator's: the next drain finishes it)
                    job.drain_unsaved_step = msg.step if job.status.drained else 0
                    job.draining = job.status.drained = False
                    sf = job.status.save_failing  # (why, typed: a store away, or one refusing the write)
                    text += (
                        f"; not drained: its checkpoint of step {msg.step} could not be saved "
                        f"({save_failing.why(sf)}), the ranks stay paused (resume, or `surgectl down` again "
                        f"{save_failing.until(sf)})"
                    )
                if job.draining and job.status.drained:  # its ranks go away with the stack: the next `up` resumes it
                    job.draining, job.parked, job.parked_live = False, True, True
                    text += f"; drained: `surgectl up` resumes it from {_newest(job)}"
                elif job.draining:  # the operator's pause, checkpointed for a drain: PAUSED after `up`
                    job.draining, job.parked, job.parked_live = False, True, True
                    text += (
                        f"; parked: its ranks stop with the stack; `surgectl resume {job.status.job_id}` "
                        f"relaunches them from {_newest(job)}"
                    )
                self._transition(job, JobState.PAUSED, Module.L2_TRAINING_LOOP, text)
                if job.resume_after_pause:  # (resumed while it paused: it continues now)
                    job.resume_after_pause = False
                    self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id))
                    self._transition(
                        job, JobState.RUNNING, ORCH, f"resumed at step {msg.step} (asked while the ranks paused)"
                    )

    def on_training_loop_finished(self, msg: engine_pb2.TrainingLoopFinished, payload: Any = None) -> None:
        """When every rank has finished: TERMINATED (FINISHED, or STOPPED if stopped early).
        Applied by the event applier, a rank's finish does not wait for its journal commit
        (commit_later.py); the last one's (the release, the queue's head tried) does."""
        with self._lock:
            self._commit_later(msg)
            self._heard_from(msg.job_id, msg.rank)
            job = self._live(msg.job_id, (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED), msg)
            if job is None:
                return
            job.finished[msg.rank] = msg.stopped
            job.status.step = max(job.status.step, msg.step)
            # (Ranks beyond the world size are an older generation's, kept by an operator
            # resume at a smaller dp so that their late clean exits are no faults.)
            world = job.status.world_size
            # (the count first: ours are among the finished, so fewer finished is not all of ours;
            # the world's ranks read once, at the last, not per rank: O(world) each at 8,192 ranks)
            ours = (
                {r: stopped for r, stopped in job.finished.items() if r < world} if len(job.finished) >= world else {}
            )
            if len(ours) < world:
                self._keep(job)
                return
            stopped = any(ours.values()) or job.pending == "stop"
            outcome = JobOutcome.STOPPED if stopped else JobOutcome.FINISHED
            how = "stopped" if stopped else "finished"
            # Stopped: say where a resume continues (the stop's checkpoint, or an older one
            # when that save was skipped or not asked for).
            then = ""
            if stopped:  # (no version to continue from: `resume` refuses it, so it is not suggested)
                usable = _usable(job)
                then = (
                    f"; `surgectl resume` continues from {_newest(job)}"
                    if usable
                    else "; no checkpoint to resume from: `surgectl submit` starts it again"
                )
                lost = job.status.step - max((step for step, _ in usable), default=job.status.step)
                if lost > 0:  # (a stop's checkpoint that failed, the store away, was said nowhere: a fresh user)
                    why = "its stop's checkpoint could not be saved" if job.boundary_failed else "not checkpointed"
                    then += f"; the {lost} step{'s' if lost > 1 else ''} after it are lost ({why})"
            self._terminate(job, outcome, f"all ranks {how} at step {job.status.step}{then}", kill=False)
            if not stopped:
                self._hooks_on_finish(job)  # (eval.hooks: eval_hooks.py)

    def on_training_loop_failed(self, msg: engine_pb2.TrainingLoopFailed, payload: Any = None) -> None:
        """Recorded only: the decision waits for the fault detector's grade. (A broken group
        fails every rank: one record each, not waited for: commit_later.py.)"""
        with self._lock:
            self._commit_later(msg)
            job = self._live(msg.job_id, (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED), msg)
            if job is not None and not msg.failure.replaced:  # (a replaced incarnation's: recorded stale, faults.py)
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "rank",
                    f"rank {msg.rank} failed at step {msg.step}: "
                    + (f"{msg.fault_class}: " if msg.fault_class else "")
                    + msg.detail,
                )

    def on_step_fault_reported(self, msg: engine_pb2.StepFaultReported, payload: Any = None) -> None:
        """A rank's loop is blocked on a step fault (every rank finds the same one at the
        same step): decide once per (step, kind) by the policy (services/control/
        fault_decision.py) and send the verdict to every rank of the job. A report of a rank
        the recovery in flight replaces is a consequence: that rank is being released."""
        fault_class = fd.STEP_FAULT_CLASS.get(msg.kind, "")
        received = time.time()
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            job = self._jobs.get(msg.job_id)
            if job is None or job.status.state == JobState.TERMINATED or not fault_class:
                return  # (its ranks are being released)
            key = (msg.step, msg.kind)
            for earlier in [k for k in job.verdicts if k[0] < msg.step]:
                del job.verdicts[earlier]  # (every rank passed that step: see _Job.verdicts)
            sent = job.verdicts.get(key)
            if sent is not None:
                if msg.reminder:
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"verdict on {fault_class} at step {msg.step} sent again: "
                        f"rank {msg.rank} still waits after {msg.waited_seconds:.0f} s",
                    )
                    self._loop(sent)
                return
            text = f"rank {msg.rank} blocked at step {msg.step}: {msg.detail}"
            incident = job.incident
            # (also a rank whose exit came first, its relaunch not placed: its report travelled
            # its own stream, behind the exit its agent reported, and was decided as a second fault)
            if incident is not None and (incident.dying[msg.rank] > 0 or awaits_relaunch(incident, msg.rank)):
                if msg.reminder and incident.phase == FROZEN:
                    return  # (held for inspection: its verdict goes when the hold ends)
                self._commit_later(msg)  # (a record only, one per rank: commit_later.py)
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "fault",
                    f"{fault_class}: {text} (consequence of rank {incident.cause.rank}'s {incident.fault_class})",
                )
                return
            # Ungraded (GRADE_UNSPECIFIED): decided by its class alone (fault_decision.decide).
            report = control_pb2.FaultReport(
                job_id=msg.job_id,
                fault_class=fault_class,
                source=Module.L2_TRAINING_LOOP,
                rank=msg.rank,
                detail=text,
                detected_unix=received,
                occurred_unix=received,
                step=msg.step,
                worker_id=job.placement.get(msg.rank, ""),
            )
            self._metrics.fault_reported(report, received)
            self._record(job, Module.L2_TRAINING_LOOP, "fault", f"{fault_class}: {text}")
            decision = self._decide(job, report, step_fault=msg)
            # (kept in job.verdicts only if the ranks go on: a relaunched generation that meets
            # the step again is asked anew)
            verdict = job.verdicts.get(key) or _step_verdict(msg, decision)
            if job.incident is not None and job.incident.phase == FROZEN and job.incident.cause is report:
                job.incident.verdict = verdict  # the ranks stay blocked for inspection (freeze.py)
                self._keep(job)
                return
            self._loop(verdict)


def _training_text(world_size: int) -> str:
    return "the rank is training" if world_size == 1 else f"all {world_size} ranks training"


def _ready_text(world_size: int) -> str:
    """The RUNNING transition's words ("all 1 ranks ready" read wrong to a trial's operator)."""
    return (
        "the rank is ready; training started" if world_size == 1 else f"all {world_size} ranks ready; training started"
    )
