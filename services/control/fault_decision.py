"""L1-1's fault decision as a pure function: ``decide(policy, job, report) -> Decision``.

The orchestrator (``orchestrator.py``) does the I/O around it: it builds the job's view,
calls :func:`decide`, then journals the decision, counts it, and commands what it says
(a relaunch, a stop, a verdict to the ranks blocked on a step fault). Nothing here reads a
clock, a lock or a port, so the whole policy is table-tested without a bus
(``tests/control/test_fault_decision.py``), in the manner of torchft's ``quorum_compute``.

The policy (``fault_policy``, services/jobspec.py): an action per fault class, else per
grade, else the defaults; step faults by their class only (the loop reports them to L1-1
directly, ungraded). Every relaunch spends one restart of the class's budget; a spent budget
stops the job FAILED; an operator's stop in flight turns any decision into that stop.

``rebuild`` (issue 16) relaunches only the lost rank: the survivors rebuild their process
group in place and the replacement heals from a live peer; ``shrink`` does the same, and
where no slot is free for the replacement the orchestrator resizes the job to the largest
data-parallel size the remaining ranks allow. It applies to the loss of a rank
(``REBUILD_CLASSES``) while the ranks run; a fault that interrupts a rebuild's recovery, or
any other class, falls back to ``restart_ranks`` (said in the decision's text).

Step faults also get a verdict for the loops blocked at the step (``StepVerdictAction``):
ignore -> apply the step as it is, skip_step -> skip its update, a relaunch -> relaunch (the
loops step no further; the ranks are replaced), stop -> stop. :func:`standing_orders` gives
the verdicts L1-1 issues in advance with the job (InitJob): skip_step classes need no round
trip per fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.contract import control_pb2, engine_pb2
from services.jobspec import IN_PLACE_ACTIONS, REBUILD_CLASSES, STEP_FAULT_CLASSES, FaultPolicySpec

FaultGrade = control_pb2.FaultGrade
JobOutcome = control_pb2.JobOutcome

# The step fault kinds the loop reports, by the policy's class names (STEP_FAULT_CLASSES).
STEP_FAULT_CLASS: dict[int, str] = {
    engine_pb2.STEP_FAULT_NON_FINITE_LOSS: "non_finite_loss",
    engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW: "gradient_overflow",
    engine_pb2.STEP_FAULT_OVERFLOW_STORM: "overflow_storm",
    engine_pb2.STEP_FAULT_LOSS_SCALE_AT_MINIMUM: "loss_scale_at_minimum",
}
assert tuple(STEP_FAULT_CLASS.values()) == STEP_FAULT_CLASSES
STEP_FAULT_KIND = {c: k for k, c in STEP_FAULT_CLASS.items()}

RELAUNCHES = frozenset({"restart_ranks", "rollback", "exclude_node", *IN_PLACE_ACTIONS})
_VERDICTS = {
    "ignore": engine_pb2.STEP_APPLY,
    "skip_step": engine_pb2.STEP_SKIP,
    "stop": engine_pb2.STEP_STOP,
    **{a: engine_pb2.STEP_RELAUNCH for a in RELAUNCHES},
}


# A worker's own fault (a FaultReport with no job): the classes that cordon it, taking it out
# of placement for every job (CordonWorker) until its node agent registers again. A device's
# uncorrectable ECC error or fatal Xid (issue 26: "an uncorrectable ECC error excludes the node").
CORDON_CLASSES = frozenset({"device_error"})


@dataclass(frozen=True)
class JobView:
    """What the decision needs of the job (read-only)."""

    restarts: Mapping[str, int]  # fault class -> relaunches spent
    ignored: Mapping[str, int]  # fault class -> faults ignored so far
    stop_requested: bool = False  # an operator stop is in flight
    loading_version: str = ""  # the version the ranks of the recovery in flight load ("": none)
    # Why a rebuild in place cannot be done now ("": it can): the recovery in flight is a
    # rebuild that another fault interrupted, or no rank is running (paused, warming up).
    no_rebuild: str = ""


@dataclass(frozen=True)
class Decision:
    """One decision on one fault.

    ``action``: ignore | skip_step | restart_ranks | rollback | exclude_node | stop (a spent
    budget or an operator's stop in flight is ``stop``). ``counted``: the action as the
    decision metric counts it (``budget_exhausted`` for a spent budget). ``text``: the
    "decision" event. Stop: ``outcome`` (FAILED, or STOPPED after an operator's stop) and
    ``final`` (the job's last message). Relaunch: ``restart`` (1-based, of ``budget``),
    ``bound`` (rollback: no version after this step), ``exclude`` (exclude_node: the
    worker left out), ``strike`` (a version found corrupt as it loaded: never loaded again).
    ``verdict``: what a loop blocked on this fault (a step fault) does.
    """

    fault_class: str
    action: str
    counted: str
    text: str
    verdict: int
    outcome: int = JobOutcome.OUTCOME_UNSPECIFIED
    final: str = ""
    restart: int = 0
    budget: int = 0
    bound: int | None = None
    exclude: tuple[str, ...] = ()
    strike: str = ""


def fault_class_of(report: control_pb2.FaultReport) -> str:
    """The class the policy decides on: a clean exit of a rank that had not finished is a
    lost rank (the orchestrator filters out the finished ones first)."""
    return "rank_exit" if report.fault_class == "rank_exit_clean" else report.fault_class


def decide(policy: FaultPolicySpec, job: JobView, report: control_pb2.FaultReport) -> Decision:
    """The decision on ``report`` (a new incident: consequences of one in flight are the
    orchestrator's to filter out first), by ``policy``, given ``job``."""
    fault_class = fault_class_of(report)
    grade = FaultGrade.Name(report.grade)
    step_fault = report.grade == FaultGrade.GRADE_UNSPECIFIED and fault_class in STEP_FAULT_CLASSES
    action = policy.step_action(fault_class) if step_fault else policy.action_for(fault_class, grade)
    who = f"{fault_class} of rank {report.rank}" + (f" on {report.worker_id}" if report.worker_id else "")
    if step_fault:
        who += f" at step {report.step}"
    said = f"{grade + ' ' if not step_fault else ''}{fault_class}: {report.detail}"

    def stop(counted: str, text: str, outcome: int, final: str) -> Decision:
        return Decision(fault_class, "stop", counted, text, engine_pb2.STEP_STOP, outcome=outcome, final=final)

    if job.stop_requested and action not in ("ignore", "skip_step"):
        # (an ignored fault or a skipped step changes nothing: the operator's stop goes on)
        return stop(
            "stop",
            f"stop after {who}: a stop was already requested",
            JobOutcome.STOPPED,
            f"stopped by the operator; then {said}",
        )
    if action == "ignore":
        n = job.ignored.get(fault_class, 0) + 1
        then = "; the step is applied as it is" if step_fault else ""
        return Decision(
            fault_class,
            "ignore",
            "ignore",
            f"ignore {who}: fault policy; {n} ignored so far{then}",
            engine_pb2.STEP_APPLY,
        )
    if action == "skip_step":
        return Decision(
            fault_class,
            "skip_step",
            "skip_step",
            f"skip step {report.step} after {who}: fault policy",
            engine_pb2.STEP_SKIP,
        )
    if action == "stop":
        return stop("stop", f"stop after {who}: fault policy", JobOutcome.FAILED, said)
    assert action in RELAUNCHES, action
    fallback = ""
    if action in IN_PLACE_ACTIONS and (job.no_rebuild or fault_class not in REBUILD_CLASSES):
        # The survivors cannot rebuild: the old path (every rank from the newest checkpoint).
        fallback = f"; restart_ranks instead of {action}: {job.no_rebuild or f'{fault_class} is not a lost rank'}"
        action = "restart_ranks"
    spent, budget = job.restarts.get(fault_class, 0), policy.budget_for(fault_class)
    if spent >= budget:
        why = f"restart budget for {fault_class} exhausted ({spent} of {budget} used)"
        return stop("budget_exhausted", f"stop after {who}: {why}", JobOutcome.FAILED, f"{why}; last fault: {said}")
    # The relaunched ranks found the version's bytes wrong as they read them (a digest
    # mismatch): the only cause that strikes a version; a load that failed for any other
    # reason (the store unreachable) says nothing of it.
    strike = job.loading_version if report.subclass == "checkpoint_integrity" else ""
    exclude = (report.worker_id,) if action == "exclude_node" and report.worker_id else ()
    text = f"{action} after {who} (restart {spent + 1} of {budget} for {fault_class})"
    if exclude:
        text += f"; excluding {report.worker_id}"
    if action == "rebuild":
        text += f"; survivors keep training, rank {report.rank} is replaced and heals from a live peer"
    if action == "shrink":
        text += (
            f"; survivors keep training, rank {report.rank} is replaced and heals from a live peer, "
            "or without a free slot the job goes on at a smaller data-parallel size"
        )
    text += fallback
    return Decision(
        fault_class,
        action,
        action,
        text,
        _VERDICTS[action],
        restart=spent + 1,
        budget=budget,
        # A step fault's step was not applied: a version of it cannot exist, so the bound only
        # says what a rollback says for any fault (nothing after the faulting step).
        bound=report.step if action == "rollback" and report.step else None,
        exclude=exclude,
        strike=strike,
    )


def standing_orders(policy: FaultPolicySpec) -> list[engine_pb2.StandingOrder]:
    """The verdicts L1-1 gives in advance with the job (InitJob.standing_orders): skip the
    step for every step fault class the policy maps to skip_step (e.g. the default for
    gradient_overflow: an fp16 overflow is what dynamic loss scaling expects). Ids 1, 2, ...
    in STEP_FAULT_CLASSES order, so every generation of ranks gets the same ids."""
    orders = []
    for fault_class in STEP_FAULT_CLASSES:
        if policy.step_action(fault_class) == "skip_step":
            orders.append(engine_pb2.StandingOrder(
                id=len(orders) + 1, kind=STEP_FAULT_KIND[fault_class], action=engine_pb2.STEP_SKIP,
            ))  # fmt: skip
    return orders
