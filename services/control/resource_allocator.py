"""L1-2 resource allocator: the worker registry, rank topology and per-rank quotas.

Seed 000 L1-2: it allocates and releases resources and lays out the rank topology; it
never starts or stops training on its own, never reads training metrics, never changes
hyper-parameters. Quotas are fixed at launch and never changed while the job runs.

Inputs: ``WorkerRegistration`` and ``MemoryPressure`` (node agents, via the session
relay), ``AllocateResources`` and ``ReleaseResources`` (from L1-1), ``RebuildCommunicator``
(from L1-4, executing a recovery L1-1 commanded).
Outputs: ``ResourcesReady`` / ``ResourcesInsufficient`` (replies), ``LaunchRanks``
and ``ReleaseRanks`` (to one node agent each; the payload names the worker id),
``ResourcePressure`` (published; the orchestrator observes it), ``ResourcesReady`` with no job
id (published when a worker registers with slots: the orchestrator's queue may start a job).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.jobspec import spec_from_json

# How long a node agent gives a released rank to exit before killing it (seconds).
RELEASE_GRACE_SECONDS = 10.0


@dataclass
class _Worker:
    reg: control_pb2.WorkerRegistration
    busy: dict[str, list[int]] = field(default_factory=dict)  # job_id -> slot indices
    under_pressure: bool = False  # the seed's 资源紧张 state, per worker
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
    """

    def __init__(self, hardware: CommandPort, emit: Emitter, control_host: str = "127.0.0.1"):
        self._hardware = hardware
        self._emit = emit
        self._control_host = control_host
        self._lock = threading.Lock()
        # Insertion order is registration order: ranks fill workers in that order.
        self._workers: dict[str, _Worker] = {}
        # job_id -> the allocation as commanded (job config, world size, exclusions): what
        # a communicator rebuild launches again.
        self._allocations: dict[str, control_pb2.AllocateResources] = {}

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
        that L1-1 can start a job waiting in its queue."""
        with self._lock:
            old = self._workers.get(msg.worker_id)
            if msg.departing:  # (before the zero-slot check: it keeps the record and its busy slots)
                if old is not None:
                    old.departing = True
                return
            if msg.slots == 0:
                self._workers.pop(msg.worker_id, None)
                return
            worker = _Worker(msg)
            if old is not None:
                worker.busy = {job: [s for s in slots if s < msg.slots] for job, slots in old.busy.items()}
                worker.under_pressure = old.under_pressure
            for launch in msg.running:
                have = len(worker.busy.get(launch.job_id, ()))
                for _ in range(len(launch.ranks) - have):
                    free = worker.free_slots()
                    if free:
                        worker.busy.setdefault(launch.job_id, []).append(free[0])
                if launch.job_id not in self._allocations and launch.ranks:
                    first = launch.ranks[0]
                    self._allocations[launch.job_id] = control_pb2.AllocateResources(
                        job_id=launch.job_id, world_size=first.world_size, backend=first.backend, init=launch.init
                    )
            self._workers[msg.worker_id] = worker  # a known id keeps its place in the order
            free = sum(len(w.free_slots()) for w in self._workers.values() if not w.departing)
        self._emit(control_pb2.ResourcesReady(free_ranks=free))  # (outside the lock, like every send)

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

        Returns ResourcesInsufficient (nothing reserved) when fewer slots are free than
        ranks are needed, or when backend ``nccl`` is asked for on CPU-only slots.

        ``adopt`` (a control restart): only record the allocation, launch nothing; the
        workers it excludes (earlier exclude_node decisions, journaled by L1-1) stay excluded.
        """
        if msg.adopt:
            with self._lock:
                known = self._allocations.setdefault(msg.job_id, msg)  # a re-attached launch may have set it
                if known is not msg:
                    known.exclude_worker_ids[:] = sorted(set(known.exclude_worker_ids) | set(msg.exclude_worker_ids))
            return control_pb2.ResourcesReady(job_id=msg.job_id, world_size=msg.world_size)
        spec = spec_from_json(msg.init.spec_json)
        excluded = set(msg.exclude_worker_ids)
        with self._lock:
            if msg.job_id in {j for w in self._workers.values() for j in w.busy}:
                return self._insufficient(msg, 0, f"job {msg.job_id} already holds resources")
            departing = sorted(w.reg.worker_id for w in self._workers.values() if w.departing)
            usable = [w for w in self._workers.values() if w.reg.worker_id not in excluded and not w.departing]
            free = sum(len(w.free_slots()) for w in usable)
            if free < msg.world_size:
                reason = f"{free} {'is' if free == 1 else 'are'} free on {len(usable)} registered worker{'' if len(usable) == 1 else 's'}"
                if excluded:
                    reason += f" (excluding {', '.join(sorted(excluded))})"
                if departing:
                    reason += f" ({', '.join(departing)} leaving)"
                return self._insufficient(msg, free, reason)
            picks: list[tuple[_Worker, int]] = []
            for w in usable:
                for slot in w.free_slots():
                    if len(picks) < msg.world_size:
                        picks.append((w, slot))
            kinds = {_device_kind(w, s) for w, s in picks}
            backend = msg.backend if msg.backend in ("gloo", "nccl") else ("nccl" if kinds == {"cuda"} else "gloo")
            if backend == "nccl" and kinds != {"cuda"}:
                return self._insufficient(msg, free, "backend nccl needs a CUDA device for every rank")
            master_addr = picks[0][0].reg.host
            master_port = self._free_port()
            self._allocations[msg.job_id] = msg
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

    def release_resources(self, msg: control_pb2.ReleaseResources, payload: Any = None) -> None:
        """释放全局资源指令: every worker holding ranks of the job releases them (kill: at
        once; otherwise after ``RELEASE_GRACE_SECONDS``) and their slots are free again.
        A kill of a job that holds nothing here goes to every registered worker: its ranks
        may have been launched before control restarted, and a node agent ignores the
        release of a job it does not run. A graceful release of such a job is a no-op."""
        with self._lock:
            self._allocations.pop(msg.job_id, None)
            holders = [w.reg.worker_id for w in self._workers.values() if w.busy.pop(msg.job_id, None) is not None]
            if not holders and msg.kill:
                holders = list(self._workers)
        grace = 0.0 if msg.kill else RELEASE_GRACE_SECONDS
        for worker_id in holders:
            self._hardware(control_pb2.ReleaseRanks(job_id=msg.job_id, kill=msg.kill, grace_seconds=grace), worker_id)

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
        with self._lock:
            allocated = self._allocations.get(msg.job_id)
        if allocated is None:
            return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason=f"job {msg.job_id} holds no allocation")
        again = control_pb2.AllocateResources()
        again.CopyFrom(allocated)
        again.adopt = False  # (an allocation adopted after a control restart is placed anew)
        again.init.resume_version = msg.resume_version
        again.exclude_worker_ids[:] = sorted(set(again.exclude_worker_ids) | set(msg.exclude_worker_ids))
        self.release_resources(control_pb2.ReleaseResources(job_id=msg.job_id, kill=True))
        placed = self.allocate_resources(again)
        if isinstance(placed, control_pb2.ResourcesInsufficient):
            with self._lock:
                self._allocations.setdefault(msg.job_id, again)
        return placed

    # ------------------------------------------------------------ private

    def _insufficient(
        self, msg: control_pb2.AllocateResources, available: int, reason: str
    ) -> control_pb2.ResourcesInsufficient:
        registered = sum(
            w.reg.slots
            for w in self._workers.values()
            if not w.departing and w.reg.worker_id not in msg.exclude_worker_ids
        )
        return control_pb2.ResourcesInsufficient(
            job_id=msg.job_id,
            requested_ranks=msg.world_size,
            available_ranks=available,
            reason=reason,
            registered_ranks=registered,
        )

    def _free_port(self) -> int:
        # A fresh port per launch, found by binding port 0 here, on the control host. This
        # assumes rank 0 runs on this host (single-machine deployments) or that the port is
        # free there too; a node agent that finds it taken reports a rank failure. A
        # multi-host deployment should ask rank 0's node agent instead.
        with socket.socket() as s:
            s.bind((self._control_host, 0))
            return s.getsockname()[1]


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


def _memory_peer(usable: list[_Worker], worker_id: str) -> control_pb2.MemoryPeer | None:
    """The worker after ``worker_id`` among ``usable`` (registration order, wrapping); None
    when it is the only one."""
    ids = [w.reg.worker_id for w in usable]
    if worker_id not in ids or len(ids) < 2:
        return None
    nxt = usable[(ids.index(worker_id) + 1) % len(ids)].reg
    return control_pb2.MemoryPeer(worker_id=nxt.worker_id, address=nxt.address)
