"""One rank process: the composition root of the L2 engine and L3 compute modules.

    python -m services.rank --session HOST:PORT --job JOB_ID --rank R

Protocol on ``WorkerService.RankSession`` (bidi stream to the node agent). ``{X}`` below is a
routed message travelling as ``RankEvent{routed}`` / ``RankCommand{routed}``: any routed
message by its full name, from its sending module, checked against the route table on
both sides (services/contract/relay.py); only set-up and plumbing have fields of their own.
    1. rank -> agent   RankEvent{job_id, rank, hello: RankHello{job_id, rank, pid}}
    2. agent -> rank   RankCommand{init: InitJob} and RankCommand{assignment: RankAssignment},
                       in either order, each exactly once (frozen afterwards)
    3. the rank builds its modules, joins the process group, loads the model, mounts the
       data and opens its stream, then sends {TrainingLoopStarted}
    4. agent -> rank   {StartTraining}; the rank trains. At any time: {PauseTraining seq},
                       {ResumeTraining}, {StopTraining seq}, {RevokeStandingOrder seq} (at the
                       step boundary every rank agrees on in its step's all-reduce:
                       services/common/boundary_commands.py; a stop before start or while
                       paused: at once), {StepVerdict}, ...: every command an L1 module may
                       send a module of the rank
    5. rank -> agent   {StepCompleted} per step (a beat's steps in the beat's message, a
                       step control decides on at once at once: session_batches.py),
                       {EvalCompleted} per evaluation,
                       {SaveCompleted} per committed checkpoint (rank 0), {TrainingLoopPaused}
                       when paused, any event a module here (or an L4/L5 module its data and
                       store relays speak for) sends an L1 module (failure events included),
                       then its final RankEvent{audit} (route counts) and
                       {TrainingLoopFinished} (exit 0) or {TrainingLoopFailed}. Then the rank
                       half-closes its side and exits;
                       after {TrainingLoopFailed} it first waits for L1 to release it (the agent's
                       signal, or the session's end: exit 1), unless its communicator is
                       broken (it leaves at once, exit 1). A step fault is no failure:
                       the loop blocks for L1-1's verdict (training_loop/step_faults.py).
    At any time after 3: agent -> rank RankCommand{audit: id}, answered rank -> agent
    RankEvent{audit} with the same id (the route counts of this process's bus); rank -> agent
    {BoundaryViolationReported} (as EXT_CONTRACT) for a send refused by its bus or by a
    service it called (relayed up to the fault detector).
    From the hello on, every ``liveness.heartbeat_interval_seconds`` (1 s until InitJob
    says otherwise): rank -> agent RankEvent{heartbeat: the last completed step, whether the
    loop is stepping}, from a side thread that keeps beating while the main thread is blocked
    (in a collective, say), so control tells a stalled rank from a silent one.
A session that ends before the rank sent {TrainingLoopFinished} or {TrainingLoopFailed} means the agent is gone:
the rank exits at once (code 3). SIGTERM ends the process immediately (default action).

Fault hooks (:mod:`services.rank.faults`) wrap the loop's port to the backward unit: tests
inject faults through ``SURGE_FAULT_INJECT``. A non-finite loss or gradient is the loop's
to handle (skip per the spec's policy, or a typed failure).

Wiring: modules never construct each other. Each gets an Emitter for its events and a
CommandPort for each module the route table lets it command; the relays of the other
layers (this session for L1, :mod:`data_client` for L4, :mod:`store_client` and
:mod:`metrics_client` (through the node agent) for L5)
subscribe on the same bus, so every message inside the rank is route-checked. A refused
send (here, or in the data or store service on this rank's request) is reported up the
session as ``BoundaryViolationReported``.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
import structlog
import torch

from services.common import fencing, grpc_waits, paths, stack_dump, thread_names
from services.common.beat_grid import phase_from, seconds_to_next_beat
from services.common.cpu_list import CPU_AFFINITY_ENV, parse_cpu_list
from services.common.device_peaks import device_peak
from services.common.grpc_server import SMALL_MESSAGES, channel
from services.common.logs import configure
from services.common.phase import COLLECTIVE, IDLE, PhaseMarker, profile_export_budget_s
from services.common.process_exit import MEMORY_ERROR_EXIT_CODE, exit_now, last_words
from services.compute.backward_unit import BackwardUnit
from services.compute.forward_unit import ForwardUnit
from services.compute.gradient_reduction import GradientReduction
from services.compute.operator_adapter import OperatorAdapter
from services.compute.pipeline_stage import StageModule, check_pipeline_job, runner_for
from services.compute.samples import SampleGenerator
from services.compute.shard_loader import ShardLoader
from services.contract import Module, audit_pb2, data_pb2, engine_pb2, store_pb2, worker_pb2, worker_pb2_grpc
from services.contract.audit import ViolationReporter, report_of
from services.contract.bus import Bus, CommandPort
from services.contract.comm_guard import install as install_comm_guard
from services.contract.failures import Refusal, set_collective_probe, set_origin
from services.contract.injection import env_error
from services.contract.relay import L1, L4, L5, RANK, Link, Routed, pack
from services.contract.validation import validate_table, validate_wiring
from services.engine.mixed_precision import MixedPrecision
from services.engine.optimizer import Optimizer
from services.engine.parallel_strategy import ParallelStrategy
from services.engine.step_profiler import StepProfiler
from services.engine.training_loop import LoopPorts, TrainingLoop
from services.jobspec import JobSpec, spec_from_json
from services.rank import session_batches
from services.rank.comm_settings import apply_nccl_environment, collective_timeout_s, side_timeout_s
from services.rank.command_delay import CommandDelay
from services.rank.evaluation_command import EvaluationCommand
from services.rank.faults import FaultInjector, StepGuard
from services.state import staging
from services.state.snapshot import RANK_SLOTS
from services.state.state_manager import StateManager

log = structlog.get_logger()
EXIT_FAILED, EXIT_SESSION_LOST = 1, 3  # (MemoryError: MEMORY_ERROR_EXIT_CODE)
SETUP_TIMEOUT_S = 600.0
RANK_MODULES = RANK  # the modules a rank process runs
# Whose events go up the session (to control's L1 modules): the rank's own modules and the
# L4 / L5 modules its data and store relays speak for (a data or store failure routed to L1
# reaches it this way).
SESSION_NEAR = RANK_MODULES | L4 | L5
# What a rank's bus hosts (checked by validate_wiring): its modules, and the relays standing
# in for L1 (the session, every L1 module an event is routed to), L4 (data_client) and L5
# (store_client).
RANK_HOSTED = (
    *sorted(RANK_MODULES),
    *sorted(L1),
    Module.L4_DATASET_VERSIONS,
    Module.L4_BATCH_PACKER,
    Module.L5_CHECKPOINT_MANAGER,
    Module.L5_METRICS_LOGGER,
)
# Events and commands the session's heartbeat reads its state from (what it states, not routing).
_STEPPING = {m.DESCRIPTOR.full_name for m in (engine_pb2.StartTraining, engine_pb2.ResumeTraining)}
_TERMINAL = (engine_pb2.TrainingLoopFinished, engine_pb2.TrainingLoopFailed)


class DataRelay(Protocol):
    def mount(self, msg: data_pb2.MountDataset, payload: Any = None) -> Any: ...
    def open_stream(self, msg: data_pb2.OpenStream, payload: Any = None) -> None: ...


class StoreRelay(Protocol):
    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: Any) -> Any: ...
    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload: Any = None) -> Any: ...
    def flush_checkpoint(self, msg: store_pb2.FlushCheckpoint, payload: Any = None) -> Any: ...
    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: Any) -> Any: ...
    def store_profile(self, msg: store_pb2.StoreProfile, payload: Any) -> Any: ...


class MetricsRelay(Protocol):
    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None: ...
    def log_collection_config(self, msg: store_pb2.LogCollectionConfig, payload: Any = None) -> None: ...
    def stop_log_collection(self, msg: store_pb2.StopLogCollection, payload: Any = None) -> None: ...
    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None: ...
    def on_sample_generated(self, msg: engine_pb2.SampleGenerated, payload: Any = None) -> None: ...
    def on_evaluation_scores(self, msg: engine_pb2.EvaluationScores, payload: Any = None) -> None: ...


class UpRelay(Protocol):
    def send_up(self, routed: Routed, msg: Any, payload: Any = None) -> None: ...


@dataclass
class RankModules:
    loop: TrainingLoop
    parallel: ParallelStrategy
    orchestrator: CommandPort  # L1-1 -> L2-1 (InitJob, Start/Pause/Resume/Stop)
    allocator: CommandPort  # L1-2 -> L2-2 (RankAssignment)
    link: Link  # the session's side of the rank: what L1 sends comes in here


def compose(
    bus: Bus,
    spec: JobSpec,
    device: str,
    *,
    data: DataRelay,
    store: StoreRelay,
    metrics: MetricsRelay,
    up: UpRelay,
    pg_timeout_s: float | None = None,
    started_at: float | None = None,
    guard: StepGuard | None = None,
    phase: PhaseMarker | None = None,
    heals: bool = False,
    side_groups: tuple[str, ...] = (),
) -> RankModules:
    """Build the rank's L2/L3 modules on ``bus`` and subscribe them and the relays.
    ``guard`` wraps the loop's ports to the forward and backward units, the optimizer and the checkpoint
    relay (test-only fault injection). ``phase``: the rank's phase marker, set by the loop and L3-5 at phase
    boundaries and read by the session's beats (services/common/phase.py). ``heals``: this
    rank replaces a lost one and takes its state from a live peer (InitJob.heal_from_peer):
    its DDP wrapper is built without DDP's start-up broadcast, as its rebuilding peers' are.
    ``side_groups``: the gloo groups L2-2 makes at every formation of the world for the
    relays (ParallelStrategy.side_group). ``pg_timeout_s``: a collective's timeout (default:
    from the spec's settings, services/rank/comm_settings.py).

    Raises:
        RouteError, ContractError: the table or this wiring breaks the contract; the rank
            reports it as its failure and exits before it trains (start-up validation).
    """
    validate_table(bus.table)
    check_pipeline_job(spec)  # ValueError: a pp > 1 combination the pipeline path lacks
    staging.keep_buffers(not device.startswith("cpu"))  # snapshot buffers kept off the CPU only (staging.py)
    port, emitter = bus.port, bus.emitter
    adapter = OperatorAdapter(emitter(Module.L3_OPERATOR_ADAPTER), device)
    # (the periodic samples are generated by the unit that runs the model: services/compute/samples.py)
    forward = ForwardUnit(
        emitter(Module.L3_FORWARD_UNIT),
        port(Module.L3_FORWARD_UNIT, Module.L3_OPERATOR_ADAPTER),
        samples=SampleGenerator(device),
    )
    # (The loop names the window in each RunBackward: a resize in place may change it.)
    backward = BackwardUnit(emitter(Module.L3_BACKWARD_UNIT), micro_steps=spec.data.grad_accum)
    marked = {"phase": phase} if phase is not None else {}
    reduction = GradientReduction(emitter(Module.L3_GRADIENT_REDUCTION), sync_at_wrap=not heals, **marked)
    optimizer = Optimizer(spec.optimizer, emitter(Module.L2_OPTIMIZER), implementation=spec.operators.adamw)
    precision = MixedPrecision(
        emitter(Module.L2_MIXED_PRECISION), port(Module.L2_MIXED_PRECISION, Module.L3_OPERATOR_ADAPTER)
    )

    attached: list[bool] = []  # [True] once the model was handed over
    evaluator = EvaluationCommand(paths.run_dir() / "evaluations")

    def handover(model: torch.nn.Module) -> None:
        # The loaded model goes to the units that run or update it; L3-5 finishes its layout
        # first (DDP, hooks; TP, activation checkpointing and FSDP2 were applied on the meta
        # device: services/compute/parallelize.py), in place, so the parameter handles below
        # are the final (possibly sharded) ones.
        run = reduction.attach(model)
        if guard is not None:
            guard.attach(model)  # (test-only: corrupt_weights)
        if attached:
            # Handed over again: the group was rebuilt in place (ddp or none only). The
            # parameters are the same tensors, so L2-3 keeps its moments and L2-4 its list;
            # the forward unit takes the new wrapper (dropping its reference to the old one),
            # and the backward unit starts a fresh accumulation window (a step cut short by
            # the fault left it in the middle of one).
            forward.attach(run)
            backward.attach(model.parameters())
            return
        attached.append(True)
        # pp > 1: the pipeline schedule runs this stage, inside L3-4's RunBackward.
        pipeline = runner_for(model, run, spec, device) if isinstance(model, StageModule) else None
        forward.attach(run, pipeline=pipeline)
        backward.attach(model.parameters(), pipeline=pipeline)
        precision.attach(model.parameters())
        optimizer.attach(model)

    # L3-1 builds the model on the meta device, has L3-5 lay out its parameters there (TP,
    # activation checkpointing, FSDP2), materialises only this rank's shards, then hands over.
    shard_loader = ShardLoader(emitter(Module.L3_SHARD_LOADER), handover, lay_out=reduction.lay_out)
    outage_s = spec.fault_policy.data_outage_seconds  # a peer may wait that long for the data service
    parallel = ParallelStrategy(
        emitter(Module.L2_PARALLEL_STRATEGY),
        port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        model=spec.model,
        parallel=spec.parallel,
        timeout_s=pg_timeout_s or collective_timeout_s(spec.liveness, spec.operators.compile, outage_s),
        side_groups=side_groups,
        side_timeout_s=max(pg_timeout_s or 0.0, side_timeout_s(spec.liveness, spec.operators.compile, outage_s)),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),  # (named when a device it cannot see is refused)
    )
    L = Module.L2_TRAINING_LOOP
    backward_port, precision_port = port(L, Module.L3_BACKWARD_UNIT), port(L, Module.L2_MIXED_PRECISION)
    forward_port, store_port = port(L, Module.L3_FORWARD_UNIT), port(L, Module.L5_CHECKPOINT_MANAGER)
    optimizer_port = port(L, Module.L2_OPTIMIZER)
    loop = TrainingLoop(
        emitter(L),
        LoopPorts(
            shard_loader=port(L, Module.L3_SHARD_LOADER),
            forward=guard.forward(forward_port) if guard else forward_port,
            backward=guard.backward(backward_port) if guard else backward_port,
            reduction=port(L, Module.L3_GRADIENT_REDUCTION),
            optimizer=guard.optimizer(optimizer_port) if guard else optimizer_port,
            precision=precision_port,
            data=port(L, Module.L4_DATASET_VERSIONS),
            store=guard.store(store_port) if guard else store_port,
            metrics=port(L, Module.L5_METRICS_LOGGER),
            parallel=port(L, Module.L2_PARALLEL_STRATEGY),
        ),
        # Fixed at the launch's layout: a resize's larger grad_accum is taken one batch at a time.
        read_ahead=2 * spec.data.grad_accum + 2,
        started_at=started_at,
        peak=functools.partial(
            device_peak,
            spec.parallel.peak_tflops_per_device,
            device,
            spec.precision.dtype,
            spec.parallel.threads_per_rank,
        ),
        profiler=functools.partial(
            StepProfiler,
            device=device,
            export_budget_s=functools.partial(
                profile_export_budget_s, spec.liveness.phase_seconds.profile_export, spec.liveness.stall_step_factor
            ),
            before_export=guard.before_profile_export if guard else None,
        ),
        evaluator=evaluator,
        **marked,
    )
    # Each module handles the routes the table sends it, by handler name (Bus.host; the
    # Protocols in services/contract/handlers.py list them), except those whose route says
    # why it does not (not_handled).
    bus.host(L, loop)
    bus.host(Module.L2_PARALLEL_STRATEGY, parallel)
    bus.host(Module.L2_OPTIMIZER, optimizer)
    bus.host(Module.L2_MIXED_PRECISION, precision)
    bus.host(Module.L3_SHARD_LOADER, shard_loader)
    bus.host(Module.L3_OPERATOR_ADAPTER, adapter)
    bus.host(Module.L3_FORWARD_UNIT, forward)
    bus.host(Module.L3_BACKWARD_UNIT, backward)
    bus.host(Module.L3_GRADIENT_REDUCTION, reduction)
    sub = bus.subscribe
    # Relays standing in for the modules of other processes.
    sub(Module.L4_DATASET_VERSIONS, data_pb2.MountDataset, data.mount)
    sub(Module.L4_DATASET_VERSIONS, data_pb2.OpenStream, data.open_stream)
    # L5-1's rank side: the state manager takes the loop's snapshots (copies) and reads
    # checkpoints into copies of its own; the store relay writes and reads the bytes.
    state = StateManager(bus.emitter(Module.L5_CHECKPOINT_MANAGER), store, RANK_SLOTS)
    sub(Module.L5_CHECKPOINT_MANAGER, store_pb2.SaveCheckpoint, state.save_checkpoint)
    sub(Module.L5_CHECKPOINT_MANAGER, store_pb2.CommitCheckpoint, store.commit_checkpoint)
    sub(Module.L5_CHECKPOINT_MANAGER, store_pb2.FlushCheckpoint, store.flush_checkpoint)
    sub(Module.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, state.load_checkpoint)
    sub(Module.L5_CHECKPOINT_MANAGER, engine_pb2.HealState, state.heal_state)
    # L5-2's records go to the node agent, which sends them to the store (metrics_client.py).
    sub(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, metrics.on_step_completed)
    sub(Module.L5_METRICS_LOGGER, engine_pb2.EvalCompleted, metrics.on_eval_completed)
    sub(Module.L5_METRICS_LOGGER, engine_pb2.SampleGenerated, metrics.on_sample_generated)
    sub(Module.L5_METRICS_LOGGER, engine_pb2.EvaluationScores, metrics.on_evaluation_scores)
    sub(Module.L5_METRICS_LOGGER, store_pb2.LogCollectionConfig, metrics.log_collection_config)
    sub(Module.L5_METRICS_LOGGER, store_pb2.StopLogCollection, metrics.stop_log_collection)
    # A profile's files go to the store directly, on the store relay's channel (profile_upload.py).
    sub(Module.L5_METRICS_LOGGER, store_pb2.StoreProfile, store.store_profile)
    # Every event routed from here to an L1 module goes up the session by its name.
    link = Link(bus, name="rank session", near=SESSION_NEAR, beyond=L1, send=up.send_up)
    link.stand_in()
    modules = RankModules(
        loop=loop,
        parallel=parallel,
        orchestrator=port(Module.L1_ORCHESTRATOR, L),
        allocator=port(Module.L1_RESOURCE_ALLOCATOR, Module.L2_PARALLEL_STRATEGY),
        link=link,
    )
    validate_wiring(bus, RANK_HOSTED)
    return modules


class SessionLost(RuntimeError):
    fault_class = "session_lost"


class Session:
    """The rank's relay of L1: the RankSession stream to its node agent.

    Events go out through a queue drained by gRPC's request iterator (never blocks the
    step), each as ``RankEvent{routed}`` (any routed message by its name,
    :mod:`services.contract.relay`); commands come in on a reader thread, ``RankCommand{routed}``
    checked against the route table and put on the rank's bus. The agent's ``audit``
    question is answered from this process's route counts.
    """

    def __init__(
        self,
        address: str,
        job_id: str,
        rank: int,
        heartbeat_interval_s: float = 1.0,
        phase: PhaseMarker | None = None,
    ):
        self._job_id, self._rank = job_id, rank
        self._phase = phase or PhaseMarker()
        self.process = f"rank {rank} of job {job_id}"
        self._out = session_batches.Outgoing()  # (a step's events do not wake its sender while it rides)
        # the rank, for its modules; what comes down is commands and acks (SMALL_MESSAGES: grpc_server.py)
        self._channel = channel(address, options=SMALL_MESSAGES, module=Module.L2_TRAINING_LOOP)
        self._call = worker_pb2_grpc.WorkerServiceStub(self._channel).RankSession(self._requests())
        self._terminal_sent = threading.Event()
        self._reader: threading.Thread | None = None
        self._delay = CommandDelay.from_env(rank, job_id)  # test-only (SURGE_COMMAND_DELAY); none by default
        self._metrics_acks: Callable[[store_pb2.MetricsAck], None] | None = None
        # What the heartbeat states, from the events and commands this relay carries.
        self._progress_lock = threading.Lock()
        self._step, self._step_seconds, self._stepping = 0, 0.0, False
        self._compute = (0.0, 0.0, 0.0)  # forward, backward, optimizer compute seconds up to `_step`
        self._urgency = session_batches.StepUrgency()
        self._beat_interval = heartbeat_interval_s
        self._beat_phase = phase_from()  # the node's place on the beat grid (its agent's)
        self._closing = threading.Event()
        self._send(hello=worker_pb2.RankHello(job_id=job_id, rank=rank, pid=os.getpid()))
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    @property
    def step(self) -> int:
        """The last step the loop completed (its start step before the first)."""
        with self._progress_lock:
            return self._step

    def set_heartbeat_interval(self, seconds: float) -> None:
        """The job spec's beat period (``liveness.heartbeat_interval_seconds``), from InitJob."""
        self._beat_interval = seconds
        self._phase.stated_every(seconds)

    def receive_setup(self) -> tuple[engine_pb2.InitJob, engine_pb2.RankAssignment]:
        """Read the first two commands: InitJob and RankAssignment, in either order.

        Raises SessionLost if the stream ends first, RuntimeError on any other command.
        """
        got: dict[str, Any] = {}
        try:
            while len(got) < 2:
                cmd = next(self._call)
                kind = cmd.WhichOneof("command")
                if kind not in ("init", "assignment") or kind in got:
                    raise RuntimeError(f"rank session: expected init and assignment first, got {kind!r}")
                got[kind] = getattr(cmd, kind)
        except (StopIteration, grpc.RpcError) as e:
            raise SessionLost(f"rank session ended before init and assignment arrived: {_rpc_text(e)}") from None
        return got["init"], got["assignment"]

    def relay_commands(self, link: Link, metrics_acks: Callable[[store_pb2.MetricsAck], None] | None = None) -> None:
        """From now on, put the commands that come down on the rank's bus, through ``link``
        (its route checks), and the store's acks of the rank's metric records to
        ``metrics_acks`` (reader thread)."""
        self._metrics_acks = metrics_acks
        self._reader = threading.Thread(target=self._read, args=(link,), name="session", daemon=True)
        self._reader.start()

    def send_up(self, routed: Routed, msg: Any, payload: Any = None) -> None:
        """The link's way out: queue one envelope. Before the terminal event goes the final
        audit: once control hears of the end it may release (kill) this process at any moment."""
        now = False  # (a step control decides on at once: session_batches.StepUrgency)
        with self._progress_lock:
            if isinstance(msg, engine_pb2.TrainingLoopStarted):
                self._step = msg.start_step
                self._urgency.started()
            elif isinstance(msg, engine_pb2.StepCompleted):
                # (the main thread, at the step's end: the sums hold exactly the steps up to it)
                self._step, self._step_seconds = msg.step, msg.step_seconds
                self._compute = self._phase.compute_seconds()
                now = self._urgency.at_once(msg) and self._rank == 0
            elif isinstance(msg, (engine_pb2.TrainingLoopPaused, *_TERMINAL)):
                self._stepping = False
        if isinstance(msg, _TERMINAL):
            self._send(audit=report_of(self.process))
            self._terminal_sent.set()
        self._send(routed=routed)
        if now:
            self._out.put(session_batches.NOW)

    def send_metrics(self, record: store_pb2.MetricRecord) -> None:
        """One of L2-1's records for L5-2, to the node agent, which sends it to the store
        (``RankEvent{metrics}``; queued, never blocks)."""
        self._send(metrics=record)

    def report_violation(self, event: audit_pb2.BoundaryViolationReported) -> None:
        """A refused send, on its way up to the fault detector (queued, never blocks)."""
        self._send(routed=pack(event, Module.EXT_CONTRACT))

    def send_failed(self, fault_class: str, detail: str) -> None:
        """For a failure before the loop exists (it would otherwise report it itself)."""
        failed = engine_pb2.TrainingLoopFailed(
            job_id=self._job_id, rank=self._rank, fault_class=fault_class, detail=detail
        )
        self.send_up(pack(failed, Module.L2_TRAINING_LOOP), failed)

    def wait_released(self) -> None:
        """Block until the node agent ends the session (control released this rank, or the
        agent is gone); a release by signal ends the process before that."""
        if self._reader is not None:
            self._reader.join()
            return
        try:
            for _ in self._call:
                pass  # (no command applies before the loop exists)
        except grpc.RpcError:
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Half-close our side after the queued events and wait for the agent to end the call."""
        self._closing.set()
        self._out.put(None)
        deadline = time.monotonic() + timeout
        if self._reader is not None:
            self._reader.join(timeout)
        else:
            try:
                for _ in self._call:
                    if time.monotonic() > deadline:
                        break
            except grpc.RpcError:
                pass
        self._call.cancel()
        self._channel.close()

    def _send(self, **event: Any) -> None:
        self._out.put(worker_pb2.RankEvent(job_id=self._job_id, rank=self._rank, **event))

    def _requests(self):
        """One stream message per wake-up, a step's events with the rank's next beat
        (services/rank/session_batches.py)."""
        yield from session_batches.messages(self._out, self._ride_s)

    def _ride_s(self) -> float:
        """How long a step's events wait for the next beat: a beat period (the job's, once
        InitJob said it); rank 0's step that control decides on at once is followed by
        ``session_batches.NOW`` (:meth:`send_up`)."""
        if not session_batches.STEPS_RIDE:
            return 0.0
        return getattr(self, "_beat_interval", 0.0)

    def _beat(self) -> None:
        """The heartbeat thread: a clock that states this process is alive, nothing more.
        The first beat goes right after the hello, so the deadline covers the set-up too."""
        try:
            while True:
                since = self._phase.since  # (before the read: see PhaseMarker.stated)
                phase, phase_s, progress, total = self._phase.read()
                with self._progress_lock:
                    beat = worker_pb2.RankHeartbeat(
                        job_id=self._job_id,
                        rank=self._rank,
                        step=self._step,
                        stepping=self._stepping,
                        step_seconds=self._step_seconds,
                        unix_time=time.time(),
                        interval_seconds=self._beat_interval,
                    )
                    (
                        beat.forward_compute_seconds,
                        beat.backward_compute_seconds,
                        beat.optimizer_compute_seconds,
                    ) = self._compute
                    if self._stepping:  # not started, paused or ended: idle, whatever was marked last
                        beat.phase, beat.phase_seconds, beat.phase_progress, beat.phase_total = (
                            phase,
                            phase_s,
                            progress,
                            total,
                        )
                    else:
                        beat.phase = IDLE
                self._send(heartbeat=beat)
                self._phase.stated(beat.phase, since)  # (a phase announced is stated: services/common/phase.py)
                # On the node's grid: its ranks' beats reach the agent together (beat_grid.py).
                if self._closing.wait(seconds_to_next_beat(time.time(), self._beat_interval, self._beat_phase)):
                    return
        except BaseException as e:  # a rank that cannot beat is declared silent: say why in its log
            log.error("heartbeat_stopped", error=f"{type(e).__name__}: {e}")
            raise

    def _read(self, link: Link) -> None:
        try:
            for cmd in self._call:
                kind = cmd.WhichOneof("command")
                if kind == "audit":
                    self._send(audit=report_of(self.process, request_id=cmd.audit.id))
                    continue
                if kind == "metrics_ack":
                    if self._metrics_acks is not None:
                        self._metrics_acks(cmd.metrics_ack)
                    continue
                if kind != "routed":
                    log.warning("rank_session_command_ignored", kind=kind)
                    continue
                if cmd.routed.type in _STEPPING:
                    with self._progress_lock:
                        self._stepping = True
                self._delay.hold(cmd.routed.type)  # (test-only; in line: the commands behind it wait too)
                try:
                    link.deliver(cmd.routed)
                except Exception as e:  # noqa: BLE001 - keep relaying; the loop's state is its own
                    log.error("rank_session_command_failed", type=cmd.routed.type, error=f"{type(e).__name__}: {e}")
        except grpc.RpcError:
            pass
        if not self._terminal_sent.is_set():
            # The agent is gone (or ended the session): nobody can command this rank any
            # more. Leave at once instead of holding the device.
            last_words("rank: session to the node agent ended; exiting\n")
            exit_now(EXIT_SESSION_LOST)


def _waits_for_release(e: BaseException, hold_on_fault: bool = False) -> bool:
    """Whether a rank that failed with ``e`` waits for L1 to release it: every failure but a
    broken communicator (a collective or point-to-point call failed: the process cannot take
    part in the group again, so it leaves, unless the job's policy holds its ranks for
    inspection on a fault: ``InitJob.hold_on_fault``), a lost session (nobody is left to
    release it) and an interrupt."""
    from services.contract import failures

    if isinstance(e, (SessionLost, KeyboardInterrupt, SystemExit)):
        return False
    if hold_on_fault:
        return True
    return failures.cause_of(e) != failures.C.FAILURE_COMMUNICATION and not failures.communicator_broken()


class CpuAffinityRefused(ValueError, Refusal):
    """The CPUs the node agent bound this rank to cannot be applied (one line, config_error)."""

    fault_class = "config_error"


def pin_cpus(cpu_list: str | None) -> tuple[int, ...]:
    """Pin this process to ``cpu_list`` (``SURGE_CPU_AFFINITY``: its GPU's share of the
    node's CPUs, services/worker/device_binding.py); threads started later inherit it.
    Returns the CPUs pinned to (empty: none asked, or not Linux).

    Raises:
        CpuAffinityRefused: not a cpulist, or CPUs this process may not run on."""
    if not cpu_list:
        return ()
    try:
        cpus = tuple(parse_cpu_list(cpu_list))
    except ValueError:
        raise CpuAffinityRefused(f"{CPU_AFFINITY_ENV}: not a cpulist: {cpu_list!r}") from None
    if not hasattr(os, "sched_setaffinity"):
        return ()
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise CpuAffinityRefused(
            f"{CPU_AFFINITY_ENV}: cannot run on CPUs {cpu_list} ({os.strerror(e.errno or 0)})"
        ) from None
    return cpus


def _rpc_text(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return "stream closed"


def main(argv: list[str] | None = None) -> NoReturn:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m services.rank", description=__doc__.split("\n")[0])
    ap.add_argument("--session", required=True, help="HOST:PORT of the node agent's WorkerService")
    ap.add_argument("--job", required=True, help="job id")
    ap.add_argument("--rank", type=int, required=True, help="global rank")
    args = ap.parse_args(argv)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # exit promptly, even inside a collective
    thread_names.install()  # its side threads seen by name from outside (bench/stack_cost.py)
    stack_dump.install()  # `kill -USR2 PID`: every thread's stack into its log (a hang's diagnosis)
    # Its stream readers wait without gRPC's 0.1 s poll (no handler of its needs the slice: grpc_waits.py).
    grpc_waits.install(grpc_waits.RANK_WAIT_SLICE_S)
    log = configure("rank", job=args.job, rank=args.rank)

    phase = PhaseMarker()
    # A failure of no more specific type while the rank waits in a collective is a
    # communication failure; its failures name this job and rank (services/contract/failures.py).
    set_collective_probe(lambda: phase.phase == COLLECTIVE)
    set_origin(args.job, args.rank)
    session = Session(args.session, args.job, args.rank, phase=phase)
    rank: RankModules | None = None
    data = store = copies = metrics = None
    code = 0
    hold_on_fault = False  # InitJob.hold_on_fault: L1-1 holds a failed rank for inspection
    try:
        init, assignment = session.receive_setup()
        hold_on_fault = init.hold_on_fault
        # Every call from here on names this incarnation: a replaced one is refused (fencing.py).
        fencing.set_identity(args.job, args.rank, assignment.generation)
        pinned = pin_cpus(os.environ.get(CPU_AFFINITY_ENV))  # before torch starts its thread pools
        torch.set_num_threads(max(1, assignment.num_threads or len(pinned) or 1))
        spec = spec_from_json(init.spec_json)
        session.set_heartbeat_interval(spec.liveness.heartbeat_interval_seconds)
        if assignment.backend == "nccl":  # (read by ProcessGroupNCCL when L2-2 makes the group)
            apply_nccl_environment(
                collective_timeout_s(spec.liveness, spec.operators.compile, spec.fault_policy.data_outage_seconds)
            )
        guard = StepGuard(lambda: session.step + 1, injector=FaultInjector.from_env(spec.name, args.job, args.rank))
        violations = ViolationReporter(
            session.process, log, deliver=session.report_violation, job_id=args.job, rank=args.rank, inline=True
        )
        bus = Bus(on_violation=violations)
        install_comm_guard(report=violations)  # tags every torch.distributed call with its module
        # Imported here so a rank that fails before this point does not pay for them.
        from services.rank.data_client import DataClient
        from services.rank.memory_client import MemoryCopyClient
        from services.rank.metrics_client import MetricsClient
        from services.rank.store_client import RELAY_GROUPS, StoreClient

        # What the data service's modules send this side comes back by name, checked (it may
        # speak only for L4 modules).
        from_data = Link(bus, name="data service", near=RANK_MODULES, beyond=L4)
        data = DataClient(
            init.data_address,
            bus.emitter(Module.L4_DATASET_VERSIONS),
            bus.emitter(Module.L4_BATCH_PACKER),
            on_error=violations.relay_rpc_error,
            back=from_data.deliver,
            job_id=args.job,
            rank=args.rank,
            outage_s=spec.fault_policy.data_outage_seconds,  # (L1-1 waits that long for a service down)
        )
        # A failed store call: its violation report, and the failure events the store's
        # modules sent this side (by name, checked: it may speak only for L5 modules).
        from_store = Link(bus, name="store service", near=RANK_MODULES, beyond=L5)

        def store_failed(error: BaseException) -> None:
            violations.relay_rpc_error(error)
            from_store.deliver_returned(
                error, skip=(store_pb2.SnapshotFailed,)
            )  # the relay reports its own, with the step

        # The newest checkpoint's chunks are also kept in memory by this node's agent (and
        # its peer's): a recovery reads them there first (services/rank/memory_client.py).
        copies = MemoryCopyClient(
            args.session, args.job, args.rank, report=bus.emitter(Module.L5_CHECKPOINT_MANAGER)
        )  # (MemoryCopySkipped: a copy without room is skipped, typed)
        store = StoreClient(
            init.store_address,
            bus.emitter(Module.L5_CHECKPOINT_MANAGER),
            on_error=store_failed,
            copies=copies,
            staging_budget_s=spec.liveness.phase_seconds.checkpoint_staging,  # bounds a wait for a busy store
        )
        # L5-2's records go to this node's agent, which sends the node's records to the store
        # on one stream; its failure events come back with their ack.
        metrics = MetricsClient(session.send_metrics, on_routed=from_store.deliver_each)
        rank = compose(
            bus,
            spec,
            assignment.device or "cpu",
            data=data,
            store=store,
            metrics=metrics,
            up=session,
            started_at=t_start,
            guard=guard,
            phase=phase,
            heals=init.heal_from_peer,
            side_groups=RELAY_GROUPS,
        )
        store.use_side_groups(rank.parallel.side_group)  # the relay's groups are made by L2-2, with the world
        if (assignment.device or "cpu").startswith("cuda"):
            # Kernels run after their launch: the GPU's own time per phase, from CUDA events on
            # the compute stream (services/common/compute_time.py), once the device is set.
            phase.time_on_cuda(torch.cuda)
        log.info(
            "rank_composed",
            world_size=assignment.world_size,
            device=assignment.device,
            cpus=os.environ.get(CPU_AFFINITY_ENV, ""),
            backend=assignment.backend,
            threads=torch.get_num_threads(),
            data=init.data_address,
            store=init.store_address,
            resume=init.resume_version,
        )
        session.relay_commands(rank.link, metrics_acks=metrics.acked)
        rank.orchestrator(init)
        rank.allocator(assignment)
        rank.loop.run()
        log.info("rank_finished")
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the exit code says it
        # A MemoryError has its own code, so the node agent tells it from any other failure
        # by the code alone (services/worker/exit_cause.py: typed, never read from text).
        code = MEMORY_ERROR_EXIT_CODE if isinstance(e, MemoryError) else EXIT_FAILED
        log.error("rank_failed", error=f"{type(e).__name__}: {e}")
        if rank is not None:
            rank.loop.fail(e)
        else:
            from services.engine.training_loop import classify_fault

            session.send_failed(*classify_fault(e))
        if _waits_for_release(e, hold_on_fault):
            # L1 decides what becomes of this rank (seed L2-1: no recovery of its own): it
            # stays, beating and idle, until control releases it (the node agent's signal)
            # or its node agent goes away. Its peers are not left waiting for a dead process
            # to be noticed, nor is a failure a policy might ignore made an exit.
            log.info("rank_waits_for_release")
            session.wait_released()
    finally:
        if metrics is not None:
            metrics.close(timeout=5.0)
        if store is not None:
            store.close(timeout=5.0)
        if copies is not None:
            copies.close()
        if data is not None:
            data.close()
        if rank is not None and code == 0:
            rank.parallel.shutdown()
        session.close(timeout=5.0)
    exit_now(code)  # do not wait for library threads (gRPC, gloo) to wind down, nor finalize under them


if __name__ == "__main__":
    main()
