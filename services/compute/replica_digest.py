"""Replica-consistency digests (issue 29 item 3: silently wrong ranks).

Data-parallel replicas of a parameter hold the same bytes: they start from the same
weights (DDP broadcasts rank 0's; a resume loads one version) and apply the same reduced
gradients with the same kernels. A flipped bit or a bad device makes one replica drift,
and nothing else notices (a checkpoint's chunk digests prove the bytes were stored intact,
not that they were right). So every ``integrity.replica_check_every_steps`` steps L3-5
digests this rank's parameters, all-gathers the digests over the dp group and compares
them here.

The digest (:func:`digest`): one float64 per tensor, the sum of its local elements
accumulated in float64 (``torch.sum(dtype=torch.float64)``; a DTensor's local shard: tp
and pp peers of one dp group hold the same shard). One read of the parameters at memory
bandwidth and no copy; any change of one element (a sign or exponent bit flip, a scaled
value) moves the sum by far more than its float64 rounding. Replicas run the same reduction
on the same bytes, so their sums are bit-identical and compared exactly (the same hardware
class: mixed devices in one dp group would need a tolerance).

The vote (:func:`odd_replicas`): pure, per tensor; the replicas holding a value more than
half of them share are right, the others are odd. At dp 2, or with no strict majority,
nothing tells which is right: every replica is suspect.

Shapes: ``digests_RT`` is replicas x tensors, float64.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Divergence:
    """What the replica check found: the first tensor (in parameter order) whose replicas
    differ, the odd dp ranks (sorted), how many tensors differ, and whether a majority
    agreed (False: at dp 2 or a tie, every replica is suspect)."""

    tensor: str
    odd_ranks: tuple[int, ...]
    num_tensors: int
    majority: bool


def local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters by name, each as this rank's local tensor (a DTensor's shard)."""
    out = []
    for name, p in model.named_parameters():
        t = p.detach()
        out.append((name, t.to_local() if hasattr(t, "to_local") else t))
    return out


def digest(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One float64 sum per tensor, on the tensors' device. Shape (tensors,), float64."""
    sums = [torch.sum(t, dtype=torch.float64) for t in tensors]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)


def odd_replicas(digests_RT: torch.Tensor | Sequence[Sequence[float]], names: Sequence[str]) -> Divergence | None:
    """Compare the replicas' digests (row r: dp rank r's). None when every column agrees;
    else the first differing tensor (``names[t]``) and the replicas that are odd in it: those
    outside a strict majority value, or every replica when none has one. A NaN digest (a
    NaN in the weights) counts as differing from everything, itself included."""
    rows = torch.as_tensor(digests_RT, dtype=torch.float64)
    num_replicas, num_tensors = rows.shape
    if num_replicas < 2:
        return None
    # (a NaN in one replica only: no other equals it; NaN in all: each equals none, all suspect)
    same = (rows == rows[0]).all(dim=0)
    differing = [t for t in range(num_tensors) if not bool(same[t])]
    if not differing:
        return None
    first = differing[0]
    column = rows[:, first].tolist()
    finite = [v for v in column if v == v]
    value, count = Counter(finite).most_common(1)[0] if finite else (0.0, 0)
    if count * 2 > num_replicas:
        odd = tuple(r for r, v in enumerate(column) if v != value)
        return Divergence(names[first], odd, len(differing), True)
    return Divergence(names[first], tuple(range(num_replicas)), len(differing), False)
