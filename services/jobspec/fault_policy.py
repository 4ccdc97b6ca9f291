"""The fault policy section: the fault classes, their default actions and budgets, and
``FaultPolicySpec``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    model_validator,
)

from services.jobspec.base import U32_MAX, _Strict

# skip_step: the training loop skips the step's update on every rank and goes on (only for
# the step faults of STEP_FAULT_CLASSES).
# skip_save: a save a destination refused (SAVE_FAULT_CLASSES) is given up; the ranks train on
# and the next checkpoint interval saves again (services/control/fault_decision.py).
# pause: the job is PAUSED, its ranks gone and every checkpoint kept, for `surgectl resume` (only
# for PAUSE_CLASSES: a data service down past data_outage_seconds, a dataset shard changed).
FaultAction = Literal[
    "ignore", "skip_step", "skip_save", "restart_ranks", "rollback", "exclude_node", "rebuild", "shrink", "replace",
    "pause", "stop",
]  # fmt: skip
# pause: the ranks end and the job is PAUSED (not FAILED), every checkpoint kept, its message
# the fault's one line and what to do; an operator's resume relaunches it from its newest
# checkpoint (services/control/fault_decision.py).
# rebuild (issue 16): the lost rank is replaced and the survivors keep their processes: they
# rebuild the process group in place and the replacement takes its state from a live peer's
# memory (services/control/fault_decision.py). It applies to the loss of a rank (these
# classes); a job whose state is not whole on a data-parallel peer cannot take it
# (rebuild_refusal). shrink: a rebuild that, when no slot is free for a replacement (a node
# lost, no spare), goes on at the largest data-parallel size the remaining ranks allow, on the
# same global batches, and grows back when slots return.


IN_PLACE_ACTIONS = ("rebuild", "shrink")
REBUILD_CLASSES = (
    "rank_exit", "rank_silent", "rank_stalled", "worker_lost", "worker_departed", "comm_error", "slow_rank",
)  # fmt: skip
# A slow rank (issue 29 item 2: computing >= 1.5x the job's median per step, sustained; the
# fault detector's slow_ranks.py) trains on at its pace unless the policy says otherwise:
# ignore (report it: event, status, metric), replace (a rebuild in place that ends it and
# starts its replacement on another node, its own left out of the job: the survivors keep
# training and it heals from a live peer, one step replayed at most), or shrink (the same, and
# without a free slot elsewhere the job goes on at a smaller data-parallel size).
SLOW_RANK_ACTIONS = ("ignore", "replace", "shrink")
# Step faults: found by the training loop in a step's all-rank values (every rank finds the same
# one at the same step). The loop blocks at that step and L1-1 decides by the class's action
# (services/control/fault_decision.py), every action valid: ignore applies the step as it is,
# skip_step skips its update (for overflow_storm: both go on with the step skipped and the count
# restarted), rollback / restart_ranks / exclude_node relaunch the ranks from the newest
# checkpoint (one before the step: it was not applied), stop fails the job.
STEP_FAULT_CLASSES = ("non_finite_loss", "gradient_overflow", "overflow_storm", "loss_scale_at_minimum")
# Save faults: a checkpoint save whose bytes a destination refused (a full disk, a quota, a
# permission, a read-only filesystem, an I/O error; typed from the errno where the write
# failed). The ranks have trained on; skip_save records it and they go on (the next interval
# saves again, the versions before are intact), stop ends the job FAILED with them kept, a
# relaunch resumes from the newest one.
SAVE_FAULT_CLASSES = ("checkpoint_write_failed",)
# A data service down (its address unreachable, the ranks' relays reconnecting) is no training
# fault: the job waits for it up to fault_policy.data_outage_seconds, then the class's action
# decides (pause by default: resumable once the service is up; stop: FAILED).
DATA_OUTAGE = "data_outage"
# ... and a dataset version whose bytes changed under the job (issue 29 item 7): a relaunch
# would meet the same shard again, so the job waits for an operator.
PAUSE_CLASSES = (DATA_OUTAGE, "data_corrupt")
FAULT_GRADES = ("MINOR", "MEDIUM", "SEVERE", "FATAL")
# The orchestrator's defaults, by fault class first, then by grade (a class not listed).
# restart_ranks resumes from the newest checkpoint (from scratch if none); rollback from the
# newest one not after the faulting step that verifies (older ones if it does not).
DEFAULT_CLASS_ACTIONS: dict[str, str] = {
    "rank_exit": "restart_ranks",
    "rank_silent": "restart_ranks",
    "rank_stalled": "restart_ranks",
    "comm_error": "restart_ranks",
    "port_in_use": "restart_ranks",
    # A lost node agent has withdrawn its slots: a relaunch cannot land there while it is
    # gone, and when it comes back (restarted in place, the stack brought up again) it is
    # a worker like any other. exclude_node stays available to leave a flaky node out.
    "worker_lost": "restart_ranks",
    # The node agent was asked to leave (SIGTERM, `surgectl restart worker-N`): its ranks
    # are relaunched elsewhere, or on it once it is back (never while it is leaving).
    "worker_departed": "restart_ranks",
    # A recovery step that waited past the policy's deadline (store_wait_seconds,
    # capacity_wait_seconds): the job ends FAILED with every checkpoint kept, to be resumed.
    "store_unreachable": "stop",
    "no_capacity": "stop",
    # The relaunched ranks did not all report ready within restore_seconds.
    "recovery_timeout": "restart_ranks",
    "non_finite_loss": "rollback",
    # An fp16 overflow is what dynamic loss scaling expects: skip, back off, go on.
    "gradient_overflow": "skip_step",
    "loss_scale_at_minimum": "rollback",
    "overflow_storm": "rollback",
    "checkpoint_error": "rollback",
    "checkpoint_write_failed": "skip_save",
    # A shard of the job's dataset version no longer holds the bytes its manifest pinned (a
    # file rewritten on disk under the running job, found at its next read or at resume: issue
    # 29 item 7). A relaunch would read the same wrong bytes: the job pauses naming the version
    # and the shard, for an operator to put the files back (or prepare a new version) and resume.
    "data_corrupt": "pause",
    # A device of the node failed (an uncorrectable ECC error, a fatal Xid: the node agent's
    # NVML sampler): its ranks are relaunched without that node, which would fail them again.
    "device_error": "exclude_node",
    # A rank's exit by its cause (the node agent's evidence: services/worker/exit_cause.py):
    # killed by the OOM killer (its cgroup's oom_kill count rose), or MemoryError (the rank's
    # exit code 75). Relaunched once with the same configuration (DEFAULT_CLASS_RESTARTS); a
    # second one pauses the job with a hint (fault_decision.py MEMORY_CLASSES), never FAILED:
    # the same model on the same devices runs out again until its configuration changes.
    # Any other exit (an error code, a signal that was no OOM kill) is rank_exit.
    "rank_oom": "restart_ranks",
    "rank_memory_error": "restart_ranks",
    # A rank its node agent could not start (its executable, or an evaluation job's command,
    # missing or not executable there): a relaunch would spend a restart on the same refusal.
    "rank_not_started": "stop",
    # Data-parallel replicas found different (integrity.replica_check_every_steps): back to
    # the newest version at or before the last check that agreed (services/control/fault_decision.py).
    "replica_divergence": "rollback",
    # A replaced incarnation of a rank (stopped past its timeout, replaced, continued) was
    # refused by a fenced service (issue 29 item 4): its replacement runs and its node agent
    # ends it; nothing to decide.
    "rank_fenced": "ignore",
    "slow_rank": "ignore",  # reported (event, status, metric), the job trains on
    # Control's journal refused a write (a full disk, an I/O error under control's own store):
    # no fault of the job. The decision it carried is undone and the operator's command refused;
    # the job trains on, control's health says the journal fails (JobList.journal_failing).
    "journal_write_failed": "ignore",
    # A collective stalled (or failed) while its ranks still beat and a data-plane link between
    # their nodes was down (both node agents hear nothing of each other, while both reach
    # control): recovered like a lost node, without one of the link's two nodes (the one with
    # more links down; a tie leaves out the one not hosting rank 0: fault_decision.link_endpoint).
    "link_down": "exclude_node",
    # The data service stayed unreachable for fault_policy.data_outage_seconds (the job waited,
    # its ranks alive): PAUSED with every checkpoint kept, `surgectl resume` once it is up.
    DATA_OUTAGE: "pause",
}
# Restart budgets by class where the default (``max_restarts``) does not fit; a job's
# ``restarts`` entry wins. One relaunch with the same configuration for running out of memory.
DEFAULT_CLASS_RESTARTS: dict[str, int] = {"rank_oom": 1, "rank_memory_error": 1}
# Every fault class control can report (and a policy can name): the fault detector's rules
# (services/control/fault_detector/rules.py DEFAULT_RULES, FAILURE_CLASSES, ALIASES), the classes a
# failure exception carries (``fault_class``), and the orchestrator's recovery-wait classes.
# jobspec is below control (import-linter), so the list lives here;
# tests/test_fault_classes_known.py fails when control can report a class it lacks.
KNOWN_FAULT_CLASSES: frozenset[str] = frozenset(
    {
        *DEFAULT_CLASS_ACTIONS,
        *STEP_FAULT_CLASSES,
        "rank_exit_clean",
        "rank_released",
        "agent_silent",  # a node's report (no job): L1-1 holds the worker out of placement
        "slow_rank_cleared",
        "rank_stalled_in_collective",
        "loop_failure",
        "internal_error",
        "boundary_violation",
        "checkpoint_integrity",
        "data_unavailable",
        "data_exhausted",
        "operator_unavailable",
        "model_error",
        "config_error",
        "config_frozen",
        "session_lost",
        "out_of_memory",
        "io_error",
        "timeout",
        "unavailable",
        "data_corrupt",
        "data_io_error",
        "snapshot_failed",
        "log_write_failed",
        "recovery_failed",
        "device_degraded",
        "rank_log_flood",  # a warning: the rank's log is rotated at its bound (issue 29 item 8)
        "memory_copy_skipped",  # a warning: the next save tries its memory copy again
        "link_degraded",  # a warning: a data-plane link loses probes (one way or both)
    }
)
DEFAULT_GRADE_ACTIONS: dict[str, str] = {
    "MINOR": "ignore",
    "MEDIUM": "ignore",
    "SEVERE": "restart_ranks",
    "FATAL": "stop",
}


class FaultPolicySpec(_Strict):
    """What the orchestrator does about a graded fault (one decision per incident).

    ``actions`` maps a fault class (``rank_exit``, ``non_finite_loss``, ...) or a grade
    (``MINOR`` .. ``FATAL``) to an action; a class entry wins over a grade entry, and both
    over the defaults above. Every relaunch (restart_ranks, rollback, exclude_node) spends one
    restart of the fault class's budget (``restarts[class]``, else DEFAULT_CLASS_RESTARTS,
    else ``max_restarts``); an exhausted budget stops the job FAILED, except running out of
    memory (``rank_oom``, ``rank_memory_error``: 1 by default), which pauses it with a hint.
    """

    actions: dict[str, FaultAction] = {}
    max_restarts: int = Field(3, ge=0, le=U32_MAX)
    restarts: dict[str, Annotated[int, Field(le=U32_MAX)]] = {}  # (>= 0: checked below, naming the class)
    # K consecutive skipped (overflowing) steps; counted in a uint32 (StepFaultReported.consecutive_skips)
    overflow_storm_steps: int = Field(8, gt=0, le=U32_MAX)
    # How long a recovery waits (seconds) before the policy decides: for the store to answer
    # its verification (``store_unreachable``), for enough free slots to relaunch the ranks
    # (``no_capacity``), and for the relaunched ranks to restore and report ready
    # (``recovery_timeout``). Waiting loses nothing: the job stays FAULT_FROZEN, its status
    # says what it waits for, and no checkpoint is struck.
    store_wait_seconds: float = Field(600.0, gt=0, le=7 * 86400)
    capacity_wait_seconds: float = Field(600.0, ge=0, le=7 * 86400)
    restore_seconds: float = Field(600.0, gt=0, le=7 * 86400)
    # The same bound for a rebuild in place (``rebuild``, ``shrink``): every rank of the new
    # group (survivors and replacements) ready within it, else ``recovery_timeout``. Shorter:
    # a survivor reaches the new rendezvous in seconds unless it is blocked in a wait its
    # lost peer's death does not end, and the fallback (restart_ranks) loses little.
    rebuild_seconds: float = Field(120.0, gt=0, le=7 * 86400)
    # How long a training loop blocked on a step fault waits for L1-1's verdict before it says
    # so (seconds): it reports the fault again and keeps waiting (it never decides itself);
    # the report reaches a restarted control, which decides then.
    verdict_seconds: float = Field(30.0, gt=0, le=7 * 86400)
    # What a relaunch does when no committed checkpoint of the job verifies (none saved yet,
    # or every one struck): start the ranks from step 0 (the default: the job's earlier
    # behaviour), or stop the job FAILED, keeping whatever the store holds for an operator
    # (services/control/fault_decision.py: ``no_checkpoint``).
    no_checkpoint: Literal["restart_from_scratch", "stop"] = "restart_from_scratch"
    # How long the job waits for a data service that cannot be reached (seconds): its ranks stay
    # alive, their streams reconnecting with backoff, and continue at the batch where they
    # stopped when it is back (`surgectl up` starts it, or `surgectl restart data`); past it the
    # policy decides ``data_outage`` (default: pause). 5 minutes covers a restart by hand or by a
    # container's restart policy; a data service gone for longer wants an operator.
    data_outage_seconds: float = Field(300.0, gt=0, le=7 * 86400)
    # Inspect before acting (issue 29 item 9): a fault whose decision relaunches a rank (in place
    # too) holds the ranks alive and idle (FreezeTraining) this long before the decided action runs, so an
    # operator can look at them (py-spy, logs); `surgectl thaw JOB` runs it at once, `surgectl
    # stop JOB` ends the job. 0 (the default): the decision runs at once. ``freeze_classes``:
    # the fault classes it applies to (empty: every class).
    freeze_seconds: float = Field(0.0, ge=0, le=7 * 86400)
    freeze_classes: list[str] = []

    @model_validator(mode="after")
    def _known_keys(self) -> FaultPolicySpec:
        for key in self.freeze_classes:
            if key not in KNOWN_FAULT_CLASSES:
                raise ValueError(
                    f"freeze_classes: {key}: unknown fault class (known: {', '.join(sorted(KNOWN_FAULT_CLASSES))})"
                )
        for table, name in ((self.actions, "actions"), (self.restarts, "restarts")):
            for key in table:
                if key not in FAULT_GRADES and key not in KNOWN_FAULT_CLASSES:
                    raise ValueError(
                        f"{name}.{key}: unknown fault class (known: {', '.join(FAULT_GRADES)}, "
                        f"{', '.join(sorted(KNOWN_FAULT_CLASSES))})"
                    )
        for key, action in self.actions.items():
            if key == "slow_rank" and action not in SLOW_RANK_ACTIONS:
                raise ValueError(f"actions.slow_rank: must be one of {', '.join(SLOW_RANK_ACTIONS)}, got {action}")
            if action == "replace" and key != "slow_rank":
                raise ValueError(f"actions.{key}: replace applies only to slow_rank (a lost rank: rebuild)")
            if action in IN_PLACE_ACTIONS and key not in REBUILD_CLASSES:  # (a grade holds other faults too)
                raise ValueError(f"actions.{key}: {action} applies only to a lost rank ({', '.join(REBUILD_CLASSES)})")
            if action == "skip_step" and key not in STEP_FAULT_CLASSES:
                raise ValueError(f"actions.{key}: skip_step applies only to {', '.join(STEP_FAULT_CLASSES)}")
            if action == "skip_save" and key not in SAVE_FAULT_CLASSES:
                raise ValueError(f"actions.{key}: skip_save applies only to {', '.join(SAVE_FAULT_CLASSES)}")
            if action == "pause" and key not in PAUSE_CLASSES:
                raise ValueError(f"actions.{key}: pause applies only to {', '.join(PAUSE_CLASSES)}")
        for key, n in self.restarts.items():
            if n < 0:
                raise ValueError(f"restarts.{key} must be >= 0, got {n}")
        return self

    def action_for(self, fault_class: str, grade: str) -> str:
        """The action for a fault of ``fault_class`` graded ``grade`` (a FaultGrade name)."""
        for table, key in ((self.actions, fault_class), (self.actions, grade), (DEFAULT_CLASS_ACTIONS, fault_class)):
            if key in table:
                return table[key]
        return DEFAULT_GRADE_ACTIONS.get(grade, "stop")

    def step_action(self, fault_class: str) -> str:
        """The action for a step fault of ``fault_class`` (one of STEP_FAULT_CLASSES), or a
        ``slow_rank``: the class's entry in ``actions``, else the default table. Grades do not
        apply: a step fault is not graded (the loop reports it to L1-1 directly), a slow rank
        fails nothing."""
        return self.actions.get(fault_class, DEFAULT_CLASS_ACTIONS[fault_class])

    @property
    def rebuilds(self) -> bool:
        """Whether some fault is rebuilt in place: the ranks then keep their processes when
        their group breaks, waiting for L1's decision (InitJob.rebuild_in_place)."""
        return any(a in IN_PLACE_ACTIONS or a == "replace" for a in self.actions.values())

    def freezes(self, fault_class: str) -> float:
        """How long a fault of ``fault_class`` holds the ranks before its decided relaunch
        runs (seconds; 0: not held)."""
        if not self.freeze_classes or fault_class in self.freeze_classes:
            return self.freeze_seconds
        return 0.0

    def budget_for(self, fault_class: str) -> int:
        """Relaunches allowed for ``fault_class`` in one job: ``restarts[class]``, else the
        class's default (DEFAULT_CLASS_RESTARTS), else ``max_restarts``."""
        return self.restarts.get(fault_class, DEFAULT_CLASS_RESTARTS.get(fault_class, self.max_restarts))
