"""The placeable capacity's sums, kept per worker (``Capacity``): what an offer
(``ResourcesReady`` with no job id, cordons.py ``_offer``) says, without a pass over every
worker.

Why: every registration publishes an offer, and the offer summed five quantities over every
registered worker; with 10,000 node agents registering that was O(workers) per registration,
O(workers²) for them all, and two thirds of control's CPU (py-spy, session 34: 4,000 agents
registered at ~20/s and slowing). Now each worker's share is kept, and a change of a worker
(its registration, withdrawal, departure, cordon, hold, or the slots its jobs hold) replaces
that worker's share in the sums: O(1) per change. The allocator names the workers it changed
(``recount``) under its lock, where it changes them; a test replays random changes against a
full recount (tests/control/test_offer_capacity.py)."""

from __future__ import annotations

from typing import NamedTuple

from services.control.resource_allocator.slots import _gpu_slots, _Worker


class _Share(NamedTuple):
    """One worker's part of the sums (zeros but the registered ones when it is not placeable)."""

    free: int  # free slots, if placeable
    gpu: int  # slots with a CUDA device, if placeable
    slots: int  # slots, if placeable
    registered_gpu: int
    registered: int


_NONE = _Share(0, 0, 0, 0, 0)


class Capacity:
    """Sums over the registered workers of their free, GPU and all slots (placeable ones) and
    of their GPU and all slots (every one). Not thread-safe: the allocator's lock guards it."""

    def __init__(self) -> None:
        self._shares: dict[str, _Share] = {}
        self._sum = _NONE

    def recount(self, worker_id: str, worker: _Worker | None, placeable: bool) -> None:
        """Replace ``worker_id``'s share by what ``worker`` (None: gone) offers now."""
        old = self._shares.pop(worker_id, _NONE)
        new = _NONE
        if worker is not None:
            gpu, slots = _gpu_slots(worker), worker.reg.slots
            new = _Share(worker.free_count(), gpu, slots, gpu, slots) if placeable else _Share(0, 0, 0, gpu, slots)
            self._shares[worker_id] = new
        self._sum = _Share(*(s - o + n for s, o, n in zip(self._sum, old, new, strict=True)))

    @property
    def free(self) -> int:
        """Free slots on the placeable workers."""
        return self._sum.free

    @property
    def gpu(self) -> int:
        """Slots with a CUDA device on the placeable workers."""
        return self._sum.gpu

    @property
    def cpu(self) -> int:
        """Slots without one on the placeable workers."""
        return self._sum.slots - self._sum.gpu

    @property
    def registered_gpu(self) -> int:
        """Slots with a CUDA device on every registered worker."""
        return self._sum.registered_gpu

    @property
    def registered_cpu(self) -> int:
        """Slots without one on every registered worker."""
        return self._sum.registered - self._sum.registered_gpu
