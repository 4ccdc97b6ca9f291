"""The data streams: opening a split's stream at a global position, and taking its next
micro-batch (a dataset gone, a training stream that ended: faults). A part of
``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import structlog

from services.contract import data_pb2
from services.engine.training_loop.faults import TrainingFault
from services.engine.training_loop.ports import Batch
from services.engine.training_loop.positions import MIXTURE_FORMAT

_log = structlog.get_logger("training_loop")


class DataStream:
    """The train and val streams (a part of ``TrainingLoop``, see loop.py)."""

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
