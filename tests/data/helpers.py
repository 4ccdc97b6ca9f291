"""Builders shared by the data tests (requests, payloads, decoding)."""

from __future__ import annotations

import re
from contextlib import contextmanager

import numpy as np
import pytest

from services.contract import data_pb2, route_pb2
from services.contract.failures import ModuleFailed
from services.data.documents import Documents

NUM_FILES = 40


def file_text(i: int) -> bytes:
    """Deterministic Python-like text; lengths vary from ~10 to ~2,500 bytes."""
    lines = [f"# module {i}\n"] + [f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range((i * 7) % 60)]
    return "".join(lines).encode()


def open_stream(
    *,
    name: str = "tiny",
    version: str = "v1",
    verify: bool = False,
    split: str = "train",
    mode: int = data_pb2.PACK,
    seq_len: int = 16,
    micro_batch_size: int = 4,
    pad_id: int = 0,
    separator_id: int = 0,
    seed: int = 7,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
    min_tokens: int = 0,
    max_tokens: int = 0,
    banned_bytes: bytes = b"",
    watermark: int = 8,
    threads: int = 2,
    repeat: bool = False,
    max_batches: int = 0,
    start: data_pb2.DataPosition | None = None,
) -> data_pb2.OpenStream:
    req = data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name=name, version=version, verify=verify),
        prefetch=data_pb2.SetPrefetch(watermark=watermark, threads=threads),
        shuffle=data_pb2.ShufflePlan(seed=seed, epoch=start.epoch if start else 0, enabled=shuffle),
        filter=data_pb2.FilterRules(min_tokens=min_tokens, max_tokens=max_tokens, banned_bytes=banned_bytes),
        packer=data_pb2.PackerConfig(
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            pad_id=pad_id,
            mode=mode,
            separator_id=separator_id,
            rank=rank,
            world_size=world_size,
        ),  # fmt: skip
        split=split,
        repeat=repeat,
        max_batches=max_batches,
    )
    if start is not None:
        req.start.CopyFrom(start)
    return req


def as_arrays(batch: data_pb2.MicroBatch) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) int32 [batch_size, seq_len] from a MicroBatch."""
    shape = (batch.batch_size, batch.seq_len)
    return (np.frombuffer(batch.input_ids, "<i4").reshape(shape), np.frombuffer(batch.labels, "<i4").reshape(shape))


def make_docs(
    *docs: list[int] | np.ndarray,
    epoch: int = 0,
    last: bool = False,
    first: int = 0,
    tokenizer: str = "bytes",
    dtype=np.uint16,
) -> Documents:
    """A Documents payload from literal token lists (index = first, first + 1, ...)."""
    parts = [np.asarray(d, dtype=dtype) for d in docs]
    return Documents.join(
        parts, np.arange(first, first + len(parts), dtype=np.int64), epoch, last, "train", tokenizer, np.dtype(dtype)
    )


@contextmanager
def module_failure(error_type: type[BaseException], match: str, event: str, cause: int):
    """The block's command failed in its module: the bus published the module's failure
    ``event`` with the typed ``cause`` and raised ModuleFailed carrying the handler's error
    (an ``error_type`` whose text matches ``match``)."""
    with pytest.raises(ModuleFailed) as failed:
        yield
    assert isinstance(failed.value.error, error_type), failed.value.error
    assert re.search(match, str(failed.value.error)), str(failed.value.error)
    assert failed.value.event.DESCRIPTOR.name == event
    assert failed.value.failure.cause == cause, route_pb2.FailureCause.Name(failed.value.failure.cause)
