"""L1-2 resource allocator: the worker registry, rank topology and per-rank quotas.

Seed 000 L1-2: it allocates and releases resources and lays out the rank topology; it
never starts or stops training on its own, never reads training metrics, never changes
hyper-parameters. Quotas are fixed at launch and never changed while the job runs.

Inputs: ``WorkerRegistration``, ``MemoryPressure`` and ``DeviceMemoryUsage`` (node agents,
via the session relay), ``AllocateResources``, ``ReleaseResources`` and ``CordonWorker`` (from
L1-1), ``RebuildCommunicator`` (from L1-4, executing a recovery L1-1 commanded).
Outputs: ``ResourcesReady`` / ``ResourcesInsufficient`` (replies), ``LaunchRanks``
and ``ReleaseRanks`` (to one node agent each; the payload names the worker id),
``RebuildParallelGroup`` (to L2-2 of every live rank of a job rebuilt in place, through
control's session relay: the fresh rendezvous),
``ResourcePressure`` (published; the orchestrator observes it), ``ResourcesReady`` with no job
id (published when a worker registers with slots: the orchestrator's queue may start a job),
``WorkerCordoned`` (the reply to CordonWorker; published with ``cleared`` when the cordon ends).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.jobspec import JobSpec, spec_from_json, spec_to_json, with_layout
from services.memory_estimate import estimate_memory, human_bytes

# How long a node agent gives a released rank to exit before killing it (seconds).
RELEASE_GRACE_SECONDS = 10.0


@dataclass
class _Worker:
    reg: control_pb2.WorkerRegistration
    busy: dict[str, list[int]] = field(default_factory=dict)  # job_id -> slot indices
    under_pressure: bool = False  # the seed's 资源紧张 state, per worker (host memory)
    devices_under_pressure: set[int] = field(default_factory=set)  # ... per device (NVML index)
    departing: bool = False  # the node agent said it is leaving: nothing new is placed here

    def free_slots(self) -> list[int]:
        taken = {s for slots in self.busy.values() for s in slots}
        return [s for s in range(self.reg.slots) if s not in taken]


class ResourceAllocator:
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

    # ------------------------------------------------------------ hardware events

    def on_worker_registration(self, msg: control_pb2.WorkerRegistration, payload: Any = None) -> None:
        """硬件资源就绪反馈. A registration offering zero slots withdraws the worker (the
        session relay sends one when the node agent's stream closes): its slots vanish.
        A worker registering again (a reconnect) replaces its record but keeps its busy
        slots: its ranks may still run there until their job is released.

        Re-attach: the ranks the node agent says it still runs (``running``, after a control
        restart) hold slots for their jobs, and their launch is taken as the job's allocation
        (world size, backend, job config) when none is known here, so the job can later be
        released or its communicator rebuilt.

        Departure: a registration with ``departing`` (the agent was asked to stop) keeps the
        worker's record and busy slots but takes it out of placement, so a recovery of the
        ranks it is stopping never relaunches one there. The next registration of the id
        (the agent restarted in place) is placeable again.

        A registration that offers slots is published as ``ResourcesReady`` with no job id
        (资源就绪可训练事件: ``free_ranks``, the ranks free on the placeable workers now), so
        that L1-1 can start a job waiting in its queue.

        Cordon: a registration of another node agent incarnation than the one cordoned (the
        agent restarted, the node rebooted or was replaced) ends the worker's cordon,
        published as ``WorkerCordoned`` with ``cleared``; the same incarnation registering
        again (a reconnect, or a control restart) keeps it. Likewise a hold (agent_silent)
        ends when another incarnation registers, or the agent whose stream closed comes back."""
        with self._lock:
            old = self._workers.get(msg.worker_id)
            if msg.departing:  # (before the zero-slot check: it keeps the record and its busy slots)
                if old is not None:
                    old.departing = True
                return
            if msg.slots == 0:
                self._workers.pop(msg.worker_id, None)
                for where in self._reattached.values():  # (its ranks are lost: not placed there any more)
                    for rank in [r for r, (w, _) in where.items() if w == msg.worker_id]:
                        del where[rank]
                return
            cleared = self._end_cordon(msg)
            if old is None or old.reg.incarnation != msg.incarnation:
                # A hold is on the silent agent; one registering now (restarted, or back after
                # its stream closed) is heard from, and the detector re-arms on its beats.
                self._holds.pop(msg.worker_id, None)
            worker = _Worker(msg)
            if old is not None:
                worker.busy = {job: [s for s in slots if s < msg.slots] for job, slots in old.busy.items()}
                worker.under_pressure = old.under_pressure
                worker.devices_under_pressure = old.devices_under_pressure
            for launch in msg.running:
                known = max((a.generation for a in launch.ranks), default=0)
                self._generations[launch.job_id] = max(self._generations.get(launch.job_id, 0), known)
                have = len(worker.busy.get(launch.job_id, ()))
                for _ in range(len(launch.ranks) - have):
                    free = worker.free_slots()
                    if free:
                        worker.busy.setdefault(launch.job_id, []).append(free[0])
                # Where each re-attached rank runs (its slot: one of the job's here, in rank
                # order), so that a rebuild in place after a control restart knows the placement.
                slots = sorted(worker.busy.get(launch.job_id, ()))
                ranks = sorted(a.rank for a in launch.ranks)
                where = self._reattached.setdefault(launch.job_id, {})
                where.update({r: (msg.worker_id, s) for r, s in zip(ranks, slots, strict=False)})
                if launch.job_id not in self._allocations and launch.ranks:
                    first = launch.ranks[0]
                    self._allocations[launch.job_id] = control_pb2.AllocateResources(
                        job_id=launch.job_id, world_size=first.world_size, backend=first.backend, init=launch.init
                    )
                if launch.job_id not in self._placed and launch.job_id in self._allocations:
                    # Fixed once every rank is back: a node lost later (its ranks then leave
                    # the re-attached set) is replaced in place, not the whole job relaunched.
                    self._placement_from_reattach(self._allocations[launch.job_id])
            self._workers[msg.worker_id] = worker  # a known id keeps its place in the order
            free = sum(len(w.free_slots()) for w in self._workers.values() if self._placeable(w))
        if cleared is not None:  # (outside the lock, like every send; before the slots are offered)
            self._emit(cleared)
        self._emit(control_pb2.ResourcesReady(free_ranks=free))

    def on_memory_pressure(self, msg: control_pb2.MemoryPressure, payload: Any = None) -> None:
        """显存溢出上报事件: publish ``ResourcePressure`` (显存资源紧张告警事件) naming the
        jobs that hold ranks on that worker, in allocation order.

        Only a change of the worker's pressure state is published: a repeated report (a
        restarted node agent under the same id, still short of memory) adds nothing. A
        report from a worker not in the registry (withdrawn) is dropped. Quotas are not
        touched: they are fixed at launch (seed 000 L1-2, 整改 1)."""
        with self._lock:
            worker = self._workers.get(msg.worker_id)
            if worker is None or worker.under_pressure == msg.under_pressure:
                return
            worker.under_pressure = msg.under_pressure
            job_ids = list(worker.busy)
        # Published outside the lock, like the commands: never hold it across another
        # module's code.
        self._emit(
            control_pb2.ResourcePressure(
                worker_id=msg.worker_id,
                job_ids=job_ids,
                available_bytes=msg.available_bytes,
                total_bytes=msg.total_bytes,
                under_pressure=msg.under_pressure,
            )
        )

    def on_device_memory_usage(self, msg: engine_pb2.DeviceMemoryUsage, payload: Any = None) -> None:
        """显存溢出上报事件 of one device (the node agent's NVML sampler): published as
        ``ResourcePressure`` with ``device`` "cuda:<index>", as :meth:`on_memory_pressure`
        does for the host's memory: only a change of that device's state, only from a
        registered worker, and no quota touched."""
        with self._lock:
            worker = self._workers.get(msg.worker_id)
            if worker is None or (msg.device in worker.devices_under_pressure) == msg.under_pressure:
                return
            if msg.under_pressure:
                worker.devices_under_pressure.add(msg.device)
            else:
                worker.devices_under_pressure.discard(msg.device)
            job_ids = list(worker.busy)
        self._emit(
            control_pb2.ResourcePressure(
                worker_id=msg.worker_id,
                job_ids=job_ids,
                available_bytes=max(msg.total_bytes - msg.used_bytes, 0),
                total_bytes=msg.total_bytes,
                under_pressure=msg.under_pressure,
                device=f"cuda:{msg.device}",
            )
        )

    # ------------------------------------------------------------ commands (L1-1)

    def allocate_resources(
        self, msg: control_pb2.AllocateResources, payload: Any = None
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
        excluded = set(msg.exclude_worker_ids)
        with self._lock:
            if msg.job_id in {j for w in self._workers.values() for j in w.busy}:
                return self._insufficient(msg, 0, f"job {msg.job_id} already holds resources")
            departing = sorted(w.reg.worker_id for w in self._workers.values() if w.departing)
            held = sorted(w for w in self._holds if w in self._workers and w not in excluded)
            cordoned = sorted(w for w in self._cordons if w in self._workers and w not in excluded)
            usable = [w for w in self._workers.values() if w.reg.worker_id not in excluded and self._placeable(w)]
            need = _rank_memory(spec)
            slots = [(w, s) for w in usable for s in range(w.reg.slots)]
            fit = sum(_memory_quota(w, s) >= need for w, s in slots)
            if fit < msg.world_size and fit < len(slots):  # (too few slots at all: wait for workers)
                return self._does_not_fit(msg, usable, need)
            free = sum(1 for w in usable for s in w.free_slots() if _memory_quota(w, s) >= need)
            if free < msg.world_size:
                reason = f"{free} {'is' if free == 1 else 'are'} free on {len(usable)} registered worker{'' if len(usable) == 1 else 's'}"
                if excluded:
                    reason += f" (excluding {', '.join(sorted(excluded))})"
                if departing:
                    reason += f" ({', '.join(departing)} leaving)"
                if cordoned:
                    reason += f" ({', '.join(cordoned)} unhealthy)"
                if held:
                    reason += f" ({'; '.join(self._holds[w] for w in held)})"
                return self._insufficient(msg, free, reason)
            picks: list[tuple[_Worker, int]] = []
            for w in usable:
                for slot in w.free_slots():
                    if len(picks) < msg.world_size and _memory_quota(w, slot) >= need:
                        picks.append((w, slot))
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
            for rank, (w, slot) in enumerate(picks):
                w.busy.setdefault(msg.job_id, []).append(slot)
                launch = launches.setdefault(w.reg.worker_id, control_pb2.LaunchRanks(job_id=msg.job_id, init=msg.init))
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
                        rank_nodes=[pw.reg.worker_id for pw, _ in picks],  # topology for L2-2's TP placement
                        generation=generation,
                    )
                )
            for worker_id, launch in launches.items():
                peer = _memory_peer(usable, worker_id)
                if peer is not None:
                    launch.memory_peer.CopyFrom(peer)
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

    def rebuild_communicator(
        self, msg: control_pb2.RebuildCommunicator, payload: Any = None
    ) -> control_pb2.ResourcesReady | control_pb2.ResourcesInsufficient:
        """重建通信域指令: the job's process group is rebuilt from scratch. Its ranks are
        killed at once (a rank blocked in a collective cannot be asked to leave it), then
        laid out again exactly as :meth:`allocate_resources` does, on a fresh rendezvous
        port, with the same job config except the checkpoint version to load first
        (``resume_version``). Workers excluded now or in an earlier rebuild of the job get
        no rank. Each node agent starts a rank only after the killed process of the same
        rank has been reaped.

        Returns ResourcesInsufficient when the job holds no allocation here, or when its
        ranks no longer fit (its old ranks are killed either way). In the latter case the
        allocation is kept: the same command places the ranks once capacity returns.
        """
        if msg.in_place:
            return self._rebuild_in_place(msg)
        with self._lock:
            allocated = self._allocations.get(msg.job_id)
        if allocated is None:
            return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason=f"job {msg.job_id} holds no allocation")
        again = control_pb2.AllocateResources()
        again.CopyFrom(allocated)
        again.adopt = False  # (an allocation adopted after a control restart is placed anew)
        again.init.resume_version = msg.resume_version
        again.exclude_worker_ids[:] = sorted(set(again.exclude_worker_ids) | set(msg.exclude_worker_ids))
        with self._lock:  # (the relaunched ranks' generation will be larger still)
            fence = self._next_generation(msg.job_id)
        self.release_resources(control_pb2.ReleaseResources(job_id=msg.job_id, kill=True), below_generation=fence)
        placed = self.allocate_resources(again)
        if isinstance(placed, control_pb2.ResourcesInsufficient):
            with self._lock:
                self._allocations.setdefault(msg.job_id, again)
        return placed

    def _rebuild_in_place(
        self, msg: control_pb2.RebuildCommunicator
    ) -> control_pb2.ResourcesReady | control_pb2.ResourcesInsufficient:
        """The survivors keep their processes (issue 16): kill only ``lost_ranks``, place one
        replacement per lost rank (same rank, same world size; its own worker first once the
        killed process is reaped, else the first free slot of another usable worker), started
        to heal from a live peer (InitJob.heal_from_peer), and send every live rank of the job
        the fresh rendezvous (RebuildParallelGroup, the next generation). Rank 0's host is the
        rendezvous, as at launch.

        With ``layout`` (a resize: shrink, scale, growing back) the group gets ``layout.dp``
        ranks: the surviving ranks at or above it are released, the lost ranks below it
        replaced, and the ranks from the old size up to it launched (healing like a
        replacement); the allocation's spec and world size become the new layout's.

        Returns ResourcesInsufficient, having killed the lost ranks (and nothing else), when a
        rank to launch does not fit or the job's placement is not known here (an allocation
        adopted after a control restart): the orchestrator then falls back to relaunching
        every rank, shrinks, or (a scale) lets the ranks go on at their size."""
        with self._lock:
            allocated, placed = self._allocations.get(msg.job_id), self._placed.get(msg.job_id)
            if placed is None and allocated is not None:
                placed = self._placement_from_reattach(allocated)
            if allocated is None or placed is None:
                why = "holds no allocation" if allocated is None else "has no known placement (control restarted)"
                return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason=f"job {msg.job_id} {why}")
            old_world = len(placed.ranks)
            world = msg.layout.dp if msg.HasField("layout") else old_world
            lost = sorted({r for r in msg.lost_ranks if r < old_world})
            released = [r for r in range(world, old_world) if r not in lost]  # survivors above the new size
            launched = [r for r in lost if r < world] + list(range(old_world, world))
            kills: dict[str, list[int]] = {}
            freed: list[tuple[_Worker, int]] = []  # slots of released ranks: given back if the rest does not fit
            for r in lost + released:
                worker_id, slot = placed.ranks[r]
                if r in lost:
                    kills.setdefault(worker_id, []).append(r)
                w = self._workers.get(worker_id)
                if w is not None and msg.job_id in w.busy:
                    w.busy[msg.job_id] = [s for s in w.busy[msg.job_id] if s != slot]
                    if r in released:
                        freed.append((w, slot))
            excluded = set(allocated.exclude_worker_ids) | set(msg.exclude_worker_ids)
            usable = [w for w in self._workers.values() if w.reg.worker_id not in excluded and self._placeable(w)]
            picks: list[tuple[_Worker, int]] = []
            holds = [self._holds[w] for w in sorted(self._holds) if w in self._workers]
            held = f" ({'; '.join(holds)})" if holds else ""  # (why a node is out: its agent is silent)
            for r in launched:
                own = self._workers.get(placed.ranks[r][0]) if r < old_world else None
                candidates = ([own] if own in usable else []) + [w for w in usable if w is not own]
                taken = {(w.reg.worker_id, s) for w, s in picks}
                spot = next(
                    ((w, s) for w in candidates for s in w.free_slots() if (w.reg.worker_id, s) not in taken), None
                )
                if spot is None:
                    what = f"a replacement of rank {r}" if r < old_world else f"new rank {r}"
                    short = self._insufficient(allocated, len(picks), f"no free slot for {what}{held}")
                    short.requested_ranks = len(launched)
                    break
                picks.append(spot)
            else:
                short = None
            launches: dict[str, control_pb2.LaunchRanks] = {}
            generation = 0
            if short is not None:
                for w, slot in freed:  # (the released ranks stay, as they were)
                    w.busy.setdefault(msg.job_id, []).append(slot)
            else:
                for r in released:
                    worker_id, _ = placed.ranks[r]
                    kills.setdefault(worker_id, []).append(r)
                del placed.ranks[world:]
                placed.ranks.extend([("", 0)] * (world - len(placed.ranks)))
                for r, (w, slot) in zip(launched, picks, strict=True):
                    w.busy.setdefault(msg.job_id, []).append(slot)
                    placed.ranks[r] = (w.reg.worker_id, slot)
                if msg.HasField("layout"):  # (also a new micro-batch split at the same size)
                    layout = msg.layout
                    spec = with_layout(
                        spec_from_json(allocated.init.spec_json),
                        dp=layout.dp,
                        micro_batch_size=layout.micro_batch_size,
                        grad_accum=layout.grad_accum,
                        source="RebuildCommunicator.layout",
                    )
                    allocated.init.spec_json, allocated.world_size = spec_to_json(spec), world
                placed.generation += 1
                generation = self._next_generation(msg.job_id)  # the replacements' incarnation (fencing)
                master_addr = _reachable_host(self._workers[placed.ranks[0][0]].reg)
                master_port = self._free_port()
                rank_nodes = [worker_id for worker_id, _ in placed.ranks]
                init = engine_pb2.InitJob()
                init.CopyFrom(allocated.init)
                init.resume_version, init.heal_from_peer = "", True
                threads = spec_from_json(init.spec_json).parallel.threads_per_rank
                for r, (w, slot) in zip(launched, picks, strict=True):
                    launch = launches.setdefault(w.reg.worker_id, control_pb2.LaunchRanks(job_id=msg.job_id, init=init))
                    launch.ranks.append(engine_pb2.RankAssignment(
                        rank=r, world_size=len(placed.ranks), local_rank=slot, master_addr=master_addr,
                        master_port=master_port, backend=placed.backend, device=_device_name(w, slot),
                        memory_quota_bytes=_memory_quota(w, slot), num_threads=threads, worker_id=w.reg.worker_id,
                        rank_nodes=rank_nodes, generation=generation,
                    ))  # fmt: skip
                for worker_id, launch in launches.items():
                    peer = _memory_peer(usable, worker_id)
                    if peer is not None:
                        launch.memory_peer.CopyFrom(peer)
                rebuild = engine_pb2.RebuildParallelGroup(
                    job_id=msg.job_id, master_addr=master_addr, master_port=master_port, reason=msg.reason,
                    world_size=len(placed.ranks), generation=placed.generation, rank_nodes=rank_nodes,
                    layout=msg.layout if msg.HasField("layout") else None,
                    lost_ranks=lost,  # the survivors abort their broken communicator at once
                )  # fmt: skip
        # The kills go first on each node agent's queue: a replacement of the same rank starts
        # only once the killed process is reaped (the node agent's rule), and a survivor blocked
        # in a collective with a hung rank is freed by that rank's death.
        # With the replacements' generation: the agent keeps it, and ends a killed incarnation
        # that shows up again (one its kill did not reach: a frozen agent's backlog).
        for worker_id, ranks in kills.items():
            self._hardware(
                control_pb2.ReleaseRanks(job_id=msg.job_id, kill=True, ranks=ranks, below_generation=generation),
                worker_id,
            )
        if short is not None:
            return short
        for worker_id, launch in launches.items():
            self._hardware(launch, worker_id)
        if self._parallel is not None:
            self._parallel(rebuild)
        return control_pb2.ResourcesReady(
            job_id=msg.job_id,
            world_size=rebuild.world_size,
            master_addr=rebuild.master_addr,
            master_port=rebuild.master_port,
            worker_ids=list(launches),
            generation=rebuild.generation,
            replaced_ranks=launched,
        )

    def cordon_worker(self, msg: control_pb2.CordonWorker, payload: Any = None) -> control_pb2.WorkerCordoned:
        """Take worker ``msg.worker_id`` out of placement for every job (L1-1 decided: a
        device of it failed fatally), until a registration of another node agent incarnation
        ends the cordon (see :meth:`on_worker_registration`). Its running ranks are not
        touched: each job with a rank there decides by its own fault policy (exclude_node).

        The unit is the worker, not the failed device's slot: the issue's rule ("an
        uncorrectable ECC error excludes the node"), and the same unit the job's own
        exclude_node decision takes. A device after an uncorrectable ECC error or a fatal Xid
        needs a GPU reset, which on NVSwitch (HGX) boards resets every GPU of the node, and
        several fatal Xids (74 NVLink, 79 off the bus, 95 uncontained) are the node's
        interconnect, not one device; ranks placed beside it meanwhile would be stopped by
        that reset.

        ``incarnation`` "" is the one registered now (none registered yet: the next to
        register is the one cordoned). Returns ``WorkerCordoned`` (``cleared`` when the
        incarnation named is not the one registered now: that agent is gone already).

        ``hold`` (L1-1 decided on the node agent's ``agent_silent``): the worker gets no new
        rank until a CordonWorker with ``hold`` and ``lift`` (its agent beats again); a cordon
        of the worker is not touched by either. A hold that ends publishes ``ResourcesReady``
        with no job id, as a registration does, so a job queued meanwhile is placed."""
        if msg.hold:
            return self._hold(msg)
        with self._lock:
            if msg.clear:  # the operator's uncordon (L1-1 checked that it had a cordon)
                ended = self._cordons.pop(msg.worker_id, None) or control_pb2.WorkerCordoned(worker_id=msg.worker_id)
                ended.cleared = True
                return ended
            worker = self._workers.get(msg.worker_id)
            registered = worker.reg.incarnation if worker is not None else ""
            cordon = control_pb2.WorkerCordoned(
                worker_id=msg.worker_id,
                incarnation=msg.incarnation or registered,
                reason=msg.reason,
                unix_time=msg.unix_time,
                quarantine=msg.quarantine,
            )
            if worker is not None and msg.incarnation and msg.incarnation != registered and not msg.quarantine:
                cordon.cleared = True  # (restored after a control restart; the node came back meanwhile)
                return cordon
            self._cordons[msg.worker_id] = cordon
            reply = control_pb2.WorkerCordoned()
            reply.CopyFrom(cordon)
        return reply

    # ------------------------------------------------------------ private

    def _hold(self, msg: control_pb2.CordonWorker) -> control_pb2.WorkerCordoned:
        with self._lock:
            if not msg.lift:
                self._holds[msg.worker_id] = msg.reason or f"{msg.worker_id} held"
                return control_pb2.WorkerCordoned(worker_id=msg.worker_id, reason=msg.reason, unix_time=msg.unix_time)
            ended = self._holds.pop(msg.worker_id, None) is not None
            free = sum(len(w.free_slots()) for w in self._workers.values() if self._placeable(w))
        if ended:  # (outside the lock, like every send)
            self._emit(control_pb2.ResourcesReady(free_ranks=free))
        return control_pb2.WorkerCordoned(worker_id=msg.worker_id, reason=msg.reason, cleared=True)

    def _placeable(self, w: _Worker) -> bool:
        """Under the lock: may new ranks be placed on ``w`` (not leaving, not cordoned, not held)."""
        return not w.departing and w.reg.worker_id not in self._cordons and w.reg.worker_id not in self._holds

    def _next_generation(self, job_id: str) -> int:
        """Under the lock: the generation of the ranks launched now (RankAssignment.generation):
        larger than every one handed out for the job here, and than a previous control's (the
        wall clock in ms: a restarted control knows only the re-attached ranks' generations)."""
        generation = max(self._generations.get(job_id, 0) + 1, time.time_ns() // 1_000_000)
        self._generations[job_id] = generation
        return generation

    def _end_cordon(self, reg: control_pb2.WorkerRegistration) -> control_pb2.WorkerCordoned | None:
        """Under the lock: a registration's effect on its worker's cordon. Another incarnation
        ends it (returned, ``cleared``); the first registration after a cordon of no known
        incarnation becomes the one cordoned."""
        cordon = self._cordons.get(reg.worker_id)
        if cordon is None:
            return None
        if not cordon.incarnation:
            cordon.incarnation = reg.incarnation
            return None
        if cordon.incarnation == reg.incarnation or cordon.quarantine:
            return None  # (a quarantine ends only by the operator's uncordon)
        del self._cordons[reg.worker_id]
        cleared = control_pb2.WorkerCordoned()
        cleared.CopyFrom(cordon)
        cleared.incarnation, cleared.cleared = reg.incarnation, True
        return cleared

    def _placement_from_reattach(self, allocated: control_pb2.AllocateResources) -> _Placement | None:
        """Under the lock: the placement of a job adopted after a control restart, from where
        its node agents said its ranks run (None until every rank re-attached). The generation
        of its rendezvous starts from the clock: the ranks may be in any generation of the
        control that went, and they take only a newer one."""
        where = self._reattached.get(allocated.job_id, {})
        if any(r not in where for r in range(allocated.world_size)):
            return None
        ranks = [where[r] for r in range(allocated.world_size)]
        backend = allocated.backend
        if backend not in ("gloo", "nccl"):  # (auto: as at launch, from the devices)
            cuda = all(w in self._workers and _device_kind(self._workers[w], s) == "cuda" for w, s in ranks)
            backend = "nccl" if cuda else "gloo"
        placed = self._placed[allocated.job_id] = _Placement(ranks, backend, generation=int(time.time() * 1000))
        return placed

    def _insufficient(
        self, msg: control_pb2.AllocateResources, available: int, reason: str
    ) -> control_pb2.ResourcesInsufficient:
        registered = sum(
            w.reg.slots
            for w in self._workers.values()
            if self._placeable(w) and w.reg.worker_id not in msg.exclude_worker_ids
        )
        return control_pb2.ResourcesInsufficient(
            job_id=msg.job_id,
            requested_ranks=msg.world_size,
            available_ranks=available,
            reason=reason,
            registered_ranks=registered,
        )

    def _does_not_fit(
        self, msg: control_pb2.AllocateResources, usable: list[_Worker], need: int
    ) -> control_pb2.ResourcesInsufficient:
        """Under the lock: the refusal of a job whose memory per rank fits too few registered
        slots, naming the estimate and the largest slot."""
        size, w, slot = max(
            ((_memory_quota(w, s), w, s) for w in usable for s in range(w.reg.slots)), key=lambda t: t[0]
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


def _reachable_host(reg: control_pb2.WorkerRegistration) -> str:
    """The host other nodes reach this node agent at: its advertised address's (rank 0's
    host is the rendezvous). Not ``reg.host``, the machine's own name, which another node
    may not resolve, or resolve to itself (hosts sharing one name: containers, namespaces)."""
    host = reg.address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[v6]:port"


@dataclass
class _Placement:
    """Where a job's ranks run (index = rank: worker id, slot), the backend chosen at launch,
    and the generation of the rendezvous its survivors last got (a rebuild in place)."""

    ranks: list[tuple[str, int]]
    backend: str
    generation: int = 0


def _device_kind(w: _Worker, slot: int) -> str:
    devices = [d for d in w.reg.devices if d.kind == "cuda"]
    return "cuda" if slot < len(devices) else "cpu"


def _device_name(w: _Worker, slot: int) -> str:
    devices = [d for d in w.reg.devices if d.kind == "cuda"]
    return f"cuda:{devices[slot].index}" if slot < len(devices) else "cpu"


def _memory_quota(w: _Worker, slot: int) -> int:
    devices = [d for d in w.reg.devices if d.kind == "cuda"]
    if slot < len(devices):
        return devices[slot].memory_bytes
    return w.reg.memory_bytes // max(w.reg.slots, 1)


def _rank_memory(spec: JobSpec) -> int:
    """The job's estimated memory per rank in bytes (services/memory_estimate.py); 0 where the
    estimate cannot be made (a layout the planner refuses: the rank refuses it in one line)."""
    try:
        return estimate_memory(spec).total
    except ValueError:
        return 0


def _memory_peer(usable: list[_Worker], worker_id: str) -> control_pb2.MemoryPeer | None:
    """The worker after ``worker_id`` among ``usable`` (registration order, wrapping); None
    when it is the only one."""
    ids = [w.reg.worker_id for w in usable]
    if worker_id not in ids or len(ids) < 2:
        return None
    nxt = usable[(ids.index(worker_id) + 1) % len(ids)].reg
    return control_pb2.MemoryPeer(worker_id=nxt.worker_id, address=nxt.address)
