"""The peak MFU divides by (services/common/device_peaks.py): a stated peak wins; a known GPU
takes its data-sheet figure by the longest matching name; a CPU, or a GPU the table lacks, is
measured (once per process); JSON output keeps maps as objects; the job's status and summary
say the figure and its source."""

from __future__ import annotations

import time
import types

import pytest

from services.cli import jsonout, render
from services.common import device_peaks as dp
from services.contract import control_pb2, engine_pb2


def test_the_table_matches_the_longest_name_and_knows_nothing_else():
    assert dp.table_peak("NVIDIA H200") == 989.0 and dp.table_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert dp.table_peak("NVIDIA L40S") == 362.0 and dp.table_peak("NVIDIA L40") == 181.0  # not L4's
    assert dp.table_peak("NVIDIA GeForce RTX 4090") is None


def test_a_stated_peak_wins_and_a_cpu_is_measured_once_per_thread_count(monkeypatch):
    assert dp.device_peak(42.0, "cuda:0") == dp.Peak(42.0, "spec")
    calls = []
    monkeypatch.setattr(dp, "measured_tflops", lambda device, dtype: calls.append((device, dtype)) or 0.05)
    peak = dp.device_peak(0.0, "cpu", "bf16", threads=4)
    assert peak.tflops == pytest.approx(0.2) and peak.source.startswith("measured: cpu float32 matmul, 0.05")
    assert calls == [("cpu", "float32")]  # a CPU rank's matmuls run in float32 whatever its autocast


def test_a_gpu_takes_its_data_sheet_figure_or_is_measured_in_the_training_dtype(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "cuda", types.SimpleNamespace(get_device_name=lambda d: "NVIDIA H100 80GB HBM3"))
    assert dp.device_peak(0.0, "cuda:1", "bf16") == dp.Peak(989.0, "data sheet: NVIDIA H100 80GB HBM3 bf16")
    monkeypatch.setattr(torch, "cuda", types.SimpleNamespace(get_device_name=lambda d: "NVIDIA RTX 6000"))
    monkeypatch.setattr(dp, "measured_tflops", lambda device, dtype: {("cuda:1", "bfloat16"): 300.0}[(device, dtype)])
    assert dp.device_peak(0.0, "cuda:1", "bf16") == dp.Peak(300.0, "measured: NVIDIA RTX 6000 bfloat16 matmul")


def test_the_cpu_measurement_is_positive_cached_and_leaves_the_thread_count():
    import torch

    threads = torch.get_num_threads()
    dp.measured_tflops.cache_clear()
    first = dp.measured_tflops("cpu", "float32", 0.05)
    assert 0 < first < 10 and torch.get_num_threads() == threads
    assert dp.measured_tflops("cpu", "float32", 0.05) is first  # (cached: a forked rank inherits it)


def test_a_cpu_peak_measured_beside_a_process_that_shares_its_core_is_the_peak_it_measures_alone():
    # A loaded host at a rank fork server's start: another process on the same core. Timed by
    # the wall clock each product took about twice as long, the peak came out near half and
    # every MFU after it near double (the demo's summary once said 110 %).
    import os
    import subprocess
    import sys

    import torch

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    cpu = min(os.sched_getaffinity(0))
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cpu})
    hog = None
    try:
        alone = dp._matmul_tflops(torch, "cpu", "float32", 0.3)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(hog.pid, {cpu})
        time.sleep(0.2)  # (it runs)
        shared = dp._matmul_tflops(torch, "cpu", "float32", 0.3)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(timeout=10)
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    assert shared > 0.65 * alone, (shared, alone)  # (the wall clock: about half)


def test_json_output_keeps_a_map_as_an_object():
    s = control_pb2.JobStatus(job_id="j", mfu=0.25, peak_tflops=989.0, peak_source="data sheet: NVIDIA H200 bf16")
    s.tags["arm"] = "baseline"
    plain = jsonout.to_plain(s)
    assert plain["tags"] == {"arm": "baseline"} and plain["mfu"] == 0.25
    started = engine_pb2.TrainingLoopStarted()
    started.restored_bytes_from["store"] = 7
    assert jsonout.to_plain(started)["restored_bytes_from"] == {"store": 7}


def test_the_summary_says_mfu_with_what_it_divides_by():
    s = control_pb2.JobStatus(job_id="j", mfu=0.123, peak_tflops=989.0, peak_source="data sheet: NVIDIA H200 bf16")
    assert render.mfu_text(s) == "12.3 % of 989 TFLOP/s per device (data sheet: NVIDIA H200 bf16)"
