"""The training loop (L2-1) composed: its state, the commands from L1 and the events from below
(handlers), the run from set-up to the end or a stop, and a failure's report.

Each other concern is a mixin in its own file (step, step faults, boundary, evaluation,
checkpoints, recovery, start-up, data streams); ``TrainingLoop`` joins them. The package
docstring (``__init__.py``) describes the module as a whole."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
from google.protobuf.message import Message

from services.common import phase as ph
from services.common.boundary_commands import HeldCommands
from services.common.device_peaks import UNKNOWN_PEAK, Peak
from services.contract import Module, data_pb2, engine_pb2, route_pb2, store_pb2
from services.contract.bus import Emitter
from services.contract.failures import failure_of
from services.contract.frozen import FrozenConfig
from services.engine.step_profiler import StepProfiler
from services.engine.training_loop.boundary import _RELOAD, _RESIZE, _STOP, Boundary
from services.engine.training_loop.checkpoints import Checkpoints
from services.engine.training_loop.data_stream import DataStream
from services.engine.training_loop.evaluation import Evaluation
from services.engine.training_loop.evaluation_job import EvaluationJob
from services.engine.training_loop.faults import _data_fault_class, _one_line, _Released, classify_fault
from services.engine.training_loop.inbox import Inbox
from services.engine.training_loop.ports import Batch, LoopPorts
from services.engine.training_loop.profiling import Profiling
from services.engine.training_loop.recovery import Recovery
from services.engine.training_loop.sampling import Sampling
from services.engine.training_loop.startup import Startup
from services.engine.training_loop.step import Step
from services.engine.training_loop.step_faults import StepFaults
from services.jobspec import JobSpec

_log = structlog.get_logger("training_loop")


class TrainingLoop(
    Step,
    StepFaults,
    Evaluation,
    Sampling,
    EvaluationJob,
    Boundary,
    Checkpoints,
    Recovery,
    Startup,
    DataStream,
    Profiling,
):
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
        peak: Callable[[], Peak] = lambda: UNKNOWN_PEAK,
        profiler: Callable[[int], Any] = lambda rank: StepProfiler(rank, "cpu"),
        evaluator: Callable[..., Any] | None = None,
    ):
        """``read_ahead``: decoded micro-batches held per stream; ``started_at``: the
        process's ``time.perf_counter()`` at start, for ``startup_seconds``; ``phase``: the
        rank's phase marker, set at this loop's phase boundaries (services/common/phase.py);
        ``peak``: gives the device's peak MFU is measured against, asked once the job's
        layout placed the rank on its device (the composition root's: the loop
        never touches a device); ``profiler``: a new profile of the given rank (a
        ``StepProfiler`` on the rank's device: the composition root knows it); ``evaluator``:
        runs an evaluation job's command (services/rank/evaluation_command.py)."""
        self._emit = emit
        self._mark = phase
        self._evaluator = evaluator
        self._warm = True  # False until the first step ran with operators.compile (it compiles)
        self._p = ports
        self._t_created = time.perf_counter() if started_at is None else started_at
        self._control: queue.Queue = queue.Queue()
        # (the data relay that fills them is woken at half: inbox.py)
        self._batches = {s: Inbox(max(1, read_ahead)) for s in ("train", "val")}
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
        self._peak_of = peak
        self._profiler_of = profiler
        self._peak = UNKNOWN_PEAK
        self._peak_flops = UNKNOWN_PEAK.tflops * 1e12
        self._lr_at = None
        # standby | stepping | waiting_data | evaluating | saving | paused | blocked | rebuilding | released
        # | frozen | fault_wait | loading | done | failed
        self._phase = "standby"
        # L1-1's FreezeTraining (issue 29 item 9): held for inspection before its decision on a
        # fault runs; the loop steps no further (``_hold``). A relaunch or a stop ends the held
        # process; a rebuild or shrink in place thaws its survivors (``FreezeTraining.thaw``).
        self._frozen: engine_pb2.FreezeTraining | None = None
        self._thawed = threading.Event()
        self._reload_version = ""  # the version a rollback in place loads (ResumeTraining.reload_version)
        # L1-1's decision on the fault this loop waits on in its loop (an ignore's go-on, a
        # rollback's reload): the step a fault wait is at (0: none), and a decision that came
        # before the wait began, with the step it was for (a peer's report can be decided while
        # this rank still leaves the check that found the fault).
        self._go_on_lock = threading.Lock()
        self._waiting_at = 0
        self._early: tuple[int, engine_pb2.ResumeTraining] | None = None

    # ------------------------------------------------------------------ L1 commands

    def init_job(self, msg: engine_pb2.InitJob, payload: Any = None) -> None:
        """The job (once). Raises ConfigFrozen on a second InitJob."""
        self._control.put(self._job.set(msg))

    def start_training(self, msg: engine_pb2.StartTraining, payload: Any = None) -> None:
        self._control.put(msg)

    def pause_training(self, msg: engine_pb2.PauseTraining, payload: Any = None) -> None:
        """Held until the ranks agree on its boundary (module docstring, "Boundary commands");
        one with ``checkpoint`` also wakes a paused loop: it saves the step it is paused at and
        stays paused (a drain of a pause whose save failed). Raises UnsequencedCommand (``seq`` 0)."""
        if self._commands.receive(msg) and msg.checkpoint and self._phase == "paused":
            self._control.put(msg)

    def resume_training(self, msg: engine_pb2.ResumeTraining, payload: Any = None) -> None:
        """Resume a paused loop; ``rebuild``: into a resize (module docstring), only while paused
        (else dropped: one left queued would start at the next pause); ``reload_version``: into
        a rollback in place (``_reload``), from a pause or from a fault wait (issue 29 item 9);
        ``go_on_at_step``: a loop waiting for L1-1's decision on a fault at that step goes on as
        it is (the policy ignored it)."""
        if msg.go_on_at_step or (msg.reload_version and self._phase != "paused"):
            # A decision on a fault wait (a reload outside a pause is a rollback of one: the
            # operator's comes to a paused loop). Queued once, only to the wait at its step (every
            # rank's report of the fault is decided: a second copy queued would be left there);
            # one that comes before the wait is kept for it (a reload was dropped there, and the
            # rollback in place then waited for this rank for good: seen at load 30).
            step = msg.go_on_at_step or self._step
            with self._go_on_lock:
                if self._waiting_at == step:
                    self._waiting_at = 0
                    self._control.put(msg)
                elif not self._waiting_at:
                    self._early = (step, msg)
                else:
                    _log.warning("fault_decision_ignored", step=self._step, waiting_at=self._waiting_at)
            return
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

    def freeze_training(self, msg: engine_pb2.FreezeTraining, payload: Any = None) -> None:
        """Hold this rank alive and idle for inspection (py-spy, logs) until L1-1's decision on
        a fault runs (``fault_policy.freeze_seconds``): its beats say PHASE_FROZEN from now on
        (no progress deadline); a loop blocked on a step fault keeps waiting for its verdict, a
        failed rank for its release, one still stepping stops at its next step boundary.
        ``thaw``: the hold is over and the rank goes on where it was (a rebuild in place keeps it)."""
        if msg.thaw:
            if self._frozen is not None:
                self._frozen = None
                self._mark.thaw()
                _log.warning("thawed", step=self._step, phase=self._phase)
            self._thawed.set()
            return
        self._thawed.clear()
        self._mark.freeze()
        self._frozen = msg
        _log.warning(
            "frozen_for_inspection", reason=msg.reason, until_unix=msg.until_unix, step=self._step, phase=self._phase
        )

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
                self._run_evaluation_job() if self._spec.evaluation is not None else self._train()
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
        if self._profile is not None:  # (its files are of no use now)
            self._profile.profiler.discard()
            self._profile = None
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
                    if self._frozen is not None:
                        self._hold()
                    step = self._step + 1
                    self._run_step(step)
                    self._step = boundary = step
                after = self._boundary(boundary)
                if after == _STOP:
                    return self._finish(stopped=True)
                boundary = None
                if after == _RELOAD:  # a rollback in place: from the version's step on
                    if not self._reload(self._reload_version):
                        return  # stopped while waiting to start again (finished)
                    continue
                if after != _RESIZE:
                    continue
                reason, in_step, resize = "resize (ResumeTraining.rebuild)", False, True
            except Exception as e:
                if self._waits_in_loop(e):  # (every rank alike: L1-1 may roll back in place)
                    if not self._await_decision(e):
                        return  # stopped while waiting (finished)
                    boundary = None
                    continue
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

    def _hold(self) -> None:
        """Frozen by L1-1 (:meth:`freeze_training`): step no further. Blocks until the process
        ends (the action L1-1 decided, a relaunch or a stop, kills it) or L1-1 thaws it (a
        rebuild in place keeps it: it goes on from here)."""
        self._phase = "frozen"
        self._mark.enter(ph.FROZEN)
        _log.warning("held_at_step_boundary", step=self._step)
        self._thawed.wait()

    def _finish(self, stopped: bool) -> None:
        self._profile_boundary(self._step, ending=True)  # (a profile the run outlasted ends with it)
        # Background saves are done (written, committed) before anyone hears of the end.
        self._p.store(store_pb2.FlushCheckpoint(job_id=self._job_id))
        if self._p.metrics is not None:  # after the last record: L5-2 closes the job's sinks
            self._p.metrics(store_pb2.StopLogCollection(job_id=self._job_id, rank=self._rank))
        self._phase = "done"
        self._emit(
            engine_pb2.TrainingLoopFinished(job_id=self._job_id, rank=self._rank, step=self._step, stopped=stopped)
        )

    @property
    def _job_id(self) -> str:
        return self._init.job_id if self._init is not None else ""
