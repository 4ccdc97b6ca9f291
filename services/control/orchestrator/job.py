"""A job's record (``_Job``), the records of its one activity in flight (``_Incident``: a
recovery, ``_Scale``: a resize, ``_Reload``: a rollback in place, ``_Resume``: an operator
resume; admitted by activity.py) and the state machine's legal transitions. The job's
journal form (``_runtime`` / ``_load_runtime``) is job_journal.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.common.deadlines import Deadline
from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.job_queue import QueueEntry
from services.jobspec import (
    JobSpec,
)

JobState = control_pb2.JobState


JobOutcome = control_pb2.JobOutcome


FaultGrade = control_pb2.FaultGrade


ORCH = Module.L1_ORCHESTRATOR


# JobQuery payload asking for the job's event log (as a reply payload: tuple of JobEvent).
EVENT_LOG = "event_log"


RESTART_MESSAGE = "control restarted; ranks not re-attached"


# A job that was mid-recovery when control restarted resumes that recovery.
RESUME_MESSAGE = "control restarted mid-recovery; resuming it"


# A job live when control restarted keeps its state: its node agents re-attach its ranks.
REATTACH_MESSAGE = "control restarted; waiting for the ranks to re-attach"


# ... and once an event of every rank arrived after the restart (replaces REATTACH_MESSAGE).
REATTACHED_MESSAGE = "control restarted; every rank re-attached"


_ALLOWED: dict[int, frozenset[int]] = {
    JobState.STANDBY: frozenset({JobState.WARMING_UP, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    # WARMING_UP -> PAUSED: its start waited past fault_policy.data_outage_seconds for the data
    # service, or the policy paused on a fault of a rank still starting (a dataset shard changed,
    # found as the resumed ranks' streams open it; out of memory in the first step).
    JobState.WARMING_UP: frozenset({JobState.RUNNING, JobState.PAUSED, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.FAULT_FROZEN: frozenset(
        {JobState.RUNNING, JobState.PAUSED, JobState.TERMINATED}
    ),  # PAUSED: recovered, paused before
    JobState.TERMINATED: frozenset(),
}


# The steps of a recovery (``_Incident.phase``), in order. Each is a command out and the
# event that answers it; the wait states retry their step with backoff until the fault
# policy's deadline for them, after which the policy decides.
VERIFYING = "verifying"  # VerifyCheckpoints sent; CheckpointVerification / SnapshotFailed answers


WAITING_STORE = "waiting_store"  # the store could not be asked (unreachable, timeout): retry


PLACING = "placing"  # StartRecovery sent (answered at once by L1-4)


WAITING_CAPACITY = "waiting_capacity"  # not enough free slots: retry as workers come


RESTORING = "restoring"  # ranks relaunched; waiting for every one to report ready


# Before the first step: the ranks are held alive and idle for inspection (FreezeTraining,
# fault_policy.freeze_seconds) until the hold runs out or the operator thaws the job.
FROZEN = "frozen"


# Backoff of a retried step: doubles from the first, capped (seconds).
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 4.0


# Classes the orchestrator names itself when a recovery step gives up (fault policy keys,
# services/control/fault_decision.py: ``wait_seconds`` says how long each step waits).
STORE_UNREACHABLE, NO_CAPACITY, RECOVERY_TIMEOUT = fd.STORE_UNREACHABLE, fd.NO_CAPACITY, fd.RECOVERY_TIMEOUT


StoreFailureCause = store_pb2.StoreFailureCause


RecoveryFailureCause = control_pb2.RecoveryFailureCause


@dataclass
class _Incident:
    """A fault being recovered from: its cause, and the ranks of failed generations whose
    exit has not been seen yet (rank -> exits still to come)."""

    cause: control_pb2.FaultReport
    fault_class: str
    action: str
    decided: float  # time.monotonic() of the decision
    dying: Counter[int] = field(default_factory=Counter)
    version: str = ""
    bound: int | None = None  # rollback: no version after this step
    exclude: list[str] = field(default_factory=list)  # exclude_node: the worker(s) left out
    relaunched: bool = False  # RecoveryCompleted applied (journaled with its event)
    # Restored from the journal after a control restart: whether the relaunch reached the
    # node agents is unknown until a relaunched rank reports ready (``relaunched`` or not:
    # a journaled relaunch was only queued to the sessions when control died).
    resumed: bool = False
    # When that relaunch was commanded again (unix time): reports graded before it are
    # about the ranks it replaced, already accounted for.
    repeated_unix: float = 0.0
    phase: str = VERIFYING  # the recovery step in flight (journaled)
    waiting_for: str = ""  # the wait state the step is in (kept across its retries)
    waiting_since: float = 0.0  # time.monotonic() that wait began
    asked_since: float = 0.0  # time.monotonic() the store was first asked (a wait counts from it)
    retries: int = 0  # retries of the current step
    timer: Deadline | None = None  # the current step's retry or deadline (not journaled)
    paused: bool = False  # the job was paused (or pausing) when the fault came
    # Bytes the relaunched ranks read per source ("memory", "peer", "store": their
    # TrainingLoopStarted.restored_bytes_from, summed; not journaled).
    restored_from: Counter[str] = field(default_factory=Counter)
    # rebuild (issue 16): the ranks replaced (the others survive and rebuild their group in
    # place), and the rank each ready rank's state came from (TrainingLoopStarted; not journaled).
    lost: list[int] = field(default_factory=list)
    healed_from: dict[int, int] = field(default_factory=dict)
    recovered_unix: float = 0.0  # when every rank was ready again (not journaled)
    at_step: int = 0  # the job's last completed step when it was decided (not journaled)
    started_at: int = 0  # the step its recovered ranks started at (not journaled)
    # shrink (issue 16): the job at the smaller data-parallel size its ranks go on at, once no
    # slot was free for a replacement (journaled as the layout's three numbers).
    shrunk: JobSpec | None = None
    # Held for inspection (phase FROZEN): until when (unix time; journaled, a restarted control
    # keeps the hold), and the verdict the ranks blocked on a step fault get when it ends.
    frozen_until: float = 0.0
    verdict: engine_pb2.StepVerdict | None = None
    # A rollback done in place (issue 29 item 9, ``Decision.in_place``): the live ranks load the
    # version (ResumeTraining.reload_version) instead of a relaunch (journaled).
    reload: bool = False
    # A rebuild in place: the workers its replacements were launched on (RecoveryCompleted;
    # not journaled: a restored recovery is relaunched whole). A replacement waited for on a
    # worker lost or gone silent is re-placed (replacement_nodes.py).
    placed_on: list[str] = field(default_factory=list)


@dataclass
class _HeldFailure:
    """A save or load broken in its collectives, waiting for the fault that caused it
    (``Orchestrator._broken_by_peer``; not journaled: a control restarted meanwhile loses
    the record, not a decision)."""

    msg: store_pb2.SnapshotFailed
    what: str
    timer: Deadline | None = None


@dataclass
class _Scale:
    """A resize of a running job in flight (issue 16: `surgectl scale`, or growing back after
    a shrink): its ranks pause at a common step boundary, then the kept ones rebuild their
    group at the new size with the new ranks, which heal from a live peer."""

    spec: JobSpec  # the job at the new layout
    why: str  # "scale by the operator", "grow back": said in the events
    phase: str = "pausing"  # pausing (PauseTraining sent) | rebuilding (RebuildCommunicator done)
    old_dp: int = 0
    since: float = 0.0  # time.monotonic() it was asked
    healed_from: dict[int, int] = field(default_factory=dict)  # rank -> source (TrainingLoopStarted)


@dataclass
class _Reload:
    """A rollback in place in flight (issue 29 item 9, `surgectl rollback`): the ranks pause at
    a common boundary (``pausing``), then load ``version`` into their live processes
    (``loading``: ResumeTraining.reload_version) and report ready at its ``step``."""

    version: str
    step: int
    phase: str = "pausing"  # pausing | loading
    since: float = 0.0  # time.monotonic() it was asked (not journaled)
    asked_unix: float = 0.0  # time.time() it was asked (journaled: an ask folded into it says when)


@dataclass
class _Recovered:
    """A recovery done, awaiting the group's first step (its record, and the recovery's time
    observed: ``on_step_completed``): the incident's last phase, in the slot. Idle to every
    admission (``activity.admit``): anything asked meanwhile starts, and drops it. Not
    journaled (a restarted control waits for no first step)."""

    incident: _Incident


@dataclass
class _Resume:
    """An operator resume asking the store for the job's versions (outside the lock; not
    journaled: nothing has changed until its answer is applied)."""

    since: float = 0.0  # time.monotonic() it was asked
    phase: str = "asking"  # resume_machine.py: asking, placing, queued, relaunched
    step: int = 0  # the version it loads (chosen once the versions are known) and its step
    version: str = ""


@dataclass
class _Job:
    status: control_pb2.JobStatus
    spec: JobSpec
    seq: int = 0  # last event seq written
    # The submit that created it (journaled in the job's row, never changed): its request id
    # ("" none) and its spec text's sha256. A submit retried with that id gets this job.
    request_id: str = ""
    spec_sha256: str = ""
    started: set[int] = field(default_factory=set)  # ranks that reported started
    paused: set[int] = field(default_factory=set)
    finished: dict[int, bool] = field(default_factory=dict)  # rank -> stopped
    # The operator's pause or stop in flight ("pause" | "stop"; ``pending`` also names a
    # resize's or a rollback's pause, which its activity holds).
    boundary: str = ""
    # The boundary of the pause / stop in flight: 0 until the ranks report the step they
    # agreed on (StepCompleted.commands_agreed covers ``pending_seq``, or their pause / end).
    pending_at: int = 0
    pending_seq: int = 0  # its boundary command sequence number (journaled)
    # The job's last boundary command sequence number (PauseTraining / StopTraining /
    # RevokeStandingOrder .seq: 1, 2, ... without a gap; journaled before the command goes),
    # and the commands sent that the ranks have not yet been seen to agree on (seq -> the
    # command; journaled: a restarted control sends them again, ``_send_again``).
    commands: int = 0
    in_flight: dict[int, Any] = field(default_factory=dict)
    running_since: float = 0.0  # unix time RUNNING was first entered
    last_persist: float = 0.0
    exited: set[int] = field(default_factory=set)  # ranks of this generation seen ended
    # The one activity in flight (issue 28 item 1): a recovery, a resize, a rollback in place
    # or an operator resume asking the store; what a second one gets is ``activity.admit``'s
    # to say. Journaled as its kind (``_runtime``), except a resume (it asks, nothing changed).
    # A recovery done and awaiting its first step is in the slot too (``_Recovered``: idle).
    activity: _Incident | _Scale | _Reload | _Resume | _Recovered | None = None
    # The last incident once recovered: a symptom of it that reaches control late (the fault
    # detector holds a comm_error to attribute it; a rank of the relaunched generation reported
    # its failed collective as it was killed) is no new fault.
    last_incident: _Incident | None = None
    held: list[_HeldFailure] = field(default_factory=list)  # failures waiting for their cause
    restarts: Counter[str] = field(default_factory=Counter)  # fault class -> relaunches spent
    ignored: Counter[str] = field(default_factory=Counter)  # fault class -> faults ignored
    versions: list[tuple[int, str]] = field(default_factory=list)  # (step, version) committed
    unusable: set[str] = field(default_factory=set)  # versions that failed verification
    excluded: set[str] = field(default_factory=set)  # workers left out by exclude_node decisions
    placement: dict[int, str] = field(default_factory=dict)  # rank -> worker it reported ready on
    # rank -> the worker a launch (a submit's, a resume's) put it on (ResourcesReady.rank_worker_ids),
    # until every rank reported ready (then ``placement`` says it): journaled, so that a control
    # restart during WARMING_UP names the worker of a rank never re-attached (session 34's trial:
    # "rank 0 on worker  sent no heartbeat"). Apart from ``placement``: a rank launched is not yet
    # one that runs there for a drain, a preemption or a rebuild.
    launched: dict[int, str] = field(default_factory=dict)
    # rank -> the generation of its newest launch (ResourcesReady / RecoveryCompleted
    # .rank_generation), journaled: after a control restart an older incarnation's end that
    # comes up before the newer one's agent re-registers is still known replaced (triage STALE).
    generations: dict[int, int] = field(default_factory=dict)
    start_held: bool = False  # recovered while paused: the ready ranks wait for StartTraining
    boundary_failed: bool = False  # the checkpoint of the pause/stop boundary in flight could not be saved
    # Versions committed after the one an operator resume went back to: another branch of
    # the job's history, never chosen by a recovery or a plain resume (only by name).
    abandoned: set[str] = field(default_factory=set)
    step_seconds: float = 0.0  # rank 0's recent step time (from its StepCompleted times; not journaled)
    last_step_unix: tuple[int, float] = (0, 0.0)  # (step, unix_time) of the last one applied
    # JobStatus.tokens_per_second, the one definition `surgectl status` and the end-of-run
    # summary both show: tokens / step seconds summed over the job's steps, the first one
    # (compilation, warm-up) and the first after a control restart left out; journaled
    # (fresh37b: after `down` / `up` it covered the steps since the resume only).
    # The third term, sum of each step's MFU x its seconds, gives JobStatus.mfu over the
    # same steps (MFU and tokens/s shown side by side describe one window).
    throughput: tuple[int, float, float] = (0, 0.0, 0.0)
    throughput_warm: bool = False  # the first step was seen (and left out)
    # Operator actions (issue 12 part 7). ``draining``: the pause in flight is a drain
    # (`surgectl down`); ``parked``: PAUSED and its ranks are gone (drained, or stopped with
    # the stack): not waited for after a control restart, and a resume relaunches them from
    # a checkpoint (an operator resume asking the store is the job's activity, ``_Resume``).
    draining: bool = False
    # A node of the job's leaves with notice (departure.py): the worker id whose departure the
    # pause in flight checkpoints for; once every rank paused the ranks are relaunched without
    # it. Not journaled: a restarted control's agents say their departure again.
    departure: str = ""
    # The job's last measured save (seconds from its step's report to the commit; 0: none yet):
    # what a departure's deadline is weighed against (not journaled).
    save_seconds: float = 0.0
    # When its last resize began (unix time; 0: none): a job grows back at most once per
    # resize_min_interval_s (grow_rule.py). Journaled: a control restarted right after a resize
    # does not let it resize again before its interval ends.
    last_resize: float = 0.0
    placed_on: list[str] = field(default_factory=list)  # the workers its last relaunch was allocated on
    parked: bool = False
    # Parked by a drain in this control's lifetime: its paused ranks still run until the stack
    # stops (a `surgectl down` interrupted before it did); a resume then continues them in
    # place. Not journaled: a restarted control's parked jobs have no ranks.
    parked_live: bool = False
    # A resume asked while the ranks pause (an interrupted `down`'s drain, a pause just sent):
    # they continue once every rank has paused (journaled).
    resume_after_pause: bool = False
    # The pause in flight (or done) is the drain's own, not the operator's (``draining`` or
    # ``status.drained`` with it): a fault's recovery ends the drain and does not keep its pause
    # (a fresh user's trial: a rank killed during `down`'s drain left the recovered job PAUSED,
    # not drained, resumed by nothing). False where the drain took over the operator's pause.
    # Journaled.
    drain_own_pause: bool = False
    # The step a drain's pause stopped at without its checkpoint (the store away: not parked,
    # `surgectl down` refused; 0: none). The pause is the drain's, not the operator's: the next
    # drain of it, checkpointing again, is a drain `up` resumes (a fresh operator's trial: it
    # became the operator's pause, left PAUSED by `up`). Keyed by the step, so a later pause
    # of the job (another step) is not taken for it. Journaled (a control restart between the
    # two `down`s keeps it).
    drain_unsaved_step: int = 0
    # The step a drain's paused ranks save in place (``_drain_unsaved_pause``; 0: the drain
    # pauses at the next boundary): shown while ``draining`` (JobStatus.draining_step). Journaled.
    drain_save_step: int = 0
    # Queued, having preempted others (preemption.py): the unix time its claim on the slots its
    # victims free ends (teams.py ``_claims``; 0: none set). Until then it is first in line for
    # them; after, it waits at its place in the fair order (a victim that never frees its slots
    # held them for it, and every job of its kind behind it, forever). Journaled.
    claim_until: float = 0.0
    # A resume that did not fit, waiting in the queue: {"version", "step", "spec" (a new
    # layout's spec JSON, "" for the job's own)} it relaunches from once placed (journaled).
    relaunch: dict | None = None
    # (step, StepFaultKind) -> the verdict (apply or skip) sent to the job's ranks blocked on
    # that step fault: one decision per fault whichever rank reports it first; sent again to a
    # rank that asks again (its reminder: the verdict may have been lost). Journaled with the
    # decision, so a restarted control answers a reminder with it instead of deciding again
    # (an ignore counted twice). Only the current step's are kept: every rank reporting a fault
    # at step s passed L3-5's all-reduce of s, so none still waits on an earlier verdict.
    verdicts: dict[tuple[int, int], engine_pb2.StepVerdict] = field(default_factory=dict)
    # StandingOrder.id -> (its RevokeStandingOrder's sequence number, the step after which this
    # generation's ranks no longer follow it: 0 until they report the boundary they agreed
    # on); kept through a rebuild or a reload in place (the ranks keep their processes), cleared
    # where every rank is relaunched: that generation gets the policy's orders again.
    revoked: dict[int, tuple[int, int]] = field(default_factory=dict)
    queued: QueueEntry | None = None  # its place while it waits in the queue (journaled)
    # The layout (dp, micro_batch_size, grad_accum) a job shrunk by a fault grows back to as
    # slots return (empty: none; journaled). An operator's scale sets the size: it is forgotten.
    grow_to: tuple[int, ...] = ()
    # The largest micro-batch its ranks ran with (journaled): a resize picks none larger, and
    # scaling back returns to it (was: each resize could only shrink it: 6 -> 4 -> 3 -> 2).
    micro_batch_cap_seen: int = 0
    # A data service its ranks cannot reach (faults.py ``_data_outage``): the ranks whose
    # relays reconnect, since when (time.monotonic()), and the policy's deadline for the wait.
    # Not journaled: after a control restart a relay still reconnecting is bounded by its own
    # budget (data_outage_seconds and a margin), whose report is decided as data_outage.
    data_waiting: set[int] = field(default_factory=set)
    data_since: float = 0.0
    data_timer: Deadline | None = None

    # The activity in flight by kind (None when it is another kind or none): read-only, the
    # slot is set and cleared through ``activity.begin`` / ``activity.end``.
    @property
    def incident(self) -> _Incident | None:
        """The recovery in progress."""
        return self.activity if isinstance(self.activity, _Incident) else None

    @property
    def scale(self) -> _Scale | None:
        """The resize in flight."""
        return self.activity if isinstance(self.activity, _Scale) else None

    @property
    def reload(self) -> _Reload | None:
        """The rollback in place in flight."""
        return self.activity if isinstance(self.activity, _Reload) else None

    @property
    def pending(self) -> str:
        """The boundary command in flight: the operator's pause or stop (``boundary``), or the
        pause of the resize ("scale") or rollback ("reload") in flight, which their activity
        holds (its phase "pausing": it moves on once every rank paused; a recovery that
        supersedes it, or the job's end, clears the slot and so this)."""
        if self.boundary:
            return self.boundary
        if isinstance(self.activity, _Scale | _Reload) and self.activity.phase == "pausing":
            return "scale" if isinstance(self.activity, _Scale) else "reload"
        return ""

    @pending.setter
    def pending(self, value: str) -> None:
        """The operator's pause or stop in flight ("": none); a resize's or a rollback's pause is
        its activity's (``activity.begin``, its machine's phases), never set here."""
        if value not in ("", "pause", "stop"):
            raise ValueError(f"pending {value!r}: only a pause or a stop is set here (a resize's is its activity's)")
        self.boundary = value

    @property
    def recovered(self) -> _Incident | None:
        """The incident recovered from, awaiting the group's first step (``_Recovered``)."""
        return self.activity.incident if isinstance(self.activity, _Recovered) else None

    @property
    def resuming(self) -> bool:
        """An operator resume is asking the store."""
        return isinstance(self.activity, _Resume)

    @property
    def micro_batch_cap(self) -> int:
        return max(self.micro_batch_cap_seen, self.spec.data.micro_batch_size)


def launched_on(reply: control_pb2.ResourcesReady | control_pb2.RecoveryCompleted, job: _Job) -> dict[int, str]:
    """rank -> the worker the allocator launched it on (``{}`` from an allocator that does not
    say); notes the launched ranks' generation in ``job.generations`` (every rank of a launch,
    a rebuild's replacements only)."""
    if reply.rank_generation:
        for r in reply.replaced_ranks or range(len(reply.rank_worker_ids) or reply.world_size):
            job.generations[r] = max(job.generations.get(r, 0), reply.rank_generation)
    return {r: w for r, w in enumerate(reply.rank_worker_ids) if w}


def _numbered(job: _Job, cmd: Any) -> Any:
    """``cmd`` (a boundary command) for the job's ranks with the job's next number, kept in
    flight until the ranks are seen to agree on it."""
    job.commands += 1
    cmd.job_id, cmd.seq = job.status.job_id, job.commands
    job.in_flight[cmd.seq] = cmd
    return cmd


def _where(job: _Job) -> str:
    """Where the pause / stop in flight takes effect, as the events say it."""
    if job.pending_at:
        return f"after step {job.pending_at}"
    return f"at the next step boundary every rank agrees on (command #{job.pending_seq} to the ranks)"


def _rebuilding(scale: _Scale | None) -> bool:
    """Whether a resize's ranks are rebuilding their group (they report ready next)."""
    return scale is not None and scale.phase == "rebuilding"


def checkpoint_step(job: _Job) -> int:
    """The step of the job's newest committed checkpoint (0: none): ``JobStatus.checkpoint_step``."""
    return next((st for st, v in job.versions if v == job.status.checkpoint_version), 0)


def withdrawn(job: _Job) -> list[int]:
    """The standing orders (StandingOrder.id) the job's live ranks agreed to withdraw (an
    operator's revoke whose boundary passed): a rank launched beside them (a rebuild's
    replacement, a grown rank) is launched without them. One still in flight is not among
    them: it is sent again to every rank of the rebuilt group, the new one included."""
    return sorted(order for order, (_, step) in job.revoked.items() if step)
