"""Admission and placement: a submitted job starts, or waits STANDBY in the queue until its
ranks fit (services/control/job_queue.py holds the order)."""

from __future__ import annotations

import math
import time
from typing import Any

import structlog

from services.contract import control_pb2, engine_pb2
from services.control import fault_decision as fd
from services.control.job_queue import QueueEntry, check_priority
from services.control.monitoring import start_monitoring
from services.control.orchestrator.job import ORCH, JobOutcome, JobState, _Job, launched_on
from services.control.orchestrator.layout import _set_layout, _set_size
from services.control.orchestrator.refusals import IllegalTransition, JobDoesNotFit
from services.control.orchestrator.request_ids import spec_sha256, submitted_before
from services.control.orchestrator.resume_machine import Queue, Refuse
from services.control.orchestrator.teams import PROMOTED, kind_of, team_of
from services.control.orchestrator.texts import _beyond_cluster, _waits_for, beyond_registered, cause_of, quota_wait
from services.control.scheduler.admission import WAIT_COHORT, Admission, admit
from services.control.scheduler.fair_share import Holds, backfills, blocks, cohort_wait
from services.hf_config import check_spec_directory
from services.jobspec import (
    parse_job_spec,
    spec_to_json,
)

_log = structlog.get_logger("orchestrator")


class JobQueueing:
    """Admission and placement (a part of ``Orchestrator``, see core.py)."""

    # ------------------------------------------------------------ operator commands

    def submit_job_request(self, msg: control_pb2.SubmitJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Validate the spec, journal the job, and start it (allocate its ranks: WARMING_UP),
        or queue it (STANDBY, see "The queue" above): when its ranks do not fit now, when a
        job of its priority or higher waits ahead of it (one that does not just wait for
        workers to join), or while the queue is held.

        Atomic: a start that fails at any point after the allocation (an event that cannot
        be journaled) takes the ranks back (killed, their slots free again) and removes
        whatever was journaled of the job, then raises. The job is journaled (STANDBY)
        before its ranks launch: a control killed in between finds it at its restart
        (FAULT_FROZEN, "ranks not re-attached"; a stop releases what was launched), never
        ranks of a job it does not know holding slots.

        Admission by memory: a job whose estimated memory per rank fits too few of the
        registered workers' slots (L1-2's refusal says so) is refused here, or, tried from
        the queue, ends FAILED saying why; where no worker is registered yet it is queued.

        Idempotent by ``request_id`` (request_ids.py): a request id a journaled job was
        created with is answered with that job's status now, whatever its state; nothing
        else happens. Checked before the spec is read (a retry is answered even if an
        ``init_from.hf`` directory went away meanwhile) and again under the lock that
        creates the job (two calls of one request id racing: one job).

        Raises:
            JobSpecError: the spec is invalid (one line naming file and field).
            RequestIdReused (a ValueError): ``request_id`` created a job of another spec text
                (one line naming both); nothing is persisted.
            JobDoesNotFit (a ValueError): its memory per rank fits no registered slot (one line
                naming the estimate and the largest slot); nothing is persisted.
            PriorityOutOfRange (a ValueError): ``priority`` out of range (one line); nothing is persisted.
        """
        with self._lock:
            if (earlier := submitted_before(self._jobs.values(), msg)) is not None:
                return self._snapshot(earlier)
        spec = parse_job_spec(msg.spec_yaml, msg.spec_path or "job.yaml")
        check_spec_directory(spec, msg.spec_path or "job.yaml")  # init_from.hf (file reads: outside the lock)
        if msg.team:  # the caller's team, from its identity (control's user port: control/access.py)
            spec = spec.model_copy(update={"team": msg.team})
        spec_json = spec_to_json(spec)
        priority = check_priority(msg.priority)
        # (nothing persisted yet)
        self._check_team_limits(spec.team, spec.world_size, msg.spec_path or "job.yaml", spec.parallel.device_kind)
        with self._lock:
            if (earlier := submitted_before(self._jobs.values(), msg)) is not None:
                return self._snapshot(earlier)
            job_id = self._new_id(spec.name)
            self._reserved.add(job_id)  # (no other submit takes the id while it is journaled)
        try:
            now = time.time()
            # Built before anything is allocated: a value that does not fit fails here.
            status = control_pb2.JobStatus(
                job_id=job_id,
                name=spec.name,
                state=JobState.STANDBY,
                total_steps=spec.steps,
                eval_loss=math.nan,
                created_unix=now,
                updated_unix=now,
                world_size=spec.world_size,
                priority=priority,
                team=spec.team,
                device=spec.parallel.device_kind,
                evaluation=spec.evaluation is not None,
            )
            _set_layout(status, spec)
            digest = spec_sha256(msg.spec_yaml) if msg.request_id else ""
            # Journaled before the decision and outside its lock (the disk holds no other
            # job's decision up); a failure here: nothing allocated yet.
            self._journal.create_job(status, spec_json, msg.request_id, digest)
        except BaseException:
            with self._lock:
                self._reserved.discard(job_id)
            raise
        with self._lock:
            self._reserved.discard(job_id)
            try:
                earlier = submitted_before(self._jobs.values(), msg)  # (a retry of the request raced this one)
            except BaseException:
                self._queued(job_id, self._journal.delete_job(job_id, wait=False))
                raise
            if earlier is not None:
                self._queued(job_id, self._journal.delete_job(job_id, wait=False))
                return self._snapshot(earlier)
            job = _Job(status=status, spec=spec, request_id=msg.request_id, spec_sha256=digest)
            self._jobs[job_id] = job
            # (one beyond every registered slot of its kind waits behind no one: the allocator says why)
            ahead = beyond_registered(spec, self._registered) is None and self._ahead_at_submit(job, priority)
            held = "waits for the jobs queued ahead of it" if ahead else ""
            held = held or self._queue_held()
            quota = None if held else self._quota_admission(job)  # (its team's quota: issue 30)
            if quota is not None and not quota.ok:  # (never: its quota was lowered since the check above)
                held = quota_wait(quota.reason, quota.never)
            reply = None if held else self._launch(job, borrowed=quota.borrowed)
            if reply is not None and reply.rank_memory_bytes:  # it cannot start on these workers
                self._jobs.pop(job_id, None)
                self._changed.add(job_id)  # (forgotten as the decision ends)
                self._queued(job_id, self._journal.delete_job(job_id, wait=False))
                raise JobDoesNotFit(f"{msg.spec_path or 'job.yaml'}: {reply.reason}")
            if held or reply is not None:
                try:
                    if quota is not None and not quota.ok:  # (before it is queued: the order reads it)
                        self._quota_held[job_id] = (quota.kind, quota.scope)
                    entry = self._queue.add(job_id, priority, submitted=job.status.created_unix)
                    job.status.queued_unix = time.time()  # (its wait counts from here: teams.py's queue)
                    self._queue.mark_beyond_cluster(job_id, reply is not None and _beyond_cluster(reply))
                    self._enqueue(job, entry, held or _waits_for(job, reply))
                except BaseException:
                    self._queue.take(job_id)
                    self._jobs.pop(job_id, None)
                    self._changed.add(job_id)  # (forgotten as the decision ends)
                    self._queued(job_id, self._journal.delete_job(job_id, wait=False))
                    raise
                # (queued for good: a victim's pause is never undone by this submit's failure)
                if not held and not _beyond_cluster(reply):
                    self._preempt_for(job, reply)  # (lower priorities may make room: preemption.py)
                elif quota is not None and not quota.ok and not quota.never:  # (its own team's lower priorities)
                    self._preempt_in_team(job, quota, self._running_by_team().get(team_of(job.status), []))
            return self._snapshot(job)

    def _launch(self, job: _Job, note: str = "", borrowed: int = 0) -> control_pb2.ResourcesInsufficient | None:
        """Under the lock: allocate the ranks of a journaled STANDBY job and journal it
        WARMING_UP (``borrowed``: of its ranks, those beyond its team's nominal quota,
        recorded in its status). Returns the allocator's refusal when they do not fit (nothing
        reserved, nothing journaled). A failure after the allocation takes the ranks back and
        forgets the job (``_abandon_start``), then raises."""
        job_id, spec = job.status.job_id, job.spec
        # Monitoring starts before the ranks launch, so a rank that dies at once is still
        # reported; a job whose allocation fails simply never produces faults.
        self._faults(start_monitoring(job_id, spec))
        try:
            reply = self._allocator(self._allocation(job)).message
            if isinstance(reply, control_pb2.ResourcesInsufficient):
                return reply  # nothing was reserved
            assert isinstance(reply, control_pb2.ResourcesReady), reply
            self._record(
                job,
                ORCH,
                "decision",
                f"{reply.world_size} ranks allocated on {', '.join(reply.worker_ids)}; "
                f"rendezvous {reply.master_addr}:{reply.master_port}",
            )
            job.status.placed_by_kind.CopyFrom(reply.placed)  # (where an ``any`` job landed: teams.py)
            job.launched = launched_on(reply, job)  # (journaled with the transition below)
            lent = f" ({borrowed} on capacity its team borrowed)" if borrowed else ""
            self._transition(job, JobState.WARMING_UP, ORCH, f"{note}ranks launching{lent}")
        except BaseException as e:
            self._abandon_start(job_id, e)
            raise
        # Undo if these records fail at their commit: the job's start is abandoned as if it
        # had failed here (its launched ranks killed, their slots freed, the job forgotten):
        # a restarted control would find it STANDBY, not running those ranks.
        self._undo_if_lost(job_id, lambda e: self._abandon_start(job_id, e))
        return None

    def _allocation(self, job: _Job, probe: bool = False) -> control_pb2.AllocateResources:
        """The placement of ``job``'s ranks asked of L1-2 (``probe``: only how many slots of its
        kind are free, nothing placed: preemption.py)."""
        spec = (self._relaunch_spec(job) or job.spec) if probe else job.spec
        init = engine_pb2.InitJob(
            job_id=job.status.job_id,
            spec_json=spec_to_json(spec),
            data_address=self._data_address,
            store_address=self._store_address,
            **fd.launch_policy(spec.fault_policy),
        )
        return control_pb2.AllocateResources(
            job_id=job.status.job_id, world_size=spec.world_size, backend=spec.parallel.backend, init=init, probe=probe
        )

    def _abandon_start(self, job_id: str, cause: BaseException) -> None:
        """A job whose start failed half-way must not run untracked nor hold slots: its ranks
        are killed and released, and no record of it stays (the journal's and ours)."""
        _log.warning("job start failed; taking its ranks back", job_id=job_id, error=str(cause))
        self._jobs.pop(job_id, None)
        self._changed.add(job_id)  # (forgotten as the decision ends)
        # The release waits for no journal write of the job: its ranks run whatever the
        # journal holds (one that failed at its commit would drop it: ``_undo_if_lost``).
        self._last_write.pop(job_id, None)
        try:
            self._allocator(control_pb2.ReleaseResources(job_id=job_id, kill=True))
        finally:
            self._queued(job_id, self._journal.delete_job(job_id, wait=False))

    # ------------------------------------------------------------ the queue

    def on_resources_ready(self, msg: control_pb2.ResourcesReady, payload: Any = None) -> None:
        """L1-2 published its offer (no job id; ``free_ranks`` free now): a worker registered
        with slots, or the placeable capacity changed (a loss, a cordon, a hold, a departure
        and their ends): the capacity per kind is taken as it is now, and the queue's head may
        fit. (A reply to AllocateResources comes back to its command, not here.)"""
        if msg.job_id:
            return
        with self._lock:
            # Fair share's denominators (teams.py): L1-2 publishes its offer at every change
            # of the placeable capacity, numbered; an older one arriving late is not applied.
            applied = not msg.offer or msg.offer > self._capacity_offer
            if applied:
                self._capacity = {"gpu": msg.gpu_slots, "cpu": msg.cpu_slots}
                if msg.HasField("registered"):  # (every registered slot per kind: ``_behind``)
                    self._registered = msg.registered
                self._capacity_offer = msg.offer or self._capacity_offer
            if not msg.free_ranks and not applied:
                return
            # A job waiting for workers may fit now: it blocks until tried. And the capacity
            # moved (a drain, a loss, a cordon too): every waiting job's reason and place are
            # decided again by a pass, even when nothing can start.
            self._queue.clear_beyond_cluster()
            self._start_soon()
            if not msg.free_ranks:
                return
            if any(j.grow_to and j.status.state == JobState.RUNNING for j in self._jobs.values()):
                self._grow_soon(msg.free_ranks)

    def _enqueue(self, job: _Job, entry: QueueEntry, why: str) -> None:
        """Under the lock: ``job`` (STANDBY, journaled) waits in the queue at ``entry``."""
        job.queued = entry
        job.status.cannot_run = cause_of(why)  # (counted: `surgectl queue`, surge_queue_cannot_run)
        where = f"position {self._queue.position(entry.job_id)} of {len(self._queue)}, priority {entry.priority}"
        self._record(job, ORCH, "queue", f"queued at {where}: {why}", status_message=f"queued: {why}")

    def _queue_held(self, but: _Job | None = None) -> str:
        """Why no queued job may start now ("": none may). Live jobs come first: one that
        recovers and whose ranks are not relaunched yet, or one drained by `surgectl down`
        that the next `up` resumes, needs the ranks a queued job would take. ``but``: a job
        whose own resume is asked (it holds back no one but itself)."""
        for j in self._jobs.values():
            if j is but:
                continue
            if j.incident is not None and not j.incident.relaunched and j.status.state == JobState.FAULT_FROZEN:
                return f"waits while job {j.status.job_id} recovers (live jobs first)"
            if j.parked and j.status.drained:
                return (
                    f"waits for drained job {j.status.job_id} to be resumed (`surgectl up` resumes it, "
                    "`surgectl stop` ends it; live jobs first)"
                )
        return ""

    def _start_soon(self) -> None:
        """Under the lock: ranks may have freed up, so the queue's head is tried, on the
        deadline pool's thread (no delay; never on the caller's, which may be the thread that
        applies the node agents' events), once however many ask before it runs. Once the
        decision's commands are sent, if it has any (a release of ranks among them: the head
        tried before it would not fit; ``_after_decision``)."""
        if getattr(self._decided, "jobs", None):
            self._decided.start = True
            return
        if len(self._queue) and self._start_armed is None:
            self._start_armed = self._deadlines.after(0.0, self._start_queued)

    def _start_queued(self) -> None:
        """Start queued jobs in queue order while their ranks fit and nothing holds the queue;
        the first that does not fit stays where it is, its status saying what it waits for,
        and the rest wait behind it -- unless it needs more ranks than the registered
        workers have slots: it waits for workers to join, holding back none of the jobs
        behind it, which are tried next. Per device kind (scheduler/fair_share.py): a job of
        kind gpu or cpu that does not fit, or that its team's per-kind bound or its cohort's idle
        slots of its kind hold back, holds back the later jobs of that kind and the ``any`` ones;
        the others are tried. A job its own team's quota holds back may preempt its team's
        lower-priority jobs (preemption.py ``_preempt_in_team``).

        The one place every queued job's reason is decided: the walk reaches every job (those
        behind a held queue or a job first in line too) and says why it waits, at every change
        that may alter it (a capacity change, a job's end, a quota change, the starvation
        bound's pass all run this pass); the places are republished with it (the fair order
        moves with the usage, the capacity and the clock): what `surgectl queue` prints."""
        with self._lock:
            self._start_armed = None
            self._places_changed = True
            held_teams = Holds()  # team, scope -> its queued job its own limits hold back
            held_cohorts = Holds()  # cohort, kind -> the queued job waiting for its idle slots
            no_room: dict[str, str] = {}  # kind -> the first job of it whose ranks did not fit the free slots
            running_by_team: dict[str, list[_Job]] | None = None  # (built once, at the first team-held job)
            nevers: dict[tuple[str, int, str], Admission] = {}  # (team, slots, kind) -> its usage-free admission
            self._queue.forget_order()  # (computed afresh: the usage, capacity or clock moved)
            order = self._queue.ordered()  # (the fair order across teams: teams.py)
            queue_held = self._queue_held()
            ahead = 0  # the jobs still queued before this one in the walk: its place is ahead + 1
            for entry in order:
                if entry.job_id not in self._queue:  # (taken out meanwhile)
                    continue
                job = self._jobs[entry.job_id]
                ahead += 1
                place = ahead
                if queue_held:
                    self._waiting(job, queue_held, place)
                    continue
                # Its team's quota (issue 30): a job it holds back holds back the later jobs of
                # its team only (no overtaking within a team), not the other teams'.
                team, kind = team_of(job.status), kind_of(job)
                cohort = self._quotas.cohort_of(team)
                # One its team may never hold (a quota lowered since its submit) says so before
                # any job it would wait behind: it can never run as things stand, and holds no
                # one back. Usage-free, so asked once per (team, size, kind) in a pass.
                key = (team, self._slots(job), kind)
                if (never := nevers.get(key)) is None:
                    never = nevers[key] = admit(self._quotas, {}, *key)
                if never.never:
                    self._quota_held[entry.job_id] = (never.kind, never.scope)
                    self._waiting(job, quota_wait(never.reason, True), place)
                    continue
                blocker = next(((k, j) for k, j in no_room.items() if blocks(k, kind)), None)
                if blocker is not None:  # (gang admission without backfill, per kind)
                    what = "" if blocker[0] == "any" else f"{blocker[0]} "
                    self._behind(job, f"waits behind job {blocker[1]}, first in line for {what}slots to free up", place)
                    continue
                if (held_by := held_teams.of(team, kind)) is not None:
                    self._behind(job, f"waits behind job {held_by} of team {team}", place)
                    continue
                if (held_by := held_cohorts.of(cohort, kind)) is not None:  # (the cohort's idle slots go in order)
                    other = team_of(self._jobs[held_by].status)  # (but within its nominal: fair_share.py)
                    if other == team or not backfills(team, other, self._quota_admission(job)):
                        self._behind(job, cohort_wait(held_by, cohort), place)
                        continue
                quota = self._quota_admission(job)
                if not quota.ok:
                    self._quota_held[entry.job_id] = (quota.kind, quota.scope)
                    if quota.kind == WAIT_COHORT:
                        held_cohorts.hold(cohort, kind, entry.job_id)
                    elif not quota.never:  # (one beyond its hard limit alone never starts: it holds no one back)
                        held_teams.hold(team, quota.scope, entry.job_id)
                    self._waiting(job, quota_wait(quota.reason, quota.never), place)
                    if not quota.never:  # (its own team's lower priorities may make room: preemption.py)
                        if running_by_team is None:
                            running_by_team = self._running_by_team()
                        self._preempt_in_team(job, quota, running_by_team.get(team, []))
                    continue
                self._quota_held.pop(entry.job_id, None)
                self._queue.take(entry.job_id)
                job.queued = None
                job.status.cannot_run = ""
                # Journaled out of the queue before its ranks launch: a control killed in
                # between finds it STANDBY and not queued (FAULT_FROZEN, see _restore), never
                # queued again while its ranks run.
                try:
                    self._keep(job)
                except Exception as e:  # noqa: BLE001 - still queued (journal and here); tried again later
                    job.queued = self._queue.put(entry)
                    _log.error("a queued job could not be taken out of the queue", job_id=entry.job_id, error=str(e))
                    return
                waited = time.time() - (job.status.queued_unix or job.status.created_unix)
                # Its time in the queue adds to its earlier waits (journaled with its launch): a
                # job preempted or requeued later counts them towards the starvation bound.
                earlier = job.status.waited_seconds
                job.status.waited_seconds = earlier + max(0.0, waited)
                try:
                    if job.relaunch is not None:  # an operator resume that waited: it loads its checkpoint
                        effects, reply = self._start_relaunch(job)
                    else:
                        reply = self._launch(
                            job, note=f"left the queue after {waited:.0f} s; ", borrowed=quota.borrowed
                        )
                        effects = _launched(job, reply)
                except Exception as e:  # noqa: BLE001 - _launch forgot the job; the rest stay queued
                    _log.error("a queued job could not be started", job_id=entry.job_id, error=str(e))
                    if job.relaunch is not None and entry.job_id in self._jobs:  # (kept: queued again, in its place)
                        job.queued = self._queue.put(entry)
                        job.status.waited_seconds = earlier
                    return
                if not effects:  # placed: it is no longer ahead of the rest
                    ahead -= 1
                for effect in effects:  # (none: placed)
                    if isinstance(effect, Refuse):  # it cannot start on these workers
                        ahead -= 1
                        job.status.outcome = JobOutcome.FAILED
                        job.relaunch = None
                        _set_size(job.status, job.spec)  # (not placed: the size it last ran at)
                        self._transition(job, JobState.TERMINATED, ORCH, f"FAILED: refused: {effect.text}")
                    else:  # not yet: its place kept
                        job.queued = self._queue.put(entry)
                        job.status.waited_seconds = earlier
                        self._queue.mark_beyond_cluster(entry.job_id, effect.beyond)
                        self._waiting(job, effect.why, place, tried=True)
                        if not effect.beyond:
                            if reply is not None:
                                self._preempt_for(job, reply)  # (lower priorities may make room: preemption.py)
                            no_room[kind] = (
                                entry.job_id
                            )  # (an ``any`` job: it could have taken any slot, every kind waits)

    def _running_by_team(self) -> dict[str, list[_Job]]:
        """Under the lock: the jobs holding ranks, by team (a pass's candidates for a preemption
        within a team)."""
        by_team: dict[str, list[_Job]] = {}
        for j in self._jobs.values():
            if self._holds_ranks(j):
                by_team.setdefault(team_of(j.status), []).append(j)
        return by_team

    def _behind(self, job: _Job, why: str, place: int) -> None:
        """Under the lock: the queued ``job``, not tried, waits behind another job (``why``) --
        unless it needs more slots of its kind than are registered at all (the allocator's last
        offer): then it can never run as things stand, and says so (not its place in line)."""
        never = beyond_registered(self._relaunch_spec(job) or job.spec, self._registered)
        self._waiting(job, never or why, place)

    def _waiting(self, job: _Job, why: str, place: int = 0, tried: bool = False) -> None:
        """Under the lock: the queued ``job`` still waits, for ``why`` (``place``: its place in
        the pass's walk; 0: asked of the queue): an event when the reason changed (none at
        every retry); ``tried`` (taken out of the queue to be placed, and put back): its place
        journaled again even so. A job the pass did not try and whose reason stands costs no
        write (a pass reaches every queued job)."""
        cause = cause_of(why)  # (read before the prefixes below make it a plain str)
        if job.status.preempted_by and not why.startswith("PREEMPTED"):  # (what it is stays in sight)
            why = f"PREEMPTED by job {job.status.preempted_by}; {why}"
        if job.status.job_id in self._promoted and self._quotas.max_wait_s is not None:  # (teams.py)
            why = PROMOTED.format(bound=self._quotas.max_wait_s / 60) + why
        message = f"queued: {why}"
        if job.status.message == message and job.status.cannot_run == cause:
            if tried:
                self._keep(job)
            return
        job.status.cannot_run = cause
        where = f"position {place or self._queue.position(job.status.job_id)} of {len(self._queue)}"
        self._record(job, ORCH, "queue", f"still queued at {where}: {why}", status_message=message)

    def _cancel(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock: take a queued job out of the queue (TERMINATED, STOPPED; it never
        ran). Raises IllegalTransition when it is not queued (nothing changes)."""
        job_id = job.status.job_id
        if job.queued is None:
            state = JobState.Name(job.status.state)
            if job.status.state == JobState.TERMINATED:  # nothing to take out, nothing to stop
                raise IllegalTransition(
                    f"job {job_id} is {state} ({JobOutcome.Name(job.status.outcome)}), not queued",
                    control_pb2.REFUSED_ALREADY_ENDED,
                )
            raise IllegalTransition(f"job {job_id} is {state}, not queued: `surgectl stop {job_id}` stops it")
        where = self._queue.position(job_id)
        self._queue.take(job_id)
        job.queued = None
        job.status.cannot_run = ""
        job.status.outcome = JobOutcome.STOPPED
        resumed = job.relaunch is not None  # (a resume that waited: its checkpoints stay, resume it again later)
        job.relaunch = None
        _set_size(job.status, job.spec)  # (a resume's layout asked with it: the size it last ran at again)
        job.status.drained = False
        job.status.preempted_by = ""
        what = "its resume taken out of the queue" if resumed else "taken out of the queue"
        self._transition(job, JobState.TERMINATED, ORCH, f"STOPPED: {what} (position {where}) by the operator")
        self._start_soon()  # the jobs behind it move up
        return self._snapshot(job)


def _launched(job: _Job, reply: control_pb2.ResourcesInsufficient | None) -> list[Queue | Refuse]:
    """A queued submit's placement (``_launch``'s answer) in the terms of a queued resume's
    (``resume_machine.allocated``): nothing (placed), refused (its ranks fit no registered
    slot: the allocator's reason, as the job's end says it) or still queued (why)."""
    if reply is None:
        return []
    if reply.rank_memory_bytes:
        return [Refuse(reply.reason, resources=True)]
    return [Queue(0, "", _waits_for(job, reply), _beyond_cluster(reply))]
