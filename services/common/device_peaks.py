"""The peak FLOP/s of a rank's device, which MFU (model FLOPs utilisation) is measured against.

A GPU's is its dense bf16 peak from the vendor's data sheet, looked up by the name CUDA
reports (``PEAK_TFLOPS``; the longest matching key wins, so "H100" is not taken for "H10").
A CPU has no data-sheet figure that means anything for one rank's threads, and neither has a
GPU missing from the table: theirs is measured, a short timed matmul at the rank's start in
the dtype it will train in. A job can state its own (``parallel.peak_tflops_per_device``);
whichever is used is said with its source, so an MFU figure always names what it divides by.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

# Dense (no sparsity) bf16 TFLOP/s per device, vendor data sheets (SXM parts where two exist).
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,  # (fp16: V100 has no bf16)
}
MEASURE_SECONDS = 0.25  # the measured peak's budget: a rank start pays this once


@dataclass(frozen=True)
class Peak:
    """A device's peak and where it came from ("spec", "data sheet: NVIDIA H200", "measured ...")."""

    tflops: float
    source: str


UNKNOWN_PEAK = Peak(1.0, "unknown")  # a loop built without one (tests): MFU against 1 TFLOP/s


def table_peak(device_name: str) -> float | None:
    """The data-sheet peak of the GPU named ``device_name`` (None: not in the table)."""
    name = device_name.upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return None


@functools.cache  # once per process: the rank fork server measures before it forks (forkserver.py)
def measured_tflops(device: str = "cpu", dtype: str = "float32", seconds: float = MEASURE_SECONDS) -> float:
    """TFLOP/s of square matmuls on ``device`` in ``dtype`` for about ``seconds`` (after one
    warm-up product), on one CPU thread for a CPU: what the densest kernel a rank runs reaches."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return _matmul_tflops(torch, device, dtype, seconds)
    finally:
        torch.set_num_threads(threads)


def _matmul_tflops(torch, device: str, dtype: str, seconds: float) -> float:
    # The best of several timed products, not their mean: a product that shared its core with
    # another process (a busy node at a rank's start) says nothing of the device's peak, and a
    # peak measured low makes every MFU after it too high. On a CPU each product is timed by
    # the thread's own CPU time, not the wall clock: on a loaded host (two cores, a stack
    # starting beside the rank fork server that measures) no product may run alone for the
    # whole of it, and the wall clock then halved the peak (the demo's MFU read 110 %).
    clock = time.thread_time if device == "cpu" else time.perf_counter
    dt = getattr(torch, dtype)
    n = 1024 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    _sync(device)
    a @ b
    _sync(device)
    best, until = 0.0, time.perf_counter() + seconds
    while True:
        t0 = clock()
        a @ b
        _sync(device)
        t1 = clock()
        if t1 > t0:
            best = max(best, 2.0 * n**3 / (t1 - t0) / 1e12)
        if time.perf_counter() >= until and best > 0:
            return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


# The spec's precision -> the dtype a GPU missing from the table is measured in (a CPU rank's
# matmuls run in float32 whatever its autocast: it is measured in float32).
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def device_peak(stated_tflops: float, device: str, precision: str = "fp32", threads: int = 1) -> Peak:
    """The peak MFU divides by: the spec's when it states one (> 0), else the data sheet's
    for a known GPU, else measured on ``device`` (a CPU: one thread's, times ``threads``)."""
    if stated_tflops > 0:
        return Peak(stated_tflops, "spec")
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(device)
        if (tflops := table_peak(name)) is not None:
            return Peak(tflops, f"data sheet: {name} bf16")
        dtype = TORCH_DTYPES[precision]
        return Peak(measured_tflops(device, dtype), f"measured: {name} {dtype} matmul")
    per_thread = measured_tflops("cpu", "float32")
    return Peak(per_thread * threads, f"measured: cpu float32 matmul, {per_thread:.3g} TFLOP/s x {threads} thread(s)")
