"""L1-3 fault detector: collects fault events, grades them, reports to the orchestrator.

Seed 000 L1-3: it only listens, grades (minor / medium / severe / fatal) and reports; it
never decides whether to stop or recover, never retries, never touches another module.
Its grading table is pushed once at construction (the seed's 故障分级规则台账) and frozen.

Inputs: ``StartFaultMonitoring`` (from L1-1), ``RankExited`` (from the node agent, via the
session relay), ``TrainingLoopFailed`` (from L2-1, via the relay), ``BoundaryViolationReported``
(from the contract layer of any process: a send the route table refused).
Output: ``FaultReport`` (to L1-1), its only event.

Every input is an event it is handed; it grades it on the delivering thread, at once. It
keeps no clock on anyone (no heartbeat, no timer): a dead rank's closed stream is the event.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from services.contract import Module, audit_pb2, control_pb2, engine_pb2
from services.contract.bus import Emitter

G = control_pb2.FaultGrade

# Fault classes this detector names itself (TrainingLoopFailed brings its own class).
RANK_EXIT = "rank_exit"              # a rank process ended with a non-zero code or a signal
RANK_EXIT_CLEAN = "rank_exit_clean"  # exit code 0: normal after the loop finished, early otherwise
WORKER_LOST = "worker_lost"          # the node agent's session closed under the rank
LOOP_FAILURE = "loop_failure"        # default for a TrainingLoopFailed class not in the table
BOUNDARY_VIOLATION = "boundary_violation"  # a send the route table refused (a module or wiring bug)

# The relay states a lost node agent as a RankExited whose detail starts with this marker
# (the proto has no WorkerLost event yet; see the control README / report).
WORKER_LOST_MARKER = WORKER_LOST + ":"

DEFAULT_RULES: dict[str, int] = {
    RANK_EXIT: G.SEVERE,
    RANK_EXIT_CLEAN: G.MEDIUM,  # the orchestrator knows whether the rank had finished
    WORKER_LOST: G.SEVERE,
    LOOP_FAILURE: G.FATAL,
    # Deterministic: the same code refuses the same send after any restart.
    BOUNDARY_VIOLATION: G.FATAL,
    "data_unavailable": G.FATAL,
    "non_finite_loss": G.FATAL,
    "model_error": G.FATAL,
    "checkpoint_error": G.SEVERE,
    "comm_error": G.SEVERE,
}


class FaultDetector:
    """Grades fault events by a frozen rule table and publishes ``FaultReport``.

    Args:
        emit: publishes this module's events (FaultReport).
        rules: fault class -> ``FaultGrade`` value; merged over ``DEFAULT_RULES``.

    Raises:
        ValueError: a rule names an unknown grade (the message names the class).
    """

    def __init__(self, emit: Emitter, rules: Mapping[str, int] | None = None):
        table = dict(DEFAULT_RULES)
        for fault_class, grade in (rules or {}).items():
            if grade not in G.values() or grade == G.GRADE_UNSPECIFIED:
                raise ValueError(f"fault rules: {fault_class}: unknown grade {grade!r}")
            table[fault_class] = grade
        # Frozen after init: no command carries rules (the seed lists none), and the table
        # itself is read-only, so nobody may change the grading at run time.
        self._rules: Mapping[str, int] = MappingProxyType(table)
        self._emit = emit
        self._lock = threading.Lock()
        self._monitored: set[str] = set()
        self._counts: Counter[tuple[str, str]] = Counter()  # (job_id, class) -> faults seen

    # ------------------------------------------------------------ commands (L1-1)

    def start_fault_monitoring(self, msg: control_pb2.StartFaultMonitoring, payload: Any = None) -> None:
        """开启全域故障监听指令: report faults of ``msg.job_id`` from now on."""
        with self._lock:
            self._monitored.add(msg.job_id)

    # ------------------------------------------------------------ fault events

    def on_rank_exited(self, msg: control_pb2.RankExited, payload: Any = None) -> None:
        """A rank process ended. Every exit of a monitored job is graded: a code-0 exit is
        normal once the loop finished, but only the orchestrator knows that."""
        if msg.detail.startswith(WORKER_LOST_MARKER):
            fault_class = WORKER_LOST
            reason = msg.detail[len(WORKER_LOST_MARKER):].strip()
            detail = f"rank {msg.rank} lost with worker {msg.worker_id}: {reason}"
        else:
            fault_class = RANK_EXIT if msg.exit_code != 0 else RANK_EXIT_CLEAN
            how = f"signal {-msg.exit_code}" if msg.exit_code < 0 else f"exit code {msg.exit_code}"
            detail = f"rank {msg.rank} on worker {msg.worker_id} ended ({how})"
            if msg.detail:
                detail += f": {msg.detail}"
        self._report(msg.job_id, fault_class, Module.EXT_HARDWARE, msg.rank, detail)

    def on_training_loop_failed(self, msg: engine_pb2.TrainingLoopFailed, payload: Any = None) -> None:
        """A rank's training loop stopped on an error it reported itself."""
        fault_class = msg.fault_class or LOOP_FAILURE
        detail = f"rank {msg.rank} failed at step {msg.step}: {msg.detail}"  # the class is in the report
        self._report(msg.job_id, fault_class, Module.L2_TRAINING_LOOP, msg.rank, detail)

    def on_boundary_violation_reported(self, msg: audit_pb2.BoundaryViolationReported, payload: Any = None) -> None:
        """A process's contract layer refused a send. Graded for the job of the process
        that reported it; a violation outside any job (``job_id`` "") is nobody's job to
        decide on here: the contract layer has counted and logged it."""
        receiver = Module.Name(msg.receiver) if msg.receiver else "any receiver"
        detail = f"{msg.process}: {Module.Name(msg.sender)} may not send {msg.message} to {receiver}"
        if msg.detail:
            detail += f" ({msg.detail})"
        self._report(msg.job_id, BOUNDARY_VIOLATION, msg.sender, msg.rank, detail)

    # ------------------------------------------------------------ private

    def _grade(self, fault_class: str) -> int:
        return self._rules.get(fault_class, self._rules[LOOP_FAILURE])

    def _report(self, job_id: str, fault_class: str, source: int, rank: int, detail: str) -> None:
        with self._lock:
            if job_id not in self._monitored:
                return  # not a job this control started (e.g. ranks from a previous run)
            self._counts[(job_id, fault_class)] += 1
        # Published outside the lock: the orchestrator may command this module back.
        self._emit(
            control_pb2.FaultReport(
                job_id=job_id,
                grade=self._grade(fault_class),
                fault_class=fault_class,
                source=source,
                rank=rank,
                detail=detail,
                detected_unix=time.time(),
            )
        )
