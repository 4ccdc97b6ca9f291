"""Operator resume from a checkpoint: a STOPPED, FAILED or parked job's ranks relaunched (a new
generation) from the newest version the store verifies, or the one named."""

from __future__ import annotations

import threading
import time
from collections import Counter

import structlog

from services.contract import control_pb2, engine_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.monitoring import start_monitoring
from services.control.orchestrator import resume_machine as rm
from services.control.orchestrator.activity import end, moved
from services.control.orchestrator.job import (
    ORCH,
    JobOutcome,
    JobState,
    _Incident,
    _Job,
    _Recovered,
    _Resume,
    launched_on,
)
from services.control.orchestrator.job_journal import _load_runtime, _runtime
from services.control.orchestrator.layout import (
    _layout_asked,
    _layout_change,
    _layout_flags,
    _new_layout,
    _set_size,
)
from services.control.orchestrator.refusals import IllegalTransition, InsufficientResources, UnknownVersion
from services.control.orchestrator.texts import (
    _beyond_cluster,
    _degrees,
    _newest,
    _version_number,
    _waits_for,
    cause_of,
)
from services.jobspec import (
    JobSpec,
    spec_from_json,
    spec_to_json,
)

_log = structlog.get_logger("orchestrator")


def _known(job: _Job, candidates: list[rm.Candidate]) -> set[str]:
    """Every version of the job control or the store knows of."""
    return {v for _, v in job.versions} | {c.version for c in candidates}


class _Answer:
    """The store's answer to an operator resume's VerifyCheckpoints, delivered by the
    applier thread to the operator's thread that waits for it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: store_pb2.CheckpointVerification | store_pb2.SnapshotFailed | None = None


# How long an operator resume waits for the store's verdicts (seconds).
RESUME_VERIFY_WAIT_S = 30.0


class OperatorResume:
    """Operator resume from a checkpoint (a part of ``Orchestrator``, see core.py)."""

    # ------------------------------------------------------------ operator resume from a checkpoint

    def _relaunchable(self, job: _Job) -> bool:
        """Whether an operator resume relaunches ``job`` from a checkpoint: STOPPED or FAILED,
        or PAUSED with its ranks gone (parked, and not by a drain whose stack still runs)."""
        s = job.status
        ended = s.state == JobState.TERMINATED and s.outcome in (JobOutcome.STOPPED, JobOutcome.FAILED)
        return ended or (s.state == JobState.PAUSED and job.parked and not job.parked_live)

    def _ask_versions(self, job_id: str) -> list[store_pb2.CheckpointVerdict] | None:
        """The store's verdict on every committed version of the job (VerifyCheckpoints; the
        answer comes back as an event, on the applier thread, or in the call in-process).
        None without a checkpoint port (the versions reported by SaveCompleted are used).

        Raises:
            IllegalTransition: the store could not be asked, or did not answer in time."""
        if self._checkpoints is None:
            return None
        answer = self._answers[job_id] = _Answer()
        try:
            try:
                reply = self._checkpoints(store_pb2.VerifyCheckpoints(job_id=job_id)).message
            except Exception as e:  # noqa: BLE001 - a relay that cannot even send
                reply = store_pb2.SnapshotFailed(
                    job_id=job_id,
                    operation="verify",
                    cause=store_pb2.UNREACHABLE,
                    reason=f"not sent: {type(e).__name__}: {e}",
                )
            if not isinstance(reply, (store_pb2.CheckpointVerification, store_pb2.SnapshotFailed)):
                if not answer.event.wait(RESUME_VERIFY_WAIT_S):
                    raise IllegalTransition(
                        f"cannot resume {job_id}: the store did not say within "
                        f"{RESUME_VERIFY_WAIT_S:.0f} s which checkpoints verify; try again"
                    )
                reply = answer.reply
        finally:
            self._answers.pop(job_id, None)
        if isinstance(reply, store_pb2.SnapshotFailed):
            cause = store_pb2.StoreFailureCause.Name(reply.cause).lower() if reply.cause else "failed"
            raise IllegalTransition(
                f"cannot resume {job_id}: the store could not verify its checkpoints "
                f"({cause}: {reply.reason}); try again"
            )
        return list(reply.versions)

    def _resume_answered(self, msg: store_pb2.CheckpointVerification | store_pb2.SnapshotFailed) -> bool:
        """Hand the store's answer to an operator resume waiting for it (True), if any."""
        answer = self._answers.get(msg.job_id)
        if answer is None or answer.event.is_set():
            return False
        if isinstance(msg, store_pb2.SnapshotFailed) and msg.operation != "verify":
            return False
        answer.reply = msg
        answer.event.set()
        return True

    def _relaunch(
        self, job: _Job, from_version: str, verdicts: list | None, spec: JobSpec | None = None
    ) -> control_pb2.JobStatus:
        """Under the lock: pick the version, allocate the job's ranks again to load it, and
        start the new generation (WARMING_UP). ``spec``: the job's spec at a new
        data-parallel layout (validated by ``_new_layout``), None: its own. Where its ranks do
        not fit now, or queued jobs come first, it waits in the queue as a submitted job does
        (STANDBY, its status saying what it waits for; ``_queue_resume``). Nothing changes
        when it is refused."""
        job_id = job.status.job_id
        if not self._relaunchable(job):
            raise IllegalTransition(
                f"job {job_id} changed while its checkpoints were verified "
                f"(now {JobState.Name(job.status.state)}); not resumed"
            )
        candidates = self._candidates(job, verdicts)
        # A drained job comes first (`surgectl up` resumes it); any other waits behind the
        # queued jobs of its priority or higher, as a submit does.
        held = "" if job.status.drained else self._resume_held(job)
        resume = job.activity if isinstance(job.activity, _Resume) else _Resume()
        resume, effects = rm.answered(before := resume, job_id, candidates, from_version, job.abandoned, held)
        moved(job, before, resume)  # (the slot holds the machine's state; a refusal leaves it as it was)
        while effects:  # (the machine's effects, in order; a placement's answer is its next event)
            effect, *effects = effects
            if isinstance(effect, rm.Refuse):
                if effect.unknown:
                    raise UnknownVersion(effect.text)
                raise (InsufficientResources if effect.resources else IllegalTransition)(effect.text)
            if isinstance(effect, rm.Queue):
                self._queue_resume(job, effect.step, effect.version, spec, effect.why, effect.beyond)
            elif isinstance(effect, rm.Place):
                reply = self._place_resume(job, effect.step, effect.version, spec, candidates)
                resume, more = rm.allocated(
                    before := resume,
                    job_id,
                    fits=reply is None,
                    nowhere=reply.reason if reply is not None and reply.rank_memory_bytes else "",
                    why=_waits_for(job, reply, spec) if reply is not None else "",
                    beyond=reply is not None and _beyond_cluster(reply),
                )
                moved(job, before, resume)
                effects = [*more, *effects]
        return self._snapshot(job)

    def _resume_held(self, job: _Job) -> str:
        """Why an operator resume of ``job`` waits in the queue before it is even tried ("":
        it is tried now)."""
        if self._queue.blocks(job.status.priority):
            return "waits for the jobs queued ahead of it"
        quota = self._quota_admission(job)  # (its team's quota, issue 30: a resume is a start)
        if not quota.ok:
            return quota.reason
        return self._queue_held(but=job)

    @staticmethod
    def _candidates(job: _Job, verdicts: list | None) -> list[rm.Candidate]:
        """The versions an operator resume may load: the store's verdicts, or (none asked)
        those SaveCompleted reported; a version a corrupt report struck never verifies."""
        if verdicts is None:
            return [rm.Candidate(step, v, v not in job.unusable) for step, v in job.versions]
        return [
            rm.Candidate(d.info.step, d.info.version, d.ok and d.info.version not in job.unusable, d.reason)
            for d in verdicts
        ]

    def _queue_resume(
        self,
        job: _Job,
        step: int,
        version: str,
        spec: JobSpec | None,
        why: str,
        beyond: bool = False,
        by: str = "by the operator",
        keep_budgets: bool = False,
        start: bool = True,
    ) -> None:
        """Under the lock: an operator resume that cannot be placed now waits in the queue
        (STANDBY), at the job's priority (a drained job first), to relaunch from ``version``
        once its ranks fit (``_start_queued``). Journaled: a restarted control keeps it.
        ``start``: the queue's head is tried now (False: the caller asks, after the release
        of the job's ranks that it decides next)."""
        job_id = job.status.job_id
        was = JobState.Name(job.status.state) + (
            f" ({JobOutcome.Name(job.status.outcome)})" if job.status.outcome else ""
        )
        # (preempted, drained, moved: its place is its submission's; an ended job resumed by
        # the operator is new work, queued as submitted now)
        submitted = time.time() if job.status.state == JobState.TERMINATED else job.status.created_unix
        entry = self._queue.add(job_id, job.status.priority, first=job.status.drained, submitted=submitted)
        self._queue.mark_beyond_cluster(job_id, beyond)
        # It entered the queue again: this wait counts from now, and it holds no slot, borrowed
        # or not, until placed. Its earlier waits (``waited_seconds``) still count towards the
        # starvation bound (preempted, drained, moved off a departing node: it did not ask to
        # leave); an ended job resumed by the operator is new work: they start again.
        job.status.queued_unix, job.status.borrowed_slots = time.time(), 0
        if job.status.state == JobState.TERMINATED:
            job.status.waited_seconds = 0.0
        try:
            job.relaunch = {"version": version, "step": step, "spec": spec_to_json(spec) if spec is not None else ""}
            if keep_budgets:  # (a departure's move, placed later: said and done as decided now)
                job.relaunch.update(by=by, keep_budgets=True)
            job.parked = job.parked_live = job.draining = job.resume_after_pause = False
            job.status.outcome = JobOutcome.OUTCOME_UNSPECIFIED
            job.queued = entry
            _set_size(job.status, spec or job.spec)  # (before its records: journaled with them)
            where = f"position {self._queue.position(job_id)} of {len(self._queue)}, priority {entry.priority}"
            self._record(
                job,
                ORCH,
                "decision",
                f"resume {was} from checkpoint {version} (step {step}) {by}: queued at {where}: {why}",
            )
            job.status.cannot_run = cause_of(why)  # (counted: `surgectl queue`, surge_queue_cannot_run)
            self._reopen(job, f"queued: {why}", JobState.STANDBY)
        except BaseException:
            self._queue.take(job_id)
            job.queued = job.relaunch = None
            _set_size(job.status, job.spec)  # (the size it ran at again)
            raise
        if start:
            self._start_soon()  # (a drained job first: what it held back may be tried behind it)

    def _start_relaunch(self, job: _Job) -> tuple[list[rm.ResumeEffect], control_pb2.ResourcesInsufficient | None]:
        """Under the lock, ``_start_queued``: place a queued operator resume (``job.relaunch``),
        the allocator's answer an event of the resume's machine (``resume_machine.allocated``)
        as for an operator resume placed at once. Its effects for the queue: none (placed), a
        ``Queue`` (not yet: nothing changed, ``why`` it still waits) or a ``Refuse`` (its
        ranks fit no registered slot); and the allocator's refusal (None: placed), which a
        preemption for it measures (preemption.py)."""
        r = job.relaunch
        by, keep = str(r.get("by", "by the operator")), bool(r.get("keep_budgets", False))
        spec = self._relaunch_spec(job)
        queued = _Resume(phase=rm.QUEUED, step=int(r["step"]), version=str(r["version"]))
        reply = self._place_resume(job, queued.step, queued.version, spec, [], by, keep)
        _, effects = rm.allocated(
            queued,
            job.status.job_id,
            fits=reply is None,
            nowhere=reply.reason if reply is not None and reply.rank_memory_bytes else "",
            why=_waits_for(job, reply, spec) if reply is not None else "",
            beyond=reply is not None and _beyond_cluster(reply),
        )
        return effects, reply

    def _asked_again_while_queued(self, job: _Job, msg: control_pb2.ResumeJobRequest) -> control_pb2.JobStatus:
        """Under the lock: a resume of a job already queued. Asked again as queued, it waits
        where it is; a new layout (``--dp``, ``--micro-batch-size``, ``--grad-accum``; the
        job's own: back to it) is applied to the queued resume, journaled with a decision,
        and the queue tried again (the new size may fit now; was: exit 0, the layout
        ignored). Another ``--from`` than the queued one (a version the job does not have: as
        unknown), or a layout for a queued submit that never ran, is refused in one line saying
        what to do.

        Raises:
            JobSpecError (the layout breaks the global batch or a rule of the spec);
            IllegalTransition (nothing changed)."""
        job_id, r = job.status.job_id, job.relaunch
        if r is None:  # (a submitted job waiting for its first start: it has no checkpoint to reshard)
            if _layout_asked(msg) or msg.from_version:
                flags = _layout_flags(msg) or f"--from {msg.from_version}"
                raise IllegalTransition(
                    f"{flags}: job {job_id} is queued to start, not to resume; cancel it first: "
                    f"`surgectl cancel {job_id}`, then submit it again with --set"
                )
            return self._snapshot(job)
        if msg.from_version and msg.from_version != r["version"]:
            known = [v for _, v in job.versions]
            if msg.from_version not in known:  # (bad input, exit 2: was the advice to cancel, losing its place first)
                raise UnknownVersion(
                    f"--from {msg.from_version}: not a committed checkpoint of {job_id} "
                    f"(its versions: {', '.join(known) or 'none'}); its resume from {r['version']} stays queued"
                )
            raise IllegalTransition(
                f"--from {msg.from_version}: job {job_id}'s resume from {r['version']} is queued; cancel the "
                f"queued resume first: `surgectl cancel {job_id}`, then `surgectl resume {job_id} "
                f"--from {msg.from_version}`"
            )
        if not _layout_asked(msg):
            return self._snapshot(job)
        new = _new_layout(job.spec, msg)  # (refused: nothing changed)
        queued = self._relaunch_spec(job) or job.spec
        target = new or job.spec
        if spec_to_json(target) == spec_to_json(queued):
            return self._snapshot(job)
        r["spec"] = spec_to_json(new) if new is not None else ""
        _set_size(job.status, target)
        self._queue.mark_beyond_cluster(job_id, False)  # (the new world size is measured afresh)
        self._record(
            job,
            ORCH,
            "decision",
            f"the queued resume from {r['version']} (step {r['step']}) takes the layout asked by the operator "
            f"({_layout_flags(msg)}): {_layout_change(queued, target)}",
            # (the reply's reason: the old one was the old layout's; the queue's pass says the
            # new one, or starts it)
            status_message=f"queued: resume from {r['version']} at the layout asked ({target.world_size} "
            f"rank{'' if target.world_size == 1 else 's'}, {_degrees(target)}); the queue is tried again",
        )
        self._start_soon()  # (it may fit now)
        return self._snapshot(job)

    def _relaunch_spec(self, job: _Job) -> JobSpec | None:
        """The new layout a queued operator resume starts at (None: the job's own, or none queued)."""
        return spec_from_json(job.relaunch["spec"]) if job.relaunch and job.relaunch.get("spec") else None

    def _place_resume(
        self,
        job: _Job,
        step: int,
        version: str,
        spec: JobSpec | None,
        candidates: list[tuple],
        by: str = "by the operator",
        keep_budgets: bool = False,
    ) -> control_pb2.ResourcesInsufficient | None:
        """Under the lock: allocate the job's ranks to load ``version`` (``step``) and start the
        new generation (WARMING_UP). Returns the allocator's refusal when they do not fit
        (nothing reserved, nothing changed); a failure after the allocation takes the ranks
        back and puts the job back as it was, then raises. ``by``: who decided it, for the
        event; ``keep_budgets``: a move off a departing node (departure.py), not the operator's
        fresh start: the restart budgets spent stay spent."""
        job_id = job.status.job_id
        new = spec or job.spec
        spec_json = spec_to_json(new)
        init = engine_pb2.InitJob(
            job_id=job_id,
            spec_json=spec_json,
            resume_version=version,
            data_address=self._data_address,
            store_address=self._store_address,
            **fd.launch_policy(new.fault_policy),
        )
        reply = self._allocator(
            control_pb2.AllocateResources(
                job_id=job_id, world_size=new.world_size, backend=new.parallel.backend, init=init
            )
        ).message
        if isinstance(reply, control_pb2.ResourcesInsufficient):
            return reply
        assert isinstance(reply, control_pb2.ResourcesReady), reply
        before, before_runtime, before_spec = control_pb2.JobStatus(), _runtime(job), job.spec
        before.CopyFrom(job.status)
        was = JobState.Name(job.status.state) + (
            f" ({JobOutcome.Name(job.status.outcome)})" if job.status.outcome else ""
        )
        try:
            # A new generation: nothing of the old one's ranks, pause, stop or recovery is kept;
            # the restart budgets start again (the operator decided to go on). Except which
            # old ranks finished: the clean exit of one reported after this is no fault
            # (each entry goes when the rank's new process reports ready).
            job.started, job.paused, job.exited, job.placement = set(), set(), set(), {}
            job.launched = launched_on(reply, job)  # (journaled with the decision below)
            job.pending, job.pending_at = "", 0
            end(job, _Incident)  # (this resume's own activity ends when its answer is given)
            end(job, _Recovered)
            if not keep_budgets:
                job.restarts, job.ignored, job.excluded = Counter(), Counter(), set()
            job.verdicts, job.revoked = {}, {}
            job.parked = job.parked_live = job.draining = job.resume_after_pause = False
            job.relaunch, job.departure, job.placed_on = None, "", list(reply.worker_ids)
            # Going back to an older version starts a new branch: what was committed after it
            # is never a recovery's choice (the fresh-user trial saw a fault right after
            # `resume --from J:17` relaunch from J:20, the branch the operator left).
            job.abandoned = (
                job.abandoned | {v for v in _known(job, candidates) if _version_number(v) > _version_number(version)}
            ) - {version}
            job.versions = [(st, v) for st, v in job.versions if v not in job.abandoned]
            s = job.status
            s.outcome, s.drained, s.step, s.checkpoint_version = JobOutcome.OUTCOME_UNSPECIFIED, False, step, version
            s.preempted_by = ""  # (PREEMPTED no more: its ranks launch again)
            layout = "" if spec is None else f" at a new layout: {_layout_change(job.spec, spec)}"
            job.spec = new
            _set_size(s, new)
            s.placed_by_kind.CopyFrom(reply.placed)  # (where an ``any`` job landed this time: teams.py)
            s.borrowed_slots = self._borrowed_of(job)  # (teams.py: beyond its team's nominal now)
            self._faults(start_monitoring(job_id, job.spec))
            self._faults(control_pb2.ResetFaultLedger(job_id=job_id))
            self._record(
                job,
                ORCH,
                "decision",
                f"resume {was} from checkpoint {version} (step {step}) {by}{layout}: "
                f"{reply.world_size} ranks allocated on {', '.join(reply.worker_ids)}"
                + (f" ({s.borrowed_slots} on capacity its team borrowed)" if s.borrowed_slots else "")
                + f"; rendezvous {reply.master_addr}:{reply.master_port}; "
                + ("restart budgets kept" if keep_budgets else "restart budgets reset"),
                spec_json=spec_json if spec is not None else None,  # (the new spec, with the decision)
            )
            self._lose_profiles(job, "ranks relaunched (resume)")  # (a paused job's: its ranks exited)
            self._reopen(job, f"ranks launching to resume from checkpoint {version} at step {step}")
        except BaseException:
            self._put_back(job, before, before_runtime, before_spec, journal=job.spec is not before_spec)
            raise
        # Undo if these records fail at their commit: the relaunched ranks are killed and the
        # job put back as it was before the resume (a queued resume queued again), in memory
        # and in the journal, which may hold part of the decision (the operator is told).
        self._undo_if_lost(
            job_id, lambda e: self._put_back(job, before, before_runtime, before_spec, journal=True, requeue=True)
        )
        self._start_soon()  # (the queue was held while it was drained)
        return None

    def _put_back(
        self,
        job: _Job,
        before: control_pb2.JobStatus,
        runtime: dict,
        spec: JobSpec,
        *,
        journal: bool,
        requeue: bool = False,
    ) -> None:
        """Under the lock: a resume placed and then failed (raised, or its records lost at
        their commit): its ranks killed and released (waiting for no journal write: they run
        whatever it holds), the job's status, bookkeeping and spec as ``before`` the resume;
        ``journal``: written so (the decision, or part of it, may be there); ``requeue``: a
        queued resume (``job.relaunch``) waits in the queue again (at the back of its
        priority: its old place was given up as it left)."""
        job_id = job.status.job_id
        self._last_write.pop(job_id, None)
        self._allocator(control_pb2.ReleaseResources(job_id=job_id, kill=True))
        job.status.CopyFrom(before)
        _load_runtime(job, runtime)
        job.spec = spec
        if requeue and job.relaunch is not None and job.queued is None:
            job.queued = self._queue.add(job_id, job.status.priority, first=job.status.drained)
            runtime = _runtime(job)
        self._changed.add(job_id)
        if not journal:
            return
        try:
            self._queued(job_id, self._journal.save_status(job.status, None, runtime, spec_to_json(spec), wait=False))
        except Exception as e:  # noqa: BLE001 - the failure being raised is the one to report
            _log.error("the job could not be put back in the journal", job_id=job_id, error=str(e))

    def _reopen(self, job: _Job, message: str, new: int = JobState.WARMING_UP) -> None:
        """TERMINATED or PAUSED (ranks gone) -> WARMING_UP (or STANDBY: queued to be placed),
        and a queued resume's STANDBY -> WARMING_UP: the one way out of TERMINATED, taken only
        by an operator resume (``_relaunch``)."""
        old = job.status.state
        assert old in (JobState.TERMINATED, JobState.PAUSED, JobState.STANDBY), JobState.Name(old)
        job.status.state = new
        self._record(
            job, ORCH, "state", f"{JobState.Name(old)} -> {JobState.Name(new)}: {message}", status_message=message
        )
        if new == JobState.STANDBY and old == JobState.PAUSED:
            # Its ranks are released (preempted, moved, a resume that waits): its training
            # series would say it trains while it waits (an ended job's went at its end).
            self._retire_series(job, "queued", queued=True)

    def _restore_parked(self, job: _Job) -> bool:
        """After a control restart: a PAUSED job whose ranks were stopped with the stack
        (drained or parked by `surgectl down`) has nothing to re-attach; it waits for a
        resume (`surgectl up` sends one for a drained job). True when ``job`` is one."""
        if job.status.state != JobState.PAUSED or not job.parked:
            return False
        job.draining = False
        if job.status.message.startswith(fd.PAUSED_BY_POLICY):  # (its fault policy's pause: the hint stays)
            text = job.status.message
            self._record(job, ORCH, "state", f"PAUSED (control restarted): {text}", status_message=text)
            return True
        if job.status.drained:
            text = (
                f"drained by `surgectl down` at step {job.status.step}; `surgectl up` (or `surgectl resume "
                f"{job.status.job_id}`) continues it from {_newest(job)}"
            )
        else:
            text = (
                f"paused; its ranks stopped with the stack: `surgectl resume {job.status.job_id}` relaunches "
                f"them from {_newest(job)}"
            )
        self._record(job, ORCH, "state", f"PAUSED: {text}", status_message=text)
        return True
