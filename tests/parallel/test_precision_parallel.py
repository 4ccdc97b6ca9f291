"""Mixed precision under sharded gradients: bf16 and fp16 (dynamic loss scaling) with FSDP2
dp=2, TP=2 and FSDP2 dp=2 x TP=2 track one process of the same precision, and an fp16
overflow is skipped on every rank with the scale backed off.

Why these configs: the precision manager (L2-4) unscales with one ``torch._foreach_mul_``
over all of its rank's gradients and checks their norm (grad_norm.py). Under FSDP2 they are
DTensor shards (Shard(0) on the dp mesh); under TP (torch 2.13, this layout) all are
DTensors on the tp mesh, Shard(0)/Shard(1) for the sharded linears, Replicate, and
Partial(sum) for the replicated weights (each rank holds a summand: scaling each by 1/scale
is right because the sum is linear); under FSDP2 x TP all are DTensors on the one dp x tp
mesh, (_StridedShard, Shard) among them. DDP and PP already have precision tests
(tests/engine/test_precision_two_ranks.py, tests/parallel/test_pipeline_parity.py).

Each run: 3 steps of the parity job (tests/parallel/harness.py: 2 layers, d_model 64, the
same global batch per step in every config) through the real rank wiring, one OS process
per rank over gloo. The fp16 runs use init scale 1024, growth after every clean step and
no hysteresis, and have inf gradients injected at step 2 on their LAST rank (the reference:
on its only rank), so every fp16 run also proves the skip and the backoff: step scales
1024, (grown) 2048 -> overflow, step skipped, backed off -> 1024.

Tolerance: autocast runs the matmuls in the low dtype and accumulates in float32; sharding
changes the order of the float32 sums and where the low-precision roundings fall, so the
configs differ from the reference by a few low-precision roundings, damped by averaging in
the loss. The bound is about one unit roundoff of the dtype (bf16: 8 significant bits,
u = 2**-8 = 3.9e-3; fp16: 11 bits, u = 2**-11 = 4.9e-4): 5e-3 for bf16, 1e-3 for fp16. The
fp32 bar (1e-5, test_loss_parity.py) does not apply: it is below bf16's resolution.
"""

from __future__ import annotations

import math

import pytest
from harness import run_config

RULE = {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1,
        "hysteresis": 1, "min_scale": 1.0}  # fmt: skip
STEPS, OVERFLOW_STEP = 3, 2
RTOL = {"bf16": 5e-3, "fp16": 1e-3}
PARALLEL = {
    "reference": {},
    "fsdp2_dp2": {"dp": 2, "data_parallel": "fsdp2"},
    "tp2": {"tp": 2},
    "fsdp2_dp2_x_tp2": {"dp": 2, "tp": 2, "data_parallel": "fsdp2"},
}


def config(name: str, dtype: str) -> dict:
    parallel = PARALLEL[name]
    world = parallel.get("dp", 1) * parallel.get("tp", 1)
    cfg = {"steps": STEPS, **parallel, "precision": {"dtype": dtype}}
    if dtype == "fp16":
        cfg["precision"]["loss_scale"] = RULE
        cfg["inject"] = [["inf_grad", OVERFLOW_STEP, world - 1]]
    return cfg


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(config name, dtype) -> per-rank results; each run once, on first use."""
    cache: dict[tuple[str, str], list[dict]] = {}

    def get(name: str, dtype: str) -> list[dict]:
        if (name, dtype) not in cache:
            cache[name, dtype] = run_config(config(name, dtype), tmp_path_factory.mktemp(f"{name}_{dtype}"))
        return cache[name, dtype]

    return get


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", [n for n in PARALLEL if n != "reference"])
def test_sharded_config_tracks_the_single_process_at_the_same_precision(results, name, dtype):
    ref, runs = results("reference", dtype)[0], results(name, dtype)
    for r in runs:  # every rank reports the same global loss, scale and verdict
        for key in ("losses", "loss_scales", "skipped"):
            assert r[key] == runs[0][key], key
    run = runs[0]
    assert run["steps"] == ref["steps"] == list(range(1, STEPS + 1))
    assert run["skipped"] == ref["skipped"]
    assert run["loss_scales"] == ref["loss_scales"]
    # A skipped step's norm is not finite; every other step's is the whole model's.
    finite = [i for i, s in enumerate(ref["skipped"]) if not s]
    loss_diff = max(rel(run["losses"][i], ref["losses"][i]) for i in range(STEPS))
    norm_diff = max(rel(run["grad_norms"][i], ref["grad_norms"][i]) for i in finite)
    print(f"{name} {dtype}: max relative loss difference {loss_diff:.2e}, grad norm {norm_diff:.2e}")
    assert loss_diff <= RTOL[dtype]
    assert norm_diff <= RTOL[dtype]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(PARALLEL))
def test_fp16_overflow_on_one_rank_is_skipped_on_every_rank_and_backs_the_scale_off(results, name):
    runs = results(name, "fp16")
    expected_skips = [s == OVERFLOW_STEP for s in range(1, STEPS + 1)]
    for r in runs:
        assert r["skipped"] == expected_skips
        # Scale each step's backward used: the clean step 1 grows 1024 -> 2048; the overflow
        # (hysteresis 1) backs it off by 0.5 at once.
        assert r["loss_scales"] == [1024.0, 2048.0, 1024.0]
        i = OVERFLOW_STEP - 1
        assert not math.isfinite(r["grad_norms"][i])
        assert all(math.isfinite(g) for j, g in enumerate(r["grad_norms"]) if j != i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in PARALLEL if n != "reference"])
def test_bf16_keeps_the_loss_scale_at_one_and_skips_nothing(results, name):
    for r in results(name, "bf16"):
        assert r["loss_scales"] == [1.0] * STEPS and not any(r["skipped"])
