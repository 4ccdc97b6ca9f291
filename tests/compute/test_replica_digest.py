"""The replica check's digest and vote, pure (services/compute/replica_digest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.compute.replica_digest import Divergence, digest, local_tensors, odd_replicas
from services.rank.faults import flip_one_weight

pytestmark = pytest.mark.timeout(60)

NAMES = ["a", "b", "c"]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))


def test_the_digest_is_one_float64_per_tensor_equal_for_equal_weights():
    one, two = _model(), _model()
    d1, d2 = (digest(t for _, t in local_tensors(m)) for m in (one, two))
    assert d1.dtype == torch.float64 and d1.shape == (len(list(one.parameters())),)
    assert torch.equal(d1, d2)  # bit-identical: compared exactly
    assert torch.equal(d1, torch.stack([p.detach().double().sum() for p in one.parameters()]))


def test_a_flipped_bit_in_one_element_changes_that_tensor_s_digest_only():
    clean, bad = _model(), _model()
    name = flip_one_weight(bad)
    assert name == "0.weight"  # the first matrix parameter
    d_clean, d_bad = (digest(t for _, t in local_tensors(m)) for m in (clean, bad))
    differs = [n for (n, _), x, y in zip(local_tensors(clean), d_clean, d_bad) if x != y]
    assert differs == ["0.weight"]
    changed = (clean[0].weight != bad[0].weight).sum().item()
    assert changed == 1  # one element, still finite
    assert torch.isfinite(bad[0].weight).all()


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ([[1.0, 2.0, 3.0]] * 3, None),
        ([[1.0, 2.0, 3.0], [1.0, 2.5, 3.0], [1.0, 2.0, 3.0]], Divergence("b", (1,), 1, True)),
        # two tensors differ on rank 0 of four: the first is named, both counted
        ([[9.0, 2.0, 9.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], Divergence("a", (0,), 2, True)),
        # dp 2: no majority, both suspect
        ([[1.0, 2.0, 3.0], [1.0, 2.0, 4.0]], Divergence("c", (0, 1), 1, False)),
        # dp 4 split 2-2: no strict majority
        ([[1.0, 0, 0], [1.0, 0, 0], [2.0, 0, 0], [2.0, 0, 0]], Divergence("a", (0, 1, 2, 3), 1, False)),
        # a NaN in one replica: odd against the majority
        ([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, float("nan"), 3.0]], Divergence("b", (2,), 1, True)),
        # dp 1: nothing to compare
        ([[1.0, 2.0, 3.0]], None),
    ],
)
def test_the_odd_replica_is_the_one_outside_a_strict_majority(rows, want):
    assert odd_replicas(torch.tensor(rows, dtype=torch.float64), NAMES) == want
