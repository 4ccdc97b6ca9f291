"""The memory quota L1-2 assigns a rank, enforced on its CUDA device.

L1-2 gives each rank a quota (``RankAssignment.memory_quota_bytes``: its device's memory on
CUDA, its share of the host's on CPU; seed 000 L1-2, 显存配额). On CUDA the rank caps its
caching allocator at that share of the device with
``torch.cuda.set_per_process_memory_fraction``: an allocation past it raises
``torch.OutOfMemoryError`` in this rank (a typed out_of_memory failure) instead of taking
memory another process on the device holds. On CPU nothing is capped here: the host's
memory is the node agent's to watch (memory_pressure.py), and admission already refused a
job whose estimate does not fit (services/control/resource_allocator/allocator.py).
"""

from __future__ import annotations

from typing import Any

import torch


def apply_memory_quota(quota_bytes: int, device: int, cuda: Any = torch.cuda) -> float | None:
    """Cap this process's allocations on CUDA device ``device`` (an index this process sees)
    at ``quota_bytes``: the fraction ``quota_bytes / total_memory`` (at most 1) is set with
    ``cuda.set_per_process_memory_fraction``. Returns the fraction set, or None for no quota
    (0: nothing set). ``cuda`` is ``torch.cuda`` (tests pass a stand-in: no GPU here)."""
    if quota_bytes <= 0:
        return None
    total = cuda.get_device_properties(device).total_memory
    fraction = min(1.0, quota_bytes / total)
    cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
