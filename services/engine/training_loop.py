"""L2-1 training loop: drives every step of one rank and reports each one up.

It schedules; it does not compute. Every tensor it touches is a handle it passes from one
module's reply to the next module's command (``payload``), and every decision reserved for
L1 (start, pause, resume, stop, what to do about a fault) arrives as a command or stays
with L1: a step fault blocks the loop until L1-1's verdict (below); a module's failure is
reported (``TrainingLoopFailed``) and the rank waits for L1 to release it.

Receives
    from L1 (through the rank's session relay): InitJob, StartTraining, PauseTraining,
        ResumeTraining, StopTraining, StepVerdict, RevokeStandingOrder;
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
(PauseTraining, no checkpoint) and then sends ``ResumeTraining(rebuild=True)``: the paused
loop goes the same way (no step in flight: nothing is taken back), reports
``TrainingLoopStarted`` and waits for StartTraining. A ``rebuild`` resume that finds the loop
not paused is dropped (logged). Ranks at the new size or above were released by L1; new
ranks are launched at the new layout with ``heal_from_peer`` (their RNG streams are a fresh
rank's, seeded from (job seed, rank); the survivors keep their own). The read-ahead bound,
fixed at construction, only bounds what waits: the loop takes a step's micro-batches one at
a time, so a larger ``grad_accum`` never waits on it.
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog
import torch
from google.protobuf.message import Message

from services.common import phase as ph
from services.common.boundary_commands import HeldCommands
from services.contract import Module, data_pb2, engine_pb2, route_pb2, store_pb2
from services.contract.bus import BoundaryViolation, CommandPort, Emitter
from services.contract.failures import ModuleFailed, cause_of, failure_of
from services.contract.frozen import FrozenConfig
from services.engine import rng_streams
from services.engine.lr_schedule import schedule_for
from services.jobspec import DATA_OUTAGE, InitFromSpec, JobSpec, JobSpecError, spec_from_json, spec_to_json, with_layout
from services.state.snapshot import RANK_SLOTS, InconsistentSnapshot, Slot, Snapshot

_DETAIL_CHARS = 400
_log = structlog.get_logger("training_loop")


class TrainingFault(RuntimeError):
    """A fault the loop reports with a class L1 understands (e.g. "data_unavailable")."""

    def __init__(self, fault_class: str, detail: str):
        super().__init__(detail)
        self.fault_class = fault_class


def _data_fault_class(msg: data_pb2.DatasetUnavailable) -> str:
    """The class the loop repeats L4-1's failure with: the data service unreachable (typed by
    its cause) is ``data_outage``, decided as L1-3 grades the relay's own report of it (by
    default a pause, never FAILED), whichever of the two reaches control first; a version whose
    bytes changed (a shard that fails its digest, e.g. as a resumed stream opens it) is
    ``data_corrupt``, which the policy pauses on too (issue 29 item 7); else a version that went
    away, ``data_unavailable``."""
    cause = msg.failure.cause
    if cause == route_pb2.FAILURE_UNAVAILABLE:
        return DATA_OUTAGE
    return "data_corrupt" if cause == route_pb2.FAILURE_DATA_CORRUPT else "data_unavailable"


class _Released(Exception):
    """L1-1's verdict on a step fault ends this loop (the job stops, or its ranks are
    relaunched): it steps no further and reports nothing more."""

    def __init__(self, verdict: engine_pb2.StepVerdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


class Batch(NamedTuple):
    """Payload of a MicroBatch on the rank's bus (tensors on the CPU)."""

    split: str  # "train" | "val"
    input_ids: torch.Tensor  # int64 [B, T]
    labels: torch.Tensor  # int64 [B, T]; -100 marks padding
    stream: Any = None  # the token of the stream it came from (OpenStream's reply payload)


@dataclass(frozen=True)
class LoopPorts:
    """The modules the loop may command (built by the composition root from the table)."""

    shard_loader: CommandPort
    forward: CommandPort
    backward: CommandPort
    reduction: CommandPort
    optimizer: CommandPort
    precision: CommandPort
    data: CommandPort
    store: CommandPort
    metrics: CommandPort | None = None  # L5-2 (LogCollectionConfig); None: no sinks configured
    parallel: CommandPort | None = None  # L2-2 (RebuildParallelGroup): a group rebuilt in place


class LoopState:
    """The loop's own progress as a state dict (the slot ``train``; the loop copies it into a
    :class:`~services.state.snapshot.Slot` and restores from one: this object never leaves
    the loop). Keys that differ per rank (RNG) live under ``rank<r>`` so ranks never collide.

    Every value is a tensor, so a checkpoint loads with ``weights_only=True`` and nothing
    is unpickled. Keys (under ``train.``): ``step``, ``skipped_steps``,
    ``consecutive_skips`` (toward ``fault_policy.overflow_storm_steps``), the precision
    manager's scaler state as it last reported it: ``loss_scale`` float64 (1 for
    fp32/bf16) and ``loss_scaler`` int64 [growth tracker, hysteresis left, dynamic (1: an
    fp16 scaler wrote it)], restored exactly and pushed back in InitPrecision;
    ``data_position`` int64 [epoch, row, *format]: where the job's one global data stream
    continues, rows of that epoch's row order already dealt (the same on every rank, whatever
    the dp size: services/data/batch_packer.py), then the UTF-8 bytes of the position's
    sample-sequence format (``DataPosition.format``, services/data/sample_index.py; none in
    checkpoints written before it was kept: the empty format, the same sequence); ``data_order`` int64 (:data:`DATA_ORDER`: what
    must not change for that position to mean the same samples, checked on resume; its last
    value is the position's format, :data:`DATA_FORMAT`: a checkpoint of another format, such
    as [epoch, document, offset] before rows were ordered, is refused); ``ranks``: the world
    size it was written at; and per rank ``rng.*`` (python, numpy, torch and CUDA streams:
    ``services/engine/rng_streams.py``). A resume at another size is exact: the position is
    global, the model and optimizer reshard through DCP, a rank that existed restores its
    streams and a rank new at this size (its key absent: ``rank >= ranks``) keeps the
    streams seeded from (job seed, rank).
    """

    def __init__(self, loop: TrainingLoop):
        self._loop = loop

    def state_dict(self) -> dict[str, Any]:
        loop = self._loop
        p = loop._position
        return {
            "step": torch.tensor(loop._step, dtype=torch.int64),
            "skipped_steps": torch.tensor(loop._skipped, dtype=torch.int64),
            "consecutive_skips": torch.tensor(loop._consecutive_skips, dtype=torch.int64),
            # float64: exact for any growth/backoff factor, not only powers of 2.
            "loss_scale": torch.tensor(loop._scaler_state.scale, dtype=torch.float64),
            "loss_scaler": torch.tensor(
                [loop._scaler_state.growth_tracker, loop._scaler_state.hysteresis_left, int(loop._dynamic_scaling)],
                dtype=torch.int64,
            ),
            # A fixed width (the format's bytes, 0-padded): every rank's state has the same
            # shapes, so a rank healed from a peer's memory or a fresh rank's template fits it.
            "data_position": torch.tensor([p.epoch, p.row, *_format_bytes(p.format)], dtype=torch.int64),
            "data_order": torch.tensor(data_order(loop._spec, loop._dp_size), dtype=torch.int64),
            "ranks": torch.tensor(loop._world, dtype=torch.int64),
            f"rank{loop._rank}": {"rng": rng_streams.capture()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop = self._loop
        # (An older format's position is read as its epoch alone: resume refuses it by data_order.)
        position = [int(v) for v in state["data_position"].tolist()]
        loop._step = int(state["step"])
        loop._skipped = int(state["skipped_steps"])
        loop._consecutive_skips = int(state["consecutive_skips"])
        growth_tracker, hysteresis_left, dynamic = (int(v) for v in state["loss_scaler"].tolist())
        # Only an fp16 scaler's state is resumed; an fp32/bf16 checkpoint's placeholder is not.
        loop._resume_scaler = (
            engine_pb2.LossScalerState(
                scale=float(state["loss_scale"]), growth_tracker=growth_tracker, hysteresis_left=hysteresis_left
            )
            if dynamic
            else None
        )
        loaded_format = data_format(tuple(int(v) for v in state["data_order"].tolist()))
        row = position[1] if loaded_format == DATA_FORMAT else 0
        # (format 1's third value is its offset, not a sample-sequence format)
        kind = bytes(position[2:]).rstrip(b"\0").decode("utf-8") if loaded_format == DATA_FORMAT else ""
        loop._position = data_pb2.DataPosition(epoch=position[0], row=row, format=kind)
        loop._loaded_order = tuple(int(v) for v in state["data_order"].tolist())
        if loop._rank < int(state["ranks"]):  # else this rank is new at this size: seeded (seed, rank)
            rng_streams.restore(state[f"rank{loop._rank}"]["rng"])


POSITION_FORMAT_BYTES = 16  # room for a sample-sequence format's name in data_position


def _format_bytes(fmt: str) -> bytes:
    raw = fmt.encode("utf-8")
    if len(raw) > POSITION_FORMAT_BYTES:
        raise ValueError(f"data position format {fmt!r}: longer than {POSITION_FORMAT_BYTES} bytes")
    return raw.ljust(POSITION_FORMAT_BYTES, b"\0")


class TrainingLoop:
    """L2-1. Handlers run on whatever thread delivers the message; ``run`` owns the rank's
    main thread and blocks on its inboxes (no polling)."""

    def __init__(
        self,
        emit: Emitter,
        ports: LoopPorts,
        *,
        read_ahead: int = 4,
        started_at: float | None = None,
        phase: ph.PhaseMarker | ph.NoPhase = ph.NO_PHASE,
    ):
        """``read_ahead``: decoded micro-batches held per stream; ``started_at``: the
        process's ``time.perf_counter()`` at start, for ``startup_seconds``; ``phase``: the
        rank's phase marker, set at this loop's phase boundaries (services/common/phase.py)."""
        self._emit = emit
        self._mark = phase
        self._warm = True  # False until the first step ran with operators.compile (it compiles)
        self._p = ports
        self._t_created = time.perf_counter() if started_at is None else started_at
        self._control: queue.Queue = queue.Queue()
        self._batches = {s: queue.Queue(maxsize=max(1, read_ahead)) for s in ("train", "val")}
        self._streams: dict[str, Any] = {"train": None, "val": None}  # each split's open stream (its token)
        self._rng_at_step: dict[str, torch.Tensor] | None = None  # the streams at the start of the step in flight
        self._generation = 0  # the generation of the group this rank trains in (0: its launch's)
        self._lock = threading.Lock()
        # Boundary commands (pause, stop, revoke) held until every rank holds them: they take
        # effect at the boundary the step's all-reduce agrees on (services/common/boundary_commands.py).
        self._commands = HeldCommands()
        # The step whose state is durable (saved, loaded, or the initial state a fresh start
        # recreates from the seed): an operator's pause or stop that checkpoints skips it.
        self._durable_step: int | None = None
        self._agreed_step: int | None = None  # the step of the last replica check that agreed (this generation)
        self._data_fault: str | None = None
        self._data_fault_class = "data_unavailable"
        self._failed = False
        # Private state (seed L2-1 s2): step/epoch counters, phase, the job as pushed.
        self._init: engine_pb2.InitJob | None = None
        # The job as L1 pushed it (seed L2-1 red line 3: never modified here); once per rank.
        self._job = FrozenConfig[engine_pb2.InitJob]("L2_TRAINING_LOOP", "job (InitJob)")
        self._spec: JobSpec | None = None
        self._spec_json = ""  # the spec as a commit names it: InitJob's, or the resized one's
        self._rank, self._world = 0, 1
        self._dp_rank, self._dp_size = 0, 1  # the data-parallel coordinate: which data this rank reads
        self._step = 0
        # The last StepCompleted this loop sent: a heal's source hands it to a rank one step behind.
        self._last_report: engine_pb2.StepCompleted | None = None
        self._skipped = 0
        self._position = data_pb2.DataPosition()
        self._components: Any = ()  # a mixture's ComponentPosition at _position
        self._loss_scale = 1.0
        # The precision manager's scaler state as it last reported it (checkpointed here,
        # pushed back in InitPrecision on resume); _resume_scaler: what a checkpoint held.
        self._scaler_state = engine_pb2.LossScalerState(scale=1.0)
        self._resume_scaler: engine_pb2.LossScalerState | None = None
        self._consecutive_skips = 0  # consecutive skipped steps, toward an overflow storm
        # Step faults (see _judge): L1-1's verdicts by (step, StepFaultKind), delivered by the
        # session's thread; the standing orders of InitJob by kind, and revoked ones (order
        # id -> the last step it still applies to).
        self._verdict_ready = threading.Condition(self._lock)
        self._verdicts: dict[tuple[int, int], engine_pb2.StepVerdict] = {}
        self._orders: dict[int, engine_pb2.StandingOrder] = {}
        self._revoked: dict[int, int] = {}
        self._dynamic_scaling = False
        self._loaded_order: tuple[int, ...] | None = None  # data order of the loaded checkpoint
        self._snapshots = 0  # snapshots taken by this loop (part of each one's version)
        self._num_parameters = 0
        self._flops_per_token = 0.0
        self._peak_flops = 1.0
        self._lr_at = None
        # standby | stepping | waiting_data | evaluating | saving | paused | blocked | rebuilding | released
        # | done | failed
        self._phase = "standby"

    # ------------------------------------------------------------------ L1 commands

    def init_job(self, msg: engine_pb2.InitJob, payload: Any = None) -> None:
        """The job (once). Raises ConfigFrozen on a second InitJob."""
        self._control.put(self._job.set(msg))

    def start_training(self, msg: engine_pb2.StartTraining, payload: Any = None) -> None:
        self._control.put(msg)

    def pause_training(self, msg: engine_pb2.PauseTraining, payload: Any = None) -> None:
        """Held until the ranks agree on its boundary (module docstring, "Boundary commands").
        Raises UnsequencedCommand (``seq`` 0)."""
        self._commands.receive(msg)

    def resume_training(self, msg: engine_pb2.ResumeTraining, payload: Any = None) -> None:
        """Resume a paused loop; ``rebuild``: into a resize (module docstring), only while
        paused (else dropped: a rebuild left queued would start one at the next pause)."""
        # (The phase is set before TrainingLoopPaused goes out; a loop wired without L2-2 has
        # no group to rebuild.)
        if msg.rebuild and (self._phase != "paused" or self._p.parallel is None):
            _log.warning("rebuild_resume_ignored", phase=self._phase, step=self._step)
            return
        self._control.put(msg)

    def stop_training(self, msg: engine_pb2.StopTraining, payload: Any = None) -> None:
        """Held as a pause is; also wakes a loop not started yet or paused (it stops there).
        Raises UnsequencedCommand (``seq`` 0)."""
        if self._commands.receive(msg):
            self._control.put(msg)

    def step_verdict(self, msg: engine_pb2.StepVerdict, payload: Any = None) -> None:
        """L1-1's verdict on a step fault: kept until the loop blocks on that fault (it may
        arrive before this rank got there: a peer reported the same fault first)."""
        with self._verdict_ready:
            if msg.step > self._step:  # (a late copy of a verdict already followed: dropped)
                self._verdicts[msg.step, msg.kind] = msg
                self._verdict_ready.notify_all()

    def revoke_standing_order(self, msg: engine_pb2.RevokeStandingOrder, payload: Any = None) -> None:
        """Follow standing order ``msg.order`` through the step of its agreed boundary only
        (held as a pause is). Raises UnsequencedCommand (``seq`` 0)."""
        self._commands.receive(msg)

    # ------------------------------------------------------------------ events from below

    def on_parallel_ready(self, msg: engine_pb2.ParallelReady, payload: Any = None) -> None:
        self._control.put(msg)

    def on_micro_batch(self, msg: data_pb2.MicroBatch, payload: Batch) -> None:
        self._batches[payload.split].put((msg, payload))  # blocks when full: read-ahead bound

    def on_data_exhausted(self, msg: data_pb2.DataExhausted, payload: Any = None) -> None:
        self._batches[msg.split].put((msg, None))

    def on_dataset_unavailable(self, msg: data_pb2.DatasetUnavailable, payload: Any = None) -> None:
        self._data_fault = msg.reason or f"dataset {msg.name}@{msg.version} unavailable"
        self._data_fault_class = _data_fault_class(msg)
        for q in self._batches.values():  # wake a loop blocked on any stream
            try:
                q.put_nowait((msg, None))
            except queue.Full:
                pass

    def on_failure(self, msg: Message, payload: Any = None) -> None:
        """A module's failure event routed to the loop (ShuffleFailed, PrefetchFailed,
        ForwardFailed, SnapshotFailed, ...), heard after L1-3 (the route's delivery order).
        Logged, nothing decided (seed L2-1: no recovery of its own): a module the
        loop commanded already raised ModuleFailed to it; a data module's failure leaves the
        loop waiting for batches that no longer come, until L1-1's decision on it (stop,
        relaunch) reaches this rank; a save the store could not take lets training go on."""
        failure = msg.failure
        _log.warning(
            "failure_event_heard",
            failure_event=msg.DESCRIPTOR.name,
            module=Module.Name(failure.module) if failure.module in Module.values() else "",
            cause=route_pb2.FailureCause.Name(failure.cause),
            detail=failure.detail,
            step=self._step,
        )

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        """Initialise, report started, wait for StartTraining, train to the end or a stop.

        Raises whatever a module raised; the caller reports it with :meth:`fail`.
        """
        self._await_setup()
        self._initialise()
        try:
            if self._await_start():
                self._train()
        except _Released as released:  # L1-1's verdict on a step fault: the ranks are stopped or replaced
            self._phase = "released"
            self._mark.enter(ph.IDLE)
            _log.info(
                "released by L1",
                step=released.verdict.step,
                action=engine_pb2.StepVerdictAction.Name(released.verdict.action),
                reason=released.verdict.reason,
            )

    def fail(self, exc: BaseException) -> None:
        """Report ``exc`` as this rank's TrainingLoopFailed (once), classified."""
        if self._failed:
            return
        self._failed, self._phase = True, "failed"
        fault_class, detail = classify_fault(exc)
        # Typed: the cause from the exception's type; a module the loop commanded that failed
        # (ModuleFailed) stays the failing module, so L1-3 reports it once.
        failure = failure_of(exc, Module.L2_TRAINING_LOOP)
        failure.job_id, failure.rank = self._job_id, self._rank
        self._emit(
            engine_pb2.TrainingLoopFailed(
                job_id=self._job_id,
                rank=self._rank,
                step=self._step,
                fault_class=fault_class,
                detail=detail,
                failure=failure,
            )
        )

    def _train(self) -> None:
        spec = self._spec
        self._durable_step = self._step  # loaded from a checkpoint, or step 0 (from the seed)
        boundary: int | None = None  # a completed step whose boundary work (eval, save, stop) is due
        while self._step < spec.steps or boundary is not None:
            try:
                if boundary is None:
                    step = self._step + 1
                    self._run_step(step)
                    self._step = boundary = step
                after = self._boundary(boundary)
                if after == _STOP:
                    return self._finish(stopped=True)
                boundary = None
                if after != _RESIZE:
                    continue
                reason, in_step, resize = "resize (ResumeTraining.rebuild)", False, True
            except Exception as e:
                if not self._rebuilds(e):
                    raise
                reason, in_step, resize = _one_line(e), boundary is None, False
            # Out of the except block: nothing references the failed collective any more.
            if not self._recover(reason, in_step, resize=resize):
                return  # stopped while waiting to start again (finished)
            # At the last step its at-end work is done again (the run would end without it);
            # elsewhere a cut-short boundary is not (every rank decides alike: from the step).
            boundary = self._step if self._step == spec.steps else None
        self._finish(stopped=False)

    def _boundary(self, step: int) -> str:
        """The work due at the boundary after ``step``: evaluation, checkpoint, then an
        operator's stop or pause. What follows: :data:`_STOP`, :data:`_RESIZE` (a pause left
        into a resize), or "" (the next step)."""
        spec = self._spec
        last = step == spec.steps
        if _due(step, spec.integrity.replica_check_every_steps, last) and self._dp_size > 1:
            self._check_replicas(step)  # before the save: a save at a check step is of agreeing replicas
        if _due(step, spec.eval.every_steps, last and spec.eval.at_end):
            self._evaluate(step)
        if _due(step, spec.checkpoint.every_steps, last and spec.checkpoint.at_end):
            self._save(step)
            self._durable_step = step
        return "" if last else self._stop_requested_at_boundary(step)

    def _check_replicas(self, step: int) -> None:
        """The replica check at the boundary of ``step`` (module docstring, "Replica check").

        Raises:
            TrainingFault: replica_divergence, naming the first differing tensor and the odd
                dp ranks (every rank raises it alike: the answer is the group's).
        """
        # (L3-5 marks the rank "in a collective" while it waits for its peers)
        found = self._p.reduction(engine_pb2.ReduceGradients(check_replicas=True)).message
        if not found.replicas_checked or not found.diverged_tensor:
            # (not checked: FSDP2 holds no dp replicas of a parameter, so none can differ)
            self._agreed_step = step
            return
        odd = list(found.odd_dp_ranks)
        who = f"dp rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} " + (
            f"{'differ' if len(odd) > 1 else 'differs'} from the majority"
            if len(odd) < self._dp_size
            else "differ and no majority says which is right"
        )
        more = f" (and {found.diverged_tensors - 1} more tensors)" if found.diverged_tensors > 1 else ""
        agreed = f"step {self._agreed_step}" if self._agreed_step is not None else "none since this generation started"
        raise TrainingFault(
            "replica_divergence",
            f"data-parallel replicas differ after step {step} in {found.diverged_tensor}{more}: {who}; "
            f"last agreeing check: {agreed}",
        )

    def _rebuilds(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a broken group this rank survives (module docstring): the job
        rebuilds in place and the failure is a communication failure (typed cause)."""
        if isinstance(exc, (_Released, TrainingFault)) or not self._init.rebuild_in_place or self._p.parallel is None:
            return False
        return cause_of(exc) == route_pb2.FAILURE_COMMUNICATION

    def _recover(self, reason: str, in_step: bool, *, resize: bool = False) -> bool:
        """Roll back to the last completed step, have the group rebuilt (at a new layout when
        L1-2's rendezvous names one), heal, reopen the data and wait to start again (module
        docstring, "Survivors keep training", "Resize in place"). ``in_step``: the fault cut
        a step short (its RNG draws are taken back). ``resize``: no fault, a paused loop left
        for an operator's resize. Returns False when a StopTraining came instead of
        StartTraining (the loop finished).

        Raises:
            whatever is not a communication failure (a rendezvous that never came, a heal with
            no state to take, a layout the spec refuses: L1 decides, as for any failure).
        """
        t0 = time.perf_counter()
        self._phase = "rebuilding"
        self._mark.enter(ph.FAULT_WAIT)  # no progress deadline while the group is rebuilt
        if resize:
            _log.info("group_left_for_resize", step=self._step, reason=reason)
        else:
            _log.warning("group_broke", step=self._step, in_step=in_step, reason=reason)
        if in_step and self._rng_at_step is not None:
            rng_streams.restore(self._rng_at_step)
        completed = self._step
        healed: engine_pb2.StateHealed | None = None
        while healed is None:
            try:
                joined = self._p.parallel(engine_pb2.RebuildParallelGroup(job_id=self._job_id, reason=reason)).payload
                self._generation = joined.generation
                self._await_ready()
                if joined.layout.dp:
                    self._take_layout(joined.layout)
                healed = self._heal(has_state=True)
            except Exception as e:
                if not self._rebuilds(e):  # (a peer lost again while healing: rebuilt again)
                    raise
                reason = _one_line(e)
        if healed.step > completed:
            self._report_taken_over(healed, completed)
        self._open_stream("train", self._position, repeat=True, max_batches=0)
        self._emit(engine_pb2.TrainingLoopStarted(
            job_id=self._job_id, rank=self._rank, start_step=self._step, num_parameters=self._num_parameters,
            startup_seconds=time.perf_counter() - t0, rebuild_generation=self._generation,
            healed=True, healed_from_rank=healed.source_rank,
        ))  # fmt: skip
        _log.info(
            "group_rebuilt_and_healed",
            step=self._step,
            generation=self._generation,
            world_size=self._world,
            layout=self._layout_text(),
            source=healed.source_rank,
            healed_bytes=healed.bytes,
            heal_s=round(healed.seconds, 4),
            recovery_s=round(time.perf_counter() - t0, 4),
        )
        self._phase = "standby"
        return self._await_start()

    def _report_taken_over(self, healed: engine_pb2.StateHealed, completed: int) -> None:
        """This rank healed onto a step it did not complete (a peer finished the step in flight
        before the group broke: a gloo all-reduce can return on some ranks and fail on
        others). That step trained, so it is reported here too, as the source reported it
        (every field is global but the rank): else this rank's record of it, rank 0's the
        job's journal and the store's, would be missing. A source with no report of it
        (never seen: the source heals only at a step it completed) leaves it unreported, logged."""
        report = healed.last_step
        if report.step != healed.step:
            _log.warning("taken_over_step_unreported", step=healed.step, completed=completed, source=healed.source_rank)
            return
        done = engine_pb2.StepCompleted()
        done.CopyFrom(report)
        done.rank = self._rank
        self._last_report = done
        self._emit(done)
        _log.info("taken_over_step_reported", step=done.step, completed=completed, source=healed.source_rank)

    def _take_layout(self, layout: engine_pb2.DataParallelLayout) -> None:
        """The layout of the group just joined (L1's command) is the job's from now on
        (module docstring, "Resize in place").

        Raises:
            TrainingFault: config_error, a layout the spec's rules refuse or that is not the
                group's size (L1 checks both before it commands a resize).
        """
        try:
            spec = with_layout(
                self._spec, dp=layout.dp, micro_batch_size=layout.micro_batch_size, grad_accum=layout.grad_accum,
                source="RebuildParallelGroup.layout",
            )  # fmt: skip
        except JobSpecError as e:
            raise TrainingFault("config_error", _one_line(e)) from None
        if spec.world_size != self._world:
            raise TrainingFault(
                "config_error",
                f"RebuildParallelGroup.layout: dp {layout.dp} needs {spec.world_size} ranks, the group has {self._world}",
            )
        before = self._layout_text()
        self._spec, self._spec_json = spec, spec_to_json(spec)
        _log.info("layout_taken", step=self._step, before=before, now=self._layout_text())

    def _layout_text(self) -> str:
        d = self._spec.data
        return f"dp {self._spec.parallel.dp} x micro_batch_size {d.micro_batch_size} x grad_accum {d.grad_accum}"

    def _await_ready(self) -> None:
        """Take the ParallelReady of a rebuilt group off the control inbox (other commands
        stay queued, in order) and take its coordinates."""
        kept = []
        while not isinstance(msg := self._control.get(), engine_pb2.ParallelReady):
            kept.append(msg)
        for other in kept:
            self._control.put(other)
        self._rank, self._world = msg.rank, msg.world_size
        self._dp_rank, self._dp_size = msg.dp_rank, max(msg.dp_size, 1)

    def _heal(self, *, has_state: bool) -> engine_pb2.StateHealed:
        """HealState with a template of this rank's state; restore what came unless this
        rank is the source. ``has_state`` false: a replacement, nothing to give."""
        ask = engine_pb2.HealState(job_id=self._job_id, step=self._step, has_state=has_state)
        if has_state and self._last_report is not None and self._last_report.step == self._step:
            ask.last_step.CopyFrom(self._last_report)  # for a peer one step behind (_report_taken_over)
        reply = self._p.store(ask, self._snapshot(self._step))
        healed = reply.message
        if healed.source_rank != self._rank or not has_state:
            self._restore(reply.payload)
        return healed

    def _run_step(self, step: int) -> None:
        """One optimizer step: data -> (forward, backward) x grad_accum -> reduce ->
        unscale/check -> update or skip -> report."""
        p, accum = self._p, self._spec.data.grad_accum
        t0 = time.perf_counter()
        if self._init.rebuild_in_place:  # what a step cut short by a broken group takes back
            self._rng_at_step = rng_streams.capture()
        mark, warm = self._mark, self._warm
        mark.enter(ph.DATA_WAIT)
        batches = [self._next_batch("train") for _ in range(accum)]
        data_wait = time.perf_counter() - t0
        local_tokens = sum(mb.tokens for mb, _ in batches)
        # Global normalisation (module docstring): back-propagate with a normaliser every rank
        # knows now (its token capacity); L2-4 corrects the gradients by the global count later.
        normalizer = float(self._spec.data.micro_batch_size * self._spec.data.seq_len * accum)
        fwd_s = bwd_s = loss_sum = 0.0
        for i, (_, batch) in enumerate(batches):
            p.reduction(engine_pb2.ArmReduction(sync=i == accum - 1))
            mark.enter(ph.FORWARD if warm else ph.COMPILE)
            fwd = p.forward(engine_pb2.RunForward(training=True), batch.input_ids)
            mark.enter(ph.BACKWARD if warm else ph.COMPILE)
            bwd = p.backward(
                engine_pb2.RunBackward(
                    normalizer=normalizer, loss_scale=self._loss_scale, backward=True, micro_steps=accum
                ),
                (fwd.payload, batch.labels),
            ).message
            fwd_s, bwd_s, loss_sum = fwd_s + fwd.message.seconds, bwd_s + bwd.seconds, loss_sum + bwd.loss_sum
            # The logits (micro-batch x sequence x vocabulary, the largest activation) and
            # their graph: freed now, not while the next micro-batch's forward runs.
            del fwd
        # This rank's overflow verdict and norm pieces first; L3-5 all-reduces them with the
        # token count and loss sum (one collective), so every rank (every mesh axis) skips or
        # applies together; L2-4 then unscales (and renormalises) and moves the scale.
        mark.enter(ph.OPTIMIZER)
        check = p.precision(engine_pb2.UnscaleAndCheck(step=step)).message
        reduced = p.reduction(engine_pb2.ReduceGradients(
            local_loss_sum=loss_sum, local_tokens=local_tokens, local_found_inf=check.found_inf,
            replicated_squares=check.replicated_squares, sharded_squares=check.sharded_squares,
            held_commands=self._commands.window(),
        )).message  # fmt: skip
        self._commands.agree(reduced.commands_agreed)  # (in force at this step's boundary: _stop_requested_at_boundary)
        mark.enter(ph.OPTIMIZER)
        self._warm = True
        adjusted = p.precision(engine_pb2.ScaleLoss(
            step=step, found_inf=reduced.found_inf, grad_squares=reduced.grad_squares,
            grad_scale=self._dp_size * normalizer / max(reduced.global_tokens, 1),
        )).message  # fmt: skip
        self._loss_scale, self._scaler_state = adjusted.loss_scale, adjusted.state
        fault, action, order, skip_reason = self._judge(step, reduced, adjusted)  # blocks on a fault: L1 decides
        lr = self._lr_at(step)
        opt_s = 0.0
        if skip_reason:
            self._skipped += 1
        else:
            opt_s = p.optimizer(engine_pb2.ApplyUpdate(step=step, learning_rate=lr)).message.seconds
        self._position = batches[-1][0].next
        self._components = batches[-1][0].components  # a mixture's: each dataset's own position
        step_s = time.perf_counter() - t0
        tokens = reduced.global_tokens
        self._emit(done := engine_pb2.StepCompleted(
            job_id=self._job_id, rank=self._rank, step=step,
            loss=reduced.global_loss_sum / tokens if tokens else float("nan"),
            learning_rate=lr, grad_norm=adjusted.grad_norm, tokens=tokens,
            tokens_per_second=tokens / step_s, step_seconds=step_s, data_wait_seconds=data_wait,
            forward_seconds=fwd_s, backward_seconds=bwd_s, reduction_seconds=reduced.seconds,
            optimizer_seconds=opt_s, loss_scale=check.loss_scale, skipped=bool(skip_reason), skip_reason=skip_reason,
            fault=fault, action=action, standing_order=order, commands_agreed=self._commands.agreed_seq,
            epoch=self._position.epoch, unix_time=time.time(), world_size=self._world,
            flops_per_token=self._flops_per_token,
            mfu=tokens / step_s * self._flops_per_token / (self._peak_flops * self._world),
        ))  # fmt: skip
        self._last_report = done
        every = self._spec.metrics.log_every
        if every and _due(step, every, step == self._spec.steps):
            _log.info(step_line(done), once=True)  # the same on every rank: rank 0 writes it
            if self._components:
                _log.info(mixture_line(step, self._components), once=True)

    def _judge(
        self, step: int, reduced: engine_pb2.GradientsReduced, adjusted: engine_pb2.LossScaleAdjusted
    ) -> tuple[int, int, int, str]:
        """What to do with the step: (StepFaultKind, StepVerdictAction, standing order id,
        skip reason: "" to apply it, "non_finite_loss" or "overflow" to skip its update).
        Both inputs are all-rank values (the loss sum and the overflow flag came through
        L3-5's all-reduce, the scale moved by that verdict), so every rank finds the same
        fault at the same step and gets the same verdict.

        A fault (a non-finite loss; non-finite gradients; those at the minimum loss scale)
        follows its kind's standing order, else blocks here until L1-1's verdict
        (:meth:`_verdict`). The ``fault_policy.overflow_storm_steps``-th consecutive skipped
        step is a fault of its own (overflow_storm), decided likewise: apply or skip goes on
        with the step skipped and the count restarted.

        Raises:
            _Released: the verdict stops the job or relaunches its ranks.
        """
        loss = reduced.global_loss_sum
        if not math.isfinite(loss):
            kind, reason = engine_pb2.STEP_FAULT_NON_FINITE_LOSS, "non_finite_loss"
            detail = f"training loss is {loss} at step {step} ({reduced.global_tokens} tokens)"
        elif reduced.found_inf and adjusted.at_minimum:
            kind, reason = engine_pb2.STEP_FAULT_LOSS_SCALE_AT_MINIMUM, "overflow"
            detail = (
                f"gradients are not finite at step {step} and the loss scale backed off to its minimum "
                f"{adjusted.loss_scale:g} (precision.loss_scale.min_scale); fp16 cannot hold these gradients"
            )
        elif reduced.found_inf:
            kind, reason = engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW, "overflow"
            detail = f"gradients are not finite at step {step} (loss scale {adjusted.loss_scale:g} after it)"
        else:
            self._consecutive_skips = 0
            return engine_pb2.STEP_FAULT_KIND_UNSPECIFIED, engine_pb2.STEP_VERDICT_ACTION_UNSPECIFIED, 0, ""
        action, order = self._verdict(step, kind, detail, reduced, adjusted)
        if action == engine_pb2.STEP_APPLY:
            self._consecutive_skips = 0
            return kind, action, order, ""
        self._consecutive_skips += 1
        storm_steps = self._spec.fault_policy.overflow_storm_steps
        if self._consecutive_skips >= storm_steps:
            kind = engine_pb2.STEP_FAULT_OVERFLOW_STORM
            self._verdict(step, kind, (
                f"{self._consecutive_skips} consecutive steps skipped (up to step {step}, last: {reason}, loss scale "
                f"{adjusted.loss_scale:g}); fault_policy.overflow_storm_steps is {storm_steps}"
            ), reduced, adjusted)  # fmt: skip
            self._consecutive_skips = 0
        return kind, engine_pb2.STEP_SKIP, order, reason

    def _verdict(
        self,
        step: int,
        kind: int,
        detail: str,
        reduced: engine_pb2.GradientsReduced,
        adjusted: engine_pb2.LossScaleAdjusted,
    ) -> tuple[int, int]:
        """(StepVerdictAction, standing order id) for a fault of ``kind`` at ``step``: its
        standing order in force, else L1-1's verdict. Blocked state (seed L2-1: 异常阻塞,
        循环阻塞等待事件): report StepFaultReported and wait at this boundary, nothing applied.
        No verdict within ``fault_policy.verdict_seconds``: report it again (a reminder) and
        keep waiting; the loop never decides a fault itself.

        Raises:
            _Released: the verdict is STEP_RELAUNCH or STEP_STOP.
        """
        with self._lock:
            order = self._orders.get(kind)
            if order is not None and step <= self._revoked.get(order.id, step):
                return order.action, order.id
        tokens = reduced.global_tokens
        report = engine_pb2.StepFaultReported(
            job_id=self._job_id, rank=self._rank, step=step, kind=kind, detail=detail,
            loss=reduced.global_loss_sum / tokens if tokens else float("nan"), loss_scale=adjusted.loss_scale,
            consecutive_skips=self._consecutive_skips,
        )  # fmt: skip
        phase, self._phase = self._phase, "blocked"
        self._mark.enter(ph.FAULT_WAIT)  # no progress deadline while L1 decides
        wait_s = self._spec.fault_policy.verdict_seconds
        t0 = time.monotonic()
        self._emit(report)  # (not under the lock: an in-process L1 may answer inside this call)
        while True:
            with self._verdict_ready:
                self._verdict_ready.wait_for(lambda: (step, kind) in self._verdicts, timeout=wait_s)
                verdict = self._verdicts.pop((step, kind), None)
            if verdict is not None:
                break
            report.reminder += 1
            report.waited_seconds = time.monotonic() - t0
            _log.warning(
                "no verdict on a step fault yet",
                step=step,
                kind=engine_pb2.StepFaultKind.Name(kind),
                waited_s=round(report.waited_seconds, 1),
                reminder=report.reminder,
            )
            self._emit(report)
        self._phase = phase
        self._mark.enter(ph.OPTIMIZER)
        if verdict.action in (engine_pb2.STEP_APPLY, engine_pb2.STEP_SKIP):
            return verdict.action, 0
        raise _Released(verdict)

    def _evaluate(self, step: int) -> None:
        """Loss on the held-out split: the same eval.batches micro-batches each time (no
        shuffle, from the start), all ranks' sums reduced to one global mean."""
        self._phase = "evaluating"
        self._mark.enter(ph.EVALUATION, total=self._spec.eval.batches)
        t0 = time.perf_counter()
        self._open_stream("val", data_pb2.DataPosition(), repeat=False, max_batches=self._spec.eval.batches)
        loss_sum, tokens = 0.0, 0
        while (item := self._next_batch("val")) is not None:
            batch = item[1]
            fwd = self._p.forward(engine_pb2.RunForward(training=False), batch.input_ids)
            done = self._p.backward(
                engine_pb2.RunBackward(normalizer=1.0, loss_scale=1.0, backward=False), (fwd.payload, batch.labels)
            ).message
            loss_sum, tokens = loss_sum + done.loss_sum, tokens + done.tokens
            self._mark.advance()
        reduced = self._p.reduction(engine_pb2.ReduceGradients(local_loss_sum=loss_sum, local_tokens=tokens)).message
        n = reduced.global_tokens
        self._emit(engine_pb2.EvalCompleted(
            job_id=self._job_id, rank=self._rank, step=step,
            loss=reduced.global_loss_sum / n if n else float("nan"), tokens=n, seconds=time.perf_counter() - t0,
        ))  # fmt: skip
        self._phase = "stepping"

    def _save(self, step: int) -> None:
        """Every rank writes its part of the checkpoint; rank 0 commits the version."""
        self._phase = "saving"
        self._mark.enter(ph.CHECKPOINT_STAGING)
        spec = self._spec
        self._p.store(store_pb2.SaveCheckpoint(
            job_id=self._job_id, step=step, rank=self._rank, write_async=spec.checkpoint.async_,
            baseline_every=spec.checkpoint.baseline_every,
        ), self._snapshot(step))  # fmt: skip
        if self._rank == 0:
            checked = spec.integrity.replica_check_every_steps > 0 and self._dp_size > 1
            self._p.store(store_pb2.CommitCheckpoint(
                job_id=self._job_id, step=step, world_size=self._world, spec_json=self._spec_json,
                keep_last=spec.checkpoint.keep_last, keep_every=spec.checkpoint.keep_every,
                # Whether this version's replicas agreed: a check at its step (before the save), or
                # a later commit of these ranks naming a later check (the store's catalog decides).
                replica_checked=checked, replica_agreed_step=self._agreed_step or 0,
                # Retention never deletes the version this generation of ranks resumed from.
                keep_versions=[self._init.resume_version] if self._init.resume_version else [],
            ))  # fmt: skip
        self._phase = "stepping"

    # ------------------------------------------------------------------ set-up and control

    def _await_setup(self) -> None:
        """Block until the job (InitJob) and the process group (ParallelReady) are here."""
        ready, early = None, []
        while self._init is None or ready is None:
            msg = self._control.get()
            if isinstance(msg, engine_pb2.InitJob):
                self._init = msg
            elif isinstance(msg, engine_pb2.ParallelReady):
                ready = msg
            else:
                early.append(msg)  # e.g. StartTraining already queued: keep it, in order
        for msg in early:
            self._control.put(msg)
        self._rank, self._world = ready.rank, ready.world_size
        self._dp_rank, self._dp_size = ready.dp_rank, max(ready.dp_size, 1)
        self._orders = {order.kind: order for order in self._init.standing_orders}
        try:
            self._spec, self._spec_json = spec_from_json(self._init.spec_json), self._init.spec_json
        except ValueError as e:
            raise TrainingFault("config_error", f"InitJob.spec_json is not a valid job spec: {_one_line(e)}") from None
        if self._spec.world_size != self._world:
            raise TrainingFault(
                "config_error",
                f"job spec needs parallel.dp * tp * pp = {self._spec.world_size} ranks but the process group has {self._world}",
            )

    def _initialise(self) -> None:
        spec, p = self._spec, self._p
        rng_streams.seed(spec.seed, self._rank)  # a checkpoint's streams replace these on resume
        self._lr_at = schedule_for(spec.optimizer, spec.steps)
        loaded = p.shard_loader(engine_pb2.LoadModel(model_json=spec.model.model_dump_json(), seed=spec.seed)).message
        self._num_parameters = loaded.num_parameters
        self._flops_per_token = model_flops_per_token(spec, self._num_parameters)
        self._peak_flops = spec.parallel.peak_tflops_per_device * 1e12
        self._warm = not spec.operators.compile  # the first step compiles forward and backward
        ops = spec.operators
        p.forward(engine_pb2.ConfigureForward(attention=spec.attention, adamw=ops.adamw, compile=ops.compile))
        for name, version, _ in spec.data.datasets:  # (a mixture: every component)
            mounted = p.data(data_pb2.MountDataset(name=name, version=version, verify=False)).message
            if isinstance(mounted, data_pb2.DatasetUnavailable):
                raise TrainingFault(_data_fault_class(mounted), mounted.reason)
            if mounted.vocab_size > spec.model.vocab_size:
                raise TrainingFault(
                    "config_error",
                    f"dataset {name}@{version} has vocab_size {mounted.vocab_size} > model.vocab_size {spec.model.vocab_size}",
                )
        restored_from: dict[str, int] = {}
        healed: engine_pb2.StateHealed | None = None
        if self._init.heal_from_peer:  # a replacement of a lost rank: a live peer's state, not a load
            healed = self._heal(has_state=False)
        elif self._init.resume_version:
            # Copies of the fresh state (keys, shapes, placements, values a checkpoint may lack),
            # handed to L5-1 to be read into.
            template = self._snapshot(self._step)
            loaded = p.store(store_pb2.LoadCheckpoint(version=self._init.resume_version), template)
            self._restore(loaded.payload)
            restored_from = dict(getattr(loaded.message, "bytes_from", {}))  # (chunks read per source)
            loaded_format = data_format(self._loaded_order)
            if loaded_format != DATA_FORMAT:
                raise TrainingFault("config_error", (
                    f"checkpoint {self._init.resume_version} holds a data position of format {loaded_format} "
                    f"({DATA_FORMATS.get(loaded_format, 'unknown')}); this build resumes format {DATA_FORMAT} "
                    f"({DATA_FORMATS[DATA_FORMAT]}): start the job afresh or resume with the build that wrote it"
                ))  # fmt: skip
            changed = data_order_changes(self._loaded_order, data_order(spec, self._dp_size))
            if changed:  # (the dp size alone may change: the position is global)
                raise TrainingFault("config_error", (
                    f"checkpoint {self._init.resume_version} was written with {changed}: its data position "
                    "would not resume exactly"
                ))  # fmt: skip
        elif spec.init_from is not None:  # a new job from existing weights (a resume loads its own instead)
            self._start_from(spec.init_from)
        self._init_precision()  # after the load: a checkpoint's scaler state goes with it
        self._open_stream("train", self._position, repeat=True, max_batches=0)
        if p.metrics is not None:  # where L5-2 writes this job's records besides its own files
            m = spec.metrics
            p.metrics(store_pb2.LogCollectionConfig(
                job_id=self._job_id, tensorboard=m.tensorboard,
                wandb_project=m.wandb.project if m.wandb else "", wandb_mode=m.wandb.mode if m.wandb else "",
            ))  # fmt: skip
        self._emit(engine_pb2.TrainingLoopStarted(
            job_id=self._job_id, rank=self._rank, start_step=self._step,
            num_parameters=self._num_parameters, startup_seconds=time.perf_counter() - self._t_created,
            restored_bytes_from=restored_from, healed=healed is not None,
            healed_from_rank=healed.source_rank if healed is not None else 0,
        ))  # fmt: skip

    def _init_precision(self) -> None:
        """InitPrecision with the spec's policy and, on resume, the checkpoint's scaler
        state (so loading never changes it)."""
        prec = self._spec.precision
        rule = prec.scaling
        msg = engine_pb2.InitPrecision(
            precision=prec.dtype, init_scale=rule.init_scale, growth_factor=rule.growth_factor,
            backoff_factor=rule.backoff_factor, growth_interval=rule.growth_interval,
            hysteresis=rule.hysteresis, min_scale=rule.min_scale, max_grad_norm=self._spec.optimizer.max_grad_norm,
        )  # fmt: skip
        if self._resume_scaler is not None and prec.dtype == "fp16":
            msg.resume.CopyFrom(self._resume_scaler)
        ready = self._p.precision(msg).message
        self._loss_scale, self._scaler_state = ready.loss_scale, ready.state
        self._dynamic_scaling = prec.dtype == "fp16"

    def _await_start(self) -> bool:
        """Block until StartTraining (True) or StopTraining (False: finish at once)."""
        while True:
            msg = self._control.get()
            if isinstance(msg, engine_pb2.StartTraining):
                self._commands.start(msg.command_seq)  # (the group's agreement starts here)
                self._phase = "stepping"
                return True
            if isinstance(msg, engine_pb2.StopTraining):
                self._finish(stopped=True)
                return False

    def _stop_requested_at_boundary(self, step: int) -> str:
        """At the boundary after ``step``, the boundary commands in force here (agreed by
        every rank in this step's reduction or before: the same on every rank): a revoke
        withdraws its standing order after ``step``; then stop (:data:`_STOP`), or pause
        until resumed (""), resumed into a resize (:data:`_RESIZE`: ``ResumeTraining.rebuild``)
        or stopped. An operator's stop or pause that asks for it checkpoints ``step`` first
        (every rank is at the same boundary, so the save's collectives meet); a pause waits
        for that commit before it reports paused (a stop's ``_finish`` waits for it). A
        paused rank stops on the stop it holds, agreed or not: every rank paused here."""
        due = self._commands.due(step)
        with self._lock:
            for msg in due:
                if isinstance(msg, engine_pb2.RevokeStandingOrder):
                    self._revoked[msg.order] = step
        stop = next((m for m in due if isinstance(m, engine_pb2.StopTraining)), None)
        pause = next((m for m in due if isinstance(m, engine_pb2.PauseTraining)), None)
        if stop is not None or pause is None:
            if stop is not None and stop.checkpoint:
                self._checkpoint_boundary(step)
            return _STOP if stop is not None else ""
        if pause.checkpoint:
            self._checkpoint_boundary(step)
            self._p.store(store_pb2.FlushCheckpoint(job_id=self._job_id))
        self._phase = "paused"
        self._emit(engine_pb2.TrainingLoopPaused(job_id=self._job_id, rank=self._rank, step=step))
        while (stop := self._commands.take(engine_pb2.StopTraining, step)) is None:
            msg = self._control.get()
            if isinstance(msg, engine_pb2.ResumeTraining):
                self._phase = "stepping"
                return _RESIZE if msg.rebuild else ""
        if stop.checkpoint:
            self._checkpoint_boundary(step)
        return _STOP

    def _checkpoint_boundary(self, step: int) -> None:
        """Save ``step`` unless its state is durable already (saved at this step, loaded from
        a checkpoint of it, or the initial state). Checked first where replicas are checked:
        an operator's last version is one a check covers, so it can be ``latest``."""
        if self._durable_step != step:
            if self._spec.integrity.replica_check_every_steps and self._dp_size > 1 and self._agreed_step != step:
                self._check_replicas(step)
            self._save(step)
            self._durable_step = step

    def _finish(self, stopped: bool) -> None:
        # Background saves are done (written, committed) before anyone hears of the end.
        self._p.store(store_pb2.FlushCheckpoint(job_id=self._job_id))
        if self._p.metrics is not None:  # after the last record: L5-2 closes the job's sinks
            self._p.metrics(store_pb2.StopLogCollection(job_id=self._job_id, rank=self._rank))
        self._phase = "done"
        self._emit(
            engine_pb2.TrainingLoopFinished(job_id=self._job_id, rank=self._rank, step=self._step, stopped=stopped)
        )

    def _next_batch(self, split: str) -> tuple[data_pb2.MicroBatch, Batch] | None:
        """The next micro-batch of ``split`` (None at the end of a finite stream)."""
        while True:
            msg, batch = self._batches[split].get()
            if batch is None or batch.stream is self._streams[split]:
                break  # (else a batch of a stream since replaced: dropped)
        if self._data_fault is not None:
            raise TrainingFault(self._data_fault_class, self._data_fault)
        if batch is None:
            if split == "train":
                raise TrainingFault("data_exhausted", "the training stream ended although it repeats epochs")
            return None
        return msg, batch

    def _open_stream(self, split: str, start: data_pb2.DataPosition, *, repeat: bool, max_batches: int) -> None:
        d = self._spec.data
        pack = d.pack == "pack"
        start = data_pb2.DataPosition(epoch=start.epoch, row=start.row, format=start.format)
        mixture = []
        if d.mixture is not None:  # the blended sequence of services/data/mixture.py; positions in its format
            start.format = MIXTURE_FORMAT
            mixture = [
                data_pb2.MixtureComponent(mount=data_pb2.MountDataset(name=n, version=v), weight=w)
                for n, v, w in d.datasets
            ]
            _log.info("data mixture stream", split=split, start_row=start.row, datasets=d.label)
        self._streams[split] = self._p.data(data_pb2.OpenStream(
            mount=data_pb2.MountDataset(name=d.name, version=d.version, verify=False) if not mixture else None,
            mixture=mixture,
            prefetch=data_pb2.SetPrefetch(watermark=d.prefetch.watermark, threads=d.prefetch.threads),
            shuffle=data_pb2.ShufflePlan(seed=d.shuffle_seed, epoch=start.epoch, enabled=d.shuffle and split == "train"),
            filter=data_pb2.FilterRules(
                min_tokens=d.filter.min_tokens, max_tokens=d.filter.max_tokens,
                banned_bytes=d.filter.banned_bytes.encode("utf-8"), banned_tokens=d.filter.banned_tokens,
            ),
            packer=data_pb2.PackerConfig(
                seq_len=d.seq_len, micro_batch_size=d.micro_batch_size, pad_id=d.pad_id,
                mode=data_pb2.PACK if pack else data_pb2.PAD, separator_id=0 if pack else -1,
                rank=self._dp_rank, world_size=self._dp_size,  # the deal; tp/pp peers read the same data
            ),
            split=split, start=start, repeat=repeat, max_batches=max_batches,
        )).payload  # fmt: skip

    def _snapshot(self, step: int) -> Snapshot:
        """A copy of the rank's state at ``step``: the model's and the optimizer's slots
        (ExportState) and the loop's own, under one version, to be written or read into (no
        digests: the writer hashes what it writes, a load's snapshot is digested when read).
        Raises InconsistentSnapshot if a reply is not a slot of that step and version."""
        self._snapshots += 1
        version = f"{self._job_id}@{step}#{self._snapshots}"
        ask = engine_pb2.ExportState(step=step, version=version)
        state = LoopState(self).state_dict()
        own = Slot.copy_of("train", Module.L2_TRAINING_LOOP, step, version, state, digest=False)
        return Snapshot.of([self._p.shard_loader(ask).payload, self._p.optimizer(ask).payload, own])

    def _restore(self, snapshot: Snapshot) -> None:
        """Restore every slot of ``snapshot``: the model's and the optimizer's by RestoreState
        (each owner copies its slot in), the loop's own here.

        Raises:
            InconsistentSnapshot, SlotDigestMismatch: not one snapshot of one step and version
                (checked before anything is restored), or a slot changed since it was taken
                (its owner refuses it; what was restored before it is not to be trained on:
                the loop fails and L1 decides).
        """
        if not isinstance(snapshot, Snapshot):
            raise InconsistentSnapshot(f"restore: expected a Snapshot, got {type(snapshot).__name__}")
        snapshot.check(RANK_SLOTS, verify=False)  # structure; each owner checks its slot's digest
        for key, port in (("model", self._p.shard_loader), ("optim", self._p.optimizer)):
            slot = snapshot.slots[key]
            port(engine_pb2.RestoreState(step=slot.step, version=slot.version, digest=slot.digest), slot)
        own = snapshot.slots["train"]
        own.check_restore("train", Module.L2_TRAINING_LOOP, snapshot.step, snapshot.version, own.digest)
        LoopState(self).load_state_dict(own.state_dict())

    def _start_from(self, init_from: InitFromSpec) -> None:
        """``init_from``: the model's weights (and with ``weights+optimizer`` the optimizer's
        state) of a committed version of another job, or of a Hugging Face directory, read by
        L5-1's rank side into copies of the fresh state like a resume load (only those slots),
        then handed to their owners (RestoreState). Nothing else is taken: the step stays 0,
        the data position, the LR schedule, the RNG streams and the loss scale are the new
        job's. (``model.freeze`` already applied by the shard loader, whatever was loaded.)

        Raises: the load's errors (CheckpointError: refused, unreadable, corrupt, or weights
        that do not fit this model, naming the tensor), InconsistentSnapshot."""
        keys = ("model", "optim") if init_from.load == "weights+optimizer" else ("model",)
        fresh = self._snapshot(self._step)
        template = Snapshot.of([fresh.slots[k] for k in keys])
        ask = (
            store_pb2.LoadCheckpoint(version=init_from.checkpoint)
            if init_from.checkpoint
            else store_pb2.LoadCheckpoint(hf_directory=init_from.hf)
        )
        try:
            loaded = self._p.store(ask, template).payload
        except ModuleFailed as e:
            if e.failure_cause != route_pb2.FAILURE_INVALID_INPUT:
                raise  # corrupt, unreachable, ...: L5-1's failure, reported and decided as any load's
            # Refused as asked (an unknown version, weights of another shape): the spec names a
            # source this job cannot start from, the same on every relaunch. The loop's own
            # fault, so it is graded (a load's SnapshotFailed alone is left to L1-1, which acts
            # on it for a recovery's load only: a start would wait).
            source = f"init_from.checkpoint: {init_from.checkpoint}" if init_from.checkpoint else "init_from.hf"
            raise TrainingFault("config_error", f"{source}: {e.error}") from None
        loaded.check({k: fresh.slots[k].owner for k in keys}, verify=False)
        for key, port in (("model", self._p.shard_loader), ("optim", self._p.optimizer)):
            if key in keys:
                slot = loaded.slots[key]
                if key == "optim":
                    slot = _own_hyperparameters(slot, fresh.slots[key])
                port(engine_pb2.RestoreState(step=slot.step, version=slot.version, digest=slot.digest), slot)
        _log.info("init_from loaded", source=loaded.version, step_of_source=loaded.step, slots=list(keys))

    @property
    def _job_id(self) -> str:
        return self._init.job_id if self._init is not None else ""


# What follows a step boundary besides the next step (TrainingLoop._boundary).
_STOP, _RESIZE = "stop", "resize"

# What the checkpoint's data position depends on (LoopState ``data_order``), in this order:
# a resume that changes one of them would not continue the same global sample sequence. The
# dp size may change (the global batch split another way: batch_packer.py's deal).
DATA_ORDER = (
    "data.shuffle_seed",
    "data.shuffle",
    "data.seq_len",
    "data.pack",
    "global batch rows (data.micro_batch_size x data.grad_accum x parallel.dp)",
    "data position format",
    "data.mixture",  # (after the format: a checkpoint without it read a single dataset, 0)
)
# The format of ``data_position`` (the last value of ``data_order``; a checkpoint whose
# data_order has no such value is format 1).
DATA_FORMATS = {
    1: "[epoch, document, offset] of the epoch's document order",
    2: "[epoch, row] of the epoch's ordered packed rows",
}
DATA_FORMAT = 2


# A mixture's position format (services/data/blend.py FORMAT): [0, blended row].
MIXTURE_FORMAT = "mix-v1"
_FORMAT_AT = DATA_ORDER.index("data position format")


def mixture_id(spec: JobSpec) -> int:
    """0 for one dataset; for a mixture a 63-bit digest of its datasets and normalised
    weights (what its blended rows mean)."""
    d = spec.data
    if d.mixture is None:
        return 0
    total = sum(w for *_, w in d.datasets)
    text = ";".join(f"{n}@{v}={w / total!r}" for n, v, w in d.datasets)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def data_order(spec: JobSpec, dp_size: int) -> tuple[int, ...]:
    """The values of :data:`DATA_ORDER` for ``spec`` at ``dp_size`` (data.pack: 1 pack, 0 pad)."""
    d = spec.data
    rows = d.micro_batch_size * d.grad_accum * dp_size
    return d.shuffle_seed, int(d.shuffle), d.seq_len, int(d.pack == "pack"), rows, DATA_FORMAT, mixture_id(spec)


def data_format(loaded: tuple[int, ...] | None) -> int:
    """The data position format a checkpoint's ``data_order`` names (1 when it names none)."""
    return loaded[_FORMAT_AT] if loaded and len(loaded) > _FORMAT_AT else 1


def mixture_line(step: int, components) -> str:
    """Where each dataset of a mixture stands after ``step``: rows taken, its own epoch/row."""
    return f"step {step} data mixture: " + ", ".join(
        f"{c.dataset} rows {c.rows} at {c.position.epoch}/{c.position.row}" for c in components
    )


def data_order_changes(loaded: tuple[int, ...] | None, now: tuple[int, ...]) -> str:
    """The empty string when a checkpoint's data order is this job's; else one line naming
    each field that changed, its value then and now."""
    loaded = tuple(loaded or ())[: len(now)]
    if len(loaded) == _FORMAT_AT + 1:  # written before data.mixture: one dataset
        loaded = (*loaded, 0)
    loaded = loaded + (None,) * (len(now) - len(loaded))
    return "; ".join(
        f"{name} {_shown(name, a)} (this job: {_shown(name, b)})"
        for name, a, b in zip(DATA_ORDER, loaded, now, strict=True)
        if a != b
    )


def _shown(name: str, value: int | None) -> object:
    if value is None:
        return "(none)"
    if name == "data.shuffle":
        return bool(value)
    if name == "data.pack":
        return "pack" if value else "pad"
    if name == "data.mixture":
        return f"mixture {value:016x}" if value else "one dataset"
    return value


def model_flops_per_token(spec: JobSpec, num_parameters: int) -> float:
    """Training FLOPs per token: 6N (forward + backward of every weight) plus attention,
    12 * n_layers * d_model * seq_len (PaLM, Chowdhery et al. 2022, appendix B)."""
    m = spec.model
    return 6.0 * num_parameters + 12.0 * m.n_layers * m.d_model * spec.data.seq_len


def _own_hyperparameters(loaded: Slot, fresh: Slot) -> Slot:
    """An ``init_from`` optimizer slot: the source's moments and step counts (``state``)
    with this job's ``param_groups`` (betas, eps, weight decay: the spec's, not the source
    job's; either layout, nested or flattened by FQN), digested anew. (``fresh`` was the
    load's template, read into in place: its tensors are the source's now, its plain values,
    the param_groups' numbers among them, are still this job's.)"""
    state = loaded.state_dict()
    mine = fresh.state_dict()
    for key in [k for k in state if k == "param_groups" or k.startswith("param_groups.")]:
        state[key] = mine[key]
    return Slot.copy_of(loaded.key, loaded.owner, loaded.step, loaded.version, state)


def step_line(done: engine_pb2.StepCompleted) -> str:
    """A step's line in the rank log: ``step 120 loss 2.3141 lr 2.9e-03 grad_norm 0.84 tok/s 12345``
    (the StepCompleted's values, rounded for reading; the store keeps them exact)."""
    line = (
        f"step {done.step} loss {done.loss:.4f} lr {done.learning_rate:.1e} "
        f"grad_norm {done.grad_norm:.4g} tok/s {done.tokens_per_second:.0f}"
    )
    return f"{line} skipped ({done.skip_reason})" if done.skipped else line


def _due(step: int, every: int, at_end: bool) -> bool:
    return (every > 0 and step % every == 0) or at_end


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:_DETAIL_CHARS]


def classify_fault(exc: BaseException) -> tuple[str, str]:
    """(fault_class, one-line detail) for an exception raised in a rank. The class is the
    one a typed exception declares (``fault_class``: TrainingFault's, CheckpointError's,
    RendezvousFailed's, a ModuleFailed's original's), or ``boundary_violation``; otherwise ""
    (L1-3 classes it by the failure's typed cause: ``services/contract/failures.py``). Never
    read from the exception's text."""
    fault_class = getattr(exc, "fault_class", None)
    if fault_class:
        return fault_class, _one_line(exc)
    detail = f"{type(exc).__name__}: {_one_line(exc)}"[:_DETAIL_CHARS]
    if isinstance(exc, BoundaryViolation):
        return "boundary_violation", detail
    return "", detail
