"""Builders shared by the data tests (requests, payloads, decoding)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from services.contract import data_pb2, route_pb2
from services.contract.failures import ModuleFailed
from services.data.documents import Catalog, EpochOrder, KeptDocuments, TokenStore
from services.data.prefetcher import TokenReader
from services.data.shuffler import epoch_order

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


def token_store(
    directory: Path, *docs: list[int] | np.ndarray, tokenizer: str = "bytes", dtype=np.uint16
) -> TokenStore:
    """A split of literal documents written to ``directory/train.bin`` (no data root: the
    sample index stays in memory)."""
    parts = [np.asarray(d, dtype=dtype) for d in docs]
    bounds = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=bounds[1:])
    path = directory / "train.bin"
    directory.mkdir(parents=True, exist_ok=True)
    (np.concatenate(parts) if parts else np.zeros(0, dtype)).astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
    return TokenStore("t@v1", "train", path, np.dtype(dtype).newbyteorder("<"), bounds, tokenizer)


def catalog(directory: Path, *docs: list[int] | np.ndarray, threads: int = 2, **kw) -> Catalog:
    """The prefetcher's payload for those documents: their bounds and a read handle."""
    store = token_store(directory, *docs, **kw)
    return Catalog(store, TokenReader(store, ThreadPoolExecutor(threads), threads, 8))


def epoch_of(cat: Catalog, epoch: int = 0, seed: int = 0, enabled: bool = False) -> EpochOrder:
    """The shuffler's payload for ``cat``'s epoch (storage order unless ``enabled``)."""
    return EpochOrder(cat, epoch, seed, enabled, lambda: epoch_order(seed, epoch, len(cat), enabled))


def kept_all(cat: Catalog, epoch: int = 0, rules: data_pb2.FilterRules | None = None) -> KeptDocuments:
    """The filter's payload keeping every document of ``cat`` in storage order."""
    return KeptDocuments(epoch_of(cat, epoch), np.ones(len(cat), bool), rules or data_pb2.FilterRules())


def packer_on_bus(cfg: data_pb2.PackerConfig):
    """L4-5 on a bus with L2-1's ports: -> (feed(kept), assemble(count), batches, exhausted)."""
    from services.contract import Module
    from services.contract.bus import Bus
    from services.data.batch_packer import BatchPacker

    bus = Bus()
    packer = BatchPacker(bus.emitter(Module.L4_BATCH_PACKER))
    bus.host(Module.L4_BATCH_PACKER, packer)
    batches: list[data_pb2.MicroBatch] = []
    exhausted: list[data_pb2.DataExhausted] = []
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.MicroBatch, lambda m, p: batches.append(m))
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DataExhausted, lambda m, p: exhausted.append(m))
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_BATCH_PACKER)
    port(cfg)

    def feed(kept: KeptDocuments) -> None:
        bus.publish(Module.L4_FILTER, data_pb2.SamplesFiltered(count=int(kept.keep_n.sum())), kept)

    def assemble(count: int = 1_000_000) -> None:
        port(data_pb2.AssembleBatches(count=count))

    return feed, assemble, batches, exhausted, port


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
