"""Profiling on demand (issue 31 item 3): L1-1's ProfileSteps is a boundary command (held
until every rank holds it, in force at the boundary the step's all-reduce agrees on), so every
rank profiles the same steps and the traces line up. The profile starts at that boundary and
stops at the boundary ``steps`` steps later (or the loop's end, whichever comes first); the
files go to L5-2 (StoreProfile) and the rank reports ProfileRecorded to L1-1. A profile is a
measurement: whatever goes wrong with it is reported in ``ProfileRecorded.error`` and the job
trains on. A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from services.common import phase as ph
from services.contract import engine_pb2, store_pb2

_log = structlog.get_logger("training_loop")


@dataclass
class _Running:
    msg: engine_pb2.ProfileSteps
    first_step: int
    profiler: Any  # services.engine.step_profiler.StepProfiler


class Profiling:
    """The profile in progress, if any (a part of ``TrainingLoop``, see loop.py)."""

    _profile: _Running | None = None

    def profile_steps(self, msg: engine_pb2.ProfileSteps, payload: Any = None) -> None:
        """Held until the ranks agree on its boundary, as a pause is. Raises
        UnsequencedCommand (``seq`` 0)."""
        self._commands.receive(msg)

    def _begin_profile(self, msg: engine_pb2.ProfileSteps, step: int) -> None:
        """At the boundary after ``step``: start profiling the next ``msg.steps`` steps. One at
        a time: a second one in force while the first records is answered with an error (every
        rank alike: the same commands are in force at the same boundaries)."""
        if self._profile is not None:
            running = self._profile.msg
            self._report_profile(msg, 0, 0, error=f"profile #{running.seq} is still recording")
            return
        try:
            profiler = self._profiler_of(self._rank)
            profiler.start()
        except Exception as e:  # noqa: BLE001 - a measurement that failed: reported, training goes on
            self._report_profile(msg, 0, 0, error=f"the profiler did not start: {type(e).__name__}: {e}")
            return
        self._profile = _Running(msg, step + 1, profiler)
        _log.info("profile_started", seq=msg.seq, first_step=step + 1, steps=msg.steps)

    def _profile_boundary(self, step: int, *, ending: bool = False) -> None:
        """At the boundary after ``step`` (or the loop's end): stop the profile whose last step
        this is, store its files, report it."""
        running = self._profile
        if running is None:
            return
        if step < running.first_step + running.msg.steps - 1 and not ending:
            if step >= running.first_step:
                running.profiler.step()  # (the trace marks each profiled step)
            return
        self._profile = None
        if step < running.first_step:  # (ended before its first step: nothing was profiled)
            running.profiler.discard()
            self._report_profile(
                running.msg, running.first_step, step, error="the run ended before the profile's first step"
            )
            return
        # Ending it holds the interpreter lock (step_profiler.py): declared first, and stated
        # by a beat before it starts, so that control allows the beats' silence within it.
        self._mark.enter(ph.PROFILE_EXPORT, total=step - running.first_step + 1)
        if not self._mark.announce():
            _log.warning("profile_export_unannounced", seq=running.msg.seq)  # (the next beat states it)
        try:
            files, seconds = running.profiler.stop()
            stored = self._p.metrics(
                store_pb2.StoreProfile(job_id=self._job_id, rank=self._rank, seq=running.msg.seq),
                {name: str(path) for name, path in files.items()},
            ).message
            self._report_profile(running.msg, running.first_step, step, stored=stored, seconds=seconds)
        except Exception as e:  # noqa: BLE001 - a measurement that failed: reported, training goes on
            _log.warning("profile_not_recorded", seq=running.msg.seq, error=str(e))
            self._report_profile(running.msg, running.first_step, step, error=f"{type(e).__name__}: {e}")
        finally:
            running.profiler.discard()

    def _report_profile(
        self,
        msg: engine_pb2.ProfileSteps,
        first: int,
        last: int,
        *,
        stored: store_pb2.ProfileStored | None = None,
        seconds: float = 0.0,
        error: str = "",
    ) -> None:
        self._emit(
            engine_pb2.ProfileRecorded(
                job_id=self._job_id,
                rank=self._rank,
                seq=msg.seq,
                first_step=first,
                last_step=max(last, 0),
                files=list(stored.files) if stored is not None else [],
                bytes=stored.bytes if stored is not None else 0,
                seconds=seconds,
                error=error[:500],
            )
        )
