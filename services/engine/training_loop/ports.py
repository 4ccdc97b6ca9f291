"""The loop's small data classes: ``Batch`` (a MicroBatch's payload) and ``LoopPorts`` (the
modules it may command)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from services.contract.bus import CommandPort


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
