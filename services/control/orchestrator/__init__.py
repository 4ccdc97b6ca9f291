"""L1-1 orchestrator: the only decision maker for start, pause, resume, stop and failure.

Seed 000 L1-1. It owns each job's state machine and publishes what it decides as
``JobEvent`` (one per decision or state change, journaled in SQLite) and ``JobStatus``
snapshots. It never touches tensors, data or devices, and never polls: everything it knows
arrives as an event (rank events relayed from the node agents, fault reports, replies).

    STANDBY (queued) -> WARMING_UP -> RUNNING <-> PAUSED
    any non-terminal -> FAULT_FROZEN (recovering) -> RUNNING | TERMINATED
    any non-terminal -> TERMINATED  (outcome FINISHED | STOPPED | FAILED)
    TERMINATED (STOPPED | FAILED), PAUSED (ranks gone) -> WARMING_UP  (operator resume only)

Pause, stop, scale and a revoke take effect at a step boundary the ranks agree on, so that
every rank stops at the same step and no rank waits in a collective for a paused peer: each
carries the job's next boundary command number (journaled before it goes, sent again with
that number once a restarted control's ranks re-attach), the ranks fold the numbers they
hold into their step's all-reduce, and a command takes effect at the first step every rank
held it in (services/common/boundary_commands.py); rank 0's StepCompleted
(``commands_agreed``), TrainingLoopPaused or TrainingLoopFinished says which step. Pause and
stop checkpoint that step first unless the operator says not to (the ranks report paused or
finished after the commit). A drain (`surgectl down`) is a pause whose job is then parked:
its ranks go with the stack, a restarted control waits for none, and the next `up` resumes
it. An operator resume of a STOPPED, FAILED or parked job relaunches its ranks (a new
generation) from the newest version the checkpoint manager verifies, or the one named, at
another data-parallel layout when asked (`surgectl resume --dp`: the global batch kept, the
job's spec replaced and journaled; see ``resume_job_request``).

The queue (issue 15): a submitted job whose ranks do not fit now is not refused: it stays
STANDBY in a queue (services/control/job_queue.py: FIFO within priority, only the head is
tried; a job needing more ranks than the registered workers have slots holds back none
behind it while it waits for workers to join), its status saying its place and what it
waits for, journaled with its place. The
head starts when ranks may have freed up: a job ended or left the queue, a recovery or an
operator resume placed its ranks, a worker registered (L1-2's ``ResourcesReady`` with no
job). Live jobs come first: the queue is held while a job recovers and its ranks are not
relaunched yet, or a job drained by `surgectl down` waits for the `up` that resumes it.
Starting queued jobs is handed to the deadline pool's thread (no delay), never run on the
thread that applies the node agents' events. ``surgectl cancel`` (StopJobRequest.queued_only)
or a stop takes a job out of the queue (TERMINATED, STOPPED).

Faults: a graded ``FaultReport`` opens an incident and gets one decision, by the job
spec's ``fault_policy`` (class first, then grade): ignore (record and count), stop (FAILED),
or a relaunch -- restart_ranks (from the newest checkpoint, or from scratch), rollback (the
newest checkpoint not after the faulting step that verifies), exclude_node (restart_ranks
without the worker the fault came from). A relaunch spends one restart of the fault class's
budget (exhausted: FAILED); the job is FAULT_FROZEN while it recovers, and RUNNING again
once every rank has restored. A recovery is a sequence of steps, each a command and the
event that answers it, none of them a blocking call (see "the recovery sequence" below):
verification (the store's recorded verdicts: only a corrupt one strikes a version; the
store unreachable or slow: wait and ask again, up to ``store_wait_seconds``), placement
(the recovery controller has the allocator kill and relaunch the ranks to load the version
named here; no free slots: wait for capacity, up to ``capacity_wait_seconds``), restore
(every relaunched rank ready within ``restore_seconds``). A wait that runs out is decided by
the policy (``store_unreachable``, ``no_capacity``, ``recovery_timeout``). With
``fault_policy.freeze_seconds`` a relaunch (in place too) waits that long first, the ranks held
alive and idle for inspection (freeze.py); a replica divergence with every rank alive is rolled back in
place (the live ranks load the version, ``ResumeTraining.reload_version``). While it recovers, reports from ranks
of the failed generation (a survivor's collective error, its exit, the kills) are recorded
as consequences of the incident, not decided on again: the incident is named after the
rank that failed first. Every decision is a "decision" event with its reason.
A data service that is down is a wait, not an incident (faults.py ``_data_outage``): the
ranks' relays reconnect and tell L1-3 (``data_outage`` reports, ``cleared`` when back); the
job keeps its state, its status says what it waits for and what brings it back, and past
``fault_policy.data_outage_seconds`` the policy decides ``data_outage`` (pause by default).

Control restart: what a restarted ``control`` needs is journaled with every event (state,
status and the bookkeeping in ``_runtime``: ranks started/finished, a pause or stop in
flight, restart budgets, checkpoint versions, workers excluded, the recovery in flight, the
verdicts on the current step's faults and the standing orders withdrawn), and
every applied step in the journal's step table. A live job is restored in its state; its
node agents re-attach its ranks and resend the events not yet applied (exactly once, see
``server.SessionHub``). A job caught mid-recovery resumes that recovery without spending
its restart again (see ``_restore``). Skipped steps
(``StepCompleted.skipped``) are "skip" events with their reason and counted in
``surge_skipped_steps_total{reason}``.

Inputs: the operator's commands (SubmitJobRequest, JobQuery, Pause/Resume/StopJobRequest),
TrainingLoopStarted / StepCompleted / EvalCompleted / TrainingLoopPaused /
TrainingLoopFinished / TrainingLoopFailed (L2-1 via the relay), SaveCompleted (L5-1 via the
relay), FaultReport (L1-3; one with no job is a worker's own fault: a device_error cordons the
worker), ResourcePressure (L1-2, observed and recorded), ResourcesReady
without a job (L1-2: a worker registered; the queue's head is tried), WorkerCordoned (L1-2: a
cordon in force or ended; journaled, listed with the jobs),
WorkerDeparting (a node agent's SIGTERM or SIGUSR1, with its deadline), DrainWorkerRequest
(`surgectl drain`),
CheckpointVerification / SnapshotFailed / CheckpointCorrupt (L5-1 via the store relay: the
verification's answer, a failed save or verification with its typed cause, a scrub finding).
Outputs: AllocateResources / ReleaseResources / CordonWorker (L1-2), StartFaultMonitoring / ResetFaultLedger
(L1-3), StartRecovery (L1-4), VerifyCheckpoints (L5-1), Start/Pause/Resume/StopTraining (L2-1 of the job's ranks, via
the session relay), JobStatus / JobList / JobEvent (the operator).

The package, one concern per file (the red-line checks read it whole: one place per seed
module). ``Orchestrator`` (core.py) joins the event handlers and commands, each a part of
it in its own file, under its one decision lock (short: core.py's docstring gives the lock
order; the operator's queries never take it):

- core.py: the ports, the lock, the jobs, and what every part shares (a transition, a
  boundary command, the status snapshot, ``job_query``);
- decision_writes.py: recording an event, a decision's journal writes in order and the
  commands held behind them until committed;
- views.py: the job statuses as published after each decision, which the queries read;
- queue.py: submit, admission and the queue (a job waits STANDBY until its ranks fit);
- operator.py: pause (and drain), resume, stop, delete, revoke a standing order;
- resume.py: an operator resume that relaunches a stopped, failed or parked job;
- resize.py: `surgectl scale` and growing back after a shrink;
- training.py: the rank events (started, step, eval, save, paused, finished, failed, step fault);
- faults.py: fault intake (FaultReport, failed saves, resource pressure);
- worker_health.py: a worker's own fault, a sick node's quarantine, cordons and `surgectl uncordon`;
- recovery.py: the decision on a new incident and the recovery sequence;
- recovery_waits.py: a recovery step's waits, retries and timers (the waits' machine applied);
- freeze.py: a decided relaunch held while the ranks stay alive for inspection
  (``fault_policy.freeze_seconds``, FreezeTraining; issue 29 item 9);
- rollback.py: `surgectl rollback`, the live ranks loading a version in place;
- annotations.py: the operator's tags and notes on a job (`surgectl tag`, `note`);
- departure.py: a node leaving with notice (a node agent's WorkerDeparting, `surgectl drain`):
  each job there checkpoints at an agreed boundary and its ranks move off the node (issue 30 item 5);
- journal.py: restore after a control restart.

and plain records and functions: job.py (``_Job``, ``_Incident``, ``_Scale``, the legal
transitions), job_journal.py (a job's journal form, written and read back), activity.py (a job's one activity in flight: a recovery,
a resize, a rollback in place or an operator resume, and ``admit``, the one rule for what a
second one gets: started, folded in, refused or superseding it), triage.py (what a fault
report is to its job: a pure function), replacement_nodes.py (where a rebuild in place may put
a replacement, and which replacements a lost or silent node holds: pure), the machines: recovery_machine.py (a recovery's
waits), resize_machine.py, rollback_machine.py, each pure transitions (state, event) ->
(new state, [effects]) whose effects (effects.py: records, commands, the group started)
one function performs (``_apply_effects``), request_ids.py (a submit retried by request id
gets its first job), departure_plan.py (a departure's deadline against the job's last save),
refusals.py, layout.py, texts.py. Every decision on a fault reads the policy through
services/control/fault_decision.py.
"""

from services.control.orchestrator.core import Orchestrator
from services.control.orchestrator.job import (
    EVENT_LOG,
    NO_CAPACITY,
    REATTACH_MESSAGE,
    REATTACHED_MESSAGE,
    RECOVERY_TIMEOUT,
    RESTART_MESSAGE,
    RESUME_MESSAGE,
    STORE_UNREACHABLE,
)
from services.control.orchestrator.preemption import PREEMPTION_CLAIM_S
from services.control.orchestrator.refusals import (
    IllegalTransition,
    InsufficientResources,
    JobDoesNotFit,
    JobNotFound,
    NoStandingOrder,
    RequestIdReused,
    UnknownVersion,
)
from services.control.orchestrator.texts import checkpoint_text, restored_from_text
from services.control.orchestrator.triage import CONSEQUENCE_DETAIL_CHARS

__all__ = [
    "CONSEQUENCE_DETAIL_CHARS",
    "EVENT_LOG",
    "NO_CAPACITY",
    "PREEMPTION_CLAIM_S",
    "REATTACHED_MESSAGE",
    "REATTACH_MESSAGE",
    "RECOVERY_TIMEOUT",
    "RESTART_MESSAGE",
    "RESUME_MESSAGE",
    "STORE_UNREACHABLE",
    "IllegalTransition",
    "InsufficientResources",
    "JobDoesNotFit",
    "JobNotFound",
    "NoStandingOrder",
    "Orchestrator",
    "RequestIdReused",
    "UnknownVersion",
    "checkpoint_text",
    "restored_from_text",
]
