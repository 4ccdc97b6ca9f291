"""The resource allocator (L1-2) composed: its state, the commands from L1-1 (allocate and
release a job's ranks) and placement: ranks laid out by slot and by memory.

Each other concern is a mixin in its own file (registry, cordons, rebuild);
``ResourceAllocator`` joins them. The package docstring (``__init__.py``) describes the module
as a whole."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.control.cluster_metrics import SlotCensus, watch_slots
from services.control.resource_allocator.capacity import Capacity
from services.control.resource_allocator.cordons import Cordons
from services.control.resource_allocator.rebuild import Rebuild
from services.control.resource_allocator.registry import Registry
from services.control.resource_allocator.slots import (
    _device_kind,
    _device_name,
    _link_probe,
    _memory_peer,
    _memory_quota,
    _of_kind,
    _placed,
    _Placement,
    _rank_memory,
    _reachable_host,
    _Ring,
    _Worker,
)
from services.jobspec import spec_from_json
from services.memory_estimate import human_bytes

# How long a node agent gives a released rank to exit before killing it (seconds).
RELEASE_GRACE_SECONDS = 10.0


class ResourceAllocator(Registry, Cordons, Rebuild):
    """Registry of node agents and their slots; lays out ranks for a job.

    Args:
        hardware: command port to the node agents (EXT_HARDWARE); each command's payload
            is the worker id it is addressed to.
        emit: publishes this module's events (ResourcePressure).
        control_host: the address this host's free ports are found on (master_port).
        parallel: command port to L2-2 of the job's ranks (RebuildParallelGroup; None: no
            rebuild in place, e.g. in tests of placement alone).
    """

    def __init__(
        self,
        hardware: CommandPort,
        emit: Emitter,
        control_host: str = "127.0.0.1",
        parallel: CommandPort | None = None,
    ):
        self._hardware = hardware
        self._emit = emit
        self._control_host = control_host
        self._lock = threading.Lock()
        # Insertion order is registration order: ranks fill workers in that order.
        self._workers: dict[str, _Worker] = {}
        # job_id -> the allocation as commanded (job config, world size, exclusions): what
        # a communicator rebuild launches again.
        self._allocations: dict[str, control_pb2.AllocateResources] = {}
        # job_id -> where each rank runs, index = rank (worker id, slot), the backend chosen
        # and the generation of its rendezvous: what a rebuild in place keeps and changes.
        self._placed: dict[str, _Placement] = {}
        # job -> rank -> (worker id, slot) its node agent re-attached after a control restart
        self._reattached: dict[str, dict[int, tuple[str, int]]] = {}
        # worker id -> its cordon (CordonWorker): kept while the worker is withdrawn (a broken
        # stream), ended only by a registration of another node agent incarnation.
        self._cordons: dict[str, control_pb2.WorkerCordoned] = {}
        self._parallel = parallel
        # job_id -> the last rank generation launched (RankAssignment.generation, fencing)
        self._generations: dict[str, int] = {}
        # worker id -> why it is held out of placement (CordonWorker{hold}: L1-1 decided on
        # its node agent's agent_silent report), until L1-1 lifts it (the agent beats again).
        self._holds: dict[str, str] = {}
        self._offers = 0  # the offers of placeable capacity published (cordons.py ``_offer``)
        self._capacity = Capacity()  # the offer's sums, kept per worker (capacity.py)
        watch_slots(self._slot_census)  # control's cluster gauges read it when scraped

    # ------------------------------------------------------------ commands (L1-1)

    def allocate_resources(
        self,
        msg: control_pb2.AllocateResources,
        payload: Any = None,
        *,
        prefer: Sequence[Sequence[tuple[str, int | None]]] = (),
    ) -> control_pb2.ResourcesReady | control_pb2.ResourcesInsufficient:
        """全局资源初始化指令: lay out ``world_size`` ranks and launch them.

        Ranks fill workers in registration order (skipping ``exclude_worker_ids``), lowest
        free slot first. Rank 0's host is the rendezvous (master_addr), on a fresh port.
        Each rank's memory quota is its device's memory (CUDA) or the host memory divided
        by the worker's slots (CPU), in bytes. Each launch names the node's peer for the
        in-memory checkpoint copies (``memory_peer``): the next placeable worker after it in
        registration order, wrapping around (a ring: every node's copies live on one other
        node, and a node's peer is the same for every job).

        Admission by memory: a rank goes only to a slot whose quota holds the job's
        estimated memory per rank (services/memory_estimate.py, what `submit --dry-run`
        prints). When fewer registered slots (free or taken) hold it than the job has ranks,
        and some slot is too small for it, the refusal says so (``rank_memory_bytes``, and the largest slot registered): the job
        cannot start on these workers.

        Returns ResourcesInsufficient (nothing reserved) when fewer slots are free than
        ranks are needed, or when backend ``nccl`` is asked for on CPU-only slots.

        ``probe``: nothing is placed; ResourcesInsufficient says the free slots of the job's
        kind that hold its memory per rank, whether or not they are enough (a preemption's
        plan in L1-1 reads it), and, when they are not, the reason a placement would give. A
        probe of a job that holds ranks here asks for ``world_size`` more of them (a `surgectl
        scale`'s growth, ``init`` at the new layout): its allocation's excluded workers count.

        ``adopt`` (a control restart): only record the allocation, launch nothing; the
        workers it excludes (earlier exclude_node decisions, journaled by L1-1) stay excluded.
        """
        if msg.adopt:
            with self._lock:
                known = self._allocations.setdefault(msg.job_id, msg)  # a re-attached launch may have set it
                if known is not msg:
                    # The journal's job is the one to go on with (a launch re-attached first
                    # names the size and spec it was launched at, before any resize).
                    excluded = sorted(set(known.exclude_worker_ids) | set(msg.exclude_worker_ids))
                    known.CopyFrom(msg)
                    known.exclude_worker_ids[:] = excluded
            return control_pb2.ResourcesReady(job_id=msg.job_id, world_size=msg.world_size)
        spec = spec_from_json(msg.init.spec_json)
        need = _rank_memory(spec)  # (the spec's arithmetic: before the lock every placement takes)
        excluded = set(msg.exclude_worker_ids)
        with self._lock:
            if msg.probe and msg.job_id in self._allocations:  # (a running job's growth: where it may not go)
                excluded |= set(self._allocations[msg.job_id].exclude_worker_ids)
            elif msg.job_id in {j for w in self._workers.values() for j in w.busy}:
                return self._insufficient(msg, 0, f"job {msg.job_id} already holds resources")
            departing = sorted(w.reg.worker_id for w in self._workers.values() if w.departing)
            held = sorted(w for w in self._holds if w in self._workers and w not in excluded)
            cordoned = sorted(w for w in self._cordons if w in self._workers and w not in excluded)
            usable = [w for w in self._workers.values() if w.reg.worker_id not in excluded and self._placeable(w)]
            kind = spec.parallel.device_kind  # (issue 30: a job's ranks go to slots of its kind only)
            slots = [(w, s) for w in usable for s in range(w.reg.slots) if _of_kind(w, s, kind)]
            fit = sum(_memory_quota(w, s) >= need for w, s in slots)
            if fit < msg.world_size and fit < len(slots):  # (too few slots at all: wait for workers)
                return self._does_not_fit(msg, usable, need, kind)
            free = sum(
                1 for w in usable for s in w.free_slots() if _of_kind(w, s, kind) and _memory_quota(w, s) >= need
            )
            if msg.probe and free >= msg.world_size:  # (nothing placed: L1-1 asks whether the ranks would fit)
                return self._insufficient(msg, free, f"{free} {kind} slots free (a probe: nothing placed)", kind)
            if free < msg.world_size:  # (a probe's refusal too: the line a placement would say)
                # The placeable workers, and how many are registered when some are not (a
                # draining or cordoned one counts as registered, not as placeable).
                registered = len([w for w in self._workers if w not in excluded])
                on = f"{len(usable)} registered worker{'' if len(usable) == 1 else 's'}"
                if registered > len(usable):
                    on = f"{len(usable)} placeable of {registered} registered workers"
                what = "" if kind == "any" else f" {kind} slot{'' if free == 1 else 's'}"
                reason = f"{free}{what} {'is' if free == 1 else 'are'} free on {on}"
                if excluded:
                    reason += f" (excluding {', '.join(sorted(excluded))})"
                if departing:
                    reason += f" ({', '.join(departing)} leaving)"
                if cordoned:
                    reason += f" ({'; '.join(f'{w} cordoned: {self._cordons[w].reason}' for w in cordoned)})"
                if held:
                    reason += f" ({'; '.join(self._holds[w] for w in held)})"
                return self._insufficient(msg, free, reason, kind)
            picks = _preferred(
                [
                    (w, s)
                    for w in usable
                    for s in w.free_slots()
                    if _of_kind(w, s, kind) and _memory_quota(w, s) >= need
                ],
                prefer,
                msg.world_size,
            )
            kinds = {_device_kind(w, s) for w, s in picks}
            backend = msg.backend if msg.backend in ("gloo", "nccl") else ("nccl" if kinds == {"cuda"} else "gloo")
            if backend == "nccl" and kinds != {"cuda"}:
                return self._insufficient(msg, free, "backend nccl needs a CUDA device for every rank")
            master_addr = _reachable_host(picks[0][0].reg)
            master_port = self._free_port()
            generation = self._next_generation(msg.job_id)
            self._allocations[msg.job_id] = msg
            self._placed[msg.job_id] = _Placement([(w.reg.worker_id, slot) for w, slot in picks], backend)
            launches: dict[str, control_pb2.LaunchRanks] = {}
            # Once, not per rank (a list of the world per rank was 8,192^2 Python steps at
            # 1,024 x 8, most of the submit's 2 minutes). Not sent: a launch names its node's
            # ranks only and each rank learns the world's nodes at its rendezvous (even as runs
            # the list made a job's launches O(nodes²): services/engine/node_map.py).
            rank_nodes = [w.reg.worker_id for w, _ in picks]
            for rank, (w, slot) in enumerate(picks):
                w.busy.setdefault(msg.job_id, []).append(slot)
                launch = launches.get(w.reg.worker_id)
                if launch is None:
                    launch = launches[w.reg.worker_id] = control_pb2.LaunchRanks(job_id=msg.job_id, init=msg.init)
                launch.ranks.append(
                    engine_pb2.RankAssignment(
                        rank=rank,
                        world_size=msg.world_size,
                        local_rank=len(launch.ranks),
                        master_addr=master_addr,
                        master_port=master_port,
                        backend=backend,
                        device=_device_name(w, slot),
                        memory_quota_bytes=_memory_quota(w, slot),
                        num_threads=spec.parallel.threads_per_rank,
                        worker_id=w.reg.worker_id,
                        generation=generation,
                    )
                )
            memory_ring, probe_ring = _Ring(w.reg.worker_id for w in usable), _Ring(rank_nodes)
            for worker_id, launch in launches.items():
                for assignment in launch.ranks:  # (LOCAL_WORLD_SIZE: the node agent's binding)
                    assignment.local_world_size = len(launch.ranks)
                peer = _memory_peer(usable, worker_id, memory_ring)
                if peer is not None:
                    launch.memory_peer.CopyFrom(peer)
                    self._placed[msg.job_id].peers[worker_id] = peer.worker_id
                probe = _link_probe(spec.links, rank_nodes, self._workers, worker_id, probe_ring)
                if probe is not None:
                    launch.link_probe.CopyFrom(probe)
                self._placed[msg.job_id].probes[worker_id] = probe
            placed = _placed(self._workers, self._placed[msg.job_id])
            self._recount(*launches)  # (their busy slots: the next offer's free count)
        # Commands leave outside the lock: the relay only queues them, but keep the
        # allocator's lock short and never held across another module's code.
        for worker_id, launch in launches.items():
            self._hardware(launch, worker_id)
        return control_pb2.ResourcesReady(
            job_id=msg.job_id,
            world_size=msg.world_size,
            master_addr=master_addr,
            master_port=master_port,
            worker_ids=list(launches),
            placed=placed,
            rank_worker_ids=rank_nodes,  # (L1-1 journals where each rank went: a restart in WARMING_UP)
            rank_generation=generation,  # (and their generation: an older one's late end is stale)
        )

    def release_resources(
        self, msg: control_pb2.ReleaseResources, payload: Any = None, *, below_generation: int = 0
    ) -> None:
        """释放全局资源指令: every worker holding ranks of the job releases them (kill: at
        once; otherwise after ``RELEASE_GRACE_SECONDS``) and their slots are free again.
        A kill of a job that holds nothing here goes to every registered worker: its ranks
        may have been launched before control restarted, and a node agent ignores the
        release of a job it does not run. A graceful release of such a job is a no-op.
        ``below_generation`` (a relaunch's own call, :meth:`rebuild_communicator`): the fence
        the agents keep for the killed ranks (an incarnation its kill did not reach is ended
        when it speaks)."""
        with self._lock:
            self._allocations.pop(msg.job_id, None)
            self._placed.pop(msg.job_id, None)
            self._reattached.pop(msg.job_id, None)
            holders = [w.reg.worker_id for w in self._workers.values() if w.busy.pop(msg.job_id, None) is not None]
            self._recount(*holders)  # (their slots are free again: the next offer's free count)
            if not holders and msg.kill:
                holders = list(self._workers)
        grace = 0.0 if msg.kill else RELEASE_GRACE_SECONDS
        for worker_id in holders:
            self._hardware(
                control_pb2.ReleaseRanks(
                    job_id=msg.job_id, kill=msg.kill, grace_seconds=grace, below_generation=below_generation
                ),
                worker_id,
            )

    # ------------------------------------------------------------ private

    def _slot_census(self) -> list[SlotCensus]:
        """Each registered worker's slots, used and free (``surge_slots``): a copy of a few
        integers under this module's short lock, taken by a scrape, never by a decision."""
        with self._lock:
            return [
                SlotCensus(
                    w.reg.worker_id,
                    w.reg.slots - len(free),
                    len(free),
                    tuple((d.kind, d.name) for d in w.reg.devices),
                )
                for w in self._workers.values()
                for free in (w.free_slots(),)
            ]

    def _next_generation(self, job_id: str) -> int:
        """Under the lock: the generation of the ranks launched now (RankAssignment.generation):
        larger than every one handed out for the job here, and than a previous control's (the
        wall clock in ms: a restarted control knows only the re-attached ranks' generations)."""
        generation = max(self._generations.get(job_id, 0) + 1, time.time_ns() // 1_000_000)
        self._generations[job_id] = generation
        return generation

    def _insufficient(
        self, msg: control_pb2.AllocateResources, available: int, reason: str, kind: str = "any"
    ) -> control_pb2.ResourcesInsufficient:
        """The refusal; ``registered_ranks`` counts the slots of the job's ``kind`` only on the
        placeable workers (a gpu job on a cluster with fewer GPUs than its ranks waits for
        workers to join); ``all_registered_ranks`` every registered one of its kind, and
        ``not_placeable`` how many of those are not placeable and why (cordoned, on a silent
        node, leaving, excluded for this job): a job beyond the placeable slots but not beyond
        the registered ones waits for them to come back, not for new workers."""
        registered = everything = 0
        why: dict[str, int] = {}
        excluded = set(msg.exclude_worker_ids)
        for w in self._workers.values():
            n = sum(1 for s in range(w.reg.slots) if _of_kind(w, s, kind))
            everything += n
            wid = w.reg.worker_id
            cause = (
                "excluded for this job"
                if wid in excluded
                else "cordoned"
                if wid in self._cordons
                else "on a silent node"
                if wid in self._holds
                else "leaving"
                if w.departing
                else ""
            )
            if cause:
                if n:
                    why[cause] = why.get(cause, 0) + n
            else:
                registered += n
        return control_pb2.ResourcesInsufficient(
            job_id=msg.job_id,
            requested_ranks=msg.world_size,
            available_ranks=available,
            reason=reason,
            registered_ranks=registered,
            all_registered_ranks=everything,
            not_placeable=", ".join(f"{n} {cause}" for cause, n in why.items()),
        )

    def _does_not_fit(
        self, msg: control_pb2.AllocateResources, usable: list[_Worker], need: int, kind: str = "any"
    ) -> control_pb2.ResourcesInsufficient:
        """Under the lock: the refusal of a job whose memory per rank fits too few registered
        slots (of its ``kind``), naming the estimate and the largest slot."""
        size, w, slot = max(
            ((_memory_quota(w, s), w, s) for w in usable for s in range(w.reg.slots) if _of_kind(w, s, kind)),
            key=lambda t: t[0],
        )
        largest = f"{_device_name(w, slot)} of {w.reg.worker_id}"
        if _device_kind(w, slot) == "cuda":
            largest += f" ({[d for d in w.reg.devices if d.kind == 'cuda'][slot].name})"
        else:
            share = f"1 of {w.reg.slots} slots" if w.reg.slots > 1 else "1 slot"
            largest += f" (host memory {human_bytes(w.reg.memory_bytes)}, {share})"
        reply = self._insufficient(
            msg,
            0,
            f"memory per rank {human_bytes(need)} (estimated) fits no registered slot for {msg.world_size} "
            f"rank{'' if msg.world_size == 1 else 's'}: the largest is {human_bytes(size)}, {largest}",
            kind,
        )
        reply.rank_memory_bytes, reply.largest_memory_bytes, reply.largest = need, size, largest
        return reply

    def _free_port(self) -> int:
        # A fresh port per launch, found by binding port 0 here, on the control host. This
        # assumes rank 0 runs on this host (single-machine deployments) or that the port is
        # free there too; a node agent that finds it taken reports a rank failure. A
        # multi-host deployment should ask rank 0's node agent instead.
        with socket.socket() as s:
            s.bind((self._control_host, 0))
            return s.getsockname()[1]


def _preferred(
    candidates: list[tuple[_Worker, int]], prefer: Sequence[Sequence[tuple[str, int | None]]], n: int
) -> list[tuple[_Worker, int]]:
    """``n`` of the free ``candidates`` (worker, slot; registration order) by rank: rank r on
    the first of ``prefer[r]`` (a relaunch's: the worker id and slot it ran on, then the node
    that holds its memory copy, any slot: None) that is among them, the other ranks on the
    first ones left. A rank relaunched where its memory copy is reads its state from memory
    (issue 29 item 8); placed in registration order, a worker freed meanwhile took rank 0 and
    moved every rank one node on, and a lost node's rank landed where no copy was (ci14). The
    caller checked that ``candidates`` hold ``n``."""
    by_slot = {(w.reg.worker_id, s): (w, s) for w, s in candidates}
    slots_of: dict[str, list[int]] = {}  # worker id -> its free slots, last first (taken lazily)
    for w, s in reversed(candidates):
        slots_of.setdefault(w.reg.worker_id, []).append(s)
    picks: list[tuple[_Worker, int] | None] = [None] * n
    # Each rank's first choice before any rank's second: a lost node's rank sent to the copy's
    # node takes no slot a rank of that node ran on. O(ranks + slots): no scan per rank (a
    # relaunch of 8,192 ranks after a control restart knows no copy's node for any of them).
    for choice in range(max((len(a) for a in prefer[:n]), default=0)):
        for r, alternatives in enumerate(prefer[:n]):
            if picks[r] is not None or choice >= len(alternatives):
                continue
            worker_id, slot = alternatives[choice]
            if slot is None:  # (any free slot of that worker)
                free = slots_of.get(worker_id, [])
                while free and (worker_id, free[-1]) not in by_slot:
                    free.pop()  # (taken by a rank's own choice meanwhile)
                slot = free.pop() if free else None
            picks[r] = by_slot.pop((worker_id, slot), None) if slot is not None else None
    rest = iter(c for c in candidates if (c[0].reg.worker_id, c[1]) in by_slot)
    return [p if p is not None else next(rest) for p in picks]
