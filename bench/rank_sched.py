"""Where a rank's wall time goes, from the kernel's own accounting: a sampler of
``/proc/<pid>/schedstat`` (the main thread: ns on a CPU, ns runnable but waiting for one)
and ``/proc/<pid>/stat`` (utime + stime of all its threads), for every process whose command
line matches one of ``patterns``.

Per step, over a window of steps (averaged over the ranks found):

- ``main_cpu_ms``: the training thread on a CPU (model math, Python, the loop's own work);
- ``runqueue_ms``: the training thread runnable but another thread had its core (CPU
  contention: the rank's own side threads, other ranks, Surge's services, anything else);
- ``sleep_ms``: the rest of the wall time: the thread blocked (waiting in a collective for
  the slower rank, for a batch, on a lock or the GIL);
- ``other_threads_cpu_ms``: CPU of the rank's other threads (gloo's loops, gRPC, relays).

This is the Linux scheduler's ``sched_info`` (Documentation/scheduler/sched-stats.rst:
``/proc/<pid>/schedstat`` = time on cpu, time waiting on a runqueue, timeslices run).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK")


class RankSampler(threading.Thread):
    """Samples every ``period_s`` (daemon thread); ``window(t0, t1)`` reads the history."""

    def __init__(self, patterns: tuple[str, ...], exclude: tuple[str, ...] = (), period_s: float = 0.25):
        super().__init__(name="rank-sampler", daemon=True)
        self._patterns, self._exclude, self._period = patterns, exclude, period_s
        self._history: list[tuple[float, dict[int, tuple[float, float, float]]]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            self._history.append((time.time(), self._snapshot()))
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()

    def window(self, t0: float, t1: float, steps: int) -> dict[str, float] | None:
        """Per-step figures (ms) between unix times ``t0`` and ``t1`` (``steps`` steps),
        from the first and last samples inside that span, averaged over the ranks alive at
        both; None when fewer than two samples fall inside."""
        hist = list(self._history)
        if not hist or steps <= 0:
            return None
        inside = [h for h in hist if t0 <= h[0] <= t1]  # a rank may be gone right after t1
        if len(inside) < 2:
            return None
        a, b = inside[0], inside[-1]
        pids = [p for p in b[1] if p in a[1]]
        if not pids or b[0] <= a[0]:
            return None
        wall = b[0] - a[0]
        rows = []
        for pid in pids:
            run, wait, proc = (y - x for x, y in zip(a[1][pid], b[1][pid]))
            rows.append((run, wait, wall - run - wait, proc - run))
        n = len(rows)
        scale = 1000.0 / steps * (t1 - t0) / wall  # ms per step, the sampled span stretched to the steps' span
        keys = ("main_cpu_ms", "runqueue_ms", "sleep_ms", "other_threads_cpu_ms")
        return {k: scale * sum(r[i] for r in rows) / n for i, k in enumerate(keys)} | {"ranks": n}

    def _snapshot(self) -> dict[int, tuple[float, float, float]]:
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if not any(p in cmd for p in self._patterns) or any(x in cmd for x in self._exclude):
                    continue
                run_ns, wait_ns, _ = (int(x) for x in Path(f"/proc/{entry}/schedstat").read_text().split())
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, ValueError):
                continue  # gone, or not ours to read
            out[int(entry)] = (run_ns / 1e9, wait_ns / 1e9, (int(fields[11]) + int(fields[12])) / _HZ)
        return out
