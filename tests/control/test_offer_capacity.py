"""The allocator's offer (ResourcesReady with no job id): its sums are kept per worker, so a
registration costs the same among 200 workers as among 2,000 (10,000 node agents registering
were O(n²): session 34), and they stay what a full recount over every worker says through
any order of registrations, withdrawals, departures, cordons, holds, allocations, releases
and rebuilds."""

from __future__ import annotations

import random
import sys

import pytest

from services.contract import Module, control_pb2
from services.contract.bus import Bus
from services.control.resource_allocator import ResourceAllocator
from services.control.resource_allocator.slots import _gpu_slots

from .conftest import registration
from .test_resource_allocator import allocate_on

pytestmark = pytest.mark.timeout(120)


def allocator_alone() -> tuple[ResourceAllocator, Bus]:
    """The allocator on a real bus, its launches and offers going nowhere (as in
    test_resource_allocator's memory pressure test)."""
    bus = Bus()
    bus.subscribe(Module.EXT_HARDWARE, control_pb2.LaunchRanks, lambda msg, worker_id: None)
    bus.subscribe(Module.EXT_HARDWARE, control_pb2.ReleaseRanks, lambda msg, worker_id: None)
    alloc = ResourceAllocator(
        hardware=bus.port(Module.L1_RESOURCE_ALLOCATOR, Module.EXT_HARDWARE),
        emit=bus.emitter(Module.L1_RESOURCE_ALLOCATOR),
    )
    bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, control_pb2.AllocateResources, alloc.allocate_resources)
    return alloc, bus


def full_recount(alloc: ResourceAllocator) -> tuple[int, int, int, int, int]:
    """The offer's sums as the allocator computed them before session 34: a pass over every
    registered worker (the reference)."""
    every = list(alloc._workers.values())
    placeable = [w for w in every if alloc._placeable(w)]
    gpu = sum(_gpu_slots(w) for w in placeable)
    registered_gpu = sum(_gpu_slots(w) for w in every)
    return (
        sum(w.free_count() for w in placeable),
        gpu,
        sum(w.reg.slots for w in placeable) - gpu,
        registered_gpu,
        sum(w.reg.slots for w in every) - registered_gpu,
    )


def offered(alloc: ResourceAllocator) -> tuple[int, int, int, int, int]:
    with alloc._lock:
        o = alloc._offer()
    return o.free_ranks, o.gpu_slots, o.cpu_slots, o.registered.gpu, o.registered.cpu


def profiled_calls(fn) -> int:
    """Python and C function calls made by ``fn()`` on this thread (a count, not a time: the
    same on a loaded machine)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_registration_costs_the_same_among_200_workers_as_among_2000():
    def cost(n: int) -> int:
        alloc, _ = allocator_alone()
        for i in range(n):
            alloc.on_worker_registration(registration(f"w{i}", slots=8, cuda=i % 2))
        alloc.cordon_worker(control_pb2.CordonWorker(worker_id="w1", reason="ecc"))
        alloc.cordon_worker(control_pb2.CordonWorker(worker_id="w2", hold=True, reason="silent"))
        return profiled_calls(lambda: alloc.on_worker_registration(registration("new", slots=8, cuda=1)))

    small, large = cost(200), cost(2000)
    # Before: the offer summed over every worker (~10 calls a worker: 2,000 and 20,000).
    assert large <= small + 20, (small, large)


def test_the_offers_sums_are_a_full_recounts_through_any_order_of_changes():
    rng = random.Random(34)
    alloc, bus = allocator_alone()
    jobs: list[str] = []
    for step in range(600):
        ids = [f"w{i}" for i in range(12)]
        op = rng.choice(
            ["register", "register", "withdraw", "depart", "cordon", "uncordon", "hold", "lift", "allocate", "release"]
            + ["rebuild"] * 2
        )
        w = rng.choice(ids)
        if op == "register":
            reg = registration(w, slots=rng.randint(1, 4), cuda=rng.randint(0, 2))
            reg.incarnation = rng.choice(["a", "b"])
            alloc.on_worker_registration(reg)
        elif op == "withdraw":
            alloc.on_worker_registration(control_pb2.WorkerRegistration(worker_id=w, slots=0))
        elif op == "depart":
            alloc.on_worker_registration(control_pb2.WorkerRegistration(worker_id=w, slots=2, departing=True))
        elif op in ("cordon", "uncordon"):
            alloc.cordon_worker(control_pb2.CordonWorker(worker_id=w, reason="ecc", clear=op == "uncordon"))
        elif op in ("hold", "lift"):
            alloc.cordon_worker(control_pb2.CordonWorker(worker_id=w, hold=True, lift=op == "lift", reason="quiet"))
        elif op == "allocate":
            job = f"j{step}"
            if isinstance(allocate_on(bus, job, dp=rng.randint(1, 3)), control_pb2.ResourcesReady):
                jobs.append(job)
        elif op == "release" and jobs:
            alloc.release_resources(control_pb2.ReleaseResources(job_id=jobs.pop(rng.randrange(len(jobs)))))
        elif op == "rebuild" and jobs:
            job = rng.choice(jobs)
            ranks = alloc._placed[job].ranks if job in alloc._placed else []
            msg = control_pb2.RebuildCommunicator(job_id=job, reason="test", in_place=rng.random() < 0.7)
            # (a rank whose worker withdrew is lost: its session reported it so, as L1-1 then says)
            msg.lost_ranks.extend(
                r for r, (wid, _) in enumerate(ranks) if wid not in alloc._workers or rng.random() < 0.5
            )
            if msg.in_place and rng.random() < 0.3:
                msg.layout.dp, msg.layout.micro_batch_size, msg.layout.grad_accum = rng.randint(1, 4), 1, 1
            alloc.rebuild_communicator(msg)
        assert offered(alloc) == full_recount(alloc), (step, op, w)
