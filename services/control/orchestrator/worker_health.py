"""Worker health (L1-3, L1-2): a worker's own fault (a report with no job), a sick node's
quarantine, the operator's uncordon and the cordons in force. A cordon takes a worker out of
placement for every job; a hold (a node agent silent past its beats) until it is heard again,
and a rebuild waiting for replacements on that node is decided again at once
(``_replacements_held``). The jobs with ranks there decide on their own reports
(faults.py)."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.contract import Module, control_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.job import FaultGrade, JobState
from services.control.orchestrator.refusals import WorkerNotCordoned
from services.control.orchestrator.replacement_nodes import WORKER_LOST, held_detail, waiting_on

_log = structlog.get_logger("orchestrator")


class WorkerHealth:
    """Worker health (a part of ``Orchestrator``, see core.py)."""

    def _on_worker_fault(self, msg: control_pb2.FaultReport) -> None:
        """A fault of a worker itself (a report with no job: a device's error, reported once
        for its node whether or not a job runs there). A class that cordons
        (``fd.CORDON_CLASSES``) takes the worker out of placement for every job, new or
        relaunched, until its node agent registers again as another incarnation (L1-2 ends
        it then). The jobs with ranks there decide on their own reports, by their policies.
        A class that holds (``fd.HOLD_CLASSES``: a node agent silent past its beats) takes it
        out of placement until the report that it ``cleared`` (the agent beats again): a
        replacement is never placed on a frozen or cut-off agent's node."""
        if msg.fault_class in fd.HOLD_CLASSES:
            self._allocator(
                control_pb2.CordonWorker(
                    worker_id=msg.worker_id, reason=msg.detail, unix_time=time.time(), hold=True, lift=msg.cleared
                )
            )
            with self._lock:  # (listed with the cordons, not journaled: the agent's next beat ends it)
                if msg.cleared:
                    self._held.pop(msg.worker_id, None)
                else:
                    self._held[msg.worker_id] = control_pb2.WorkerCordoned(
                        worker_id=msg.worker_id,
                        reason=f"placement held: {msg.detail}",
                        unix_time=time.time(),
                        held=True,
                    )
                self._publish_cordons()
            _log.warning("worker placement held" if not msg.cleared else "worker placement hold ended",
                         worker_id=msg.worker_id, reason=msg.detail)  # fmt: skip
            if not msg.cleared:
                self._replacements_held(msg)
            return
        if msg.fault_class not in fd.CORDON_CLASSES:
            return
        with self._lock:
            if msg.worker_id in self._cordoned:
                return  # (a second device of the node, or the same error again)
        reason = f"{msg.fault_class}: {msg.detail}"
        cordon = self._allocator(
            control_pb2.CordonWorker(worker_id=msg.worker_id, reason=reason, unix_time=time.time())
        )
        _log.warning("worker cordoned", worker_id=msg.worker_id, reason=reason)
        self.on_worker_cordoned(cordon.message)

    def _replacements_held(self, msg: control_pb2.FaultReport) -> None:
        """A node agent silent (``agent_silent``, its worker just held) while a rebuild in place
        waits for replacements launched there: to that job its worker is lost (``worker_lost``,
        ``subclass`` naming the agent's silence), decided by its policy (a rebuild again, placed
        elsewhere: the node is held) instead of waiting until the node wakes."""
        with self._lock:
            for job in list(self._jobs.values()):
                ranks = waiting_on(job, msg.worker_id)
                if not ranks or job.status.state == JobState.TERMINATED:
                    continue
                report = control_pb2.FaultReport(
                    job_id=job.status.job_id,
                    grade=msg.grade,
                    fault_class=WORKER_LOST,
                    subclass=msg.fault_class,
                    source=msg.source,
                    rank=ranks[0],
                    detail=held_detail(ranks, msg),
                    detected_unix=msg.detected_unix,
                    occurred_unix=msg.occurred_unix,
                    worker_id=msg.worker_id,
                )
                self._record(job, Module.L1_FAULT_DETECTOR, "fault", f"{FaultGrade.Name(msg.grade)} "
                             f"{fd.named(WORKER_LOST, report)}: {report.detail}")  # fmt: skip
                self._decide(job, report)

    def on_fault_backlog_alert(self, msg: control_pb2.FaultBacklogAlert, payload: Any = None) -> None:
        """A sick node (L1-3: its rank faults piled up across jobs and incidents): quarantined,
        out of placement for every new or relaunched rank until the operator's `surgectl
        uncordon` (a restarted node agent does not end it). Its running ranks are not touched:
        each job decides on its own faults. Journaled with the other cordons."""
        with self._lock:
            if msg.worker_id in self._cordoned:
                return  # (cordoned already: a device's error, or quarantined)
        reason = f"quarantined: {msg.detail}"
        cordon = self._allocator(
            control_pb2.CordonWorker(worker_id=msg.worker_id, reason=reason, unix_time=time.time(), quarantine=True)
        )
        _log.warning("worker quarantined", worker_id=msg.worker_id, reason=reason)
        self.on_worker_cordoned(cordon.message)

    def uncordon_worker_request(
        self, msg: control_pb2.UncordonWorkerRequest, payload: Any = None
    ) -> control_pb2.JobList:
        """`surgectl uncordon NODE`: the worker's cordon (a quarantine, a device's) ends; new
        and relaunched ranks may be placed there again. Returns the cordons still in force
        (``JobList.cordoned``, no jobs).

        Raises:
            WorkerNotCordoned: the worker has no cordon (one line naming it and those that have).
        """
        with self._lock:
            known = sorted(self._cordoned)
        if msg.worker_id not in known:
            held = f"cordoned: {', '.join(known)}" if known else "no worker is cordoned"
            raise WorkerNotCordoned(f"uncordon: worker {msg.worker_id!r} is not cordoned ({held})")
        ended = self._allocator(control_pb2.CordonWorker(worker_id=msg.worker_id, clear=True)).message
        _log.info("worker uncordoned by the operator", worker_id=msg.worker_id)
        self.on_worker_cordoned(ended)
        with self._lock:
            self._start_soon()  # (a job waiting for slots may fit now)
            return control_pb2.JobList(cordoned=list(self._cordoned.values()))

    def on_worker_cordoned(self, msg: control_pb2.WorkerCordoned, payload: Any = None) -> None:
        """A cordon in force (L1-2's reply to CordonWorker) or ended (``cleared``: the
        worker's node agent registered as another incarnation): journaled, so a restarted
        control commands it again, and listed with the jobs (``JobList.cordoned``)."""
        with self._lock:
            if msg.cleared:
                ended = self._cordoned.pop(msg.worker_id, None)
            else:
                self._cordoned[msg.worker_id] = msg
            self._publish_cordons()
        if not msg.cleared:
            self._journal.save_cordon(msg)
            return
        if ended is not None:
            _log.info("worker cordon ended: its node agent registered again", worker_id=msg.worker_id)
        self._journal.delete_cordon(msg.worker_id)  # (also one restored for an agent gone meanwhile)

    def _publish_cordons(self) -> None:
        """Under the lock: the cordons in force, then the holds of workers not cordoned, to what
        the operator's queries read (``JobList.cordoned``)."""
        held = [h for w, h in self._held.items() if w not in self._cordoned]
        self._views.publish_cordons([*self._cordoned.values(), *held])
