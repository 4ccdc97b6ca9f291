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
from services.control.orchestrator import verification_machine as vm
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
    JobOutcome,
    JobState,
    RecoveryFailureCause,
    StoreFailureCause,
    _Incident,
    _Job,
    _Recovered,
    _Reload,
    _Scale,
    launched_on,
    withdrawn,
)
from services.control.orchestrator.layout import _layout_change, _layout_msg, _layout_of, _shrink_to
from services.control.orchestrator.texts import _overdue
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


def _pausing(job: _Job, msg: control_pb2.FaultReport) -> str:
    """Whether ``msg``'s step is where the job stops training (``fd.JobView.pausing``): the
    boundary of its pause or drain in flight, or the step it is paused at."""
    if job.pending == "pause" and msg.step and msg.step == job.pending_at:
        return "drain" if job.draining else "pause"
    if job.status.state == JobState.PAUSED and msg.step and msg.step == job.status.step:
        return "paused"
    return ""


def _operator_paused(job: _Job) -> bool:
    """Whether the job is paused or pausing at the operator's word: a recovery keeps that pause
    (``Incident.paused``). A drain's own pause is not kept: the recovery ends the drain (its ranks
    are new, the `down` that asked it says "not drained"), so the recovered job runs."""
    pausing = job.status.state == JobState.PAUSED or job.pending == "pause"
    return pausing and not ((job.draining or job.status.drained) and job.drain_own_pause)


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
            restarts=job.restarts, ignored=job.ignored, stop_requested=job.pending == "stop", pausing=_pausing(job, msg),
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
            if fault_class == fd.REPLICA_DIVERGENCE and msg.step:
                # Its ranks wait in their loop for this decision (it fails none of them): they go
                # on as they are. Once per report (every rank's is decided); a loop not waiting
                # at that step keeps nothing of it.
                self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id, go_on_at_step=msg.step))
        if step_fault is not None and decision.verdict in (engine_pb2.STEP_APPLY, engine_pb2.STEP_SKIP):
            job.verdicts[step_fault.step, step_fault.kind] = _step_verdict(step_fault, decision)
        self._record(job, ORCH, "decision", decision.text)
        facts = rm.Facts(
            previous=previous,
            step=job.status.step,
            world_size=job.status.world_size,
            exited=frozenset(job.exited),
            lost=tuple(_lost_ranks(job, msg)),
            paused=_operator_paused(job),
            unusable=frozenset(job.unusable),
            frozen=job.status.state == JobState.FAULT_FROZEN,
            hold=fd.freeze_for(job.spec.fault_policy, decision, recovering=previous is not None)
            if action not in ("ignore", "skip_step", "skip_save", "stop", "pause")
            else 0.0,
        )
        incident, effects = rm.decided(decision, msg, facts, time.monotonic())
        self._decided_effects(job, incident, effects)
        return decision

    def _decided_effects(self, job: _Job, incident: _Incident | None, effects: list) -> None:
        """Under the lock: perform ``recovery_machine.decided``'s effects, in order."""
        for effect in effects:
            if isinstance(effect, rm.Terminate):
                self._terminate(job, effect.outcome, effect.message, kill=True)
            elif isinstance(effect, rm.PauseJob):
                self._pause_after_fault(job, effect.message)
            elif isinstance(effect, rm.Spend):
                job.restarts[effect.fault_class] += 1
            elif isinstance(effect, rm.Strike):
                job.unusable.add(effect.version)
            elif isinstance(effect, rm.NeverLoadDiverged):
                self._never_load_diverged(job, effect.bound, job.versions)
            elif isinstance(effect, rm.Begin):
                self._begin(job, effect.incident, effect.why)
                # Undo if the decision's records fail at their commit: none can be made (the
                # recovery's commands to L1-4 and L5-1 are sent as it is decided: ranks may be
                # killed already), so it is written again, with an event saying so; else a
                # restarted control would decide the fault afresh (a second restart spent on it).
                self._undo_if_lost(job.status.job_id, lambda e, i=effect.incident: self._decision_rewritten(job, i, e))
            elif isinstance(effect, rm.Freeze):
                self._freeze(job, incident, effect.seconds)
            elif isinstance(effect, rm.Recover):
                self._recover(job, incident)
            else:
                self._apply_effects(job, [effect])

    def _begin(self, job: _Job, incident: _Incident, why: str) -> None:
        """Under the lock: ``incident`` is the job's activity from now on (admit: a recovery
        supersedes whatever was in flight: said for a resize or a rollback, folded into it for
        an earlier recovery); the failing generation's bookkeeping goes."""
        self._cancel_timer(job.incident)
        superseded = begin(job, incident)
        job.exited = set()  # (a recovery awaiting its first step was replaced in the slot)
        self._end_data_wait(job)  # (its ranks are replaced: a new generation says what it waits for)
        self._release_held(job, incident)  # (a save that broke a moment before this fault came)
        job.started, job.paused, job.finished, job.placement = set(), set(), {}, {}  # (a new generation)
        job.launched = {}
        job.verdicts.clear()
        # (job.revoked stays: ranks kept by a rebuild or a reload in place hold the withdrawal;
        # it lapses where every rank is relaunched, ``_withdrawals_lapse``)
        job.pending = ""  # a pause in flight ends here: the incident keeps it (``paused``)
        # A drain ends here too: the recovered job is not `up`'s to resume (its ranks are new).
        job.draining = job.parked = job.parked_live = job.resume_after_pause = job.status.drained = False
        job.drain_unsaved_step = 0
        # (a recovery supersedes a departure's move or a preemption: its relaunch places the ranks)
        job.departure = job.status.preempted_by = ""
        if isinstance(superseded, _Reload):  # (the ranks it loads into are being replaced)
            self._record(
                job, ORCH, "recovery",
                f"rollback in place to {superseded.version} given up: {why}; the relaunch replaces it",
            )  # fmt: skip
        if isinstance(superseded, _Scale):  # (its new layout stays if it was already commanded)
            self._record(job, ORCH, "scale", _scale_superseded(superseded, job, why))
        job.start_held = False
        job.excluded.update(incident.exclude)  # journaled with the decision: a restarted control keeps it

    def _decision_rewritten(self, job: _Job, incident: _Incident, error: BaseException) -> None:
        """Under the lock: the records of ``incident``'s decision failed at their commit;
        the job's state as it is now is journaled again (every record carries the job's whole
        bookkeeping), the incident in it if it is still in flight. The commands to its ranks
        behind the lost records were dropped (a hold's FreezeTraining, a reload's
        ResumeTraining): the hold ends by its timer, a reload that never comes by
        ``restore_seconds`` (``recovery_timeout``, decided as any fault)."""
        if self._jobs.get(job.status.job_id) is not job:
            return
        still = "goes on" if job.incident is incident else "is over"
        self._record(
            job, ORCH, "recovery",
            f"the decision on {incident.fault_class} of rank {incident.cause.rank} was not journaled "
            f"({type(error).__name__}: {error}); written again: its recovery {still}",
        )  # fmt: skip

    def _never_load_diverged(self, job: _Job, bound: int, versions: list[tuple[int, str]]) -> None:
        """Of ``versions`` ((step, version)), strike those saved after ``bound``, the last
        replica check that agreed before a replica_divergence: their replicas may already
        differ (a resume loads one of them), so no recovery loads them. Called with the
        versions known at the decision, those the store's verification lists, and a commit
        of the failed ranks reported during the recovery."""
        diverged = [v for s, v in versions if s > bound and v not in job.unusable]
        job.unusable.update(diverged)
        if job.status.checkpoint_version in diverged:  # status names what a resume would load, never a struck one
            usable = [(s, v) for s, v in job.versions if v not in job.unusable]
            job.status.checkpoint_version = max(usable)[1] if usable else ""
        if diverged:
            self._record(
                job, ORCH, "checkpoint",
                f"checkpoint{'s' if len(diverged) > 1 else ''} {', '.join(diverged)} saved after the last replica "
                f"check that agreed (step {bound}); never loaded",
            )  # fmt: skip

    def _load_outage(self, job: _Job, incident: _Incident, msg: control_pb2.FaultReport, text: str) -> None:
        """A relaunched rank could not load the incident's version: the store did not answer
        (triage.py ``_relaunch_load_outage``). The store's outage, not the recovery's fault: no decision,
        no restart spent. The relaunch is placed again once the store answers: the recovery
        goes back to asking the store (its verification, waited for with backoff up to
        ``fault_policy.store_wait_seconds``, then the policy's ``store_unreachable``), and until
        the new placement whatever the failed relaunch's ranks report is of that incarnation
        (``awaits_relaunch``: its exits and broken collectives are consequences, its late ready
        reports not counted)."""
        self._record(job, Module.L1_FAULT_DETECTOR, "fault", text)
        incident.relaunched = False  # (journaled with the record below, as its phase)
        job.started, job.exited, job.placement, job.launched = set(), set(), {}, {}
        limit = fd.wait_seconds(job.spec.fault_policy, STORE_UNREACHABLE)
        self._record(
            job, ORCH, "recovery",
            f"checkpoint {incident.version or 'load'} not loaded: the store did not answer rank {msg.rank}; "
            f"the recovery waits for it (up to {limit:g} s, fault_policy.store_wait_seconds) and relaunches "
            "the ranks to load it again; no restart spent",
        )  # fmt: skip
        self._recover(job, incident)

    def _on_resumed_fault(self, job: _Job, incident: _Incident, msg: control_pb2.FaultReport, text: str) -> None:
        """A fault report while a recovery restored from the journal waits to learn whether
        its relaunch reached the node agents (verification_machine.py's ``resumed_fault``)."""
        again = False
        for effect in vm.resumed_fault(incident.cause, incident.fault_class, msg.fault_class, msg.rank, text):
            if not isinstance(effect, vm.RelaunchAgain):
                self._apply_effects(job, [effect])
                continue
            # Once: later reports are this relaunch's business (decided as usual). The ranks it
            # kills exit as released (no decision); the failed generation's are still counted
            # in ``dying``. Not journaled: killed again before it completes, it is resumed again.
            incident.resumed, incident.repeated_unix, again = False, time.time(), True
            job.started, job.exited, job.placement, job.launched = set(), set(), {}, {}
        if again:  # (after its decision's record: the relaunch follows it)
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
        """Learn the verdicts (verification_machine.py's ``verified``: a version is struck only
        for its bytes), then go on to placement."""
        effects = vm.verified(msg.versions, job.versions, frozenset(job.abandoned), frozenset(job.unusable))
        self._verification_effects(job, incident, effects)
        job.versions.sort()
        if incident.fault_class == fd.REPLICA_DIVERGENCE and incident.bound is not None:
            # (a commit of the failed ranks whose report never arrived, or came after the decision)
            listed = [(v.info.step, v.info.version) for v in msg.versions if v.info.version not in job.abandoned]
            self._never_load_diverged(job, incident.bound, listed)
        self._apply(job, incident, *rm.answered(rm.waits_of(incident), time.monotonic()))
        self._place(job, incident)

    def _verification_failed(self, job: _Job, incident: _Incident, msg: store_pb2.SnapshotFailed) -> None:
        """The store could not be asked (verification_machine.py's ``verification_failed``):
        nothing is struck; the job waits FAULT_FROZEN and the verification is asked again
        with backoff, up to the policy's ``store_wait_seconds``; then the policy decides
        (``store_unreachable``). A store that answered and refused: placement goes on."""
        self._verification_effects(job, incident, vm.verification_failed(msg.cause, msg.reason))

    def _verification_effects(self, job: _Job, incident: _Incident, effects: list) -> None:
        """Under the lock: perform verification_machine.py's effects, in order."""
        for effect in effects:
            if isinstance(effect, vm.Strike):
                job.unusable.add(effect.version)
            elif isinstance(effect, vm.Learn):
                job.versions.append((effect.step, effect.version))
            elif isinstance(effect, vm.Place):
                self._place(job, incident)
            elif isinstance(effect, vm.WaitStore):
                limit = fd.wait_seconds(job.spec.fault_policy, STORE_UNREACHABLE)
                self._wait(job, incident, WAITING_STORE, STORE_UNREACHABLE, limit, effect.what)
            elif isinstance(effect, vm.ArmRestore):
                limit = fd.wait_seconds(job.spec.fault_policy, RECOVERY_TIMEOUT, in_place=effect.in_place)
                self._arm(incident, limit, self._restore_overdue, job.status.job_id)
            else:
                self._apply_effects(job, [effect])

    def _place(self, job: _Job, incident: _Incident) -> None:
        """Name the version (the newest usable one, within the rollback bound) and command
        the recovery controller to relaunch the ranks to load it. When the job has no usable
        committed version the fault policy decides (``no_checkpoint``): from scratch, or stop."""
        self._cancel_timer(incident)
        in_place = incident.action in IN_PLACE_ACTIONS
        effects = vm.placement(
            action=incident.action,
            fault_class=incident.fault_class,
            rank=incident.cause.rank,
            reload=incident.reload,
            version="" if in_place else self._pick_version(job, incident.bound),
            versions=len(job.versions),
            policy=job.spec.fault_policy,
        )
        for effect in effects[:-1]:
            if isinstance(effect, vm.Counted):
                self._metrics.decided(effect.fault_class, effect.action)
            elif isinstance(effect, vm.NoReload):
                incident.reload = False
            else:
                self._apply_effects(job, [effect])
        last = effects[-1]
        if isinstance(last, vm.Stop):
            self._terminate(job, last.outcome, last.message, kill=True)
            return
        if isinstance(last, vm.ReloadInPlace):
            self._reload_live(job, incident, last.version)
            return
        if not in_place:
            self._withdrawals_lapse(job)
        version, source = last.version, last.source
        incident.version = version
        incident.phase = PLACING
        reply = self._recovery(
            control_pb2.StartRecovery(
                job_id=job.status.job_id,
                checkpoint_version=version,
                exclude_worker_ids=incident.exclude,
                reason=f"{incident.action} after {incident.fault_class} of rank {incident.cause.rank}",
                in_place=in_place,
                lost_ranks=incident.lost,
                layout=_layout_msg(incident.shrunk) if incident.shrunk is not None else None,
                withdrawn_orders=withdrawn(job) if in_place else [],
            )
        ).message
        if isinstance(reply, control_pb2.RecoveryCompleted):
            old_world = job.status.world_size
            for effect in vm.relaunched(incident.shrunk, old_world, in_place, source):
                if isinstance(effect, vm.Shrunk):
                    job.grow_to = job.grow_to or _layout_of(job.spec)  # (a second shrink grows back to the first's)
                    self._take_layout(job, effect.spec)
                elif isinstance(effect, vm.Placed):
                    incident.relaunched = True  # (journaled with the event, as its phase)
                    incident.placed_on = list(reply.worker_ids) if in_place else []
                    self._apply(job, incident, *rm.placed(rm.waits_of(incident), time.monotonic()))
                    self._record_relaunch(job, reply, effect.source, old_world=old_world, lost=incident.lost)
                    self._lose_profiles(job, f"ranks relaunched ({incident.fault_class} of rank {incident.cause.rank})")
                    self._start_soon()  # (the queue was held for it)
                else:
                    self._verification_effects(job, incident, [effect])
            return
        assert isinstance(reply, control_pb2.RecoveryFailed), reply
        refusal = rm.Refusal(
            reply.reason,
            reply.requested_ranks,
            reply.available_ranks,
            reply.cause == RecoveryFailureCause.RECOVERY_NO_PLACEMENT,
        )
        # (Only an unshrunk shrink whose ranks did not fit may shrink: the layout is asked for it alone.)
        could = incident.action == "shrink" and incident.shrunk is None and refusal.requested > refusal.available
        smaller = _shrink_to(job, incident, refusal.available) if could else None
        effects = rm.relaunch_refused(
            incident,
            refusal,
            smaller=smaller,
            smaller_text=_layout_change(job.spec, smaller) if smaller is not None else "",
            dp=job.spec.parallel.dp,
            world_size=job.status.world_size,
            source=source,
        )
        self._refused(job, incident, effects)

    def _withdrawals_lapse(self, job: _Job) -> None:
        """Under the lock, as every rank of the job is relaunched: the orders the operator
        withdrew from the ranks being replaced are the policy's again in the new ones' InitJob
        (said: they would otherwise come back unannounced). A rebuild or a reload in place
        keeps them withdrawn: its ranks keep their processes (and a rank launched beside them
        is launched without them, ``withdrawn``)."""
        if not job.revoked:
            return
        names = ", ".join(fd.order_name(job.spec.fault_policy, o) for o in sorted(job.revoked))
        self._record(
            job, ORCH, "recovery",
            f"standing order {names} withdrawn by the operator: the ranks this recovery launches get the "
            f"fault policy's orders again (`surgectl revoke {job.status.job_id} CLASS` withdraws it again)",
        )  # fmt: skip
        job.revoked.clear()

    def _refused(self, job: _Job, incident: _Incident, effects: list) -> None:
        """Under the lock: perform ``relaunch_refused``'s effects, in order."""
        for effect in effects:
            if isinstance(effect, rm.Shrink):
                incident.shrunk = effect.spec
                self._place(job, incident)
            elif isinstance(effect, rm.RelaunchAll):
                incident.action, incident.lost, incident.shrunk = "restart_ranks", [], None
                incident.dying.update(
                    r for r in range(job.status.world_size) if r not in job.exited and not incident.dying[r]
                )
                self._recover(job, incident)
            elif isinstance(effect, rm.WaitCapacity):
                limit = fd.wait_seconds(job.spec.fault_policy, NO_CAPACITY)
                self._wait(job, incident, WAITING_CAPACITY, NO_CAPACITY, limit, effect.what)
            elif isinstance(effect, rm.Fail):
                self._terminate(job, JobOutcome.FAILED, effect.reason, kill=True)
            else:
                self._apply_effects(job, [effect])

    def _reload_live(self, job: _Job, incident: _Incident, version: str) -> None:
        """Under the lock: a rollback done in place (``incident.reload``): the live ranks load
        ``version`` (verification_machine.py's ``reload_live``)."""
        incident.version, incident.phase, incident.relaunched = version, RESTORING, True
        job.started = set()
        effects = vm.reload_live(job.status.job_id, version, job.status.world_size)
        self._verification_effects(job, incident, effects)

    def _pause_after_fault(self, job: _Job, message: str) -> None:
        """The policy paused the job on a fault (out of memory again with the same
        configuration, fault_decision.MEMORY_CLASSES; a data service down past
        data_outage_seconds, PAUSE_CLASSES): its ranks are killed and their slots
        freed, it is PAUSED and parked (ranks gone, every checkpoint kept) until an operator
        resumes it, which relaunches it from its newest checkpoint (with the budgets anew)."""
        self._cancel_timer(job.incident)
        self._end_data_wait(job)
        end(job)  # (its ranks are killed: a recovery, a resize or a rollback in flight ends here)
        job.pending, job.departure, job.status.preempted_by = "", "", ""
        job.parked, job.parked_live, job.resume_after_pause = True, False, False
        if job.status.state == JobState.PAUSED:  # (paused by the operator, its ranks alive: now gone)
            self._record(job, ORCH, "state", f"PAUSED: {message}", status_message=message)
        else:
            self._transition(job, JobState.PAUSED, ORCH, message)
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=True))
        self._start_soon()

    def _recovered(self, job: _Job, incident: _Incident, start_step: int) -> None:
        """Every relaunched (or rebuilt) rank of ``incident`` is ready at ``start_step``: the
        recovery is over (recovery_machine.py's ``recovered``; its ``Ended`` performed here)."""
        # Recovered. The failed generation's last events came before these ranks' own on
        # every worker that runs one, so the incident is over here.
        seconds = time.monotonic() - incident.decided
        for effect in rm.recovered(incident, job.status.world_size, start_step, seconds=seconds):
            if not isinstance(effect, rm.Ended):
                self._apply_effects(job, [effect])
                continue
            self._cancel_timer(incident)
            end(job, incident)
            incident.recovered_unix = time.time()
            incident.started_at = start_step
            job.last_incident = incident
            job.running_since = job.running_since or time.time()  # (a fault while warming up)
            # Awaiting its first step (in the slot, idle), unless held: its ranks wait for an
            # operator resume.
            if effect.held:
                job.start_held = True
            else:
                begin(job, _Recovered(incident))

    def _restore_overdue(self, job_id: str, incident: _Incident) -> None:
        """The relaunched ranks did not all report ready within ``restore_seconds`` (a rebuild
        in place: ``rebuild_seconds``, survivors included): a fault of the recovery itself
        (``recovery_timeout``), decided by the policy like any other."""
        with self._lock:
            job = self._current(job_id, incident, RESTORING)
            if job is None:
                return
            missing = vm.missing(job.status.world_size, job.started)
            detail = _overdue(job, incident, missing)
            report = vm.overdue_report(job_id, incident.action, incident.cause.rank, missing, detail, time.time())
            self._record(job, Module.L1_RECOVERY_CONTROLLER, "fault", f"SEVERE {RECOVERY_TIMEOUT}: {report.detail}")
            self._decide(job, report)

    def _retire_series(self, job: _Job, reason: str, *, ended: bool = False, queued: bool = False) -> None:
        """Under the lock: the job ended (``ended``), left for the queue with its ranks gone
        (``queued``) or its ranks were replaced: L5-2 retires the job's series (a rank killed
        without its loop's end never says so itself; after a relaunch, a rank that records
        again keeps its own), sent after this decision's journal write. At its end L5-1
        retires the job's checkpoint series too (its own state, so its own command); not at a
        relaunch nor in the queue: the job's checkpoints still matter."""
        if self._metric_series is not None:
            msg = store_pb2.RetireMetricSeries(job_id=job.status.job_id, reason=reason, ended=ended, queued=queued)
            self._metric_series(msg)
        if ended and self._checkpoint_series is not None:
            self._checkpoint_series(store_pb2.RetireCheckpointSeries(job_id=job.status.job_id, reason=reason))

    def _record_relaunch(
        self, job: _Job, reply: control_pb2.RecoveryCompleted, source: str, *, old_world: int = 0, lost: list[int] = ()
    ) -> None:
        """The recovery controller's relaunch, as an event; ``old_world``: the group's size
        before a resize (the job's new spec is journaled with it), ``lost``: its ranks that
        were lost (the others above the new size are released). The replaced generation's
        series are retired (its ranks that go on, and the new ones, keep theirs by recording)."""
        self._retire_series(job, "relaunch")
        # Its ranks placed again, perhaps fewer, perhaps (an ``any`` job) on another kind: where
        # they are (teams.py counts its team there; its borrowed slots are derived as the decision ends).
        if reply.HasField("placed"):
            job.status.placed_by_kind.CopyFrom(reply.placed)
        # Where each rank of the new generation runs, journaled with this record (until every
        # rank reports ready): a control restarted while they warm up names a lost rank's
        # worker (was: "the worker it was launched on is not known", blame34's left item).
        job.launched = launched_on(reply, job)
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
        return vm.pick_version(job.versions, job.unusable, bound)


def _scale_superseded(scale: _Scale, job: _Job, why: str) -> str:
    """What became of a resize a fault's recovery superseded, from the job's layout now (the
    `scale` event `surgectl scale` prints and checks): its rebuild commanded, the layout is
    the job's and the recovery takes the ranks over at it; else the job stays at its size
    (was: "given up" either way, while the recovery relaunched at the new size: a fresh
    operator's trial)."""
    dp = scale.spec.parallel.dp
    if job.spec.parallel.dp == dp:
        return (
            f"{scale.why} to dp {dp}: the job is at dp {dp} (world size {job.status.world_size}): its new layout "
            f"was commanded before the fault, whose recovery takes its ranks over at that layout: {why}"
        )
    return f"{scale.why} to dp {dp} given up: {why}; the job stays at dp {job.spec.parallel.dp}"
