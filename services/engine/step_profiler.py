"""A profile of a run of training steps (issue 31 item 3, `surgectl profile`): a torch.profiler
trace of the steps, as Chrome's trace format gzipped (Perfetto and chrome://tracing read it;
``torch.profiler``'s own `tensorboard_trace_handler` writes the same), and on a CUDA device a
memory snapshot of the same steps (``torch.cuda.memory._record_memory_history`` /
``_dump_snapshot``, what https://pytorch.org/memory_viz reads), as torchtitan's
``--profiling.enable_profiling`` and ``--profiling.enable_memory_snapshot`` record them.

The training loop (L2-1) starts one at a step boundary and stops it at a later one; it never
touches the device itself: the composition root says which device the rank trains on.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
import time
from pathlib import Path

import torch

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept by the CUDA memory history (torchtitan's default)


def _record_every_step(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class StepProfiler:
    """One profile: :meth:`start` at a boundary, :meth:`stop` at a later one, which returns the
    files it wrote ({file name: local path}) in a private temporary directory that
    :meth:`discard` removes once the files were handed on."""

    def __init__(self, rank: int, device: str):
        self._rank = rank
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
        export's time not included). An export that fails raises; :meth:`discard` still
        removes what it wrote."""
        assert self._prof is not None, "stop before start"
        prof, self._prof = self._prof, None
        prof.stop()
        seconds = time.perf_counter() - self._t0
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
            torch.cuda.memory._record_memory_history(enabled=None)
            files[name] = self._dir / name
        return files, seconds

    def discard(self) -> None:
        """Stop a profile still running (the loop ended first) and remove its files."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.stop()
            finally:
                if self._cuda:
                    torch.cuda.memory._record_memory_history(enabled=None)
        shutil.rmtree(self._dir, ignore_errors=True)
