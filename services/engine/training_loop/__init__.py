"""L2-1 training loop: drives every step of one rank and reports each one up.

It schedules; it does not compute. Every tensor it touches is a handle it passes from one
module's reply to the next module's command (``payload``), and every decision reserved for
L1 (start, pause, resume, stop, what to do about a fault) arrives as a command or stays
with L1: a step fault blocks the loop until L1-1's verdict (below); a module's failure is
reported (``TrainingLoopFailed``) and the rank waits for L1 to release it.

Receives
    from L1 (through the rank's session relay): InitJob, StartTraining, PauseTraining,
        ResumeTraining, StopTraining, StepVerdict, RevokeStandingOrder, FreezeTraining;
    from L2-2: ParallelReady; from L4 (through the data relay): MicroBatch (payload
        :class:`Batch`), DataExhausted, DatasetUnavailable.
Commands
    L3-1 LoadModel/ExportState/RestoreState, L2-4 InitPrecision/UnscaleAndCheck/ScaleLoss, L3-3 ConfigureForward/
    RunForward, L3-4 RunBackward, L3-5 ArmReduction/ReduceGradients, L2-3 ApplyUpdate/
    ExportState/RestoreState, L4 MountDataset/OpenStream, L5 SaveCheckpoint/CommitCheckpoint/LoadCheckpoint/
    FlushCheckpoint, L5-2 LogCollectionConfig (the spec's ``metrics:``, once, before the first step) and
    StopLogCollection (at the end).
Publishes
    TrainingLoopStarted, StepCompleted, EvalCompleted, TrainingLoopPaused, StepFaultReported,
    TrainingLoopFinished, TrainingLoopFailed (to L1; step and eval events also to L5-2).

Loss normalisation (global, exact): the step's global count N of non-padding tokens (all
micro-steps, all dp ranks) is known only after a reduction, so each rank back-propagates
its summed token losses divided by a normaliser known before the step, its token capacity
K = micro_batch_size x seq_len x grad_accum (the same on every rank), and DDP / FSDP2
average gradients over the dp ranks. After backward, L3-5's one small all-reduce brings N
(with the loss sum, the overflow verdict and the norm's pieces), and L2-4 multiplies the
gradients by dp x K / N in the same pass as it unscales them (``ScaleLoss.grad_scale``).
So the gradient is d/dw (sum of all token losses of the step / N): gradient accumulation x
data parallelism x padding equals one large batch of the same tokens, up to floating-point
rounding (one more multiply per element; the loss-parity tests in tests/parallel/ hold it
to 1e-5). Tensor- and pipeline-parallel peers see the same data, so only the dp axis counts.

Step faults (seed L2-1: 异常阻塞, 循环阻塞等待事件; see :meth:`TrainingLoop._judge`): after
backward, L2-4 checks this rank's gradients, L3-5 all-reduces that verdict with the loss sums
(every rank, every mesh axis), and L2-4 moves the loss scale by the all-rank verdict. A
non-finite loss, non-finite gradients, those at the minimum loss scale, and the
``fault_policy.overflow_storm_steps``-th consecutive skipped step are step faults: every rank
finds the same one at the same step. The loop follows the standing order L1-1 gave for its
kind in InitJob (e.g. "skip fp16 overflow steps"), else it blocks at that step's boundary,
reports ``StepFaultReported`` and waits for L1-1's ``StepVerdict`` (reporting again every
``fault_policy.verdict_seconds`` without one): apply the step as it is, skip its update, or
step no further (L1 relaunches the ranks or stops the job). ``StepCompleted`` says the fault,
what was done and the standing order followed (``fault``, ``action``, ``standing_order``;
``skipped`` / ``skip_reason`` as before; the loss stays what it was, NaN included).

Boundary commands (PauseTraining, StopTraining, RevokeStandingOrder; issue 28): each carries
the job's boundary command sequence number and is held until every rank holds it. The loop
puts the numbers it holds into the step's one all-reduce (``ReduceGradients.held_commands``,
over the whole world: tp and pp peers agree too) and L3-5 answers the highest number every
rank holds (``GradientsReduced.commands_agreed``); the commands up to it take effect at this
step's boundary, the same on every rank whatever the delay of a delivery
(services/common/boundary_commands.py). ``StartTraining.command_seq`` starts the group's
agreement (a command sent before the group formed is void), and StepCompleted says the agreed
number (``commands_agreed``: how L1-1 learns the boundary).

Replica check (issue 29 item 3; ``integrity.replica_check_every_steps``, N): at the boundary
of every N-th step (and of the last), after the update and before that step's evaluation and save, the loop
asks L3-5 to compare the data-parallel replicas' parameters (``ReduceGradients.check_replicas``:
a digest per tensor, all-gathered over the dp group; services/compute/replica_digest.py).
Every rank gets the same answer. A mismatch is the fault ``replica_divergence``
(TrainingFault: reported to L1-3, decided by L1-1, which rolls back to the newest version at
or before the last check that agreed); its detail names the tensor and the odd dp ranks. So a
save at a check step is written only once its replicas agreed, and a diverged state is never
saved at one. Rank 0's CommitCheckpoint says the step of the last check that agreed
(``replica_agreed_step``): the store's ``latest`` names only versions a check covered.

Exact resume (DESIGN.md "Faults"): the checkpoint is a snapshot (services/state/snapshot.py):
an immutable copy of each owner's state at one step, the modules' (model, optimizer: their
``ExportState`` replies) and the loop's own (slot ``train``, :class:`LoopState`: step,
skipped steps, loss scale,
the one global data position, and per rank the python / numpy / torch (and CUDA) RNG
streams). The LR schedule is a pure function of the step and the shuffle order a pure
function of (seed, epoch), so a run resumed from step k replays steps k+1.. bit for bit:
same batches, same random draws, same updates. A fresh start seeds those streams from (job
seed, rank). The data position does not depend on the dp size (every rank reads the global
order, the packer deals rows: services/data/batch_packer.py), so a job also resumes at
another dp on the same global batches (losses equal to float rounding; :class:`LoopState`).
Nothing hands out live state: a save hands the snapshot to L5-1 (the rank's state manager);
a load hands L5-1 a template snapshot and gets back the loaded one, which the loop checks
(one step, one version, every digest) and restores: ``RestoreState`` with each module's slot,
its own fields from its slot.

Saves are asynchronous by default (``checkpoint.async``): the loop blocks for the copy of
the state to host memory only; before it reports its end it waits for the write and
commit (``FlushCheckpoint``), because a finished rank may be released at once.

Inspect before acting, rollback in place (issue 29 item 9): L1-1's FreezeTraining holds the
rank where it is (a step fault's wait, a failed rank's wait for its release, or its next step
boundary), its beats saying PHASE_FROZEN, until L1-1's decided action ends it. A replica
divergence fails no rank: every rank waits in the loop (phase FAULT_WAIT) for L1-1's decision.
``ResumeTraining.reload_version`` (from that wait, or from a pause L1-1 asked for: `surgectl
rollback`) loads a committed version into the live process (``_reload``: the load a relaunched
rank does at start-up, every slot restored, the stream reopened at the loaded position) and
waits for StartTraining; the steps after it replay bit for bit (see "Exact resume").

Survivors keep training (issue 16; ``InitJob.rebuild_in_place``, the job's fault policy
``rebuild``): a communication failure (typed cause FAILURE_COMMUNICATION) raised in a step,
an evaluation, a save or a heal does not fail the rank. The loop first leaves the ``except``
block: the exception's traceback holds the failed collective's work, and while anything
references it, destroying the group does not close its sockets, so a peer not next to the
lost rank stays blocked in it (measured, torch 2.13 gloo). Then (:meth:`TrainingLoop._recover`,
phase FAULT_WAIT: no progress deadline) it rolls back to the last step it completed
(``self._step``): under ddp or none nothing communicates after ApplyUpdate and the update is
local, so the model and optimizer are untouched until then; the RNG streams go back to the
step's start, the data position stays, and gradients start anew (the backward unit's window
restarts when the model is attached again). It commands L2-2 ``RebuildParallelGroup``
(``master_port`` 0: L2-2 drops the broken group and joins the next generation L1-2 names;
it blocks until then), takes ``ParallelReady`` (the dp coordinates), and sends L5-1's rank
side ``HealState``: the ranks agree on the lowest rank at the highest completed step as the
source, and every other rank restores the source's snapshot (model, optimizer, the loop's
progress; it keeps its own RNG streams: the source's slot holds only its own rank's). A
rank healed onto a step it did not complete (a peer finished the step in flight: a gloo
all-reduce may return on some ranks and fail on others) reports that step as the source
did (``StateHealed.last_step``): a step that trained is never missing from the records. It
reopens the train stream at the healed position (a batch of the old stream still in the
inbox, or on its way, is dropped by its stream token: data_client.py), reports
``TrainingLoopStarted`` (``rebuild_generation``, ``healed``, ``healed_from_rank``) and waits
for ``StartTraining``, like a relaunched generation. A rank launched to replace a lost one
(``InitJob.heal_from_peer``) heals (``has_state`` false) where it would load a checkpoint.
Evaluation and checkpoint work of a step boundary cut short by the fault is not done again,
except at the last step (its at-end work); the next interval saves. Only ddp or none with
tp == pp == 1 are rebuilt in place (L1 decides a relaunch for anything else).

Resize in place (issue 16: ``surgectl scale``, a job shrunk on a fault, growing back): the
rendezvous L2-2 joined may name a new data-parallel layout (``RebuildParallelGroup.layout``,
L1's command: dp, micro_batch_size, grad_accum; the global batch unchanged). L2-2's reply
carries it, and the loop takes it as the job's from then on (``services.jobspec.with_layout``;
the InitJob stays as pushed): the micro-steps per step (and ``RunBackward.micro_steps``,
L3-4's accumulation window), the normaliser and ``grad_scale`` (dp x K / N), the stream
reopened at the same global position with the new dp coordinates and micro-batch size,
the MFU's world, the checkpoint's ``data_order`` (its global rows, hence its meaning, are
unchanged) and the spec a commit names. A survivor of a fault enters it from :meth:`_recover`
as above; an operator's resize pauses every rank at a common boundary first
(PauseTraining, no checkpoint; a save in flight there, the boundary's periodic one or an
earlier one, is committed before the rank reports paused: the group it writes on is still
whole, so it is never dropped with the old group, and L1-1 releases or rebuilds nothing before
every rank paused) and then sends ``ResumeTraining(rebuild=True)``: the paused
loop goes the same way (no step in flight: nothing is taken back), reports
``TrainingLoopStarted`` and waits for StartTraining. A ``rebuild`` resume that finds the loop
not paused is dropped (logged). Ranks at the new size or above were released by L1; new
ranks are launched at the new layout with ``heal_from_peer`` (their RNG streams are a fresh
rank's, seeded from (job seed, rank); the survivors keep their own). The read-ahead bound,
fixed at construction, only bounds what waits: the loop takes a step's micro-batches one at
a time, so a larger ``grad_accum`` never waits on it.
"""

from __future__ import annotations

from services.engine.training_loop.boundary import _RESIZE, _STOP
from services.engine.training_loop.faults import (
    _DETAIL_CHARS,
    TrainingFault,
    _data_fault_class,
    _one_line,
    _Released,
    classify_fault,
)
from services.engine.training_loop.loop import TrainingLoop
from services.engine.training_loop.ports import Batch, LoopPorts
from services.engine.training_loop.positions import (
    _FORMAT_AT,
    DATA_FORMAT,
    DATA_FORMATS,
    DATA_ORDER,
    MIXTURE_FORMAT,
    POSITION_FORMAT_BYTES,
    _format_bytes,
    _shown,
    data_format,
    data_order,
    data_order_changes,
    mixture_id,
)
from services.engine.training_loop.state import LoopState, _own_hyperparameters
from services.engine.training_loop.summary import _due, mixture_line, model_flops_per_token, step_line

__all__ = [
    "Batch",
    "DATA_FORMAT",
    "DATA_FORMATS",
    "DATA_ORDER",
    "LoopPorts",
    "LoopState",
    "MIXTURE_FORMAT",
    "POSITION_FORMAT_BYTES",
    "TrainingFault",
    "TrainingLoop",
    "_DETAIL_CHARS",
    "_FORMAT_AT",
    "_RESIZE",
    "_Released",
    "_STOP",
    "_data_fault_class",
    "_due",
    "_format_bytes",
    "_one_line",
    "_own_hyperparameters",
    "_shown",
    "classify_fault",
    "data_format",
    "data_order",
    "data_order_changes",
    "mixture_id",
    "mixture_line",
    "model_flops_per_token",
    "step_line",
]
