"""Footprint (issue 29 item 8): what bounding rank logs and metric files costs.

    python -m bench.footprint [LINES]

1. A child writes LINES (default 2,000,000) 100-byte lines as fast as it can (a flooding
   rank): to a file directly (the writer before issue 29) and through the node agent's log
   pump into a rotated rank log (services/worker/rank_logs.py) at the default bound
   (64 MiB x 4) and at 1 MiB x 4: wall time, the agent's CPU, files and bytes kept.
2. The store's compaction (services/store/metric_files.py) of a full history and a full
   rotated-out file at the default bound (2 x 128 MiB of 8 ranks' step records): time,
   stride, the history's size and the process's peak memory.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common.rotated_files import rotated_paths
from services.store.metric_files import MetricFileBound, compact, history_path
from services.worker.rank_logs import LogPump, LogSettings, RankLog

MIB = 1 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _writer(lines: int) -> list[str]:
    code = f"import sys\nline = 'x' * 99 + '\\n'\nw = sys.stdout.write\nfor _ in range({lines}): w(line)\n"
    return [sys.executable, "-c", code]


def direct(d: Path, lines: int) -> float:
    with open(d / "direct.log", "ab") as out:
        t = time.perf_counter()
        subprocess.run(_writer(lines), stdout=out, check=True)
    return time.perf_counter() - t


def pumped(d: Path, lines: int, settings: LogSettings, name: str) -> tuple[float, float, int, int]:
    pump = LogPump()
    log = RankLog(d / name, settings)
    c0 = _cpu()
    read, write = pump.pipe()
    t = time.perf_counter()
    proc = subprocess.Popen(_writer(lines), stdout=write)
    os.close(write)
    pump.attach(read, log)
    proc.wait()
    log.closed.wait(120)
    seconds = time.perf_counter() - t
    pump.close()
    files = rotated_paths(d / name)
    return seconds, _cpu() - c0, len(files), sum(f.stat().st_size for f in files)


def logs(lines: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d, total = Path(tmp), lines * 100
        t0 = direct(d, lines)
        print(f"{total / MIB:.0f} MiB of 100-byte lines, direct to a file: {t0:.2f} s ({total / t0 / MIB:.0f} MiB/s)")
        for settings, name in ((LogSettings(), "a.rank0.log"), (LogSettings(max_bytes=MIB, backups=3), "b.rank0.log")):
            t, cpu, n, kept = pumped(d, lines, settings, name)
            print(
                f"  pump + rotation at {settings.max_bytes / MIB:.0f} MiB x {settings.backups + 1}: {t:.2f} s "
                f"({total / t / MIB:.0f} MiB/s), agent CPU {cpu:.2f} s ({cpu / (total / 2**30):.1f} s/GiB); "
                f"{n} files, {kept / MIB:.2f} MiB kept (bound {(settings.backups + 1) * settings.max_bytes / MIB:.0f} MiB)"
            )


def compaction() -> None:
    bound = MetricFileBound()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "j.jsonl"
        record = {"type": "step", "job_id": "j", "loss": 2.5, "tokens_per_second": 12345.6, "pad": "x" * 480}

        def fill(f: Path, step: int) -> int:
            n = 0
            with open(f, "w") as out:
                while n < bound.max_bytes:
                    for rank in range(8):
                        line = json.dumps({**record, "step": step, "rank": rank}) + "\n"
                        out.write(line)
                        n += len(line)
                    step += 1
            return step

        pending = Path(tmp) / "j.jsonl.pending-1"
        fill(pending, fill(history_path(path, bound), 1))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        stride = compact(path, pending, bound)
        seconds = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(
            f"compaction of 2 x {bound.max_bytes / MIB:.0f} MiB (8 ranks' step records): {seconds:.1f} s, stride "
            f"{stride}, history {history_path(path, bound).stat().st_size / MIB:.1f} MiB, peak RSS {peak / 1024:.0f} MiB "
            f"(before {before / 1024:.0f} MiB)"
        )


if __name__ == "__main__":
    logs(int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000)
    compaction()
