"""Priority preemption that checkpoints first and comes back (issue 30 item 2).

When the queue's head cannot be placed, running jobs of a strictly lower priority (or on the
borrowed-capacity list the team quotas give) may make room: which ones is preemption_plan.py's
pure answer. Each victim checkpoints at a step boundary every rank agrees on (the pause's
boundary command, as a node's departure does), then its ranks are released (killed: their exits
are no fault, no restart budget is spent) and it waits in the queue at its own priority, shown
PREEMPTED (STANDBY with ``JobStatus.preempted_by``), to continue from that checkpoint by itself
when capacity returns: at most the steps after the boundary are lost (none, the boundary is
where it stopped). The head starts once the slots are free: until it starts it claims them,
first in the queue after drained jobs (teams.py ``_claims``, scheduler/fair_share.py), so a
victim whose team is below its fair share is not placed straight back on them. The claim lasts
``PREEMPTION_CLAIM_S`` (control's --preemption-claim-seconds) from the decision: a victim that
never frees its slots, or slots taken meanwhile, no longer hold the head first in line (and
every job of its kind behind it) and every later preemption back; an event says so.

Within a team (``_preempt_in_team``): a queued job its own team's quota holds back (hard limit,
borrow limit, nominal used up with nothing to borrow: no slot shortage the allocator would
report) preempts its team's lower-priority jobs by the same rules, and no more than bring the
team within its quota and, with the free slots of its kind (the allocator's probe, nothing
placed), fit it (preemption_plan.py ``choose_within_team``).

A victim that has not paused within the grace period moves from its newest committed checkpoint
(the steps after it lost, said in a warning); with none it keeps its slots until its pause's
checkpoint commits (a warning says so). A fault during the checkpoint is a recovery, which
supersedes the preemption (the head plans again later). One preemption at a time: while a
victim checkpoints, the head waits for it rather than choosing more.

Journaled: ``preempted_by`` rides with the job's status and the pause in flight with its
runtime, so a control restarted mid-preemption finishes it when the ranks re-attach (the grace
timer armed anew), and a PREEMPTED job's place and checkpoint are its queued resume's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.common.deadlines import Deadline
from services.contract import control_pb2, engine_pb2
from services.control.orchestrator.activity import idle
from services.control.orchestrator.job import ORCH, JobState, _Job
from services.control.orchestrator.preemption_plan import Running, choose_victims, choose_within_team
from services.control.orchestrator.teams import held_by_kind, kind_of, landed_kind, team_of, usage_of
from services.control.orchestrator.texts import _usable
from services.control.scheduler.admission import Admission, admit, quota_deficit
from services.control.scheduler.admission import held as held_in

_log = structlog.get_logger("orchestrator")

PREEMPTION = "preemption"  # the event type of preemption's decisions and warnings
# How long a queued preemptor claims the slots its victims free (seconds from the preemption's
# decision; control's --preemption-claim-seconds): ten of the default grace. A victim that never
# frees them (no checkpoint of its pause and none before it) held the preemptor first in line,
# and with it every queued job of its kind, and held every later preemption back, forever.
PREEMPTION_CLAIM_S = 600.0


@dataclass
class PolicyTimer:
    """A preemption's or growing back's armed timer (``_arm_policy_timer``)."""

    timer: Deadline | None = None


class Preempting:
    """Priority preemption (a part of ``Orchestrator``, see core.py)."""

    def _preemption_in_flight(self) -> list[_Job]:
        """Under the lock: victims still checkpointing (their slots not released yet)."""
        return [
            j
            for j in self._jobs.values()
            if j.status.preempted_by and j.status.state == JobState.RUNNING and j.pending == "pause"
        ]

    def _preemption_holding(self) -> bool:
        """Under the lock: whether a victim still checkpoints for a preemptor whose claim
        stands (no other preemption is chosen meanwhile: its release starts the preemptor)."""
        now = time.time()
        for victim in self._preemption_in_flight():
            head = self._jobs.get(victim.status.preempted_by)
            if head is None or not 0 < head.claim_until <= now:
                return True
        return False

    def _claim(self, head: _Job) -> None:
        """Under the lock, as a preemption for the queued ``head`` is decided (before its
        record, which journals it): its claim on the freed slots lasts ``_preemption_claim_s``
        (teams.py ``_claims``); then ``_claim_ended``."""
        head.claim_until = time.time() + self._preemption_claim_s
        self._arm_claim(head.status.job_id, head.claim_until)

    def _arm_claim(self, head_id: str, until: float) -> None:
        def over() -> None:
            with self._lock:
                self._policy_timers.pop(f"claim:{head_id}", None)
                self._claim_ended(head_id, until)

        self._arm_policy_timer(f"claim:{head_id}", max(until - time.time(), 0.0), over)

    def _claim_ended(self, head_id: str, until: float) -> None:
        """Under the lock: the claim of the preemptor ``head_id`` set to end at ``until`` ran
        out. Where it still waits queued and a victim's slots are still claimed for it, the
        claim is dropped (an event says so): it waits at its place in the fair order, and
        other preemptions may be chosen (for it too)."""
        head = self._jobs.get(head_id)
        if head is None or head.claim_until != until or head_id not in self._queue:
            return  # (started, ended, or a later preemption's claim)
        victims = sorted(
            v.status.job_id
            for v in self._jobs.values()
            if v.status.preempted_by == head_id
            and (
                (v.status.state == JobState.RUNNING and v.pending == "pause")
                or (v.status.job_id in self._queue and v.status.queued_unix >= head.running_since)
            )
        )
        if not victims:
            return
        held = [v for v in victims if self._jobs[v].status.state == JobState.RUNNING]
        why = (
            f"job{'s' if len(held) > 1 else ''} {', '.join(held)} still hold{'' if len(held) > 1 else 's'} "
            "the slots (no checkpoint of the preemption's pause)"
            if held
            else "it did not fit the freed slots (taken meanwhile)"
        )
        self._queue.forget_order()
        self._record(
            head,
            ORCH,
            PREEMPTION,
            f"claim dropped: the preemption of {', '.join(victims)} did not start it within "
            f"{self._preemption_claim_s:g} s: {why}; it waits at its place in the queue (fair order), "
            f"position {self._queue.position(head_id)} of {len(self._queue)}",
        )
        self._start_soon()  # (the queue's order and reasons again; a preemption may be chosen)

    def _rearm_claims(self) -> None:
        """Under the lock, after a restore: each queued preemptor's claim ends when journaled."""
        for job in self._jobs.values():
            if job.claim_until > 0 and job.status.job_id in self._queue:
                self._arm_claim(job.status.job_id, job.claim_until)

    def _preemptable(self, job: _Job) -> bool:
        """Whether ``job`` could be paused for a preemption now: running, nothing else in flight
        (a recovery, resize, rollback, pause, stop or departure), its ranks its own."""
        return (
            job.status.state == JobState.RUNNING
            and idle(job)
            and not job.pending
            and not job.departure
            and not job.parked
            and not job.status.preempted_by
        )

    def _placeable_ranks(self, job: _Job) -> int:
        """The slots ``job`` frees where something can be placed (not on a cordoned node)."""
        if not job.placement:
            return job.status.world_size
        return sum(1 for w in job.placement.values() if w not in self._cordoned)

    def _preempt_for(self, head: _Job, reply: control_pb2.ResourcesInsufficient) -> None:
        """Under the lock: the queue's head ``head`` does not fit (``reply``): preempt what the
        plan names, or wait (a retry is armed for when a young candidate's minimum run time ends)."""
        if self._preemption_holding():
            return  # (its release starts the head; nothing more is chosen meanwhile)
        now = time.time()
        running = [
            Running(
                j.status.job_id,
                j.status.priority,
                self._placeable_ranks(j),
                j.spec.preemptible,
                j.running_since,
            )
            for j in self._jobs.values()
            if j is not head and self._preemptable(j) and _frees_for(landed_kind(j), kind_of(head))
        ]
        needs, free = reply.requested_ranks or head.status.world_size, reply.available_ranks
        borrowed = self._reclaimable(head, needs, free)  # (its cohort's borrowers: teams.py)
        choice = choose_victims(
            needs=needs,
            free=free,
            priority=head.status.priority,
            running=running,
            now=now,
            min_run_seconds=self._preemption_min_run_s,
            borrowed=borrowed,
        )
        if not choice.victims:
            self._preemption_retry(head, running, now, borrowed)
            self._note_starting(head, kind_of(head), None)
            return
        head_id = head.status.job_id
        self._claim(head)
        self._record(head, ORCH, PREEMPTION, f"job {head_id} (priority {head.status.priority}) {choice.why}")
        for victim_id in choice.victims:
            self._preempt(self._jobs[victim_id], head, reclaimed=victim_id in borrowed)

    def _preempt_in_team(self, head: _Job, quota: Admission, team_jobs: list[_Job]) -> None:
        """Under the lock: the queued ``head`` is held back by its own team's quota (``quota``:
        its hard limit, its borrow limit, or its nominal used up with nothing to borrow):
        the team's lower-priority jobs make room, by preemption_plan.py's
        ``choose_within_team`` (the same rules as across teams: strictly lower priority,
        ``preemptible``, the minimum run time, and nothing unless it would then fit, both its
        team's quota and the free slots, which the allocator is asked for without placing).
        ``team_jobs``: the jobs of its team holding ranks."""
        team, kind, priority = team_of(head.status), kind_of(head), head.status.priority
        mine = [j for j in team_jobs if j is not head and j.status.priority < priority and self._preemptable(j)]
        if not mine or self._preemption_holding():
            return
        usage, slots = self._usage(), self._slots(head)
        deficit = quota_deficit(self._quotas, usage, team, slots, kind)
        if not deficit:
            return
        now = time.time()
        in_team = [
            Running(
                j.status.job_id,
                j.status.priority,
                held_in(held_by_kind(j.status), quota.scope),  # (the slots the quota's bound counts)
                j.spec.preemptible,
                j.running_since,
            )
            for j in mine
        ]
        probe = self._allocator(self._allocation(head, probe=True)).message
        assert isinstance(probe, control_pb2.ResourcesInsufficient), probe
        if probe.rank_memory_bytes:
            return  # (its ranks fit no registered slot: nothing would let it start)
        others = [
            Running(j.status.job_id, j.status.priority, self._placeable_ranks(j), j.spec.preemptible, j.running_since)
            for j in self._jobs.values()
            if j is not head and self._preemptable(j) and _frees_for(landed_kind(j), kind)
        ]
        frees = {r.job_id: r.ranks for r in others}
        choice = choose_within_team(
            deficit=deficit,
            needs=slots,
            free=probe.available_ranks,
            priority=priority,
            team=in_team,
            frees=frees,
            others=others,
            now=now,
            min_run_seconds=self._preemption_min_run_s,
        )
        if choice.victims:  # (the quota is checked again with exactly these jobs' slots gone)
            gone = set(choice.victims)
            left = [j for j in self._jobs.values() if self._holds_ranks(j) and j.status.job_id not in gone]
            if not admit(self._quotas, usage_of(left), team, slots, kind).ok:
                return
        else:
            self._preemption_retry(head, in_team, now, [])
            self._note_starting(head, kind, team)
            return
        head_id = head.status.job_id
        self._claim(head)
        self._record(head, ORCH, PREEMPTION, f"job {head_id} (priority {priority}) {choice.why}")
        for victim_id in choice.victims:
            victim = self._jobs[victim_id]
            self._preempt(victim, head, in_team=team_of(victim.status) == team)

    def _preemption_retry(self, head: _Job, running: list[Running], now: float, borrowed: list[str]) -> None:
        """Under the lock: a candidate still inside its minimum run time may be one later: the
        queue is tried again when the first such time ends (nothing else would try it then)."""
        young = [
            r.started_unix + self._preemption_min_run_s - now
            for r in running
            if r.preemptible
            and r.started_unix
            and (r.priority < head.status.priority or r.job_id in borrowed)
            and now - r.started_unix < self._preemption_min_run_s
        ]
        if not young:
            return

        def again() -> None:
            with self._lock:
                self._start_soon()

        self._arm_policy_timer("min-run", min(young) + 0.05, again)

    def _note_starting(self, head: _Job, kind: str, team: str | None) -> None:
        """Under the lock: a preemption for ``head`` found nothing to preempt now: where a
        lower-priority preemptible job (of ``team``; None: any) is still starting, its ranks
        not running yet, it becomes a candidate once it runs and its minimum run time ends,
        and no other event need try the queue then (a fresh user's hp2, session 33, waited
        115 s, "never preempted again"): ``_preemption_on_run`` arms that try."""
        self._preempt_after_start = self._preempt_after_start or any(
            j.status.state == JobState.WARMING_UP
            and j.spec.preemptible
            and j.status.priority < head.status.priority
            and (team is None or team_of(j.status) == team)
            and _frees_for(landed_kind(j), kind)
            for j in self._jobs.values()
            if j is not head and self._holds_ranks(j)
        )

    def _preemption_on_run(self) -> None:
        """Under the lock: a job's ranks started training. If a preemptor waits for such a job
        (``_note_starting``), the queue is tried when its minimum run time ends."""
        if not self._preempt_after_start:
            return
        self._preempt_after_start = False

        def again() -> None:
            with self._lock:
                self._start_soon()

        self._arm_policy_timer("min-run:started", self._preemption_min_run_s + 0.05, again)

    def _arm_policy_timer(self, key: str, seconds: float, fn: Callable[[], None]) -> None:
        """Under the lock: the one timer of a preemption or growing-back wait named ``key`` (a
        victim's grace to checkpoint, a protected job's minimum run time ending, a job's resize
        interval ending), armed by the decision that starts the wait; arming it again replaces
        it (the old one cancelled). A policy's wait, never a judgment of a rank's liveness."""
        held = self._policy_timers.setdefault(key, PolicyTimer())
        self._cancel_timer(held)
        held.timer = self._deadlines.after(seconds, fn)

    def _preempt(self, victim: _Job, head: _Job, reclaimed: bool = False, in_team: bool = False) -> None:
        """Under the lock: ``victim`` checkpoints at its next agreed boundary for ``head``
        (``reclaimed``: it runs on slots its team borrowed from ``head``'s team's cohort;
        ``in_team``: of ``head``'s team, whose quota holds ``head`` back)."""
        cmd = self._in_flight(victim, "pause", engine_pb2.PauseTraining(checkpoint=True))
        victim.boundary_failed = victim.resume_after_pause = victim.draining = victim.status.drained = False
        victim.paused.clear()
        victim.status.preempted_by = head.status.job_id
        self._record(
            victim,
            ORCH,
            PREEMPTION,
            f"preempted by job {head.status.job_id} ("
            + (
                f"its team {head.status.team or 'default'} reclaims the slots team "
                f"{victim.status.team or 'default'} borrowed"
                if reclaimed
                else f"priority {head.status.priority} > {victim.status.priority}"
                + (f", within team {victim.status.team or 'default'}'s quota" if in_team else "")
            )
            + f"): checkpoint at the next step boundary every rank agrees on (command "
            f"#{cmd.seq} to the ranks), then its slots are released; it waits in the queue at priority "
            f"{victim.status.priority} and continues from that checkpoint when capacity returns "
            f"(grace {self._preemption_grace_s:g} s; no fault, no restart spent)",
        )
        self._loop(cmd)
        self._arm_preemption_grace(victim.status.job_id, cmd.seq)

    def _arm_preemption_grace(self, job_id: str, seq: int) -> None:
        def overdue() -> None:
            with self._lock:
                self._policy_timers.pop(f"grace:{job_id}", None)
                self._preemption_overdue(job_id, seq)

        self._arm_policy_timer(f"grace:{job_id}", self._preemption_grace_s, overdue)

    def _rearm_preemptions(self) -> None:
        """Under the lock, after a restore: a victim journaled mid-checkpoint gets its grace again."""
        for job in self._preemption_in_flight():
            self._arm_preemption_grace(job.status.job_id, job.pending_seq)
        self._rearm_claims()

    def _preemption_overdue(self, job_id: str, seq: int) -> None:
        """Under the lock: the grace period of the preemption's pause #``seq`` ended."""
        job = self._jobs.get(job_id)
        if job is None or job.pending != "pause" or job.pending_seq != seq or not job.status.preempted_by:
            return  # (paused in time, or superseded)
        if not _usable(job):
            self._record(
                job,
                ORCH,
                PREEMPTION,
                f"WARNING: preempted by job {job.status.preempted_by}: no checkpoint at a step boundary within "
                f"the {self._preemption_grace_s:g} s grace and none committed before: it keeps its slots until "
                "its pause's checkpoint commits",
            )
            return
        step, version = self._newest_version(job)
        lost = max(job.status.step - step, 0)
        job.in_flight.pop(seq, None)
        self._record(
            job,
            ORCH,
            PREEMPTION,
            f"WARNING: preempted by job {job.status.preempted_by}: no checkpoint at a step boundary within the "
            f"{self._preemption_grace_s:g} s grace: its ranks are released now and it continues from {version} "
            f"(step {step}; read from the nodes' memory copies where they hold it): {lost} steps lost",
        )
        self._yield_slots(job, step, version)

    def _preemption_paused(self, job: _Job, step: int) -> None:
        """Under the lock, on the applier thread: every rank paused at the preemption's boundary
        ``step`` after its checkpoint's commit (or its failure): the slots are released."""
        job.pending, job.status.step = "", step
        by = job.status.preempted_by
        if job.boundary_failed and not _usable(job):  # nothing to continue from: the preemption is given up
            job.status.preempted_by = ""
            self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id))
            self._record(
                job,
                ORCH,
                PREEMPTION,
                f"WARNING: preempted by job {by}: the checkpoint of step {step} could not be saved and none was "
                "committed before: not preempted, the ranks continue",
            )
            return
        newest, version = self._newest_version(job)
        if job.boundary_failed:
            self._record(
                job,
                ORCH,
                PREEMPTION,
                f"WARNING: preempted by job {by}: the checkpoint of step {step} could not be saved: it continues "
                f"from {version} (step {newest}): {max(step - newest, 0)} steps lost",
            )
        self._yield_slots(job, newest, version)

    def _yield_slots(self, job: _Job, step: int, version: str) -> None:
        """Under the lock: the victim's ranks are released (killed: their exits are no fault)
        and it waits in the queue at its priority, PREEMPTED, to continue from ``version``."""
        by = job.status.preempted_by
        job.pending = ""
        job.parked, job.parked_live, job.departure = True, False, ""
        self._transition(
            job,
            JobState.PAUSED,
            ORCH,
            f"preempted by job {by}: checkpoint {version} at step {step}; ranks released (no fault, no restart spent)",
        )
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=True))
        job.status.drained = False  # (queued at its own priority: the head comes first)
        self._queue_resume(
            job,
            step,
            version,
            None,
            f"PREEMPTED by job {by} at step {step}: continues from {version} when capacity returns",
            by=f"(preempted by job {by})",
            keep_budgets=True,
        )


def _frees_for(victim: str, head: str) -> bool:
    """Whether a victim of device kind ``victim`` frees slots a head of kind ``head`` can take
    (gpu, cpu, any): a gpu head gains nothing from a cpu job's slots; an ``any`` victim's may be
    of either kind, so only an ``any`` head counts on them."""
    return head == "any" or victim == head
