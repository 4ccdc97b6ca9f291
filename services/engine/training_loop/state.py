"""The loop's own checkpointed progress: ``LoopState`` (the slot ``train``) and an ``init_from``
optimizer slot with this job's hyperparameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from services.contract import data_pb2, engine_pb2
from services.engine import rng_streams
from services.engine.training_loop.positions import DATA_FORMAT, _format_bytes, data_format, data_order
from services.state.snapshot import Slot

if TYPE_CHECKING:
    from services.engine.training_loop.loop import TrainingLoop


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
