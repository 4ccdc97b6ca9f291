"""A node that announces its departure (issue 30 item 5): its node agent's SIGTERM or SIGUSR1
(WorkerDeparting, with a deadline) or the operator's `surgectl drain NODE --deadline S`.

A departure known in advance is no fault: each running job with ranks on the node checkpoints
at a step boundary every rank agrees on (the pause's boundary command), then its ranks are
relaunched without the node (a new generation on the free slots, a spare first in line; the
departing node is out of placement) from that checkpoint: no step lost, no fault recorded, the
restart budgets untouched. Whether the deadline leaves time for that is departure_plan.py's
answer (the job's last measured save, with a margin). Too short: the ranks move now from the
newest committed checkpoint (read from the nodes' memory copies where they hold it), the steps
after it lost, said in a warning; no checkpoint at all: a warning, and the ranks' end at the
deadline is the job's worker_departed fault, decided by its policy as before.

A fault during the move is a recovery, which supersedes it (activity.admit: the recovery's
relaunch places the ranks, and the departing node is out of placement for it too); a second
departure while a job moves is folded into the move under way (its relaunch comes after, and
places the ranks off both nodes).
"""

from __future__ import annotations

import math
import time
from typing import Any

import structlog

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator.activity import REFUSE, PauseAsk, admit
from services.control.orchestrator.departure_plan import CHECKPOINT, FROM_NEWEST, plan_departure
from services.control.orchestrator.job import ORCH, JobState, _Job
from services.control.orchestrator.refusals import BadDeparture
from services.control.orchestrator.texts import _usable, newest_usable
from services.control.orchestrator.undos import Before

_log = structlog.get_logger("orchestrator")

DEPARTURE = "departure"  # the event type of a departure's decisions and warnings


class Departures:
    """Nodes leaving with notice (a part of ``Orchestrator``, see core.py)."""

    def on_worker_departing(self, msg: control_pb2.WorkerDeparting, payload: Any = None) -> None:
        """A node agent got SIGTERM or SIGUSR1: its ranks run until they are released or its
        deadline passes. On the applier thread: only decisions and queued commands here."""
        # The deadline is counted from the agent's signal, not from this event's arrival.
        late = max(0.0, time.time() - msg.unix_time) if msg.unix_time > 0 else 0.0
        source = f"its node agent got {msg.signal}" if msg.signal else "its node agent is leaving"
        self._depart(msg.worker_id, msg.deadline_seconds - late, source)

    def drain_worker_request(self, msg: control_pb2.DrainWorkerRequest, payload: Any = None) -> control_pb2.JobList:
        """`surgectl drain NODE --deadline S`: the node is cordoned (nothing new placed there;
        `surgectl uncordon` or a new node agent incarnation ends it) and its jobs move as for a
        node agent's departure. Returns the statuses of the jobs with ranks there.

        Raises:
            BadDeparture: no worker named, or a deadline that is not > 0 (one line).
        """
        if not msg.worker_id:
            raise BadDeparture("drain: a worker id is required")
        if not 0 < msg.deadline_seconds < math.inf:  # (NaN and inf too: a deadline is a time)
            raise BadDeparture(
                f"drain: --deadline must be a finite number of seconds > 0, got {msg.deadline_seconds:g}"
            )
        reason = f"draining: leaves within {msg.deadline_seconds:g} s (`surgectl drain`)"
        cordon = self._allocator(
            control_pb2.CordonWorker(worker_id=msg.worker_id, reason=reason, unix_time=time.time())
        ).message
        self.on_worker_cordoned(cordon)
        _log.info("worker drained by the operator", worker_id=msg.worker_id, deadline_s=msg.deadline_seconds)
        return control_pb2.JobList(jobs=self._depart(msg.worker_id, msg.deadline_seconds, "`surgectl drain`"))

    def _depart(self, worker_id: str, deadline_s: float, source: str) -> list[control_pb2.JobStatus]:
        """Each live job with ranks on ``worker_id`` moves off it (``_depart_job``); returns
        their statuses. A node with no job's ranks: nothing to do (it is out of placement
        already: its departing registration or the drain's cordon)."""
        with self._lock:
            jobs = [
                j
                for j in self._jobs.values()
                if worker_id in j.placement.values() and j.status.state not in (JobState.TERMINATED, JobState.STANDBY)
            ]
            for job in jobs:
                self._depart_job(job, worker_id, deadline_s, source)
            if not jobs:
                _log.info("node departs with no job's ranks on it", worker_id=worker_id, deadline_s=deadline_s)
            return [self._snapshot(j) for j in jobs]

    def _depart_job(self, job: _Job, worker_id: str, deadline_s: float, source: str) -> None:
        """Under the lock: one job's answer to its node's departure (module docstring)."""
        if job.parked:  # (drained or parked by `surgectl down`: its ranks stop with the stack)
            return
        head = f"node {worker_id} departs in {_seconds(deadline_s)} s ({source})"
        if job.departure:  # (moving already: the relaunch after its checkpoint places the ranks off both)
            self._record(job, ORCH, DEPARTURE, f"{head}: folded into the move off {job.departure} under way")
            return
        state = job.status.state
        if state == JobState.PAUSED and not job.incident and not job.pending:
            return self._release_paused(job, worker_id, head)
        if state != JobState.RUNNING:
            why = (
                "its ranks are being recovered (the relaunch places none there)"
                if job.incident
                else f"it is {JobState.Name(state)}: its ranks there end at the deadline and its fault policy "
                "decides (worker_departed)"
            )
            self._record(job, ORCH, DEPARTURE, f"{head}: not moved: {why}")
            return
        if job.pending == "stop":
            self._record(job, ORCH, DEPARTURE, f"{head}: its stop in flight checkpoints first; nothing to move")
            return
        admission = admit(job.status.job_id, job.activity, PauseAsk())
        if admission.verdict == REFUSE or job.pending in ("scale", "reload"):
            self._record(
                job,
                ORCH,
                DEPARTURE,
                f"WARNING: {head}: not moved ({admission.reason or 'a resize or rollback is in flight'}); "
                "its ranks there end at the deadline and its fault policy decides (worker_departed)",
            )
            return
        has_checkpoint = bool(_usable(job))
        plan = plan_departure(deadline_s, job.save_seconds, job.step_seconds, has_checkpoint)
        if plan.action == CHECKPOINT:
            before = Before.of(job)
            job.departure = worker_id
            if job.pending == "pause":  # (an operator's pause in flight: its boundary is the move's)
                job.resume_after_pause = False
                self._record(
                    job, ORCH, DEPARTURE, f"{head}: the pause in flight checkpoints, then its ranks move off it"
                )
                self._undo_if_lost(job.status.job_id, lambda e: self._departure_undone(job, None, before))
                return
            cmd = self._in_flight(job, "pause", engine_pb2.PauseTraining(checkpoint=True))
            job.boundary_failed = job.resume_after_pause = job.draining = job.status.drained = False
            job.paused.clear()
            self._record(
                job,
                ORCH,
                DEPARTURE,
                f"{head}: checkpoint at the next step boundary every rank agrees on (command #{cmd.seq} to the "
                f"ranks), then its ranks move off it ({plan.estimate})",
            )
            self._loop(cmd)
            # Undo if its record fails at its commit: no move under way (undos.py).
            self._undo_if_lost(job.status.job_id, lambda e: self._departure_undone(job, cmd, before))
            return
        if plan.action == FROM_NEWEST:
            step, version = self._newest_version(job)
            lost = max(job.status.step - step, 0)
            said = (
                f"WARNING: {head}: too short for a save ({plan.estimate}); its ranks move now from checkpoint "
                f"{version} (step {step}; read from the nodes' memory copies where they hold it): {lost} steps lost"
            )
            self._move(job, worker_id, step, version, f"node {worker_id} departs: resuming from {version}", said=said)
            return
        self._record(
            job,
            ORCH,
            DEPARTURE,
            f"WARNING: {head}: too short for a save ({plan.estimate}) and no checkpoint to move to; its ranks "
            "there end at the deadline and its fault policy decides (worker_departed)",
        )

    def _release_paused(self, job: _Job, worker_id: str, head: str) -> None:
        """Under the lock: a PAUSED job with ranks on the leaving node (an operator's pause).
        Its ranks are released now (their exits are no fault, no restart is spent) and it stays
        PAUSED, parked: `surgectl resume` relaunches it from its newest checkpoint off the node.
        Without a checkpoint nothing is done here (its ranks end at the deadline and its fault
        policy decides, as for a sudden loss)."""
        if not _usable(job):
            self._record(
                job,
                ORCH,
                DEPARTURE,
                f"{head}: not moved: it is PAUSED with no checkpoint to resume from; its ranks there end at the "
                "deadline and its fault policy decides (worker_departed)",
            )
            return
        step, version = self._newest_version(job)
        lost = job.status.step - step
        before = Before.of(job)
        job.parked, job.parked_live = True, False
        self._record(
            job,
            ORCH,
            DEPARTURE,
            f"{head}: PAUSED at step {job.status.step}: its ranks are released now (no fault, no restart spent); "
            f"`surgectl resume {job.status.job_id}` relaunches it from {version} (step {step}) off {worker_id}"
            + (f" ({lost} steps after it are lost: the pause had no checkpoint)" if lost > 0 else ""),
        )
        # After its record (the outbox sends it once that is committed; it went before, whatever
        # became of the record, and a lost record left a PAUSED job with its ranks killed that
        # the journal did not say was parked).
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=True))
        # Undo if its record fails at its commit: not parked (its release went with the record).
        self._undo_if_lost(job.status.job_id, lambda e: self._departure_undone(job, None, before))

    def _departure_paused(self, job: _Job, step: int) -> None:
        """Under the lock, on the applier thread: every rank paused at the departure's boundary
        ``step`` after its checkpoint's commit (or its failure): the ranks move."""
        worker_id = job.departure
        job.pending, job.status.step = "", step
        if job.boundary_failed:  # its checkpoint could not be saved: nothing new to move to
            job.departure = ""
            self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id))
            self._record(
                job,
                ORCH,
                DEPARTURE,
                f"WARNING: node {worker_id} departs: the checkpoint of step {step} could not be saved; the ranks "
                "continue; their end at the deadline is decided by the job's fault policy (worker_departed)",
            )
            return
        newest, version = self._newest_version(job)
        self._move(
            job, worker_id, newest, version, f"node {worker_id} departs: checkpoint at step {newest}", paused=True
        )

    def _newest_version(self, job: _Job) -> tuple[int, str]:
        """(step, version) of the job's newest usable version (callers checked there is one)."""
        newest = newest_usable(job)
        assert newest is not None
        return newest

    def _move(
        self, job: _Job, worker_id: str, step: int, version: str, head: str, said: str = "", paused: bool = False
    ) -> None:
        """Under the lock: the job's ranks are killed (released: their exits are no fault) and
        relaunched from ``version`` on placeable slots (the departing node is not one), the
        restart budgets kept; it waits in the queue first in line until its release went (and
        for free slots, where there are none). ``said``: the warning that decided it, its
        first record; ``paused``: every rank waits at the departure's checkpoint boundary.

        One decision (one_write.py): its records are one journal write and the release
        follows it, so a failed commit loses them and the release together, and is undone
        (undos.py ``_move_undone``: the job runs on, its ranks paused for the move continue)."""
        before = Before.of(job)
        waited = (job.status.queued_unix, job.status.borrowed_slots)
        with self._one_write(job):
            if said:
                self._record(job, ORCH, DEPARTURE, said)
            job.parked, job.parked_live, job.departure = True, False, ""
            self._transition(
                job,
                JobState.PAUSED,
                ORCH,
                f"{head}: ranks released to move off {worker_id} (no fault, no restart spent)",
            )
            job.status.drained = True  # (first in the queue: nothing else takes the slots it frees)
            self._queue_resume(
                job,
                step,
                version,
                None,
                f"waits for its ranks to be released, then continues off {worker_id}",
                by=f"({head}, moving off it)",
                keep_budgets=True,
                start=False,
            )
            # Its place as the queue gives it (drained jobs first, among them in the order they
            # left: was "first in the queue" while `status` said #2, behind one drained earlier).
            where = f"position {self._queue.position(job.status.job_id)} of {len(self._queue)}"
            self._record(
                job, ORCH, DEPARTURE, f"{head} ({version}): continues from it off {worker_id}, queued at {where}"
            )
        # After the move's write (the outbox sends it once that is committed, drops it with it).
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=True))
        self._start_soon()  # (placed once the release went: ``_start_soon`` waits for the decision's commands)
        # Undo only if that write failed (another write of the job's may fail beside it: the
        # move then stands, journaled, its release sent).
        write = self._last_write.get(job.status.job_id)
        self._undo_if_lost(
            job.status.job_id,
            lambda e: (
                (write is None or write.exception() is not None)
                and self._move_undone(job, worker_id, before, waited, paused, e)
            ),
        )


def _seconds(s: float) -> str:
    """A deadline as said in a job's events: one decimal under 10 s (was: 0.5 s said as "0 s")."""
    s = max(s, 0.0)
    return f"{s:.1f}".removesuffix(".0") if s < 10 else f"{s:.0f}"
