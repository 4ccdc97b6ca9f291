"""Teams' quotas and fair share in L1-1 (issue 30 items 1 and 4): the quota book in force, the
fair order the queue is tried in, each job's admission by its team's quota, and the admin
commands (`surgectl team set/remove/list`, `surgectl queue`).

The policy is services/control/scheduler/ (pure functions); this file feeds it the jobs and
acts on its answers. The book comes from the quota file (``control --quotas``), overlaid by
the journaled admin commands (job_store's ``team_quotas``: a team set or removed by command
keeps that across a restart, whatever the file says).

Which jobs count towards a team's usage: those holding ranks (not queued, not ended, not
parked with their ranks gone), by their current world size, per device kind (the spec's
``parallel.device``: gpu, cpu or any; scheduler/admission.py says how each bound counts them).
Fair share divides each kind's held slots by the placeable slots of that kind, as the
allocator last offered them (``ResourcesReady.gpu_slots``/``cpu_slots``: L1-2 derives them in
one place, resource_allocator/cordons.py ``_offer``, and publishes them at every change: a
registration, a withdrawal, a departure, a cordon, a quarantine, a hold and their ends; after a
control restart, the restored cordons and the node agents' registrations rebuild them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable
from types import SimpleNamespace
from typing import Any

from services.contract import control_pb2
from services.control.job_queue import QueueEntry
from services.control.orchestrator.job import JobState, _Job
from services.control.orchestrator.refusals import BeyondHardLimit
from services.control.scheduler import Admission, QuotaBook, QuotaFileError, TeamQuota, Waiting, admit, fair_order
from services.control.scheduler.admission import borrowed_by_job
from services.control.scheduler.admission import held as held_in
from services.control.scheduler.fair_share import backfills, blocks, next_overdue
from services.control.scheduler.quotas import KINDS, check_max_wait, check_team_name, quota_from_fields
from services.control.scheduler.reclaim import reclaim_victims

UNLIMITED = -1  # TeamQuota's proto form of None (no bound)
# The journal's team_quotas row of the starvation bound set by command (not a team's name: the
# pattern refuses "*"): {"max_wait_minutes": minutes or None}.
MAX_WAIT_ROW = "*max_wait"
# A queued job's status message when the starvation bound put it ahead (`surgectl queue` says
# how long it waited: ``_queue_reason``).
PROMOTED = "promoted by the {bound:g} min starvation bound; "
_IDLE = (JobState.STANDBY, JobState.TERMINATED)


def team_of(status: control_pb2.JobStatus) -> str:
    return status.team or "default"  # (a journal of a control before teams has none)


def kind_of(job: _Job) -> str:
    """The device kind ``job``'s ranks need: gpu, cpu or any (its spec's ``parallel.device``)."""
    return job.spec.parallel.device_kind


def held_by_kind(status: control_pb2.JobStatus) -> dict[str, int]:
    """The slots a job holding ranks counts for, per kind its team's quota reads: its own kind
    (gpu, cpu); for an ``any`` job, the kinds it landed on (``placed_by_kind``, recorded at each
    placement; after a shrink, its remaining ranks on the kind they ran on), or ``any`` (either
    kind: admission.py counts it against both) for ranks whose kind is not known (no placement
    recorded, a growth not yet placed, a mixed job shrunk beyond telling)."""
    kind, n = status.device or "any", status.world_size
    if kind != "any" or not status.HasField("placed_by_kind"):
        return {kind: n}
    placed = status.placed_by_kind
    if n <= placed.gpu + placed.cpu:
        # Its ranks now (a shrink keeps ranks where they ran): at least n - cpu of them on
        # GPUs and n - gpu on CPU slots; all of them, on one kind it landed on whole. Only
        # what cannot be told apart (a mixed job shrunk) counts as ``any``.
        gpu, cpu = max(0, n - placed.cpu), max(0, n - placed.gpu)
    else:  # (grown, its new ranks not placed yet: those may be of either kind)
        gpu, cpu = placed.gpu, placed.cpu
    held = {k: v for k, v in (("gpu", gpu), ("cpu", cpu), ("any", n - gpu - cpu)) if v}
    return held or {kind: n}


def landed_kind(job: _Job) -> str:
    """The one device kind ``job``'s ranks hold (its own, or the kind an ``any`` job landed on
    whole), else ``any`` (mixed, or not known): which heads its slots serve (preemption, reclaim)."""
    held = held_by_kind(job.status)
    return next(iter(held)) if len(held) == 1 else "any"


def usage_of(jobs: Iterable[_Job]) -> dict[str, dict[str, int]]:
    """Slots held per team and device kind by ``jobs`` (each holding ranks; an ``any`` job
    counted where it landed)."""
    usage: dict[str, dict[str, int]] = {}
    for job in jobs:
        per = usage.setdefault(team_of(job.status), {})
        for kind, n in held_by_kind(job.status).items():
            per[kind] = per.get(kind, 0) + n
    return usage


class Teams:
    """Teams' quotas and fair share (a part of ``Orchestrator``, see core.py)."""

    def _init_teams(self, quotas: QuotaBook | None) -> None:
        """Before the jobs are restored: the book (file, then the journaled commands) and the
        queue's order."""
        book = quotas or QuotaBook()
        for name, q in self._journal.load_team_quotas().items():
            if name == MAX_WAIT_ROW:  # (`surgectl team set --max-wait`: kept over the file's)
                minutes = (q or {}).get("max_wait_minutes")
                book = book.with_max_wait(None if minutes is None else minutes * 60)
                continue
            book = book.without(name) if q is None else book.with_team(name, TeamQuota.model_validate(q))
        self._quotas = book  # immutable: replaced whole under the decision lock, read anywhere
        # Queued jobs their team's quota holds back (job id -> (admission kind, its scope: the
        # device kind, or "" for all)): they hold back the later jobs of their own team only (of
        # their cohort, for "cohort_full"; none, for "beyond_hard_limit"), of that kind. Not
        # journaled: at a restart each blocks until tried.
        self._quota_held: dict[str, tuple[str, str]] = {}
        # The placeable slots per device kind, as the allocator last offered them (fair share's
        # denominators; zeros until a worker registers: then the slot share, as before kinds).
        self._capacity: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._capacity_offer = 0  # the number of the allocator's offer it is from (queue.py)
        # Every registered slot per kind, placeable or not, as last offered (None: no offer yet):
        # a queued job needing more can never run as things stand (queue.py ``_behind``).
        self._registered: control_pb2.KindSlots | None = None
        # The queued jobs the starvation bound put ahead in the last order computed (under the
        # lock), and the pass armed for the next job to reach the bound (the order changes then
        # with no other event: its place and its reason are published then, not at a later change).
        self._promoted: set[str] = set()
        self._overdue_at: float | None = None  # (unix time the pass is armed for)
        # Each job holding ranks -> (team, priority, slots per kind) as of the last decision's
        # end: a change of it re-derives its team's borrowed slots (``_refresh_borrowed``).
        self._holdings: dict[str, tuple] = {}
        self._borrowed_all = False  # (the book changed: every team's derived again)
        self._team_lock = threading.Lock()  # orders team commands: journal, then book (taken before the decision lock)
        self._queue.order = self._fair_entries

    # ------------------------------------------------------------ admission

    def _holds_ranks(self, job: _Job) -> bool:
        return job.queued is None and job.status.state not in _IDLE and not job.parked

    def _usage(self) -> dict[str, dict[str, int]]:
        """Under the lock: slots held per team and device kind now."""
        return usage_of(j for j in self._jobs.values() if self._holds_ranks(j))

    def _slots(self, job: _Job) -> int:
        spec = self._relaunch_spec(job) or job.spec
        return spec.world_size

    def _quota_admission(self, job: _Job) -> Admission:
        """Under the lock: whether ``job``'s team's quota lets it start now."""
        return admit(self._quotas, self._usage(), team_of(job.status), self._slots(job), kind_of(job))

    def _borrowed_of(self, job: _Job) -> int:
        """Under the lock: of ``job``'s ranks (its world size now, as if it held them), those
        beyond its team's nominal quota (``_team_borrowed``'s rule)."""
        team = team_of(job.status)
        mine = [j for j in self._jobs.values() if j is not job and self._holds_ranks(j) and team_of(j.status) == team]
        return self._team_borrowed(team, [*mine, job]).get(job.status.job_id, 0)

    def _team_borrowed(self, team: str, jobs: list[_Job]) -> dict[str, int]:
        """Under the lock: each of ``team``'s ``jobs`` (those holding ranks) -> its slots beyond
        the team's nominal (admission.py ``borrowed_by_job``): the nominal covers them in the
        team's queue order (higher priority first, then earlier submission), the rest is
        borrowed, and reclaim.py takes those first."""
        jobs = sorted(jobs, key=lambda j: (-j.status.priority, j.status.created_unix, j.status.job_id))
        return borrowed_by_job(self._quotas.get(team), [(j.status.job_id, held_by_kind(j.status)) for j in jobs])

    def _refresh_borrowed(self) -> None:
        """Under the lock, as a decision ends (and before reclaim reads it): ``borrowed_slots``
        (`surgectl status`'s "(N borrowed)") of every job of each team whose holdings changed
        in it (a job placed, ended, resized, moved, its priority) or of every team (the book
        changed), derived again by ``_team_borrowed``: not a copy kept from the job's
        placement, which stayed when another job of its team ended. A job holding no ranks
        borrows none. Published with the decision; journaled with the job's next write (a
        restarted control derives it again as it publishes its jobs)."""
        dirty: set[str] = set()
        for job_id in list(self._changed):
            job = self._jobs.get(job_id)
            holding = job is not None and self._holds_ranks(job)
            mark = (
                (team_of(job.status), job.status.priority, tuple(held_by_kind(job.status).items())) if holding else None
            )
            before = self._holdings.get(job_id)
            if mark != before:
                dirty.update(m[0] for m in (mark, before) if m is not None)
                if mark is None:
                    self._holdings.pop(job_id, None)
                else:
                    self._holdings[job_id] = mark
            if not holding and job is not None and job.status.borrowed_slots:
                job.status.borrowed_slots = 0
        if self._borrowed_all:
            self._borrowed_all = False
            dirty = {m[0] for m in self._holdings.values()}
        if not dirty:
            return
        by_team: dict[str, list[_Job]] = {}
        for job_id, mark in self._holdings.items():
            if mark[0] in dirty:
                by_team.setdefault(mark[0], []).append(self._jobs[job_id])
        for team, jobs in by_team.items():
            got = self._team_borrowed(team, jobs)
            for job in jobs:
                if job.status.borrowed_slots != got[job.status.job_id]:
                    job.status.borrowed_slots = got[job.status.job_id]
                    self._changed.add(job.status.job_id)

    def _grow_room(self, job: _Job, free: int) -> int:
        """Under the lock: of ``free`` more ranks for the running ``job`` (growing back after a
        shrink), how many its team's quota admits now (0..free)."""
        usage, team, kind = self._usage(), team_of(job.status), kind_of(job)
        return next((n for n in range(free, 0, -1) if admit(self._quotas, usage, team, n, kind).ok), 0)

    def _reclaimable(self, head: _Job, needs: int, free: int) -> list[str]:
        """Under the lock: the running jobs of other teams of ``head``'s cohort on borrowed
        slots to reclaim so that ``head`` (within its team's nominal quota) can start
        (scheduler/reclaim.py); preemption.py takes them first, whatever their priority."""
        self._refresh_borrowed()  # (derived for the holdings of the moment)
        running = [
            SimpleNamespace(
                job_id=j.status.job_id,
                team=team_of(j.status),
                slots=j.status.world_size,
                priority=j.status.priority,
                started=j.running_since,
                borrowed=j.status.borrowed_slots,
                kind=landed_kind(j),
            )
            for j in self._jobs.values()
            if j is not head and self._holds_ranks(j)
        ]
        return reclaim_victims(self._quotas, self._usage(), team_of(head.status), needs, free, running, kind_of(head))

    def _check_team_limits(self, team: str, slots: int, source: str, kind: str = "any") -> None:
        """A submit of ``slots`` of device ``kind`` for ``team``: refused when beyond what the
        team may ever hold (scheduler/admission.py rule 1: its hard limit, its nominal plus its
        borrow limit, its cohort's nominal), or of kind ``any`` for a team whose quota is per
        device kind -- as Slurm refuses a job over its association's limits at submit.

        Raises:
            BeyondHardLimit: one line naming the file, the team, the quota's field and the bound.
        """
        a = admit(self._quotas, {}, team, slots, kind)
        if a.never:
            raise BeyondHardLimit(f"{source}: team: {a.reason}")

    def _fair_entries(self, entries: list[QueueEntry]) -> list[QueueEntry]:
        """The queue's entries (by key) in the fair order across teams (scheduler/fair_share.py).
        Under the lock: the jobs promoted by the starvation bound are kept (``_promoted``) and
        a pass is armed for the next job to reach it."""
        by_id = {e.job_id: e for e in entries}
        claims = self._claims()
        waiting = [self._waiting_of(e, claims) for e in entries]
        now, promoted = time.time(), set()
        order = fair_order(waiting, self._usage(), self._quotas, self._capacity, now, promoted)
        self._promoted = promoted
        self._arm_overdue(next_overdue(waiting, self._quotas, now), now)
        return [by_id[w.job_id] for w in order]

    def _arm_overdue(self, when: float | None, now: float) -> None:
        """Under the lock: a pass at ``when`` (unix time), when a queued job reaches the
        starvation bound, unless one is armed as early (a policy's wait: preemption.py's
        ``_arm_policy_timer``, one timer, re-arming replaces it)."""
        if when is None or (self._overdue_at is not None and self._overdue_at <= when):
            return
        self._overdue_at = when
        self._arm_policy_timer("starvation bound", when - now + 0.05, self._overdue_pass)

    def _overdue_pass(self) -> None:
        """A queued job reached the starvation bound: the order is computed again, its place
        published and the queue tried (its reason says it was promoted)."""
        with self._lock:
            self._overdue_at = None
            self._places_changed = True
            self._start_soon()

    def _waiting_of(self, e: QueueEntry, claims: Collection[str] = ()) -> Waiting:
        job = self._jobs.get(e.job_id)
        if job is None:
            return Waiting(e.job_id, "default", 1, e.priority, e.seq, e.first, submitted=e.submitted)
        since = job.status.queued_unix or job.status.created_unix  # (journaled: its age survives a restart)
        if since:  # (its earlier waits, before it was preempted or requeued, count towards the bound)
            since -= job.status.waited_seconds
        return Waiting(
            e.job_id,
            team_of(job.status),
            self._slots(job),
            e.priority,
            e.seq,
            e.first,
            kind_of(job),
            since or None,
            claims=e.job_id in claims,
            submitted=e.submitted,
        )

    def _claims(self) -> set[str]:
        """Under the lock: the queued preemptors whose victims' slots are theirs (scheduler/
        fair_share.py, "A preemptor's claim"): named by a victim's ``preempted_by`` while that
        victim checkpoints to release its slots, or waits queued having released them since the
        preemptor last ran (once it has run, the claim is spent: a victim still queued then
        does not put it first again). A preemptor itself preempted meanwhile claims nothing
        (its own preemptor's claim comes first), nor one whose claim's time ran out
        (``claim_until``: preemption.py ``_claim_ended``). Derived from journaled fields: a
        restarted control keeps the claims."""
        claims: set[str] = set()
        now = time.time()
        for v in self._jobs.values():
            by = v.status.preempted_by
            if not by or (head := self._jobs.get(by)) is None or by not in self._queue or head.status.preempted_by:
                continue
            if 0 < head.claim_until <= now:
                continue
            checkpointing = v.status.state == JobState.RUNNING and v.pending == "pause"
            if checkpointing or (v.status.job_id in self._queue and v.status.queued_unix >= head.running_since):
                claims.add(by)
        return claims

    def _ahead_at_submit(self, job: _Job, priority: int) -> bool:
        """Under the lock: whether a queued job comes before the new ``job`` in the fair order
        and holds it back: one not waiting for workers to join; if its team's own limits hold
        it, one of the same team; if its cohort's idle slots, one of the same cohort."""
        if not len(self._queue):
            return False
        team, kind = team_of(job.status), kind_of(job)
        within_nominal: Admission | None = None  # (asked once, at the first cohort hold of another team)
        new = Waiting(
            job.status.job_id, team, job.spec.world_size, priority, 1 << 62, kind=kind, submitted=float("inf")
        )
        claims = self._claims()
        queued = [self._waiting_of(e, claims) for e in sorted(self._queue.ordered(), key=QueueEntry.key)]
        for w in fair_order([*queued, new], self._usage(), self._quotas, self._capacity, time.time()):
            if w.job_id == new.job_id:
                return False
            if self._queue.beyond_cluster(w.job_id):
                continue
            held, scope = self._quota_held.get(w.job_id, ("", ""))
            if held == "beyond_hard_limit":
                continue
            if held == "cohort_full" and (
                self._quotas.cohort_of(w.team) != self._quotas.cohort_of(team) or not blocks(w.kind, kind)
            ):
                continue
            if held == "cohort_full" and w.team != team:  # (backfill within nominal: fair_share.py)
                within_nominal = within_nominal or self._quota_admission(job)
                if backfills(team, w.team, within_nominal):
                    continue
            if held and held != "cohort_full" and (w.team != team or not blocks(scope, kind)):
                continue
            if not held and not blocks(w.kind, kind):  # (waiting for slots of another kind)
                continue
            return True
        return False

    # ------------------------------------------------------------ admin commands

    def set_team_quota_request(self, msg: control_pb2.SetTeamQuotaRequest, payload: Any = None) -> control_pb2.TeamList:
        """`surgectl team set NAME ...` / `surgectl team remove NAME`: the team's quota set (or
        removed: the default applies), journaled, then in force; queued jobs are tried again.

        ``set_max_wait``: the cluster's starvation bound instead (``max_wait_minutes``; -1:
        none), journaled, kept across a restart over the quota file's.

        Raises:
            QuotaFileError (a ValueError): a field out of range (one line naming it).
        """
        if msg.set_max_wait:
            return self._set_max_wait(msg.max_wait_minutes)
        name = msg.quota.name
        if msg.remove:
            quota = None
            if name not in self._quotas.teams:
                listed = ", ".join(self._quotas.teams) or "none"
                raise QuotaFileError(f"team remove: team {name!r} has no quota of its own (teams with one: {listed})")
        else:
            q = msg.quota
            quota = quota_from_fields(
                {
                    "nominal": _bound_of(q, "nominal"),
                    "borrow_limit": _bound_of(q, "borrow_limit"),
                    "hard_limit": _bound_of(q, "hard_limit"),
                    "weight": q.weight,
                    "cohort": q.cohort or "default",
                }
            )
        check_team_name(name)
        with self._team_lock:  # journaled, then in force, in the same order for every command
            self._journal.save_team_quota(name, None if quota is None else quota.to_json())
            with self._lock:
                self._quotas = self._quotas.without(name) if quota is None else self._quotas.with_team(name, quota)
                self._book_changed()
        return self.team_query(control_pb2.TeamQuery())

    def _set_max_wait(self, minutes: float) -> control_pb2.TeamList:
        """`surgectl team set --max-wait MIN|none`: the starvation bound, journaled, then in force."""
        bound = check_max_wait(minutes)
        with self._team_lock:
            self._journal.save_team_quota(MAX_WAIT_ROW, {"max_wait_minutes": None if bound is None else bound / 60})
            with self._lock:
                self._quotas = self._quotas.with_max_wait(bound)
                self._overdue_at = None  # (armed for the old bound: the next order arms it again)
                self._book_changed()
        return self.team_query(control_pb2.TeamQuery())

    def _book_changed(self) -> None:
        """Under the lock: the book in force changed: holds are decided again, the order and
        the queue tried again, and each running job's ranks beyond its team's nominal derived
        again (``borrowed_slots``: `surgectl status` says "(N borrowed)" after a quota is
        lowered below what a team holds, as `team list` does)."""
        self._quota_held.clear()  # (every hold is decided again by the next pass)
        self._places_changed = True  # (the fair order may change)
        self._borrowed_all = True  # (every job's borrowed slots derived again as the decision ends)
        self._start_soon()

    def team_query(self, msg: control_pb2.TeamQuery, payload: Any = None) -> control_pb2.TeamList:
        """Every team's quota and usage and the waiting jobs in order, from the published views
        (never under the decision lock)."""
        jobs, _ = self._views.listing()
        book = self._quotas
        used: dict[str, int] = {}
        used_kind: dict[str, dict[str, int]] = {}  # team -> gpu/cpu slots held by its jobs of that kind
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        queue = []
        now = time.time()
        for s in jobs:
            team = team_of(s)
            if s.queue_position:
                waiting[team] = waiting.get(team, 0) + 1
                queue.append(
                    control_pb2.QueuedJob(
                        job_id=s.job_id,
                        name=s.name,
                        team=team,
                        position=s.queue_position,
                        priority=s.priority,
                        slots=s.world_size,
                        reason=_queue_reason(s, now, book.max_wait_s),
                        waiting_seconds=_waited(s, now),
                        device=s.device or "any",
                        promoted=s.message.startswith("queued: promoted "),
                        cannot_run=s.cannot_run,
                    )
                )
            elif s.state not in _IDLE and not s.drained:
                used[team] = used.get(team, 0) + s.world_size
                per = used_kind.setdefault(team, {})
                for kind, n in held_by_kind(s).items():  # (an ``any`` job: where it landed)
                    per[kind] = per.get(kind, 0) + n
                running[team] = running.get(team, 0) + 1
        teams = []
        for name in sorted(set(book.teams) | set(used) | set(waiting)):
            q = _quota_msg(name, book.get(name), name in book.teams)
            q.used, q.running_jobs, q.waiting_jobs = used.get(name, 0), running.get(name, 0), waiting.get(name, 0)
            per = used_kind.get(name, {})
            q.used_by_kind.gpu, q.used_by_kind.cpu = per.get("gpu", 0), per.get("cpu", 0)
            quota = book.get(name)
            for kind in KINDS:  # (borrowed per kind: beyond a per-kind nominal, this kind's and "any" jobs')
                nominal, scope = quota.bound("nominal", kind)
                if scope and nominal is not None:
                    setattr(q.borrowed_by_kind, kind, max(0, held_in(per, kind) - nominal))
            if not isinstance(quota.nominal, dict):
                q.borrowed = 0 if quota.nominal is None else max(0, q.used - quota.nominal)
            else:
                q.borrowed = q.borrowed_by_kind.gpu + q.borrowed_by_kind.cpu
            teams.append(q)
        queue.sort(key=lambda j: j.position)
        return control_pb2.TeamList(
            teams=teams,
            default_quota=_quota_msg("", book.default, False),
            queue=queue,
            cluster_slots=sum(self._capacity.values()),
            cluster_by_kind=control_pb2.KindSlots(**self._capacity),
            max_wait_minutes=UNLIMITED if book.max_wait_s is None else book.max_wait_s / 60,
        )


def _waited(s: control_pb2.JobStatus, now: float) -> float:
    """A queued job's time in the queue: since it last entered it, and its earlier waits
    (before it was preempted or requeued): what the starvation bound counts."""
    return max(0.0, now - (s.queued_unix or s.created_unix)) + s.waited_seconds


def _queue_reason(s: control_pb2.JobStatus, now: float, bound_s: float | None) -> str:
    """Why a queued job waits, as `surgectl queue` shows it: its status message; one the
    starvation bound promoted says so with its wait, e.g. ``promoted: waited 2h05m > 120 min
    starvation bound; waits for 4 slots...``."""
    why = s.message.removeprefix("queued: ")
    if not why.startswith("promoted ") or "; " not in why:
        return why
    rest = why.split("; ", 1)[1]
    if bound_s is None:  # (the bound was turned off since: the order is the fair one again)
        return rest
    minutes = int(_waited(s, now) // 60)
    return f"promoted: waited {minutes // 60}h{minutes % 60:02d}m > {bound_s / 60:g} min starvation bound; {rest}"


def _quota_msg(name: str, q: TeamQuota, configured: bool) -> control_pb2.TeamQuota:
    def bound(v: int | None) -> int:
        return UNLIMITED if v is None else v

    msg = control_pb2.TeamQuota(name=name, weight=q.weight, cohort=q.cohort, configured=configured)
    for field in ("nominal", "borrow_limit", "hard_limit"):
        value = getattr(q, field)
        if isinstance(value, dict):  # (per kind: the int field is not read; -1 there says so to old readers)
            setattr(msg, field, UNLIMITED)
            getattr(msg, f"{field}_by_kind").CopyFrom(control_pb2.KindSlots(**{k: bound(value[k]) for k in KINDS}))
        else:
            setattr(msg, field, bound(value))
    return msg


def _bound_of(q: control_pb2.TeamQuota, field: str) -> int | dict[str, int | None] | None:
    """A bound of a TeamQuota message: per kind when its ``*_by_kind`` is set, else the int
    (-1: none)."""
    if q.HasField(f"{field}_by_kind"):
        per = getattr(q, f"{field}_by_kind")
        return {k: None if getattr(per, k) == UNLIMITED else getattr(per, k) for k in KINDS}
    value = getattr(q, field)
    return None if value == UNLIMITED else value
