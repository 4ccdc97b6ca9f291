"""Data parallelism over two real gloo rank processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_fakes import free_port, tiny_spec

from services.compute.inference import load_model_for_inference
from services.compute.model import build_model
from services.contract import Module
from tests.rank_forks import run_ranks_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.timeout(120)
def test_two_gloo_ranks_with_different_data_end_with_identical_parameters(tmp_path):
    port = free_port()
    run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
        [[str(HERE / "ddp_rank_main.py"), str(r), str(port), str(tmp_path)] for r in (0, 1)],
        timeout=100,
        tail=2000,
        cwd=REPO,
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))

    assert not torch.equal(r0["first_batch"], r1["first_batch"])  # each rank its own data
    assert r0["state"].keys() == r1["state"].keys()
    assert all(torch.equal(r0["state"][k], r1["state"][k]) for k in r0["state"])
    spec = tiny_spec(steps=6, parallel={"dp": 2}, data={"micro_batch_size": 4, "grad_accum": 2})
    init = build_model(spec.model, spec.seed).state_dict()
    assert not torch.equal(init["blocks.0.attn.q.weight"], r0["state"]["blocks.0.attn.q.weight"])
    # The reported loss and token count are global: the same on both ranks.
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 6
    assert r0["tokens"] == [2 * 2 * 4 * 64] * 6
    assert r0["eval"] == r1["eval"] and len(r0["eval"]) == 1
    # Rank 0 committed the at-end checkpoint written by both ranks; it loads back exactly.
    assert (r0["committed"], r1["committed"]) == (1, 0)
    model = load_model_for_inference(str(tmp_path / "ckpt" / "step6"), spec)
    assert all(torch.equal(v, r0["state"][k]) for k, v in model.state_dict().items())
    # Communication outside L3-5 (services/contract/comm_guard.py): DDP's construction in
    # L3-1's handover, its bucket all-reduces in L3-4's backward, the group's teardown are
    # registered; the fake store relay's DCP save and barrier are not (the real relay's
    # are: tests/engine/test_save_agreement.py), so the guard finds them, as it would any.
    for r in (r0, r1):
        registered = {c[3] for c in r["crossings"] if c[3]}
        assert registered == {
            "shard-loader-handover-communication",
            "ddp-hook-in-backward",
            "composition-root-teardown",
        }, r["crossings"]
        assert {(c[0], c[2]) for c in r["crossings"] if not c[3]} == {
            (Module.L5_CHECKPOINT_MANAGER, "tests/engine/rank_fakes.py::FakeStore.save_checkpoint")
        }
        assert "barrier" in {c[1] for c in r["crossings"] if not c[3]}
