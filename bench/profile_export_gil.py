"""How long ending a torch.profiler profile keeps every other thread of the process from running
(issue 28 helper, profile28): a side thread ticks every 50 ms, as a rank's heartbeat thread
beats; the longest gap between its ticks during ``prof.stop()`` and ``export_chrome_trace`` is
how long a rank's beats stop while its profile ends. With and without ``trace_only``
(services/engine/step_profiler.py profiles with it).

    PYTHONPATH=$PWD .venv/bin/python bench/profile_export_gil.py --steps 40
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile


def measure(steps: int, trace_only: bool) -> dict[str, float]:
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.wait(0.05):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    threading.Thread(target=tick, daemon=True).start()
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(30)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = torch._C._profiler._ExperimentalConfig(trace_only=True) if trace_only else None
    prof = profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        experimental_config=config,
        schedule=lambda s: ProfilerAction.RECORD,
    )
    prof.start()
    for _ in range(steps):
        for _ in range(5):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        prof.step()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        for name, call in (("stop", prof.stop), ("export", lambda: prof.export_chrome_trace(path))):
            gaps.clear()
            t0 = time.monotonic()
            call()
            out[f"{name}_s"] = time.monotonic() - t0
            time.sleep(0.1)  # (the tick after the call closes its gap)
            out[f"{name}_longest_gap_s"] = max(gaps, default=0.0)
        out["trace_mb"] = os.path.getsize(path) / 1e6
    done.set()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    for trace_only in (False, True):
        r = measure(args.steps, trace_only)
        print(
            f"trace_only={trace_only!s:5} steps={args.steps}: stop {r['stop_s']:.2f} s "
            f"(longest tick gap {r['stop_longest_gap_s']:.2f} s), export {r['export_s']:.2f} s "
            f"(gap {r['export_longest_gap_s']:.2f} s), trace {r['trace_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
