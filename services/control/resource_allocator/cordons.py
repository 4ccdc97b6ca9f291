"""Who may get new ranks: a worker's cordon (a fatal device fault; a quarantine, ended only by
the operator), its hold (its node agent is silent), its departure."""

from __future__ import annotations

from typing import Any

from services.contract import control_pb2
from services.control.resource_allocator.slots import _Worker


class Cordons:
    """Cordons, quarantine and holds (a part of ``ResourceAllocator``, see allocator.py)."""

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
                offer = self._offer(msg.worker_id)
            else:
                ended, offer = None, None
        if ended is not None:
            self._emit(offer)  # (outside the lock, like every send: the capacity changed)
            return ended
        with self._lock:
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
            offer = self._offer(msg.worker_id)
        self._emit(offer)  # (its slots are no longer placeable: fair share's denominators)
        return reply

    # ------------------------------------------------------------ private

    def _hold(self, msg: control_pb2.CordonWorker) -> control_pb2.WorkerCordoned:
        with self._lock:
            if not msg.lift:
                changed = msg.worker_id not in self._holds
                self._holds[msg.worker_id] = msg.reason or f"{msg.worker_id} held"
            else:
                changed = self._holds.pop(msg.worker_id, None) is not None
            offer = self._offer(msg.worker_id)
        if changed:  # (outside the lock, like every send)
            self._emit(offer)
        if not msg.lift:
            return control_pb2.WorkerCordoned(worker_id=msg.worker_id, reason=msg.reason, unix_time=msg.unix_time)
        return control_pb2.WorkerCordoned(worker_id=msg.worker_id, reason=msg.reason, cleared=True)

    def _offer(self, *changed: str) -> control_pb2.ResourcesReady:
        """Under the lock: the slots free on the placeable workers, and their registered slots
        per device kind (what L1-1's fair share divides each kind's held slots by), once the
        shares of the workers ``changed`` are counted again (``_recount``).

        The one place the placeable capacity is derived: every change of it (a registration, a
        withdrawal, a departure, a cordon or a quarantine and its end, a hold and its lift)
        publishes this offer, numbered (``offer``) so that L1-1 keeps the newest of two that
        cross on their way (each is sent outside the lock). O(1): the sums are kept per worker
        (capacity.py), never summed over every worker (10,000 registrations were O(n²))."""
        self._recount(*changed)
        self._offers += 1
        total = self._capacity
        return control_pb2.ResourcesReady(
            free_ranks=total.free,
            gpu_slots=total.gpu,
            cpu_slots=total.cpu,
            offer=self._offers,
            registered=control_pb2.KindSlots(gpu=total.registered_gpu, cpu=total.registered_cpu),
        )

    def _recount(self, *worker_ids: str) -> None:
        """Under the lock: the workers' shares of the offer's sums counted again, after a change
        of their registration, placeability or busy slots (each place that changes one says so)."""
        for worker_id in worker_ids:
            worker = self._workers.get(worker_id)
            self._capacity.recount(worker_id, worker, worker is not None and self._placeable(worker))

    def _placeable(self, w: _Worker) -> bool:
        """Under the lock: may new ranks be placed on ``w`` (not leaving, not cordoned, not held)."""
        return not w.departing and w.reg.worker_id not in self._cordons and w.reg.worker_id not in self._holds

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
