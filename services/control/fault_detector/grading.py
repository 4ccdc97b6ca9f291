"""Grading: a fault class's grade by the frozen rule table, the ``FaultReport`` made of it (with
the fault counted for its job and, for a node's fault, for its node: sick_nodes.py), and the
``FaultBacklogAlert`` of a node whose faults piled up."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.contract import control_pb2
from services.control.fault_detector.rules import LOOP_FAILURE
from services.control.sick_nodes import NODE_FAULT_CLASSES, NodeFault, SickNode

_log = structlog.get_logger("fault_detector")


class Grading:
    """Grades and reports (a part of ``FaultDetector``, see detector.py)."""

    def _grade(self, fault_class: str) -> int:
        return self._rules.get(fault_class, self._rules[LOOP_FAILURE])

    def _graded(
        self,
        job_id: str,
        fault_class: str,
        source: int,
        rank: int,
        detail: str,
        *,
        occurred: float = 0.0,
        worker_id: str = "",
        step: int = 0,
        phase: int = 0,
        subclass: str = "",
        event: str = "",
        cause: int = 0,
        exit_cause: int = 0,
        generation: int = 0,
        agent_unheard: bool = False,
        replaced: bool = False,
    ) -> control_pb2.FaultReport | None:
        """``generation``: the launch of the rank that failed, where the fault says it (a rank's
        exit): a node's sick count takes one launch's faults in one incident once. ``replaced``:
        that launch was replaced before the fault came up (the end of an incarnation already
        written off): graded and reported, counted nowhere (not the node's fault now, not the
        job's round: its incident was decided when the incarnation was replaced)."""
        now = time.time()
        sick = None
        with self._job_lock(job_id):
            job = self._jobs.get(job_id)
            if job is None:
                return None  # not a job this control started (e.g. ranks from a previous run)
            if not replaced:
                self._counts[(job_id, fault_class)] += 1
                job.round_faults += 1
            if not worker_id and rank in job.ranks and not replaced:
                worker_id = job.ranks[rank].worker_id
            if worker_id and fault_class in NODE_FAULT_CLASSES and not replaced:
                kind = fault_class + (f"/{control_pb2.ExitCause.Name(exit_cause)}" if exit_cause else "")
                with self._cluster:  # (across jobs: the node's faults)
                    sick = self._sick.record(NodeFault(worker_id, job_id, job.round, kind, now, generation))
        if sick is not None:
            self._alert_sick(sick)
        return control_pb2.FaultReport(
            job_id=job_id,
            grade=self._grade(fault_class),
            fault_class=fault_class,
            source=source,
            rank=rank,
            detail=detail,
            detected_unix=now,
            occurred_unix=occurred or now,
            worker_id=worker_id,
            step=step,
            phase=phase,
            subclass=subclass,
            event=event,
            cause=cause,
            agent_unheard=agent_unheard,
            generation=generation,
            replaced=replaced,
        )

    def _alert_sick(self, sick: SickNode) -> None:
        """A node's rank faults piled up across jobs and incidents (sick_nodes.py): L1-1 is
        told (it quarantines the node), before the report that made it sick, so the cordon is
        in force before that job decides where to relaunch. Outside the lock."""
        _log.warning("sick node", worker_id=sick.worker_id, faults=sick.faults, incidents=sick.incidents)
        self._emit(
            control_pb2.FaultBacklogAlert(
                worker_id=sick.worker_id,
                reports=sick.faults,
                incidents=sick.incidents,
                window_seconds=sick.window_seconds,
                detail=sick.detail,
            )
        )

    def _report(self, job_id: str, fault_class: str, source: int, rank: int, detail: str, **known: Any) -> None:
        report = self._graded(job_id, fault_class, source, rank, detail, **known)
        if report is None:
            return
        self._report_graded(job_id, report)
