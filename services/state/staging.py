"""Host staging: the host-memory buffers a snapshot's tensors are copied into, reused between saves.

A snapshot (services/state/snapshot.py) is a private copy of a rank's state. Taken into fresh
memory every save, it costs page faults on every page (seconds for a 100 M-parameter model
with its optimizer state) and, for state on an accelerator, pinned memory allocated anew
(``cudaHostAlloc``, slower still); cloned on the accelerator, it doubles device memory. This
pool keeps the buffers instead, as torch's own asynchronous checkpoint stager does with
``cache_staged_state_dict`` (torch.distributed.checkpoint.staging): every tensor of a slot is
staged into a host buffer kept per (slot key, path) — the path is the state dict's FQN —
and handed out again at the next save when its size in bytes and its pinning still match
(the bytes are viewed as the tensor's shape and dtype). A different size at a path (a
resize, a new parallel layout) drops the path's old buffers. The pool keeps one copy of the
state in host memory between saves (two while a background write overlaps the next
snapshot): the price of saves without page faults, as in torch's stager.

Why reuse can never overwrite bytes still being read: a buffer is handed out only while no
tensor but the pool's own handle refers to its storage (the storage's reference count,
views included). The slot holding it, the checkpoint writer's thread that reads it in the
background (services/rank/store_client.py's asynchronous save), a load template: while any
of them holds a tensor on it, the next save is given another buffer (double buffering,
when a write overlaps the next snapshot); once the last one lets go, the buffer is free.
Nothing has to remember to release it.

On CUDA the buffers are pinned (``torch.empty(..., pin_memory=True)``) so the copy is a
DMA without a staging bounce; a tensor is copied in chunks of at most ``CHUNK_BYTES`` when
it is not contiguous (each chunk's contiguous temporary is the only device memory a save
allocates beyond the state itself) and the copies are awaited once, at the end of a slot.

One pool per process (a rank is one process; its owners' ExportState replies take their
copies through it): :func:`pool`.
"""

from __future__ import annotations

import threading

import torch

CHUNK_BYTES = 64 << 20  # the most device memory one non-contiguous tensor's copy allocates at once
_KEPT_PER_PATH = 2  # buffers kept per path: one being written in the background, one for the next save


class HostStaging:
    """Host buffers per (slot key, FQN path), reused once nothing but the pool refers to them
    (module docstring). Thread-safe: a snapshot may be taken while the writer thread drops
    the previous one. ``reuse=False``: every stage allocates fresh memory (the behaviour
    before this pool; for comparison in bench/checkpoint_save.py)."""

    def __init__(self, *, reuse: bool = True):
        self.reuse = reuse
        self._lock = threading.Lock()
        self._buffers: dict[tuple[str, str], list[torch.UntypedStorage]] = {}
        self._pending_cuda = False  # a non-blocking device -> host copy not yet awaited
        self._allocated = self._reused = 0  # bytes handed out in new buffers / in kept ones

    def stage(self, key: str, path: str, value: torch.Tensor) -> torch.Tensor:
        """A host copy of ``value`` (detached; a DTensor's local shard, returned as a DTensor
        with the same mesh, placements, shape and stride) in a buffer of this pool. A copy
        from an accelerator may still be in flight: call :meth:`wait` before reading it."""
        value = value.detach()
        local = value.to_local() if hasattr(value, "to_local") else value
        host = self._buffer(key, path, local)
        self._copy(host, local)
        if local is value:
            return host
        from torch.distributed.tensor import DTensor

        # A DTensor over a host-side local shard, with the source's spec (mesh, placements,
        # global shape and stride), as torch's own CPU staging builds it for an asynchronous
        # DCP save (torch.distributed._state_dict_utils._create_cpu_state_dict). Not
        # DTensor.from_local: it moves the local tensor to the mesh's device, back onto the GPU.
        return DTensor(host, value._spec, requires_grad=False)

    def wait(self) -> None:
        """Wait for the device -> host copies issued since the last wait (none on a CPU)."""
        if self._pending_cuda:
            torch.cuda.current_stream().synchronize()
            self._pending_cuda = False

    def held_bytes(self) -> int:
        """Bytes of host memory the pool keeps (free or lent)."""
        with self._lock:
            return sum(s.nbytes() for kept in self._buffers.values() for s in kept)

    def stats(self) -> dict[str, int]:
        """Bytes staged so far into new buffers (``allocated``) and into reused ones
        (``reused``), and the bytes the pool keeps (``held``)."""
        return {"allocated": self._allocated, "reused": self._reused, "held": self.held_bytes()}

    def _buffer(self, key: str, path: str, like: torch.Tensor) -> torch.Tensor:
        """A free host tensor shaped like ``like`` (contiguous, same dtype), from the pool or new."""
        pin = like.device.type == "cuda" and torch.cuda.is_available()
        nbytes = max(1, like.numel() * like.element_size())  # (a storage of 0 bytes cannot be pinned)
        if not self.reuse:
            self._allocated += nbytes
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        with self._lock:
            kept = self._buffers.setdefault((key, path), [])
            fits = [s for s in kept if s.nbytes() == nbytes and s.is_pinned() == pin]
            if len(fits) != len(kept):  # a resize or a new layout: the old shapes are not coming back
                kept[:] = fits
            storage = next((s for s in kept if _unused(s)), None)
            if storage is None:
                storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
                kept.append(storage)
                del kept[:-_KEPT_PER_PATH]  # forget the oldest (its holder keeps it until it lets go)
                self._allocated += nbytes
            else:
                self._reused += nbytes
            return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)

    def _copy(self, host: torch.Tensor, src: torch.Tensor) -> None:
        on_device = src.device.type != "cpu"
        self._pending_cuda = self._pending_cuda or src.device.type == "cuda"
        non_blocking = on_device and host.is_pinned()
        if src.is_contiguous() or src.dim() == 0:
            host.copy_(src, non_blocking=non_blocking)  # device -> host directly: no device memory
            return
        # A strided source is made contiguous on its device before it crosses: a slice of
        # rows at a time, so that temporary is one chunk, never the whole tensor.
        row_bytes = max(1, src[0].numel() * src.element_size())
        rows = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, src.shape[0], rows):
            host[start : start + rows].copy_(src[start : start + rows], non_blocking=non_blocking)


def _unused(storage: torch.UntypedStorage) -> bool:
    """Nothing but the pool's own handle refers to ``storage`` (no tensor, no view)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1  # torch's own count of the StorageImpl's owners


_POOL = HostStaging()
_FRESH = HostStaging(reuse=False)  # for a copy that belongs to no slot


def pool() -> HostStaging:
    """This process's staging pool."""
    return _POOL


def use_pool(staging: HostStaging) -> HostStaging:
    """Make ``staging`` this process's pool (a benchmark comparing a reusing pool with fresh
    memory each save, a test starting from an empty pool); returns the pool it replaces."""
    global _POOL
    _POOL, previous = staging, _POOL
    return previous


def keep_buffers(keep: bool) -> None:
    """Whether this process's pool keeps its buffers between saves (a fresh pool either way).
    A rank decides it once from its device (services/rank/__main__.py compose): kept when the
    state is on an accelerator, where the copies are host memory beside it; not on a CPU rank,
    whose state is itself host memory: kept buffers would hold a second copy of the state for
    the whole job, and a model sized to the host would no longer fit."""
    use_pool(HostStaging(reuse=keep))


def staging_for(key: str | None) -> HostStaging:
    """The pool a copy of slot ``key`` is staged in: this process's, or for no key (a copy
    that is no slot's) fresh memory each time."""
    return _POOL if key is not None else _FRESH
