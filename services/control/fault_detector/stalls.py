"""Stalls: a rank that beats but makes no progress within its phase's budget. Outside a
collective it is an incident's likely cause (``rank_stalled``), and the peers waiting for it
in one are its consequences (``rank_stalled_in_collective``); a rank waiting in a collective
while a peer still works is no fault. A stall is a symptom: held for attribution.py."""

from __future__ import annotations

import time

import structlog

from services.contract import Module, control_pb2
from services.control.fault_detector.rules import QUIET_BEATS, RANK_STALLED, RANK_STALLED_IN_COLLECTIVE
from services.control.fault_detector.watch import _DATA_PHASES, _RESTING, RankPhase, _Job, _RankWatch, phase_name

_log = structlog.get_logger("fault_detector")


class Stalls:
    """Progress deadlines and blame by phase (a part of ``FaultDetector``, see detector.py)."""

    def _stall_passed(self, job_id: str, rank: int, watch: _RankWatch) -> None:
        """The rank made no progress for its phase's budget. Outside a collective it is an
        incident's likely cause (``rank_stalled``), reported with the peers that wait for
        it in a collective as its consequences (``rank_stalled_in_collective``, after it).
        In a collective it waits for someone: while a peer still works (progressing outside
        a collective) that is no fault, and the rank waits without a deadline of its own
        until it moves on (that peer's own deadline reports it, if that peer stalls);
        otherwise it is reported as a symptom, held for its cause, with the ranks waiting
        in a collective that way."""
        now = time.time()
        consequences: list[tuple[int, _RankWatch]] = []
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None or job.ranks.get(rank) is not watch or watch.stall is None:
                return
            watch.stall = None
            quiet = self._quiet(job, now)
            if (
                watch.phase == RankPhase.PHASE_COLLECTIVE
                and rank not in quiet
                and any(
                    r != rank and (r not in quiet and self._working(w) or self._waits_for_data(w) or self._exporting(w))
                    for r, w in job.ranks.items()
                )
            ):
                # Waiting for a peer that still works (e.g. a longer evaluation on it), or that
                # waits for the data service (L1-1 waits for it too), or that ends a profile
                # (its export holds its interpreter lock: quiet by nature); a late beat of that
                # peer changes nothing: were it gone, its silence deadline reports it: no fault
                # (see the docstring).
                watch.waiting = True
                return
            if rank in quiet:
                # It stopped beating too: its silence deadline reports it (as silent). Should it
                # beat again without progress (a pause, not a death), that beat re-arms this one.
                watch.deferred = True
                return
            link = None
            if watch.phase == RankPhase.PHASE_COLLECTIVE:
                # Waiting across a link both ends say is cut, its ranks all beating: the link's
                # fault, not a rank's (links.py); a cause, published at once (outside the lock).
                link = self._link_down_report(job_id, job, rank, quiet, "waits in a collective with no progress")
            if link is None:
                watch.stalled = True  # declared once; the next progress re-arms the deadline
                deadline = job.phase_deadline_s(watch.phase, watch.phase_total, watch.data_outage)
                in_collective = watch.phase == RankPhase.PHASE_COLLECTIVE
                for r, w in sorted(job.ranks.items()):
                    # Outside a collective: its peers waiting in one since (at least 1.5 of their
                    # beats without progress) wait for it. In one: the peers that waited without
                    # a deadline for a peer that worked then. Consequences, reported after it.
                    if r == rank or r in quiet or w.phase != RankPhase.PHASE_COLLECTIVE or not w.stepping or w.stalled:
                        continue
                    if w.waiting or (
                        not in_collective and now - w.last_progress_unix > QUIET_BEATS * (w.interval_s or 1.0)
                    ):
                        if w.stall is not None:
                            w.stall.cancel()
                        w.stall, w.stalled, w.waiting = None, True, False
                        consequences.append((r, w))
        if link is not None:
            self._publish_cause(job_id, link)
            return
        stalled_for = now - watch.last_progress_unix
        where = phase_name(watch.phase)
        fault_class = RANK_STALLED_IN_COLLECTIVE if in_collective else RANK_STALLED
        if in_collective:
            text = (
                f"rank {rank} on worker {watch.worker_id} waits in a collective: no step progress for "
                f"{stalled_for:.1f} s (deadline {deadline:.1f} s) after step {max(watch.step, 0)}"
            )
        else:
            text = (
                f"rank {rank} on worker {watch.worker_id} is alive but made no step progress for {stalled_for:.1f} s "
                f"(deadline {deadline:.1f} s) after step {max(watch.step, 0)}"
            )
            if where:
                text += f", in its {where} phase" + (
                    f" ({watch.phase_progress} of {watch.phase_total} done)" if watch.phase_total else ""
                )
        report = self._graded(
            job_id,
            fault_class,
            Module.EXT_HARDWARE,
            rank,
            text,
            occurred=watch.last_progress_unix,
            worker_id=watch.worker_id,
            step=max(watch.step, 0),
            phase=watch.phase,
        )
        if report is None:
            return
        followers = self._waiting_reports(job_id, consequences, rank, f"stalled in its {where or 'step'}", now)
        # Held: until a quiet peer's silence deadline can have fired, or long enough to
        # tell whether a peer goes quiet (then extended, see _release_held).
        _log.info(
            "stall held for attribution",
            job_id=job_id,
            rank=rank,
            quiet=quiet,
            phase=where,
            waiting_in_collective=[r for r, _ in consequences],
        )
        if quiet:
            self._hold(
                job_id,
                report,
                window=max(job.attribution_s, job.heartbeat_timeout_s + 0.5),
                waited=quiet,
                followers=followers,
            )
        else:
            self._hold(job_id, report, window=max(job.attribution_s, self._beat_window(job)), followers=followers)

    def _waiting_reports(
        self,
        job_id: str,
        waiting: list[tuple[int, _RankWatch]],
        cause_rank: int,
        how: str,
        now: float,
    ) -> list[control_pb2.FaultReport]:
        """``rank_stalled_in_collective`` reports of the ranks that wait for ``cause_rank``."""
        reports = []
        for r, w in waiting:
            waited = now - w.last_progress_unix
            report = self._graded(
                job_id,
                RANK_STALLED_IN_COLLECTIVE,
                Module.EXT_HARDWARE,
                r,
                f"rank {r} on worker {w.worker_id} waits in a collective: no step progress for {waited:.1f} s "
                f"after step {max(w.step, 0)}, waiting for rank {cause_rank} ({how})",
                occurred=w.last_progress_unix,
                worker_id=w.worker_id,
                step=max(w.step, 0),
                phase=w.phase,
            )
            if report is not None:
                reports.append(report)
        return reports

    @staticmethod
    def _working(w: _RankWatch) -> bool:
        """Progressing outside a collective: stepping, its progress deadline armed, not
        declared stalled, in a phase that is not a collective wait."""
        return (
            w.stepping
            and w.stall is not None
            and not w.stalled
            and w.phase not in _RESTING
            and w.phase != RankPhase.PHASE_COLLECTIVE
        )

    @staticmethod
    def _waits_for_data(w: _RankWatch) -> bool:
        """Stepping, waiting for batches while its data relay reconnects to an unreachable
        data service (DataServiceUnreachable), not declared stalled."""
        return w.stepping and w.data_outage and not w.stalled and w.phase in _DATA_PHASES

    @staticmethod
    def _exporting(w: _RankWatch) -> bool:
        """Stepping, in a profile's announced export (PHASE_PROFILE_EXPORT), not declared
        stalled: its own deadlines allow the export, silence included."""
        return w.stepping and not w.stalled and w.phase == RankPhase.PHASE_PROFILE_EXPORT

    @staticmethod
    def _quiet(job: _Job, now: float) -> list[int]:
        """Ranks with no beat for more than QUIET_BEATS of their beat periods."""
        return [
            r
            for r, w in job.ranks.items()
            if now - w.last_beat_unix > QUIET_BEATS * (w.interval_s or job.heartbeat_timeout_s)
        ]

    @staticmethod
    def _beat_window(job: _Job) -> float:
        """QUIET_BEATS of the longest beat period the job's ranks stated (seconds; 0 when
        none did: then nothing tells a quiet peer before its deadline)."""
        return QUIET_BEATS * max((w.interval_s for w in job.ranks.values()), default=0.0)
