"""A profile of a run of training steps (issue 31 item 3, `surgectl profile`): a torch.profiler
trace of the steps, as Chrome's trace format gzipped (Perfetto and chrome://tracing read it;
``torch.profiler``'s own `tensorboard_trace_handler` writes the same), and on a CUDA device a
memory snapshot of the same steps (``torch.cuda.memory._record_memory_history`` /
``_dump_snapshot``, what https://pytorch.org/memory_viz reads), as torchtitan's
``--profiling.enable_profiling`` and ``--profiling.enable_memory_snapshot`` record them.

The training loop (L2-1) starts one at a step boundary and stops it at a later one; it never
touches the device itself: the composition root says which device the rank trains on.

Ending a profile is slow by nature and holds the interpreter lock throughout (measured on
torch 2.13, CPU, 40 profiled steps of a 30-layer MLP, 111 MB of trace: ``prof.stop()`` 24 s and
``export_chrome_trace`` 4.4 s, no other thread of the process ran meanwhile, the heartbeat's
included): running it on another thread would not let the beats through. So the profile is
``trace_only`` (the trace is all it is for; the post-processing into FunctionEvents that
``key_averages`` reads is skipped: 3.9 s and 1.3 s for the same trace), and the loop declares
the export a phase of its own (PHASE_PROFILE_EXPORT, announced by a beat before it starts)
whose budget control allows for the silence too. An export that takes longer than that budget
is a profile that failed (:class:`ProfileExportOverran`), never a fault.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept by the CUDA memory history (torchtitan's default)


class ProfileExportOverran(RuntimeError):
    """The profile's stop and export took longer than its budget
    (``liveness.phase_seconds.profile_export``...): its files are not kept."""


def _record_every_step(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class StepProfiler:
    """One profile: :meth:`start` at a boundary, :meth:`stop` at a later one, which returns the
    files it wrote ({file name: local path}) in a private temporary directory that
    :meth:`discard` removes once the files were handed on."""

    def __init__(
        self,
        rank: int,
        device: str,
        *,
        export_budget_s: Callable[[float], float] | None = None,
        before_export: Callable[[], None] | None = None,
    ):
        """``export_budget_s``: the profiled steps' seconds -> how long the stop and export
        may take (services.common.phase.profile_export_budget_s with the job's liveness; None:
        no bound). ``before_export``: a test-only hook (services/rank/faults.py)."""
        self._rank = rank
        self._budget_of = export_budget_s
        self._before_export = before_export
        self._cuda = device.startswith("cuda") and torch.cuda.is_available()
        self._dir = Path(tempfile.mkdtemp(prefix=f"surge-profile-rank{rank}-"))
        self._prof: torch.profiler.profile | None = None
        self._t0 = 0.0

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # (before the profiler: the snapshot covers the same steps as the trace)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        # (no profile_memory: with it a traced step of the demo model took 2.0x an untraced one, without it
        # 1.03-1.06x (bench/profile_overhead.py); the CUDA snapshot says where device memory went)
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            # (what makes prof.stop() 6x shorter, see the module docstring)
            experimental_config=torch._C._profiler._ExperimentalConfig(trace_only=True),
            schedule=_record_every_step,  # (a schedule is what makes the trace mark each step: ProfilerStep#N)
        )
        self._prof.start()
        self._t0 = time.perf_counter()

    def step(self) -> None:
        """A step boundary inside the profile: the trace marks each step (``ProfilerStep#N``)."""
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> tuple[dict[str, Path], float]:
        """End the profile; returns its files and the profiled steps' wall seconds (the
        export's time not included). An export that fails raises, one that overran its budget
        raises ProfileExportOverran; :meth:`discard` still removes what it wrote."""
        assert self._prof is not None, "stop before start"
        prof, self._prof = self._prof, None
        seconds = time.perf_counter() - self._t0
        t0 = time.perf_counter()
        if self._before_export is not None:
            self._before_export()
        try:
            prof.stop()
            files = self._export(prof)
        finally:
            self._end_memory_history()  # (a failed export must not leave every later step recording allocations)
        took = time.perf_counter() - t0
        budget = self._budget_of(seconds) if self._budget_of is not None else None
        if budget is not None and took > budget:
            raise ProfileExportOverran(
                f"its export took {took:.1f} s, over its budget of {budget:.1f} s "
                "(liveness.phase_seconds.profile_export; profile fewer steps)"
            )
        return files, seconds

    def _export(self, prof: torch.profiler.profile) -> dict[str, Path]:
        files: dict[str, Path] = {}
        raw = self._dir / "trace.json"
        prof.export_chrome_trace(str(raw))
        name = f"rank{self._rank}.trace.json.gz"
        with raw.open("rb") as src, gzip.open(self._dir / name, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        files[name] = self._dir / name
        if self._cuda:
            name = f"rank{self._rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(self._dir / name))
            files[name] = self._dir / name
        return files

    def _end_memory_history(self) -> None:
        if self._cuda:
            torch.cuda.memory._record_memory_history(enabled=None)

    def discard(self) -> None:
        """Stop a profile still running (the loop ended first) and remove its files."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.stop()
            finally:
                self._end_memory_history()
        shutil.rmtree(self._dir, ignore_errors=True)
