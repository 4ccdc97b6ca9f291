"""Set-up: wait for the job and the group, initialise the modules (load, mount, resume or
heal, precision, the train stream), wait for StartTraining. A part of ``TrainingLoop``
(loop.py)."""

from __future__ import annotations

import time

from services.contract import data_pb2, engine_pb2, store_pb2
from services.engine import rng_streams
from services.engine.lr_schedule import schedule_for
from services.engine.training_loop.faults import TrainingFault, _data_fault_class, _one_line
from services.engine.training_loop.positions import (
    DATA_FORMAT,
    DATA_FORMATS,
    data_format,
    data_order,
    data_order_changes,
)
from services.engine.training_loop.summary import model_flops_per_token
from services.jobspec import spec_from_json


class Startup:
    """Set-up and the wait for StartTraining (a part of ``TrainingLoop``, see loop.py)."""

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
        self._peak = self._peak_of()  # (after L2-2 took the device: one it cannot see was refused, typed)
        self._peak_flops = self._peak.tflops * 1e12
        self._warm = not spec.operators.compile  # the first step compiles forward and backward
        ops = spec.operators
        p.forward(engine_pb2.ConfigureForward(attention=spec.attention, adamw=ops.adamw, compile=ops.compile))
        for i, (name, version, _) in enumerate(spec.data.datasets):  # (a mixture: every component)
            mounted = p.data(data_pb2.MountDataset(name=name, version=version, verify=False)).message
            if isinstance(mounted, data_pb2.DatasetUnavailable):
                raise TrainingFault(_data_fault_class(mounted), mounted.reason)
            if i == 0 and mounted.tokenizer:  # samples decode with the first dataset's (sampling.py)
                self._tokenizer = mounted.tokenizer
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
            self._check_position(self._init.resume_version)
        elif spec.init_from is not None:  # a new job from existing weights (a resume loads its own instead)
            self._start_from(spec.init_from)
        self._init_precision()  # after the load: a checkpoint's scaler state goes with it
        self._open_stream("train", self._position, repeat=True, max_batches=0)
        if p.metrics is not None:  # where L5-2 writes this job's records besides its own files
            m = spec.metrics
            p.metrics(store_pb2.LogCollectionConfig(
                job_id=self._job_id, tensorboard=m.tensorboard,
                wandb_project=m.wandb.project if m.wandb else "", wandb_mode=m.wandb.mode if m.wandb else "",
                team=spec.team,  # (the store keeps it: a team's token reaches its own jobs' records only)
            ))  # fmt: skip
        self._emit(engine_pb2.TrainingLoopStarted(
            job_id=self._job_id, rank=self._rank, start_step=self._step,
            num_parameters=self._num_parameters, startup_seconds=time.perf_counter() - self._t_created,
            restored_bytes_from=restored_from, healed=healed is not None,
            healed_from_rank=healed.source_rank if healed is not None else 0,
            peak_tflops=self._peak.tflops, peak_source=self._peak.source,
        ))  # fmt: skip

    def _check_position(self, version: str) -> None:
        """The data position just loaded from ``version`` resumes exactly with this build and
        this job's data order.

        Raises:
            TrainingFault: config_error, naming the version and what differs."""
        loaded_format = data_format(self._loaded_order)
        if loaded_format != DATA_FORMAT:
            raise TrainingFault("config_error", (
                f"checkpoint {version} holds a data position of format {loaded_format} "
                f"({DATA_FORMATS.get(loaded_format, 'unknown')}); this build resumes format {DATA_FORMAT} "
                f"({DATA_FORMATS[DATA_FORMAT]}): start the job afresh or resume with the build that wrote it"
            ))  # fmt: skip
        changed = data_order_changes(self._loaded_order, data_order(self._spec, self._dp_size))
        if changed:  # (the dp size alone may change: the position is global)
            raise TrainingFault("config_error", (
                f"checkpoint {version} was written with {changed}: its data position would not resume exactly"
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
