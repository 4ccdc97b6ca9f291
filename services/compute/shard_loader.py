"""L3-1 shard loader: builds the model and makes it resident on the rank's device.

Receives: ``ParallelPlan`` (from L2-2, once; payload: the ``("pp", "dp", "tp")`` DeviceMesh;
during an in-place rebuild of the group the same plan twice more, without a mesh and then
with the new group's (for a resize in place, issue 16, the second at another dp size: what
this module lays out does not depend on it): each time a loaded model is handed over
again, so that L3-5 drops its wrapper on the old group and then wraps it anew on the new one),
``LoadModel``, ``ExportState`` and ``RestoreState`` (from the training loop). Replies
``ModelLoaded``, ``StateExported`` (payload: a copy of the weights, an immutable
:class:`~services.state.snapshot.Slot`) and ``StateRestored`` (it copied the weights of the
slot it was handed into the model; it keeps nothing of the slot).

Models larger than one rank: the model is built on the meta device (structure, no storage);
with pp > 1 the rank keeps its pipeline stage only (local, no communication); then the
layout steps that only re-lay parameters out (tensor parallelism, activation checkpointing,
FSDP2) are applied to it there by L3-5, through the composition root (``lay_out``), in the
one order services/compute/parallelize.py fixes; then the loader materialises it
(services/compute/model.py ``materialise``: ``to_empty`` on the device, each parameter
allocated at this rank's shard size, then filled). Only then is it handed over, for DDP
and the units that run and update it. No rank ever holds the whole model: the peak beyond
its shards is one full parameter, drawn on the CPU.

Initialisation is a pure function of (ModelSpec, seed): values are drawn on the CPU by a
private generator, every parameter whole in the full model's order, each rank keeping its
slice, so every rank starts from the weights a single process would have, bit for bit,
whatever the layout, without a broadcast. A checkpoint or an ``init_from`` is then read into
these shards (DCP, or safetensors slices: services/compute/hf_format.py), never a full copy.
The built module is handed to whoever the composition root named (``handover``); the
loader keeps only its own reference for exporting state.

Red lines kept (seed L3-1): no forward/backward, no optimizer logic, no communication, no
disk I/O of its own (checkpoint bytes are read by the rank's state manager into copies of
its own, and come back as a RestoreState), the plan is taken as pushed and never changed.
No live handle on the weights leaves through a message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from services.compute.model import count_parameters, materialise, meta_model
from services.compute.parallelize import data_parallel_resize
from services.compute.pipeline_stage import stage_of
from services.contract import Module, engine_pb2
from services.contract.bus import Emitter, Reply
from services.contract.frozen import FrozenConfig
from services.jobspec import STORED, ModelSpec, frozen_parameters
from services.state.snapshot import Slot, restorable, thaw

_log = structlog.get_logger("shard_loader")


class ShardLoader:
    """L3-1. ``handover`` receives the built module (wired by the composition root);
    ``lay_out`` (the composition root's, L3-5's ``lay_out``) applies the parameter layout
    to the model on the meta device before its weights are materialised (None: nothing
    before; the whole layout then happens at the handover, on full weights)."""

    def __init__(
        self,
        emit: Emitter,
        handover: Callable[[nn.Module], None],
        lay_out: Callable[[nn.Module], None] | None = None,
    ):
        self._emit = emit
        self._handover = handover
        self._lay_out = lay_out
        # Seed L3-1 s4: 并行分片规则配置推送（一次性初始化）; frozen after that (red line 5).
        self._plan = FrozenConfig[engine_pb2.ParallelPlan]("L3_SHARD_LOADER", "parallel plan")
        self._mesh: Any = None  # the DeviceMesh (only handed on: pipeline stages need it)
        # The plan in force (the first, or a resize's) and whether it was just withdrawn (the
        # same plan again without a mesh: a rebuild is under way, the next one may resize it).
        self._current: engine_pb2.ParallelPlan | None = None
        self._withdrawn = False
        self._model: nn.Module | None = None
        self._state = "unloaded"  # unloaded | loading | loaded | mismatch

    def parallel_plan(self, msg: engine_pb2.ParallelPlan, payload: Any = None) -> None:
        """固化分片规则指令 (payload: the DeviceMesh). Once, then only the same plan again,
        for a group rebuilt in place; once that plan was withdrawn (pushed without a mesh),
        the same at another dp size may come with the new mesh, for a resize in place (module
        docstring). Each time the loaded model is handed over again (the weights stay as they
        are).

        Raises ConfigFrozen on another plan (red line 5)."""
        if not self._plan.is_set:
            self._current = self._plan.set(msg)
            self._mesh = payload
            return
        # A resize leaves this module's part of the plan (device, stages, layers) as it was.
        resized = self._withdrawn and payload is not None and data_parallel_resize(self._current, msg)
        if msg != self._current and not resized:
            self._plan.require_unset()  # raises ConfigFrozen: the plan is fixed (red line 5)
        self._current, self._withdrawn, self._mesh = msg, payload is None, payload
        if self._model is not None:
            self._hand_over(self._model)

    def export_model(self, msg: engine_pb2.ExportModel, payload: Any = None) -> Reply:
        """An evaluation job's export: a copy of the loaded model's weights (float32 on the
        CPU, cloned: the caller never holds this module's tensors) as the reply's payload;
        ``error`` when no model is loaded. (Writing them is the rank's evaluation runner's:
        this module touches no disk.)"""
        if self._model is None:
            return Reply(engine_pb2.ModelExported(error="no model is loaded"), None)
        state = {k: v.detach().float().cpu().clone() for k, v in get_model_state_dict(self._model).items()}
        return Reply(engine_pb2.ModelExported(tensors=len(state)), state)

    def load_model(self, msg: engine_pb2.LoadModel, payload: Any = None) -> engine_pb2.ModelLoaded:
        """初始化模型权重加载指令.

        Raises:
            RuntimeError: no parallel plan yet, or a model is already loaded.
            pydantic.ValidationError: ``model_json`` is not a valid ModelSpec.
        """
        if not self._plan.is_set:
            raise RuntimeError("shard loader: LoadModel before the parallel plan (no device assigned)")
        if self._model is not None:
            raise RuntimeError("shard loader: a model is already loaded")
        self._state = "loading"
        t0 = time.perf_counter()
        spec = ModelSpec.model_validate_json(msg.model_json, context=STORED)  # freeze: _freeze's check below
        plan = self._plan.get()
        model = meta_model(spec)  # no storage yet (module docstring)
        _freeze(model, spec.freeze)
        if plan.pp > 1:  # this rank keeps its pipeline stage only (services/compute/pipeline_stage.py)
            model = stage_of(model, plan, self._mesh)
        if self._lay_out is not None:  # TP / activation checkpointing / FSDP2, on the meta device
            self._lay_out(model)
        materialise(model, spec, msg.seed, plan.device or "cpu")  # this rank's shards only
        self._model = model
        self._state = "loaded"
        self._hand_over(model)
        n = count_parameters(model)
        return engine_pb2.ModelLoaded(
            num_parameters=n,
            parameter_bytes=sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()),
            seconds=time.perf_counter() - t0,
        )

    def _hand_over(self, model: nn.Module) -> None:
        """The one way the model leaves this module (write-only: nothing is read back)."""
        self._handover(model)

    def export_state(self, msg: engine_pb2.ExportState, payload: Any = None) -> Reply:
        """A copy of the weights keyed by FQN (the slot ``model``), stamped with ``msg``'s step
        and version. Raises RuntimeError if no model is loaded."""
        if self._model is None:
            raise RuntimeError("shard loader: no model loaded, nothing to export")
        slot = Slot.exported("model", Module.L3_SHARD_LOADER, msg, get_model_state_dict(self._model))
        return Reply(slot.stamped(engine_pb2.StateExported(key="model")), slot)

    def restore_state(self, msg: engine_pb2.RestoreState, payload: Slot) -> engine_pb2.StateRestored:
        """Copy the weights of ``payload`` (this module's slot, of the step, version and digest
        ``msg`` names) into the model.

        Raises:
            RuntimeError: no model loaded.
            InconsistentSnapshot, SlotDigestMismatch: not this module's slot, not the one named,
                or its content changed since it was taken (nothing is copied).
        """
        if self._model is None:
            raise RuntimeError("shard loader: no model loaded, nothing to restore into")
        t0 = time.perf_counter()
        slot = restorable(payload, "model", Module.L3_SHARD_LOADER, msg)
        # The slot's own tensors, read only (copied into the parameters, nothing kept): no
        # second copy of this rank's weights beside the slot's while it restores.
        set_model_state_dict(self._model, thaw(slot.state, clone=False))
        return slot.stamped(engine_pb2.StateRestored(key="model", seconds=time.perf_counter() - t0))


def _freeze(model: nn.Module, patterns: list[str]) -> None:
    """``requires_grad = False`` on every parameter whose name matches one of ``patterns``
    (fnmatch; a tied parameter by any of its names): the fine-tune's frozen part. The
    rule is the spec's (services/jobspec/model.py ``frozen_parameters``), applied to the built
    model's own names.

    Raises:
        ValueError: a pattern matches no parameter, or the patterns freeze every parameter
            (one line naming ``model.freeze``; a validated spec has neither).
    """
    if not patterns:
        return
    named = list(model.named_parameters(remove_duplicate=False))
    try:
        frozen = frozen_parameters(patterns, ((name, id(p)) for name, p in named))
    except ValueError as e:
        raise ValueError(f"model.{e}") from None
    for _, p in named:
        if id(p) in frozen:
            p.requires_grad_(False)
    distinct = {id(p): p for _, p in named}.values()
    _log.info(
        "model.freeze applied",
        trainable=sum(p.numel() for p in distinct if p.requires_grad),
        frozen=sum(p.numel() for p in distinct if not p.requires_grad),
        frozen_tensors=len(frozen),
        patterns=list(patterns),
    )
