"""The recovery sequence: a fault decided by the policy (``fault_decision.decide``), then
verification, placement and restore, each a command and the event that answers it, with
retries and deadlines on the deadline pool."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.orchestrator import recovery_machine as rm
from services.control.orchestrator.activity import begin, end
from services.control.orchestrator.job import (
    NO_CAPACITY,
    ORCH,
    PLACING,
    RECOVERY_TIMEOUT,
    RESTORING,
    STORE_UNREACHABLE,
    VERIFYING,
    WAITING_CAPACITY,
    WAITING_STORE,
    FaultGrade,
    JobOutcome,
    JobState,
    RecoveryFailureCause,
    StoreFailureCause,
    _Incident,
    _Job,
    _Reload,
    _Scale,
)
from services.control.orchestrator.layout import _layout_change, _layout_msg, _layout_of, _shrink_to
from services.control.orchestrator.texts import _healed_text, _overdue, restored_from_text
from services.control.orchestrator.triage import _lost_ranks, _no_rebuild, _no_reload
from services.jobspec import (
    IN_PLACE_ACTIONS,
    spec_to_json,
)

_log = structlog.get_logger("orchestrator")


def _step_verdict(report: engine_pb2.StepFaultReported, decision: fd.Decision) -> engine_pb2.StepVerdict:
    """L1-1's verdict to the ranks blocked on the step fault ``report`` says, by ``decision``."""
    return engine_pb2.StepVerdict(
        job_id=report.job_id, step=report.step, kind=report.kind, action=decision.verdict, reason=decision.text
    )


def _corrupt(verdict: store_pb2.CheckpointVerdict) -> bool:
    """Whether a failed verdict is about the version's bytes (the only reason to strike it)."""
    # (A store older than the typed verdict sends none: it said not-ok only for a hash failure.)
    return verdict.cause in (store_pb2.VERDICT_UNSPECIFIED, store_pb2.VERDICT_CORRUPT, store_pb2.VERDICT_MISSING_FILE)


class Recovery:
    """The recovery sequence (a part of ``Orchestrator``, see core.py)."""

    def _decide(
        self, job: _Job, msg: control_pb2.FaultReport, step_fault: engine_pb2.StepFaultReported | None = None
    ) -> fd.Decision:
        """Decide on ``msg`` (services/control/fault_decision.py) and do what it says.
        ``step_fault``: the loop's report ``msg`` was made from; a verdict that lets the
        ranks go on (apply, skip) is kept in ``job.verdicts``."""
        previous, last = job.incident, job.last_incident
        decision = fd.decide(job.spec.fault_policy, fd.JobView(
            restarts=job.restarts, ignored=job.ignored, stop_requested=job.pending == "stop",
            loading_version=previous.version if previous is not None else "",
            no_rebuild=_no_rebuild(job, msg),
            replica_check_every_steps=job.spec.integrity.replica_check_every_steps,
            recovered_class=last.fault_class if last is not None else "",
            recovered_version=last.version if last is not None else "",
            recovered_step=dict((v, s) for s, v in job.versions).get(last.version, 0) if last is not None else 0,
            job_id=job.status.job_id,
            no_reload=_no_reload(job) if fd.fault_class_of(msg) == fd.REPLICA_DIVERGENCE else None,
            rank0_worker_id=job.placement.get(0, ""),
        ), msg)  # fmt: skip
        fault_class, action = decision.fault_class, decision.action
        self._metrics.decided(fault_class, decision.counted)
        # What the decision leaves in the bookkeeping is journaled with its event: a control
        # restarted right after it neither counts the ignored fault again nor decides the
        # ranks' reminder of it afresh.
        if action == "ignore":
            job.ignored[fault_class] += 1
        if step_fault is not None and decision.verdict in (engine_pb2.STEP_APPLY, engine_pb2.STEP_SKIP):
            job.verdicts[step_fault.step, step_fault.kind] = _step_verdict(step_fault, decision)
        self._record(job, ORCH, "decision", decision.text)
        if action in ("ignore", "skip_step", "skip_save"):
            return decision
        if action == "stop":
            self._terminate(job, decision.outcome, decision.final, kill=True)
            return decision
        if action == "pause":
            self._pause_after_fault(job, decision.final)
            return decision
        job.restarts[fault_class] += 1
        if decision.strike and decision.strike not in job.unusable:  # (struck already if its load's report came first)
            job.unusable.add(decision.strike)
            why = (
                "reproduced the replica divergence it was loaded to recover from: suspect"
                if fault_class == fd.REPLICA_DIVERGENCE
                else "fails its digest check on load"
            )
            self._record(job, ORCH, "checkpoint", f"checkpoint {decision.strike} {why}; never loaded again")
        bound, exclude = decision.bound, list(decision.exclude)
        if fault_class == fd.REPLICA_DIVERGENCE and bound is not None:
            self._never_load_diverged(job, bound, job.versions)
        incident = _Incident(
            cause=msg,
            fault_class=fault_class,
            action=action,
            decided=time.monotonic(),
            at_step=job.status.step,
            bound=bound,
            exclude=exclude,
            # The operator's pause outlives the fault: recovered, the job stays paused.
            paused=job.status.state == JobState.PAUSED
            or job.pending == "pause"
            or (previous is not None and previous.paused),
            reload=decision.in_place,
        )
        if action in IN_PLACE_ACTIONS:
            # Only the lost ranks end (the recovery kills them if they still run); the others
            # survive: their collective's failure, reported as they rebuild, is a consequence.
            # A rebuild during a rebuild also replaces the ranks the first one was replacing
            # (they hold no state yet: relaunched from a spare, they heal with the others).
            incident.lost = sorted(set(_lost_ranks(job, msg)) | set(previous.lost if previous is not None else ()))
            incident.dying.update(r for r in incident.lost if r not in job.exited)
        else:
            # Every rank of the failing generation not yet seen ended will end (the recovery
            # kills it): its reports until then are consequences of this incident.
            incident.dying.update(r for r in range(job.status.world_size) if r not in job.exited)
        if previous is not None:
            incident.dying.update(previous.dying)
            self._cancel_timer(previous)
        # (admit: a recovery supersedes whatever was in flight; said below for a resize or
        # a rollback, folded above for an earlier recovery)
        superseded = begin(job, incident)
        job.recovered, job.exited = None, set()
        self._end_data_wait(job)  # (its ranks are replaced: a new generation says what it waits for)
        self._release_held(job, incident)  # (a save that broke a moment before this fault came)
        job.started, job.paused, job.finished, job.placement = set(), set(), {}, {}  # (a new generation)
        job.verdicts.clear()
        job.revoked.clear()
        job.pending = ""  # a pause in flight ends here: the incident keeps it (``paused``)
        # A drain ends here too: the recovered job is not `up`'s to resume (its ranks are new).
        job.draining = job.parked = job.parked_live = job.resume_after_pause = job.status.drained = False
        job.departure = ""  # (a recovery supersedes a departure's move: its relaunch places the ranks)
        if isinstance(superseded, _Reload):  # (the ranks it loads into are being replaced)
            self._record(
                job, ORCH, "recovery",
                f"rollback in place to {superseded.version} given up: {decision.text}; the relaunch replaces it",
            )  # fmt: skip
        if isinstance(superseded, _Scale):  # (its new layout stays if it was already commanded)
            self._record(
                job, ORCH, "scale", f"{superseded.why} to dp {superseded.spec.parallel.dp} given up: {decision.text}"
            )
        job.start_held = False
        job.excluded.update(exclude)  # journaled with the decision: a restarted control keeps it
        hold = fd.freeze_for(job.spec.fault_policy, decision, recovering=previous is not None)
        if hold:  # inspect before acting (freeze.py): the recovery starts when the hold ends
            self._freeze(job, incident, hold)
            return decision
        if job.status.state != JobState.FAULT_FROZEN:
            self._transition(job, JobState.FAULT_FROZEN, ORCH, f"recovering from {fault_class} of rank {msg.rank}")
        self._recover(job, incident)
        return decision

    def _never_load_diverged(self, job: _Job, bound: int, versions: list[tuple[int, str]]) -> None:
        """Of ``versions`` ((step, version)), strike those saved after ``bound``, the last
        replica check that agreed before a replica_divergence: their replicas may already
        differ (a resume loads one of them), so no recovery loads them. Called with the
        versions known at the decision, those the store's verification lists, and a commit
        of the failed ranks reported during the recovery."""
        diverged = [v for s, v in versions if s > bound and v not in job.unusable]
        job.unusable.update(diverged)
        if diverged:
            self._record(
                job, ORCH, "checkpoint",
                f"checkpoint{'s' if len(diverged) > 1 else ''} {', '.join(diverged)} saved after the last replica "
                f"check that agreed (step {bound}); never loaded",
            )  # fmt: skip

    def _on_resumed_fault(self, job: _Job, incident: _Incident, msg: control_pb2.FaultReport, text: str) -> None:
        """A fault report while a recovery restored from the journal waits to learn whether
        its relaunch reached the node agents. The exit of a rank of the failed generation
        (one the recovery kills) is a consequence (``triage``: never reaches here); anything else (a rank not re-attached in
        time and declared silent, a rank that died, a stall) says the relaunched ranks are
        not all there: the relaunch is commanded again, for the same incident (its restart
        was spent when it was decided)."""
        cause = incident.cause
        self._record(
            job,
            Module.L1_FAULT_DETECTOR,
            "fault",
            f"{text} (during the recovery from rank {cause.rank}'s {cause.fault_class}, resumed after "
            "a control restart)",
        )
        if msg.fault_class == "rank_released":
            return  # an exit control asked for: says nothing of the relaunch
        # Once: later reports are this relaunch's business (decided as usual). The ranks it
        # kills exit as released (no decision); the failed generation's are still counted
        # in ``dying``. Not journaled: killed again before it completes, it is resumed again.
        incident.resumed, incident.repeated_unix = False, time.time()
        job.started, job.exited, job.placement = set(), set(), {}
        self._record(
            job,
            ORCH,
            "decision",
            f"relaunch again for the recovery from {incident.fault_class} of rank {cause.rank} interrupted "
            f"by the control restart: the relaunched ranks are not all there ({msg.fault_class} of rank "
            f"{msg.rank}); no further restart spent",
        )
        self._recover(job, incident)

    def _recover(self, job: _Job, incident: _Incident) -> None:
        """Start the incident's recovery at its first step: ask the checkpoint manager which
        versions are intact. The answer comes back as an event (``on_checkpoint_verification``
        or ``on_snapshot_failed``); nothing here waits for it. Without a checkpoint port
        (tests), the versions reported by SaveCompleted are trusted."""
        self._cancel_timer(incident)
        self._apply(job, incident, rm.asked(rm.waits_of(incident), time.monotonic()), [])
        if self._checkpoints is None or incident.action in IN_PLACE_ACTIONS:  # (a rebuild loads no version)
            self._place(job, incident)
            return
        self._ask_verification(job, incident)

    def _ask_verification(self, job: _Job, incident: _Incident) -> None:
        job_id = job.status.job_id
        try:
            reply = self._checkpoints(store_pb2.VerifyCheckpoints(job_id=job_id)).message
        except Exception as e:  # noqa: BLE001 - a relay that cannot even send: the store is unreachable
            _log.warning("verification not sent", job_id=job_id, error=str(e))
            reply = store_pb2.SnapshotFailed(
                job_id=job_id,
                operation="verify",
                cause=StoreFailureCause.UNREACHABLE,
                reason=f"not sent: {type(e).__name__}",
            )
        # A relay that answers in the call (in-process tests) answers here; the gRPC relay
        # answers later, on the applier thread, with the same events. (An answer delivered as
        # an event during the call has moved the recovery on already: not applied twice.)
        if job.incident is not incident or incident.phase not in (VERIFYING, WAITING_STORE):
            return
        if isinstance(reply, store_pb2.CheckpointVerification):
            self._verified(job, incident, reply)
        elif isinstance(reply, store_pb2.SnapshotFailed):
            self._verification_failed(job, incident, reply)

    def on_checkpoint_verification(self, msg: store_pb2.CheckpointVerification, payload: Any = None) -> None:
        """The checkpoint manager's verdicts on a job's versions: the answer to the recovery's
        verification step (a late or repeated answer changes nothing but the record)."""
        if self._resume_answered(msg):
            return
        with self._lock:
            job = self._jobs.get(msg.job_id)
            incident = job.incident if job is not None else None
            if incident is None or incident.phase not in (VERIFYING, WAITING_STORE):
                return
            self._verified(job, incident, msg)

    def _verified(self, job: _Job, incident: _Incident, msg: store_pb2.CheckpointVerification) -> None:
        """Learn the verdicts (a version is struck only for its bytes: a digest mismatch or a
        missing file), then go on to placement."""
        known = {v for _, v in job.versions} | job.abandoned  # (another branch is not a lost report)
        for verdict in msg.versions:
            version, step = verdict.info.version, verdict.info.step
            if version in job.abandoned:
                continue
            if not verdict.ok:
                if _corrupt(verdict) and version not in job.unusable:
                    job.unusable.add(version)
                    self._record(
                        job,
                        Module.L5_CHECKPOINT_MANAGER,
                        "checkpoint",
                        f"checkpoint {version} at step {step} fails verification ({verdict.reason}); never loaded",
                    )
            elif version not in known:
                job.versions.append((step, version))
                self._record(
                    job,
                    Module.L5_CHECKPOINT_MANAGER,
                    "checkpoint",
                    f"checkpoint {version} at step {step} verified: committed by the store, "
                    "its completion report never arrived",
                )
        job.versions.sort()
        if incident.fault_class == fd.REPLICA_DIVERGENCE and incident.bound is not None:
            # (a commit of the failed ranks whose report never arrived, or came after the decision)
            listed = [(v.info.step, v.info.version) for v in msg.versions if v.info.version not in job.abandoned]
            self._never_load_diverged(job, incident.bound, listed)
        self._apply(job, incident, *rm.answered(rm.waits_of(incident), time.monotonic()))
        self._place(job, incident)

    def _verification_failed(self, job: _Job, incident: _Incident, msg: store_pb2.SnapshotFailed) -> None:
        """The store could not be asked. Nothing is struck: the job waits FAULT_FROZEN and
        the verification is asked again with backoff, up to the policy's
        ``store_wait_seconds``; then the policy decides (``store_unreachable``)."""
        if msg.cause not in (StoreFailureCause.UNREACHABLE, StoreFailureCause.TIMEOUT):
            # The store answered but refused (e.g. it knows no version of the job): the
            # versions reported by SaveCompleted are all there is to choose from.
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "recovery",
                f"checkpoint verification refused ({msg.reason}); choosing among the versions reported",
            )
            self._place(job, incident)
            return
        cause = StoreFailureCause.Name(msg.cause).lower()
        self._wait(
            job,
            incident,
            WAITING_STORE,
            STORE_UNREACHABLE,
            fd.wait_seconds(job.spec.fault_policy, STORE_UNREACHABLE),
            f"waiting for the store ({cause}: {msg.reason}) to verify the checkpoints",
        )

    def _place(self, job: _Job, incident: _Incident) -> None:
        """Name the version (the newest usable one, within the rollback bound) and command
        the recovery controller to relaunch the ranks to load it. When the job has no usable
        committed version the fault policy decides (``no_checkpoint``): from scratch, or stop."""
        self._cancel_timer(incident)
        in_place = incident.action in IN_PLACE_ACTIONS
        version = "" if in_place else self._pick_version(job, incident.bound)
        if not in_place and not version:
            cause = incident.cause
            decision = fd.no_checkpoint(job.spec.fault_policy, incident.fault_class, cause.rank, len(job.versions))
            self._metrics.decided(decision.fault_class, decision.counted)
            # (from scratch is the relaunch's source, a step of the incident's one decision;
            # a stop ends the incident instead, as a decision of its own)
            self._record(job, ORCH, "decision" if decision.action == "stop" else "recovery", decision.text)
            if decision.action == "stop":
                self._terminate(job, decision.outcome, decision.final, kill=True)
                return
        if incident.reload and not version:  # (from scratch: the relaunch path)
            incident.reload = False
            self._record(job, ORCH, "recovery", "no version to load in place: every rank is relaunched")
        if incident.reload:
            self._reload_live(job, incident, version)
            return
        incident.version = version
        incident.phase = PLACING
        source = f"checkpoint {version}" if version else "scratch"
        if in_place:
            source = "a live peer's memory"
        reply = self._recovery(
            control_pb2.StartRecovery(
                job_id=job.status.job_id,
                checkpoint_version=version,
                exclude_worker_ids=incident.exclude,
                reason=f"{incident.action} after {incident.fault_class} of rank {incident.cause.rank}",
                in_place=in_place,
                lost_ranks=incident.lost,
                layout=_layout_msg(incident.shrunk) if incident.shrunk is not None else None,
            )
        ).message
        if isinstance(reply, control_pb2.RecoveryCompleted):
            old_world = job.status.world_size
            if incident.shrunk is not None and incident.shrunk.world_size != old_world:
                job.grow_to = job.grow_to or _layout_of(job.spec)  # (a second shrink grows back to the first's)
                self._take_layout(job, incident.shrunk)
            incident.relaunched = True  # (journaled with the event, as its phase)
            self._apply(job, incident, *rm.placed(rm.waits_of(incident), time.monotonic()))
            self._record_relaunch(job, reply, source, old_world=old_world, lost=incident.lost)
            self._start_soon()  # (the queue was held for it)
            limit = fd.wait_seconds(job.spec.fault_policy, RECOVERY_TIMEOUT, in_place=in_place)
            self._arm(incident, limit, self._restore_overdue, job.status.job_id)
            return
        assert isinstance(reply, control_pb2.RecoveryFailed), reply
        # (Shrunk only when ranks to launch did not fit: not when the placement is unknown.)
        if incident.action == "shrink" and incident.shrunk is None and reply.requested_ranks > reply.available_ranks:
            smaller = _shrink_to(job, incident, reply.available_ranks)
            if smaller is not None:
                incident.shrunk = smaller
                self._record(
                    job,
                    ORCH,
                    "decision",
                    f"shrink after {incident.fault_class} of rank {incident.cause.rank}: {reply.reason}; the job goes "
                    f"on at {_layout_change(job.spec, smaller)}, and grows back to dp {job.spec.parallel.dp} "
                    "when slots return",
                )
                self._place(job, incident)
                return
        if in_place:
            # The survivors cannot be kept (no slot for a replacement, the placement unknown
            # after a control restart): every rank is relaunched from the newest checkpoint.
            self._record(
                job,
                ORCH,
                "decision",
                f"restart_ranks instead of rebuild after {incident.fault_class} of rank {incident.cause.rank}: "
                f"{reply.reason}; every rank relaunched from the newest checkpoint",
            )
            incident.action, incident.lost, incident.shrunk = "restart_ranks", [], None
            incident.dying.update(
                r for r in range(job.status.world_size) if r not in job.exited and not incident.dying[r]
            )
            self._recover(job, incident)
            return
        if reply.cause == RecoveryFailureCause.RECOVERY_NO_PLACEMENT:
            needs = f"needs {reply.requested_ranks or job.status.world_size} ranks, {reply.available_ranks} free"
            self._wait(
                job,
                incident,
                WAITING_CAPACITY,
                NO_CAPACITY,
                fd.wait_seconds(job.spec.fault_policy, NO_CAPACITY),
                f"waiting for capacity to resume from {source}: {needs} ({reply.reason})",
            )
            return
        self._terminate(job, JobOutcome.FAILED, f"recovery failed: {reply.reason}", kill=True)

    def _reload_live(self, job: _Job, incident: _Incident, version: str) -> None:
        """Under the lock: a rollback done in place (``incident.reload``): every rank waits in
        its loop; each loads ``version`` into its live process (ResumeTraining.reload_version)
        and reports ready at its step, within ``restore_seconds`` (else ``recovery_timeout``,
        decided as any fault: a relaunch)."""
        incident.version, incident.phase, incident.relaunched = version, RESTORING, True
        job.started = set()
        self._record(
            job, ORCH, "recovery",
            f"loading checkpoint {version} into the {job.status.world_size} live ranks (none relaunched)",
        )  # fmt: skip
        self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id, reload_version=version))
        limit = fd.wait_seconds(job.spec.fault_policy, RECOVERY_TIMEOUT)
        self._arm(incident, limit, self._restore_overdue, job.status.job_id)

    def _pause_after_fault(self, job: _Job, message: str) -> None:
        """The policy paused the job on a fault (out of memory again with the same
        configuration, fault_decision.MEMORY_CLASSES; a data service down past
        data_outage_seconds, PAUSE_CLASSES): its ranks are killed and their slots
        freed, it is PAUSED and parked (ranks gone, every checkpoint kept) until an operator
        resumes it, which relaunches it from its newest checkpoint (with the budgets anew)."""
        self._cancel_timer(job.incident)
        self._end_data_wait(job)
        end(job)  # (its ranks are killed: a recovery, a resize or a rollback in flight ends here)
        job.recovered = None
        job.pending, job.departure = "", ""
        job.parked, job.parked_live, job.resume_after_pause = True, False, False
        if job.status.state == JobState.PAUSED:  # (paused by the operator, its ranks alive: now gone)
            self._record(job, ORCH, "state", f"PAUSED: {message}", status_message=message)
        else:
            self._transition(job, JobState.PAUSED, ORCH, message)
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=True))
        self._start_soon()

    def _recovered(self, job: _Job, incident: _Incident, start_step: int, *, held: bool) -> None:
        """Every relaunched (or rebuilt) rank of ``incident`` is ready at ``start_step``: the
        recovery is over. ``held``: the job was paused when the fault came; it stays PAUSED
        (its ranks wait for an operator resume), else it runs again."""
        # Recovered. The failed generation's last events came before these ranks' own on
        # every worker that runs one, so the incident is over here.
        self._cancel_timer(incident)
        end(job, incident)
        job.recovered = incident
        incident.recovered_unix = time.time()
        job.last_incident = incident
        job.running_since = job.running_since or time.time()  # (a fault while warming up)
        self._faults(control_pb2.ResetFaultLedger(job_id=job.status.job_id))
        source = f"checkpoint {incident.version}" if incident.version else "scratch"
        read = restored_from_text(incident.restored_from) if incident.version else ""
        source += f", {read}," if read else ""
        restored = f"all {job.status.world_size} ranks restored from {source}"
        if incident.action in IN_PLACE_ACTIONS:
            restored = _healed_text(incident, job.status.world_size)
        elif incident.reload:
            restored = (
                f"all {job.status.world_size} ranks loaded checkpoint {incident.version} in place (none relaunched)"
            )
        if held:
            job.recovered, job.start_held = None, True
            self._transition(
                job,
                JobState.PAUSED,
                ORCH,
                f"recovered from {incident.fault_class} of rank {incident.cause.rank}: {restored} "
                f"at step {start_step}; paused, as before the fault "
                "(resume continues it)",
            )
            return
        self._transition(
            job,
            JobState.RUNNING,
            ORCH,
            f"recovered from {incident.fault_class} of rank {incident.cause.rank}: {restored} "
            f"at step {start_step} "
            f"{time.monotonic() - incident.decided:.1f} s after the decision; training resumed",
        )

    def _restore_overdue(self, job_id: str, incident: _Incident) -> None:
        """The relaunched ranks did not all report ready within ``restore_seconds`` (a rebuild
        in place: ``rebuild_seconds``, survivors included): a fault of the recovery itself
        (``recovery_timeout``), decided by the policy like any other."""
        with self._lock:
            job = self._current(job_id, incident, RESTORING)
            if job is None:
                return
            missing = sorted(set(range(job.status.world_size)) - job.started)
            report = control_pb2.FaultReport(
                job_id=job_id,
                grade=FaultGrade.SEVERE,
                fault_class=RECOVERY_TIMEOUT,
                source=Module.L1_RECOVERY_CONTROLLER,
                # A rebuild's is named after the rank it replaces (the survivors not ready are
                # in the detail: naming one would blame a healthy peer); a relaunch's after its first missing rank.
                rank=incident.cause.rank if incident.action in IN_PLACE_ACTIONS else missing[0] if missing else 0,
                detected_unix=time.time(),
                occurred_unix=time.time(),
                detail=_overdue(job, incident, missing),
            )
            self._record(job, Module.L1_RECOVERY_CONTROLLER, "fault", f"SEVERE {RECOVERY_TIMEOUT}: {report.detail}")
            self._decide(job, report)

    def _record_relaunch(
        self, job: _Job, reply: control_pb2.RecoveryCompleted, source: str, *, old_world: int = 0, lost: list[int] = ()
    ) -> None:
        """The recovery controller's relaunch, as an event; ``old_world``: the group's size
        before a resize (the job's new spec is journaled with it), ``lost``: its ranks that
        were lost (the others above the new size are released)."""
        workers = ", ".join(reply.worker_ids)
        if reply.in_place:
            launched = ", ".join(str(r) for r in reply.replaced_ranks)
            resized = old_world and old_world != job.status.world_size
            if not resized:
                what = f"replacement for rank(s) {launched or 'none'} launched on {workers or 'no worker'}"
                what += ", the survivors keep their processes"
            else:
                what = f"{old_world} -> {job.status.world_size} ranks: "
                what += f"rank(s) {launched} launched on {workers}" if launched else "no rank launched"
                released = [r for r in range(job.status.world_size, old_world) if r not in lost]
                if released:
                    what += f", rank(s) {', '.join(map(str, released))} released"
                what += "; the other ranks keep their processes"
            self._record(
                job,
                Module.L1_RECOVERY_CONTROLLER,
                "recovery",
                f"rebuild in place commanded (generation {reply.generation}, rendezvous "
                f"{reply.master_addr}:{reply.master_port}): {what}",
                spec_json=spec_to_json(job.spec) if old_world else None,
            )
            return
        self._record(
            job,
            Module.L1_RECOVERY_CONTROLLER,
            "recovery",
            f"ranks killed and relaunched on {workers} (rendezvous {reply.master_addr}:{reply.master_port}) "
            f"to resume from {source}; commanded in {reply.seconds:.2f} s (the ranks report ready as they restore)",
        )

    def _pick_version(self, job: _Job, bound: int | None) -> str:
        """The newest committed version not known unusable (and not after step ``bound``)."""
        for step, version in reversed(job.versions):
            if version not in job.unusable and (bound is None or step <= bound):
                return version
        return ""
