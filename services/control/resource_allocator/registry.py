"""The worker registry: a node agent's registration (a reconnect, a withdrawal, a departure,
the ranks it re-attached after a control restart) and its memory pressure reports."""

from __future__ import annotations

import time
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.control.resource_allocator.slots import _device_kind, _Placement, _Worker


class Registry:
    """Registrations, re-attach and memory pressure (a part of ``ResourceAllocator``, see
    allocator.py)."""

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
        that L1-1 can start a job waiting in its queue. A withdrawal and a departure publish
        it too (cordons.py ``_offer``: every change of the placeable capacity does).

        Cordon: a registration of another node agent incarnation than the one cordoned (the
        agent restarted, the node rebooted or was replaced) ends the worker's cordon,
        published as ``WorkerCordoned`` with ``cleared``; the same incarnation registering
        again (a reconnect, or a control restart) keeps it. Likewise a hold (agent_silent)
        ends when another incarnation registers, or the agent whose stream closed comes back."""
        with self._lock:
            old = self._workers.get(msg.worker_id)
            if msg.departing or msg.slots == 0:
                if old is None:
                    return
                if msg.departing:  # (before the zero-slot check: it keeps the record and its busy slots)
                    old.departing = True
                else:
                    self._workers.pop(msg.worker_id, None)
                    for where in self._reattached.values():  # (its ranks are lost: not placed there any more)
                        for rank in [r for r, (w, _) in where.items() if w == msg.worker_id]:
                            del where[rank]
                offer = self._offer(msg.worker_id)
            else:
                offer = None
        if offer is not None:  # (its slots left the placeable capacity: fair share's denominators)
            self._emit(offer)
            return
        with self._lock:
            old = self._workers.get(msg.worker_id)
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
            offer = self._offer(msg.worker_id)
        if cleared is not None:  # (outside the lock, like every send; before the slots are offered)
            self._emit(cleared)
        self._emit(offer)

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

    # ------------------------------------------------------------ private

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
