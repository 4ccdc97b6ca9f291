"""L1-1's fault decision as a pure function: ``decide(policy, job, report) -> Decision``.

The orchestrator (the ``orchestrator`` package) does the I/O around it: it builds the job's view,
calls :func:`decide`, then journals the decision, counts it, and commands what it says
(a relaunch, a stop, a verdict to the ranks blocked on a step fault). Nothing here reads a
clock, a lock or a port, so the whole policy is table-tested without a bus
(``tests/control/test_fault_decision.py``), in the manner of torchft's ``quorum_compute``.

The policy (``fault_policy``, services/jobspec/fault_policy.py): an action per fault class, else per
grade, else the defaults; step faults by their class only (the loop reports them to L1-1
directly, ungraded). Every relaunch spends one restart of the class's budget; a spent budget
stops the job FAILED (running out of memory pauses it instead: ``MEMORY_CLASSES``); an
operator's stop in flight turns any decision into that stop. A relaunch that finds no
checkpoint to load is decided here too (:func:`no_checkpoint`).

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

A ``replica_divergence`` (data-parallel replicas found different by the replica check every
``integrity.replica_check_every_steps`` = N steps, issue 29 item 3) reported at step s says
that the check at the last multiple of N before s agreed and nothing since was right: a
rollback is bound to the newest version at or before it (:func:`replica_bound`). The same fault again before any
check agreed after the version the last recovery loaded (the first check after it failed)
says that version reproduces it: it is struck, and the rollback goes to an older one; each
relaunch spends a restart, so this never loops. With every rank alive and waiting in its
loop (the divergence fails none of them: they wait for the decision, issue 29 item 9) the
rollback is done in place: the live ranks load the version (``Decision.in_place``,
``JobView.no_reload``); otherwise every rank is relaunched to load it.

A slow rank (``slow_rank``, issue 29 item 2) is ignored by default (reported only);
``replace`` is a ``rebuild`` that leaves the slow rank's node out of the job (its
replacement goes to another node's free slot or a spare), ``shrink`` the same shrink, also
leaving that node out: a replacement on the node that made it slow would be slow again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.contract import control_pb2, engine_pb2, route_pb2
from services.jobspec import DATA_OUTAGE, IN_PLACE_ACTIONS, REBUILD_CLASSES, STEP_FAULT_CLASSES, FaultPolicySpec

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
REPLACE = "replace"  # slow_rank's rebuild, on another node (decided as "rebuild")
_VERDICTS = {
    "ignore": engine_pb2.STEP_APPLY,
    "skip_step": engine_pb2.STEP_SKIP,
    "stop": engine_pb2.STEP_STOP,
    "pause": engine_pb2.STEP_STOP,
    **{a: engine_pb2.STEP_RELAUNCH for a in RELAUNCHES},
}


# The classes L1-1 names itself when a step of a recovery waited as long as the policy allows
# (:func:`wait_seconds`); the policy decides on each (:func:`give_up`).
STORE_UNREACHABLE, NO_CAPACITY, RECOVERY_TIMEOUT = "store_unreachable", "no_capacity", "recovery_timeout"


# A worker's own fault (a FaultReport with no job): the classes that cordon it, taking it out
# of placement for every job (CordonWorker) until its node agent registers again. A device's
# uncorrectable ECC error or fatal Xid (issue 26: "an uncorrectable ECC error excludes the node").
CORDON_CLASSES = frozenset({"device_error"})
# Worker faults that hold the worker out of placement only while they last: the report with
# ``cleared`` ends the hold (a node agent silent past its beats, until it beats again).
HOLD_CLASSES = frozenset({"agent_silent"})

# Running out of memory (the OOM killer, a MemoryError): the same configuration on the same
# devices runs out again, so once the class's budget of relaunches as it was is spent (1 by
# default, jobspec DEFAULT_CLASS_RESTARTS) the job pauses, ranks gone and every checkpoint
# kept, for an operator to change it and resume: PAUSED, not FAILED.
MEMORY_CLASSES = frozenset({"rank_oom", "rank_memory_error"})
PAUSED_BY_POLICY = "paused: "  # how the job's message starts when the policy paused it
# What to do about a fault the policy paused on (``pause``), by class (else none).
PAUSE_HINTS = {
    "data_corrupt": "put the version's files back as prepared (or prepare a new version)",
}
MEMORY_HINT = (
    "lower data.micro_batch_size, or enable parallel.activation_checkpointing or parallel.data_parallel: fsdp2"
)
# A data service down (``data_outage``): the job waits for it (its ranks alive, reconnecting) up
# to ``fault_policy.data_outage_seconds`` (:func:`wait_seconds`), then this class is decided
# (:func:`give_up`; the ranks' own report once their reconnection is spent: :func:`decide`):
# pause by default, with this hint.
DATA_OUTAGE_HINT = "bring the data service back (`surgectl up` starts what is down, or `surgectl restart data`)"


@dataclass(frozen=True)
class JobView:
    """What the decision needs of the job (read-only)."""

    restarts: Mapping[str, int]  # fault class -> relaunches spent
    ignored: Mapping[str, int]  # fault class -> faults ignored so far
    stop_requested: bool = False  # an operator stop is in flight
    # The report's step is where the job stops training: "pause" (a pause's boundary), "drain"
    # (a drain's, its save in place of a paused step too), "paused" (paused there); "": it trains on.
    pausing: str = ""
    loading_version: str = ""  # the version the ranks of the recovery in flight load ("": none)
    # Why a rebuild in place cannot be done now ("": it can): the recovery in flight is a
    # rebuild that another fault interrupted, or no rank is running (paused, warming up).
    no_rebuild: str = ""
    # The replica check's period (integrity.replica_check_every_steps; 0: off), and the last
    # recovery's fault class and the version it loaded (its step): a replica_divergence that
    # comes back from it before a check agreed strikes it (module docstring).
    replica_check_every_steps: int = 0
    recovered_class: str = ""
    recovered_version: str = ""
    recovered_step: int = 0
    job_id: str = ""  # named in a pause's hint (`surgectl resume JOB`)
    # Whether a replica_divergence's rollback can load the version into the live ranks (issue 29
    # item 9: every rank waits in its loop, the group intact): "" it can, else why not (a rank
    # gone, a recovery in flight); None: not known (the rollback relaunches, as before).
    no_reload: str | None = None
    rank0_worker_id: str = ""  # where rank 0 runs ("": unknown): a cut link's tie (link_endpoint)


@dataclass(frozen=True)
class Decision:
    """One decision on one fault.

    ``action``: ignore | skip_step | skip_save | restart_ranks | rollback | exclude_node | stop (a spent
    budget or an operator's stop in flight is ``stop``) | pause (the policy's, e.g. data_corrupt's
    default, or a spent budget of a ``MEMORY_CLASSES`` class: ``final`` is the job's message,
    with the hint). ``counted``: the action as the
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
    in_place: bool = False  # rollback: the live ranks load the version (ResumeTraining.reload_version)
    spends: bool = True  # a relaunch counted against the class's budget (not: the store's outage)


# The typed causes of a store that could not be asked (services/rank/checkpoint_errors.py
# StoreUnavailable, a transfer cut): an outage, never a finding about a version's bytes.
STORE_OUTAGE_CAUSES = frozenset({route_pb2.FailureCause.FAILURE_UNAVAILABLE, route_pb2.FailureCause.FAILURE_TIMEOUT})


def load_outage(report: control_pb2.FaultReport) -> bool:
    """Whether ``report`` is a rank's checkpoint load the store did not answer (killed,
    restarting, stopped): ``checkpoint_error`` typed unavailable or timeout."""
    return report.fault_class == "checkpoint_error" and report.cause in STORE_OUTAGE_CAUSES


def fault_class_of(report: control_pb2.FaultReport) -> str:
    """The class the policy decides on: a clean exit of a rank that had not finished is a
    lost rank (the orchestrator filters out the finished ones first)."""
    return "rank_exit" if report.fault_class == "rank_exit_clean" else report.fault_class


def named(fault_class: str, report: control_pb2.FaultReport) -> str:
    """``fault_class`` as the operator reads it in events and status lines: with the report's
    typed ``subclass`` when that names a narrower cause than the class the report goes under
    (``worker_lost (agent_silent)``: a rank behind a silent node agent, where the line said
    ``worker_lost`` alone; ``checkpoint_error (checkpoint_integrity)``). Never from the detail."""
    sub = report.subclass
    return f"{fault_class} ({sub})" if sub and sub != fault_class else fault_class


def _step_fault(report: control_pb2.FaultReport) -> bool:
    """A step fault (the loop's report, ungraded) is decided by its class only."""
    return report.grade == FaultGrade.GRADE_UNSPECIFIED and fault_class_of(report) in STEP_FAULT_CLASSES


def action_of(policy: FaultPolicySpec, report: control_pb2.FaultReport) -> str:
    """The action ``policy`` names for ``report``: a step fault's by its class, any other's by
    its class, else its grade (before a budget or an operator's stop is considered: what
    :func:`decide` starts from)."""
    fault_class = fault_class_of(report)
    if _step_fault(report):
        return policy.step_action(fault_class)
    if fault_class == "slow_rank":
        # By its class only (ignore | replace | shrink): a grade's entry (``MINOR: stop``) never
        # fails a job that is only slower.
        return policy.step_action(fault_class)
    return policy.action_for(fault_class, FaultGrade.Name(report.grade))


REPLICA_DIVERGENCE = "replica_divergence"


def replica_bound(step: int, every: int) -> int:
    """The step of the last replica check that agreed, for a divergence found at ``step`` by
    checks every ``every`` steps: the last multiple of ``every`` before ``step`` (a check ran
    there, and one that disagreed would have been reported then; ``step`` itself may be the
    last step or an operator's checkpoint boundary, checked too). 0: none (the initial state)."""
    return (step - 1) // every * every if every > 0 and step > 0 else step


def replica_suspect(job: JobView, bound: int) -> str:
    """The version the last recovery loaded when it reproduced a replica divergence (no check
    agreed after it: ``bound``, the last agreeing check, is not after its step), else ""."""
    if job.recovered_class != REPLICA_DIVERGENCE or not job.recovered_version:
        return ""
    return job.recovered_version if bound <= job.recovered_step else ""


def decide(policy: FaultPolicySpec, job: JobView, report: control_pb2.FaultReport) -> Decision:
    """The decision on ``report`` (a new incident: consequences of one in flight are the
    orchestrator's to filter out first), by ``policy``, given ``job``."""
    fault_class = fault_class_of(report)
    grade = FaultGrade.Name(report.grade)
    step_fault = _step_fault(report)
    action = action_of(policy, report)
    who = f"{named(fault_class, report)} of rank {report.rank}" + (
        f" on {report.worker_id}" if report.worker_id else ""
    )
    if step_fault:
        who += f" at step {report.step}"
    said = f"{grade + ' ' if not step_fault else ''}{named(fault_class, report)}: {report.detail}"

    def stop(counted: str, text: str, outcome: int, final: str) -> Decision:
        return Decision(fault_class, "stop", counted, text, engine_pb2.STEP_STOP, outcome=outcome, final=final)

    if job.stop_requested and action not in ("ignore", "skip_step", "skip_save"):
        # (an ignored fault or a skipped step changes nothing: the operator's stop goes on)
        return stop(
            "stop",
            f"stop after {who}: a stop was already requested",
            JobOutcome.STOPPED,
            f"stopped by the operator; then {said}",
        )
    if load_outage(report):
        # The store's outage under a load (a resume's, an `up`'s, a rollback in place's): not
        # the job's fault, so not its policy's nor its budget's. Every rank is relaunched to
        # load the version once the store answers: the recovery's verification waits for it
        # (store_wait_seconds, then store_unreachable decides). (During a recovery's own
        # relaunch the orchestrator waits without a new decision: triage's STORE_WAIT.)
        return Decision(
            fault_class, "restart_ranks", "restart_ranks",
            f"restart_ranks after {who}: the store did not answer the checkpoint's load (its outage, not the "
            "job's fault): every rank is relaunched to load it once the store answers (waited for up to "
            "fault_policy.store_wait_seconds); no restart spent",
            _VERDICTS["restart_ranks"], spends=False,
        )  # fmt: skip
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
    if action == "skip_save":
        # The ranks trained on (their save was lost where it was refused): nothing to command.
        saved = f"the save of step {report.step}" if report.step else "the save"
        at = f"step {report.step}" if report.step else "its step"
        then = {  # (a paused job trains on no more: "training continues" was said of a drain's save, F1)
            "pause": f"the pause goes on without it (the ranks pause at {at} with no checkpoint of it)",
            "drain": f"the drain's pause goes on without it: not drained, the ranks stay paused at {at}",
            "paused": f"the job stays paused at {at} with no checkpoint of it",
        }.get(job.pausing, "training continues, the next interval tries again")
        then = "the stop goes on without it" if job.stop_requested else then
        return Decision(
            fault_class,
            "skip_save",
            "skip_save",
            f"skip {saved} after {who}: fault policy; {then}",
            engine_pb2.STEP_APPLY,
        )
    if action == "stop":
        return stop("stop", f"stop after {who}: fault policy", JobOutcome.FAILED, said)
    if action == "pause":  # (PAUSE_CLASSES: a data service down past the wait, a shard changed)
        why = said if fault_class == DATA_OUTAGE else f"{fault_class}: {report.detail}"  # (the shard, as found)
        return _paused(fault_class, f"pause after {who}: fault policy", why, job.job_id)
    asked = action
    if action == REPLACE:
        action = "rebuild"
    assert action in RELAUNCHES, action
    fallback = ""
    if action in IN_PLACE_ACTIONS and (job.no_rebuild or fault_class not in REBUILD_CLASSES):
        # The survivors cannot rebuild: the old path (every rank from the newest checkpoint).
        fallback = f"; restart_ranks instead of {action}: {job.no_rebuild or f'{fault_class} is not a lost rank'}"
        action = "restart_ranks"
    spent, budget = job.restarts.get(fault_class, 0), policy.budget_for(fault_class)
    if spent >= budget and fault_class in MEMORY_CLASSES:
        why = f"out of memory again with the same configuration ({spent} of {budget} relaunches used)"
        return Decision(
            fault_class, "pause", "pause", f"pause after {who}: {why}; {MEMORY_HINT}", engine_pb2.STEP_STOP,
            final=f"{PAUSED_BY_POLICY}{fault_class} again with the same configuration; {MEMORY_HINT}",
        )  # fmt: skip
    if spent >= budget:
        why = f"restart budget for {fault_class} exhausted ({spent} of {budget} used)"
        return stop("budget_exhausted", f"stop after {who}: {why}", JobOutcome.FAILED, f"{why}; last fault: {said}")
    # The relaunched ranks found the version's bytes wrong as they read them (a digest
    # mismatch): the only cause that strikes a version; a load that failed for any other
    # reason (the store unreachable) says nothing of it.
    strike = job.loading_version if report.subclass == "checkpoint_integrity" else ""
    # A step fault's step was not applied: a version of it cannot exist, so the bound only
    # says what a rollback says for any fault (nothing after the faulting step).
    bound = report.step if action == "rollback" and report.step else None
    if fault_class == REPLICA_DIVERGENCE:
        bound = replica_bound(report.step, job.replica_check_every_steps) if action == "rollback" else None
        strike = strike or replica_suspect(job, replica_bound(report.step, job.replica_check_every_steps))
    # A slow rank is replaced off its node (a replacement there would be as slow).
    leave_out = action == "exclude_node" or (fault_class == "slow_rank" and asked in (REPLACE, "shrink"))
    left_out = link_endpoint(report, job.rank0_worker_id) if fault_class == LINK_DOWN else report.worker_id
    exclude = (left_out,) if leave_out and left_out else ()
    text = f"{asked if asked == REPLACE else action} after {who} (restart {spent + 1} of {budget} for {fault_class})"
    if exclude:
        text += f"; excluding {left_out}"
        if fault_class == LINK_DOWN:
            text += " (" + _link_text(report, left_out) + ")"
    if action == "rebuild":
        text += f"; survivors keep training, rank {report.rank} is replaced and heals from a live peer"
    if action == "shrink":
        text += (
            f"; survivors keep training, rank {report.rank} is replaced and heals from a live peer, "
            "or without a free slot the job goes on at a smaller data-parallel size"
        )
    if bound is not None and fault_class == REPLICA_DIVERGENCE:
        text += f"; back to a version at or before step {bound}, the last replica check that agreed"
    if strike and fault_class == REPLICA_DIVERGENCE:
        text += f"; {strike} reproduced the divergence: suspect, never loaded again"
    in_place = action == "rollback" and fault_class == REPLICA_DIVERGENCE and job.no_reload == ""
    if in_place:
        text += "; in place: the live ranks load it, none is relaunched"
    elif action == "rollback" and fault_class == REPLICA_DIVERGENCE and job.no_reload:
        text += f"; every rank relaunched, not loaded in place: {job.no_reload}"
    text += fallback
    return Decision(
        fault_class,
        action,
        action,
        text,
        _VERDICTS[action],
        restart=spent + 1,
        budget=budget,
        bound=bound,
        exclude=exclude,
        strike=strike,
        in_place=in_place,
    )


# The decisions a freeze holds (``fault_policy.freeze_seconds``, issue 29 item 9): every
# recovery that relaunches a rank, one rule for all. A relaunch of every rank ends the
# processes an operator would want to inspect; a rebuild or shrink in place ends the lost
# ranks (a slow rank being replaced is alive until then: the one most worth a py-spy dump) and
# its survivors' broken group is the state to look at before the rebuild replaces it. A stop,
# a pause or an ignore is not held (see :func:`freeze_for`).
FREEZE_ACTIONS = RELAUNCHES


def freeze_for(policy: FaultPolicySpec, decision: Decision, *, recovering: bool) -> float:
    """How long L1-1 holds the job's ranks alive and idle (FreezeTraining) before it carries
    out ``decision`` (seconds; 0: at once). ``recovering``: a recovery was already in flight
    when the fault came (its ranks are being replaced: nothing of the failed generation is
    left to inspect, and a second hold would only delay it)."""
    if recovering or decision.action not in FREEZE_ACTIONS:
        return 0.0
    return policy.freezes(decision.fault_class)


LINK_DOWN = "link_down"


def link_endpoint(report: control_pb2.FaultReport, rank0_worker_id: str = "") -> str:
    """Which node of a cut link (``report.link_ends``) a relaunch leaves out: the one with
    more links down (the likelier broken one: its cable, its NIC, its switch port), on a tie
    the one not hosting rank 0 (the rendezvous and the job's step summaries stay where they
    are), then the larger worker id (a fixed order). "" when the report names no link."""
    ends = list(report.link_ends)
    if not ends:
        return ""
    best = max(ends, key=lambda e: (e.links_down, e.worker_id != rank0_worker_id, e.worker_id))
    return best.worker_id


def _link_text(report: control_pb2.FaultReport, left_out: str) -> str:
    ends = {e.worker_id: e.links_down for e in report.link_ends}
    kept = [w for w in ends if w != left_out]
    if kept and ends[left_out] > ends[kept[0]]:
        return f"link to {kept[0]} cut; {left_out} has {ends[left_out]} links down, {kept[0]} {ends[kept[0]]}"
    return f"link to {kept[0] if kept else '?'} cut; a tie, {left_out} does not host rank 0"


def no_checkpoint(policy: FaultPolicySpec, fault_class: str, rank: int, versions: int) -> Decision:
    """The decision when the relaunch of an incident (``fault_class`` of ``rank``) finds no
    committed version that verifies; ``versions``: how many the job committed (0: none yet,
    else every one is struck). By ``policy.no_checkpoint``: ``restart_from_scratch`` (the
    ranks start again from step 0; the incident's restart was spent when it was decided) or
    ``stop`` (FAILED; what the store holds is kept for an operator)."""
    had = f"none of its {versions} committed checkpoints verifies" if versions else "no checkpoint was committed yet"
    who = f"{fault_class} of rank {rank}"
    if policy.no_checkpoint == "stop":
        text = f"stop after {who}: {had} (fault policy no_checkpoint: stop)"
        return Decision(
            fault_class, "stop", "stop", text, engine_pb2.STEP_STOP, outcome=JobOutcome.FAILED,
            # (none committed: nothing to keep, and nothing for `surgectl resume` to load)
            final=f"{had}; not restarted from scratch (no_checkpoint: stop)"
            + ("; every checkpoint is kept" if versions else ""),
        )  # fmt: skip
    text = f"restart from scratch after {who}: {had} (fault policy no_checkpoint: restart_from_scratch)"
    return Decision(fault_class, "restart_from_scratch", "restart_from_scratch", text, engine_pb2.STEP_RELAUNCH)


def wait_seconds(policy: FaultPolicySpec, fault_class: str, *, in_place: bool = False) -> float:
    """How long a recovery step waits before ``policy`` decides on ``fault_class``: the store
    to answer (``store_unreachable``), a free slot (``no_capacity``), every relaunched rank
    ready (``recovery_timeout``; a rebuild in place, ``in_place``, has its own bound)."""
    if fault_class == STORE_UNREACHABLE:
        return policy.store_wait_seconds
    if fault_class == NO_CAPACITY:
        return policy.capacity_wait_seconds
    if fault_class == DATA_OUTAGE:
        return policy.data_outage_seconds
    assert fault_class == RECOVERY_TIMEOUT, fault_class
    return policy.rebuild_seconds if in_place else policy.restore_seconds


def give_up(policy: FaultPolicySpec, fault_class: str, why: str, job_id: str = "") -> Decision:
    """The decision when a recovery step waited as long as ``policy`` allows (``fault_class``:
    ``store_unreachable``, ``no_capacity`` or ``recovery_timeout``, decided as SEVERE; ``why``:
    what it waited for and how long). ``stop`` ends the job FAILED with every version kept;
    any other action lets the recovery go on (the orchestrator says how)."""
    action = policy.action_for(fault_class, "SEVERE")
    text = f"{action} after {fault_class}: {why} (fault policy)"
    if action == "pause":
        return _paused(fault_class, text, why, job_id)
    if action == "stop":
        return Decision(
            fault_class, "stop", "stop", text, engine_pb2.STEP_STOP, outcome=JobOutcome.FAILED,
            final=f"{why}; every checkpoint is kept",
        )  # fmt: skip
    return Decision(fault_class, action, action, text, _VERDICTS[action])


def _paused(fault_class: str, text: str, why: str, job_id: str) -> Decision:
    """The policy's ``pause`` (PAUSE_CLASSES): the job PAUSED, ranks gone and every checkpoint
    kept; ``final`` (the job's one-line message) says why and what brings it back."""
    hint = DATA_OUTAGE_HINT if fault_class == DATA_OUTAGE else PAUSE_HINTS.get(fault_class, "")
    resume = f"`surgectl resume {job_id or 'JOB'}` continues it from its newest checkpoint"
    return Decision(
        fault_class, "pause", "pause", text + (f"; {hint}" if hint else ""), engine_pb2.STEP_STOP,
        final=f"{PAUSED_BY_POLICY}{why}; {hint + ', then ' if hint else ''}{resume}",
    )  # fmt: skip


def launch_policy(policy: FaultPolicySpec) -> dict:
    """What a job's ranks are told of its fault policy as they launch (``InitJob``'s fields):
    its standing orders (``standing_orders``), whether a fault may be rebuilt in place (its
    survivors keep their processes) and whether a fault holds the ranks first
    (``freeze_seconds``). One lookup for every launch: a submit's, an operator resume's, a
    restarted control's adoption (each read the policy itself before)."""
    return {
        "standing_orders": standing_orders(policy),
        "rebuild_in_place": policy.rebuilds,
        "hold_on_fault": policy.freeze_seconds > 0,
    }


def order_name(policy: FaultPolicySpec, order: int) -> str:
    """``order`` (a StandingOrder id) as an operator reads it: ``2 (skip_step for
    non_finite_loss)``; the id alone when the policy holds no such order."""
    for o in standing_orders(policy):
        if o.id == order:
            return f"{order} (skip_step for {STEP_FAULT_CLASS[o.kind]})"
    return str(order)


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
