"""Gradient norms over parameters that may be DTensor shards (FSDP2, tensor parallel).

``torch.nn.utils.get_total_norm`` runs ``torch._foreach_norm`` over one list, which refuses
a mix of plain tensors and DTensors, and on DTensors returns a DTensor (a partial norm)
rather than a number. A layout may leave non-sharded weights (embedding, norms) plain
tensors beside DTensor q/k/v/..., or put DTensors on two meshes (dp x tp and dp). (Surge's
present layout, torch 2.13, gives only DTensors on one mesh: tp, or dp x tp, with Partial
grads for the replicated weights; tests/parallel/test_precision_parallel.py.) So the gradients are grouped
by mesh, each group's norm is made whole (``full_tensor()``: the collective that sums the
shards' squares over the mesh), and the groups are combined as sqrt(sum of squares).
Every rank must call it, in the same order (the full_tensor reductions are collectives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0, over: dist.ProcessGroup | None = None) -> float:
    """The L-``norm_type`` norm of all of ``grads`` together, as a Python float (one host
    sync). Plain tensors and DTensors of any meshes may be mixed; ``inf`` norms too.
    ``over``: a process group whose ranks hold disjoint parameters (pipeline stages): the
    norm of all their gradients together (one more 1-element all-reduce, on every rank of it)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    parts = []
    for mesh, group in sorted(groups.items(), key=lambda kv: _mesh_key(kv[0])):
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    inf = norm_type == float("inf")
    local = torch.stack(parts) if parts else torch.zeros(1)
    local = local.max().reshape(1) if inf else local.pow(norm_type).sum().reshape(1)
    if over is not None:  # on the gradients' device: NCCL reduces no CPU tensor
        local = local.to(grads[0].device if grads else "cpu")
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=over)
        local = local.cpu()
    return float(local[0]) if inf else float(local[0].pow(1.0 / norm_type))


def _mesh_key(mesh) -> tuple:
    # Same group order on every rank, so the full_tensor collectives line up.
    if mesh is None:
        return ()
    return (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist()))
