"""This rank's pieces of the squared gradient norm, computed without communicating.

The whole model's norm needs every rank's gradients: DTensor shards (FSDP2, tensor parallel)
and pipeline stages hold disjoint parts, DDP replicas identical copies. The precision
manager (L2-4) may not communicate (seed L2-4 red line 4), so it computes only this rank's
sums of squares here, split so that one sum over every rank of the world counts each
gradient element exactly once; L3-5 does that sum in the step's one small all-reduce
(services/compute/gradient_reduction.py), and L2-4 takes the square root of what it is given.

    replicated: plain tensors (held whole; the same on every dp / tp replica: L3-5 counts
        only the replica at dp = tp = 0, as it laid the replicas out);
    sharded: DTensor local shards, counted here only on the rank at coordinate 0 of each
        mesh dim the DTensor is Replicate on (Shard dims: every coordinate holds a distinct
        part). A Partial grad (a summand, not a part) has no local square; L3-5 settles
        Partial grads into Replicate ones at the end of backward, so none reaches here.

``torch._foreach_norm`` refuses a mix of plain tensors and DTensors, so the local tensors
are taken (``to_local()``) and grouped by device and dtype first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate


def local_squares(grads: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(replicated, sharded): sums of squares (float64 Python numbers, ``inf``/``nan`` when a
    gradient is not finite) of this rank's plain-tensor gradients and of its counted DTensor
    shards (module docstring). One host sync.

    Raises:
        ValueError: a gradient is a Partial DTensor (L3-5 should have settled it).
    """
    plain: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for g in grads:
        if not isinstance(g, DTensor):
            plain.append(g)
            continue
        if any(isinstance(p, Partial) for p in g.placements):
            raise ValueError("gradient norm: a Partial DTensor gradient reached the precision manager unsettled")
        mesh = g.device_mesh
        if all(not isinstance(p, Replicate) or mesh.get_local_rank(d) == 0 for d, p in enumerate(g.placements)):
            shards.append(g.to_local())
    return _squares(plain), _squares(shards)


def _squares(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    # The norms in float32 (as torch.nn.utils.get_total_norm), squared in float64: squaring
    # first could overflow float32 for large, still finite, gradients (fp16 loss scaling).
    norms = [torch.stack(torch._foreach_norm(ts, 2.0)).double() for ts in groups.values()]
    return float(torch.cat(norms).pow(2).sum())
