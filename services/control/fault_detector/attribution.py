"""Attribution ("the survivor is not blamed"): a symptom (a ``comm_error``, a stall) is held
until its cause arrives or its window passes; a cause is published first and the held
symptoms follow it. Also orders what the node agents resend after a control restart."""

from __future__ import annotations

import time

from services.contract import control_pb2
from services.control.fault_detector.rules import (
    _STALLS,
    _SYMPTOMS,
    AGENT_SILENT,
    COMM_ERROR,
    RANK_SILENT,
    RANK_STALLED,
)
from services.control.fault_detector.watch import _Job

# How long past its due time an awaited rank's silence verdict is still waited for (the
# deadline pool may run late under load); then the held reports go without it.
REATTACH_GRACE_S = 2.0


def _silence(report: control_pb2.FaultReport) -> bool:
    """A rank's silence: its own (``rank_silent``) or its node agent's, which relays its beats
    (``worker_lost`` with subclass ``agent_silent``, liveness.py): never a consequence."""
    return report.fault_class == RANK_SILENT or report.subclass == AGENT_SILENT


class Attribution:
    """Held symptoms and their causes (a part of ``FaultDetector``, see detector.py)."""

    def _hold_or_report(self, job_id: str, rank: int, report: control_pb2.FaultReport) -> None:
        with self._job_lock(job_id):
            job = self._jobs[job_id]
            if rank in job.ranks:
                job.ranks[rank].unheard = False  # its agent is back (resending)
                job.back.add(job.ranks[rank].worker_id)
            if report.fault_class == COMM_ERROR and not job.reattaching:
                # A collective failed across a link both ends say is cut, its ranks all
                # beating: the link's fault (links.py), published at once as the cause.
                quiet = self._quiet(job, time.time())
                link = self._link_down_report(job_id, job, rank, quiet, f"failed its collective ({report.detail})")
                if link is not None:
                    report = link
            if report.fault_class == COMM_ERROR and (job.attribution_s > 0 or job.reattaching):
                window = max(job.attribution_s, job.reattach_s if job.reattaching else 0.0)
                self._hold(job_id, report, window=window)
                return
        self._report_graded(job_id, report)

    def _release_held(self, job_id: str) -> None:
        """The attribution window closed with no cause from another rank: the first held
        symptom is the cause after all, and the rest follow it. Unless a stall (of either
        kind: outside or in a collective) is held and some rank has gone quiet: the stalled
        rank itself (its last state, e.g. "in a collective", is then stale: its silence is the
        verdict) or the peer it waits for. Then the window is extended until that rank's
        silence deadline can have fired, and again while it has not (its agent stated a stop
        or a run since) as long as it sent no beat: a rank that beats again, and goes quiet
        once more, is not waited for twice (a slow beater does not hold a stall forever)."""
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None:
                return
            if job.held and (due := self._reattach_due(job)) is not None:
                # After a control restart, a rank not heard from since may still be declared
                # lost: its silence deadline was pushed out by an agent's re-registration
                # (liveness.py ``_reattach_progress``) past this window, which opened with the
                # first held symptom (a survivor's comm_error, applied on the job's queue, can
                # come before that registration, on the node's). The story waits for that
                # verdict: released alone, the survivor's symptom was decided as the cause
                # (CI ci4, test_control_restart's node agent lost before the restart).
                job.held_timer = self._deadlines.after(
                    max(0.0, due - time.monotonic()) + 0.5, self._release_held, (job_id,)
                )
                return
            if any(r.fault_class in _STALLS for r in job.held):
                pending = [
                    (r, w)
                    for r in self._quiet(job, time.time())
                    if (w := job.ranks[r]).silence is not None
                    and job.held_waited.get(r, w.last_beat_unix) == w.last_beat_unix
                ]
                if pending:
                    job.held_waited.update((r, w.last_beat_unix) for r, w in pending)
                    wait = max(w.silence_due for _, w in pending) - time.monotonic()
                    job.held_timer = self._deadlines.after(max(0.0, wait) + 0.5, self._release_held, (job_id,))
                    return
            if job.held_timer is not None:
                job.held_timer.cancel()  # (released early: every rank re-attached)
            held, job.held, job.held_timer = job.held, [], None
            job.held_waited = {}
            restored = job.reattach_s > 0
        causes = self._causes(held)
        if restored and causes:
            # Reports held while the node agents re-attached after a control restart: the
            # cause that happened first (long before it arrived) goes first; the rest keep
            # their order (a rank's exit stays after its own symptom).
            first = min(causes, key=lambda r: r.occurred_unix)
            held = [first] + [r for r in held if r is not first]
        elif not causes:
            # Symptoms only: a rank stalled outside a collective is what the ranks stalled
            # in one wait for, whichever deadline fired first: it goes first (the rest keep
            # their order).
            held = sorted(held, key=lambda r: r.fault_class != RANK_STALLED)
        for report in held:
            self._emit(report)

    @staticmethod
    def _reattach_due(job: _Job) -> float | None:
        """When the last silence deadline of a rank still awaited after a control restart is
        due (time.monotonic()), or None: none is awaited, or that deadline is cancelled or
        overdue by ``REATTACH_GRACE_S`` (its verdict is not waited for forever)."""
        dues = [
            w.silence.when
            for r in job.reattaching
            if (w := job.ranks.get(r)) is not None and w.unheard and w.silence is not None and not w.silence.cancelled
        ]
        if not dues or time.monotonic() > max(dues) + REATTACH_GRACE_S:
            return None
        return max(dues)

    @staticmethod
    def _causes(held: list[control_pb2.FaultReport]) -> list[control_pb2.FaultReport]:
        """The held reports that may be an incident's cause: not a symptom, and not a report
        of a rank after its own symptom (a survivor's exit after its failed collective
        follows that failure, as ``_report_graded`` orders it live). A silence always may."""
        symptomatic: set[int] = set()
        causes = []
        for r in held:
            if r.fault_class in _SYMPTOMS:
                symptomatic.add(r.rank)
            elif r.rank not in symptomatic or _silence(r):
                causes.append(r)
        return causes

    @staticmethod
    def _held_rank(job: _Job, rank: int) -> bool:
        return any(r.rank == rank for r in job.held)

    def _hold(
        self,
        job_id: str,
        report: control_pb2.FaultReport,
        window: float,
        waited: list[int] = (),
        followers: list[control_pb2.FaultReport] = (),
    ) -> None:
        """Hold a symptom until its cause arrives or ``window`` seconds pass. The window
        opens with the first symptom held and does not move (``waited``: the quiet ranks
        whose silence deadline it covers, see _release_held). ``followers`` are held with
        it, after it."""
        with self._job_lock(job_id):
            job = self._jobs[job_id]
            if not job.held:
                job.held_waited = {r: job.ranks[r].last_beat_unix for r in waited if r in job.ranks}
                if job.held_timer is not None:
                    job.held_timer.cancel()
                job.held_timer = self._deadlines.after(window, self._release_held, (job_id,))
            job.held.append(report)
            job.held.extend(followers)

    def _report_graded(self, job_id: str, report: control_pb2.FaultReport) -> None:
        """Publish a graded report as a cause, unless its rank has a symptom held: then it
        follows that symptom (e.g. the held rank's own exit)."""
        rank = report.rank
        with self._job_lock(job_id):
            job = self._jobs[job_id]
            if job.reattaching:
                # Restored after a control restart: the node agents resend what happened
                # while control was down one after another; the whole story is ordered
                # once every rank was heard from (see _release_held).
                self._hold(job_id, report, window=job.reattach_s)
                return
            # A replaced incarnation's end is no cause of the symptoms held now (they are its
            # successors'): published alone, nothing held goes with it.
            alone = report.replaced
            # A silence is never a consequence: it is published as a cause at once.
            if not alone and job.held and not _silence(report) and self._held_rank(job, rank):
                job.held.append(report)  # the held rank's own exit follows its symptom
                return
        if alone:
            self._emit(report)
            return
        self._publish_cause(job_id, report)

    def _publish_cause(self, job_id: str, report: control_pb2.FaultReport) -> None:
        """Publish ``report``, then whatever symptoms were waiting for a cause: it is theirs.
        Published outside the lock: the orchestrator may command this module back."""
        with self._job_lock(job_id):
            job = self._jobs[job_id]
            held, job.held, job.held_waited = job.held, [], {}
            if job.held_timer is not None:
                job.held_timer.cancel()
                job.held_timer = None
        self._emit(report)
        for symptom in held:
            self._emit(symptom)
