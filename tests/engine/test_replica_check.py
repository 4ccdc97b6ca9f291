"""The replica check over real gloo rank processes (issue 29 item 3): a rank whose weights
were corrupted after an update is found at the next check step and named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_fakes import free_port

from tests.rank_forks import run_ranks_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _run(tmp_path: Path, world: int, steps: int, every: int, inject_step: int, inject_rank: int) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(steps), str(every), str(inject_step), str(inject_rank)]
    run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
        [[str(HERE / "replica_rank_main.py"), str(r), str(world), str(port), str(tmp_path), *argv]
         for r in range(world)],
        timeout=240, tail=2000, cwd=REPO,
    )  # fmt: skip
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.timeout(300)
def test_three_gloo_ranks_find_the_corrupted_rank_at_the_next_check_and_name_it(tmp_path):
    # Checks at steps 2, 4, 6, ...; rank 2's weights are corrupted after step 3's update.
    ranks = _run(tmp_path, world=3, steps=10, every=2, inject_step=3, inject_rank=2)
    for r in ranks:
        # Every rank stops at the check of step 4 (one step after the corruption), none later.
        assert r["steps"] == [1, 2, 3, 4]
        ((fault_class, step, detail),) = r["failed"]
        assert (fault_class, step) == ("replica_divergence", 4)
        # The corrupted tensor (flip_one_weight's: the first matrix parameter) and the odd rank.
        assert "replicas differ after step 4 in tok_emb.weight: dp rank 2 differs from the majority" in detail
        assert "last agreeing check: step 2" in detail
        assert len(r["check_seconds"]) == 2  # steps 2 (agreed) and 4


@pytest.mark.timeout(300)
def test_at_dp_2_both_replicas_are_suspect_and_an_uncorrupted_run_finishes(tmp_path):
    bad = _run(tmp_path / "bad", world=2, steps=6, every=3, inject_step=1, inject_rank=1)
    for r in bad:
        ((fault_class, step, detail),) = r["failed"]
        assert (fault_class, step) == ("replica_divergence", 3)
        assert "dp ranks 0, 1 differ and no majority says which is right" in detail
        assert "last agreeing check: none since this generation started" in detail
    good = _run(tmp_path / "good", world=2, steps=6, every=3, inject_step=0, inject_rank=0)
    for r in good:
        assert r["failed"] == [] and r["steps"] == [1, 2, 3, 4, 5, 6]
        assert len(r["check_seconds"]) == 2  # steps 3 and 6, both agreed
