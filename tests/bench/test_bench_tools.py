"""The CPU-side parts of the benchmarks: the torchrun baseline's data and schedule, the
job specs the comparisons use, bench/gpu.sh's dry run (every configuration's job spec
validated, the plan for 1, 3, 6 and 8 GPUs within its budget, its one-line refusals; the qualification itself
needs a GPU), and the statistics every table prints. No speed is asserted here."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

from services.jobspec import load_job_spec, mlp_hidden_width
from services.memory_estimate import estimate_memory
from tests.conftest import REPO

sys.path.insert(0, str(REPO))

from bench import common, gpu, torchrun_ddp  # noqa: E402


def _tiny_dataset(root, docs: list[list[int]]) -> None:
    path = root / "tiny" / "v1"
    path.mkdir(parents=True)
    np.concatenate([np.asarray(d, np.uint16) for d in docs]).tofile(path / "train.bin")
    np.save(path / "train.idx.npy", np.cumsum([0] + [len(d) for d in docs]).astype(np.int64))


def _spec(tmp_path, **data):
    spec = yaml.safe_load((REPO / "bench/jobs/throughput.yaml").read_text())
    spec["data"].update(
        {
            "dataset": "tiny@v1",
            "seq_len": 4,
            "micro_batch_size": 2,
            "filter": {"min_tokens": 1, "max_tokens": 0, "banned_bytes": ""},
            **data,
        }
    )
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return load_job_spec(p)


def test_torchrun_baseline_packs_documents_with_separator_and_shifted_labels(tmp_path):
    docs = [[10 + i] * 5 for i in range(8)]
    _tiny_dataset(tmp_path, docs)
    spec = _spec(tmp_path, shuffle=False)
    stream = torchrun_ddp.batches(tmp_path, spec, rank=0, world=1)
    x1, y1 = next(stream)
    x2, _ = next(stream)
    assert x1.shape == y1.shape == (2, 4) and x1.dtype.is_floating_point is False
    # documents back to back, each followed by one 0 separator; labels are inputs shifted by one
    flat = [10] * 5 + [0] + [11] * 5 + [0] + [12] * 5
    assert x1.flatten().tolist() == flat[:8]
    assert y1.flatten().tolist() == flat[1:9]
    assert x2.flatten().tolist() == flat[8:16]


def test_torchrun_baseline_shards_by_rank_and_resumes_by_skipping(tmp_path):
    _tiny_dataset(tmp_path, [[10 + i] * 7 for i in range(12)])
    spec = _spec(tmp_path, shuffle=True)
    r0 = [next(torchrun_ddp.batches(tmp_path, spec, 0, 2))[0] for _ in range(2)]
    assert r0[0].equal(r0[1])  # a pure function of (seed, epoch, rank)
    tokens0 = set(next(torchrun_ddp.batches(tmp_path, spec, 0, 2))[0].flatten().tolist()) - {0}
    tokens1 = set(next(torchrun_ddp.batches(tmp_path, spec, 1, 2))[0].flatten().tolist()) - {0}
    assert tokens0 and tokens1 and not tokens0 & tokens1  # disjoint documents per rank
    full = torchrun_ddp.batches(tmp_path, spec, 0, 2)
    third = [next(full) for _ in range(3)][2][0]
    assert next(torchrun_ddp.batches(tmp_path, spec, 0, 2, skip=2))[0].equal(third)


def test_torchrun_baseline_drops_documents_the_filter_drops(tmp_path):
    _tiny_dataset(tmp_path, [[5] * 3, [6] * 9, [7, 0, 7, 7, 7, 7, 7, 7, 7], [8] * 9])
    spec = _spec(tmp_path, shuffle=False, filter={"min_tokens": 4, "max_tokens": 0, "banned_bytes": "\0"})
    stream = torchrun_ddp.batches(tmp_path, spec, 0, 1)
    seen = {t for _ in range(2) for t in next(stream)[0].flatten().tolist()}
    assert seen == {6, 0, 8}  # short doc and the one with a banned byte gone


def test_torchrun_baseline_lr_warms_up_then_decays_to_min_ratio():
    spec = load_job_spec(REPO / "bench/jobs/throughput.yaml")
    o = spec.optimizer
    assert torchrun_ddp.lr_at(spec, 1) == pytest.approx(o.lr / o.warmup_steps)
    assert torchrun_ddp.lr_at(spec, o.warmup_steps) == pytest.approx(o.lr)
    assert torchrun_ddp.lr_at(spec, spec.steps) == pytest.approx(o.lr * o.min_lr_ratio)


def test_throughput_spec_is_the_demo_job_without_eval_and_checkpoints():
    bench = yaml.safe_load((REPO / "bench/jobs/throughput.yaml").read_text())
    demo = yaml.safe_load((REPO / "examples/jobs/demo.yaml").read_text())
    for section in ("model", "data", "parallel", "optimizer", "precision", "seed"):
        assert bench[section] == demo[section], section
    assert bench["eval"]["every_steps"] == 0 and bench["eval"]["at_end"] is False
    assert bench["checkpoint"]["every_steps"] == 0 and bench["checkpoint"]["at_end"] is False


def test_gpu_spec_is_a_llama_1b_shape_at_bf16():
    spec = load_job_spec(REPO / "bench/jobs/llama1b.yaml")
    m = spec.model
    assert (m.n_layers, m.d_model, m.n_heads, m.vocab_size, spec.data.seq_len) == (16, 2048, 32, 32000, 2048)
    assert mlp_hidden_width(m) == 8192 and spec.precision.dtype == "bf16"
    # 16 x (4 x 2048^2 + 3 x 2048 x 8192) + 32000 x 2048 (tied) + norms: ~1.1 G
    assert estimate_memory(spec).total_parameters == 1_038_682_112


def _plan(*argv: str):
    """bench/gpu.py's plan as --dry-run makes it (8 GPUs of 80 GiB unless told)."""
    args = gpu.parse(["--dry-run", *argv])
    return gpu.plan(args, args.gpus or 8, (args.gpu_memory_gib or 80) * 2**30, 989.0)


def _planned_total(configs) -> float:
    return gpu.STACK_S + sum(cfg.estimate_s for cfg in configs if not cfg.skip)


@pytest.mark.timeout(120)
def test_gpu_sh_dry_run_validates_every_configuration_for_eight_gpus_without_a_gpu():
    out = subprocess.run(
        [str(REPO / "bench/gpu.sh"), "--dry-run", "--gpus", "8"], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines() if line.startswith("| ")}
    for name in ("DDP dp=8", "FSDP2 dp=8", "TP tp=8", "FSDP2 dp=4 x TP tp=2"):
        for compiled in ("off", "on"):
            key = next(k for k in rows if k.startswith(f"{name}, compile {compiled}"))
            assert "| runs, ~" in rows[key], rows[key]
    assert "| runs, ~" in rows["restore of that save (DDP dp=8), a profile, then SIGKILL rank 1, rebuild in place"]
    assert "validated: 9 of 9 job specs" in out.stdout
    assert "1.04 G parameters (GQA 8 KV heads)" in out.stdout
    total = float(out.stdout.split("estimated total ")[1].split(" s")[0])
    assert total <= 480, out.stdout


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_gpu_plan_runs_every_row_the_hardware_allows_within_the_default_budget(n_gpus):
    _, configs = _plan("--gpus", str(n_gpus))
    assert not [cfg.name for cfg in configs if cfg.skip.startswith("budget")]
    if n_gpus == 8:
        assert not [cfg.name for cfg in configs if cfg.skip]
    assert _planned_total(configs) <= 480.0
    # torch.compile is counted apart from the timed steps, cheaper for per-rank shapes (tp)
    # an earlier row compiled: FSDP2 compiles first, DDP (same shapes) after it
    est = {cfg.name.split(", then")[0]: cfg.estimate_s for cfg in configs if cfg.kind == "train"}
    one = "dp=1 (one rank)" if n_gpus == 1 else f"dp={n_gpus}"
    on, off = est[f"FSDP2 {one}, compile on"], est[f"FSDP2 {one}, compile off"]
    assert on - off == pytest.approx(gpu.COMPILE_S)
    ddp_on, ddp_off = est[f"DDP {one}, compile on"], est[f"DDP {one}, compile off"]
    assert ddp_on - (ddp_off - gpu.SAVE_S) == pytest.approx(gpu.COMPILE_CACHED_S)


def test_gpu_plan_marks_rows_past_the_budget_skipped_in_the_plan_table(capsys):
    facts, configs = _plan("--gpus", "8", "--budget-s", "220")
    facts["gpu"] = "(dry run)"
    over = [cfg for cfg in configs if cfg.skip]
    assert over and all(cfg.skip.startswith("budget (estimated") for cfg in over)
    assert _planned_total(configs) <= 220.0
    assert [cfg.name for cfg in over] == [cfg.name for cfg in configs if cfg.compile]  # they go last
    gpu.print_plan(facts, configs, gpu.parse(["--dry-run", "--budget-s", "220"]))
    table = capsys.readouterr().out
    for cfg in over:
        (line,) = [x for x in table.splitlines() if x.startswith(f"| {cfg.name} |")]
        assert "| skipped: budget (" in line and "| runs" not in line


@pytest.mark.parametrize(
    ("n_gpus", "tp_row", "tp_skip", "mixed_runs"),
    [
        (3, "TP, compile off", "no tp > 1 dividing 3 GPUs divides model.n_heads (32) and n_kv_heads (8)", False),
        (6, "TP tp=2 (2 of 6 GPUs), compile off", "", True),
    ],
)
def test_gpu_plan_picks_the_largest_tp_the_model_takes_and_still_plans_the_other_rows(
    n_gpus, tp_row, tp_skip, mixed_runs
):
    _, configs = _plan("--gpus", str(n_gpus))
    by_name = {cfg.name: cfg for cfg in configs}
    assert by_name[tp_row].skip == tp_skip
    assert not by_name[f"DDP dp={n_gpus}, compile off, then a save"].skip
    assert not by_name[f"FSDP2 dp={n_gpus}, compile on"].skip
    mixed = by_name[f"FSDP2 dp={max(n_gpus // 2, 2)} x TP tp=2, compile off"]
    assert (mixed.skip == "") is mixed_runs and (mixed.ranks == n_gpus) is mixed_runs


def test_gpu_plan_skips_tp_rows_a_model_with_one_kv_head_cannot_take():
    _, configs = _plan("--gpus", "8", "--kv-heads", "1")
    skips = {cfg.name: cfg.skip for cfg in configs if "TP" in cfg.name}
    assert skips["TP, compile on"] == "no tp > 1 dividing 8 GPUs divides model.n_heads (32) and n_kv_heads (1)"
    assert skips["FSDP2 dp=4 x TP tp=2, compile on"].startswith("the model cannot take tp=2: parallel.tp: model.n_kv")
    assert not [cfg.name for cfg in configs if "TP" not in cfg.name and cfg.skip]


def test_gpu_plan_on_one_gpu_runs_one_rank_layouts_and_says_why_the_rest_cannot_run():
    facts, configs = _plan("--gpus", "1")
    by_name = {cfg.name: cfg for cfg in configs}
    assert not by_name["DDP dp=1 (one rank), compile off, then a save"].skip
    assert not by_name["FSDP2 dp=1 (one rank), compile on"].skip
    restore = by_name["restore of that save (DDP dp=1), a profile (no rebuild: it needs 2+ GPUs)"]
    assert not restore.skip and not restore.rebuild
    for name in ("TP, compile off", "FSDP2 dp=2 x TP tp=2, compile on"):
        assert "NCCL cannot run two ranks on one GPU" in by_name[name].skip, name
    assert facts["flops_per_token"] == 6.0 * facts["params"] + 12.0 * 16 * 2048 * 2048


def test_gpu_plan_skips_a_layout_whose_estimated_memory_exceeds_the_gpu():
    _, configs = _plan("--gpus", "8", "--gpu-memory-gib", "40")
    skips = {cfg.name.split(",")[0]: cfg.skip for cfg in configs if cfg.kind == "train" and cfg.compile}
    assert skips["DDP dp=8"].startswith("estimated 61.0 GiB per rank > the GPU's 40.0 GiB")
    assert skips["TP tp=8"] == "" and skips["FSDP2 dp=4 x TP tp=2"] == ""


def test_gpu_plan_refuses_a_spec_the_job_spec_validation_refuses_naming_the_file_and_field(tmp_path):
    spec = yaml.safe_load((REPO / "bench/jobs/llama1b.yaml").read_text())
    spec["model"]["vocab_size"] = 0
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(spec))
    with pytest.raises(gpu.UsageError, match=f"{p}.*vocab_size"):
        _plan("--spec", str(p))


@pytest.mark.timeout(120)
def test_gpu_sh_refuses_bad_arguments_with_one_line_naming_the_flag():
    out = subprocess.run(
        [str(REPO / "bench/gpu.sh"), "--steps", "3", "--dry-run"], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --steps: must be > --warmup + 1 (4), got 3"]
    with pytest.raises(gpu.UsageError, match=r"^--gpus: must be >= 1 \(leave it out for every GPU"):
        gpu.parse(["--dry-run", "--gpus", "0"])


@pytest.mark.timeout(120)
def test_gpu_sh_says_in_one_line_when_the_venvs_torch_has_no_cuda_and_helps_without_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this venv's torch has CUDA: gpu.sh would run the qualification")
    out = subprocess.run([str(REPO / "bench/gpu.sh")], capture_output=True, text=True, timeout=100)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: the venv's torch ({torch.__version__}) cannot use a GPU")
    assert "pip install torch==2.13.0 --index-url" in line  # the project's torch, not the newest
    out = subprocess.run([str(REPO / "bench/gpu.sh"), "--help"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.startswith("usage: bench/gpu.sh") and not out.stderr
    assert "default: every GPU nvidia-smi lists" in " ".join(out.stdout.split())  # argparse wraps lines


def test_gpu_peak_table_knows_datacenter_gpus_and_refuses_unknown_ones():
    assert gpu.peak_for("NVIDIA H200") == 989.0
    assert gpu.peak_for("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_for("NVIDIA L40S") == 362.0  # not L4's figure: longest name first
    with pytest.raises(gpu.UsageError, match="--peak-tflops"):
        gpu.peak_for("Some Future GPU")


def test_steady_tokens_per_second_counts_wall_time_after_warmup():
    recs = [{"step": s, "unix_time": 100.0 + s, "tokens": 1000} for s in range(1, 11)]
    recs[6]["unix_time"] += 0.5  # a slow gap between steps counts too
    assert common.steady_tokens_per_s(recs, warmup=4) == pytest.approx(6000 / 6.0)
    s = common.summary([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert math.isnan(common.summary([])["median"])


@pytest.mark.timeout(60)
def test_rank_sampler_splits_a_busy_process_wall_time_into_cpu_runqueue_and_sleep():
    """A child that spins 1.5 s then sleeps 1.5 s: the kernel's accounting, read back per
    'step', shows about half its wall time on the CPU and the rest blocked; the three parts
    add up to the wall time."""
    import time

    from bench.rank_sched import RankSampler

    marker = "surge-rank-sampler-test"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, sys\nt = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(1.5)",
            marker,
        ]
    )
    try:
        sampler = RankSampler((marker,), period_s=0.05)
        sampler.start()
        t0 = time.time()
        time.sleep(0.2)  # the first sample sees the child
        child.wait(timeout=30)
        t1 = time.time() - 0.1
        sampler.stop()
        w = sampler.window(t0, t1, steps=2)
    finally:
        child.kill()
        child.wait()
    assert w is not None and w["ranks"] == 1
    wall_ms = 1000 * (t1 - t0) / 2
    parts = w["main_cpu_ms"] + w["runqueue_ms"] + w["sleep_ms"]
    assert parts == pytest.approx(wall_ms, rel=0.02)
    assert 0.25 * wall_ms < w["main_cpu_ms"] + w["runqueue_ms"] < 0.75 * wall_ms
    assert w["other_threads_cpu_ms"] < 0.1 * wall_ms
    assert sampler.window(t1 + 100, t1 + 200, steps=2) is None  # no sample inside: no figure


@pytest.mark.timeout(60)
def test_the_benches_keep_their_state_under_the_operators_surge_home(tmp_path):
    """bench-scale and bench-control wrote under the clone's .surge whatever SURGE_HOME said
    (fresh37 #9); a bench's child, started with the bench's own home as SURGE_HOME, keeps the
    same root (SURGE_BENCH_ROOT), not a home nested in it."""
    import os

    show = "from bench import common, scale; print(common.BENCH_HOME, common.DATA_ROOT, scale.HOME)"

    def paths(**env) -> list[str]:
        base = {k: v for k, v in os.environ.items() if k not in ("SURGE_HOME", "SURGE_BENCH_ROOT")}
        out = subprocess.run(
            [sys.executable, "-c", show], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=50
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    home = tmp_path / "home"
    expected = [str(home / "bench"), str(home / "datasets"), str(home / "bench-scale")]
    assert paths(SURGE_HOME=str(home)) == expected
    assert paths(SURGE_HOME=str(home / "bench"), SURGE_BENCH_ROOT=str(home)) == expected
    dot = REPO / ".surge"
    assert paths() == [str(dot / "bench"), str(dot / "datasets"), str(dot / "bench-scale")]


def test_every_makefile_bench_target_is_in_the_readmes_list():
    """The README's Benchmarks block left out four of the Makefile's bench targets (fresh37 #13)."""
    import re

    targets = set(re.findall(r"^(bench(?:-[a-z-]+)?):", (REPO / "Makefile").read_text(), re.M))
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("## Benchmarks") :]
    block = block[: block.index("```", block.index("```") + 3)]
    listed = set(re.findall(r"^(?:BENCH_QUICK=1 )?make (bench(?:-[a-z-]+)?)\s", block, re.M))
    assert len(targets) > 10 and targets == listed, (targets - listed, listed - targets)
