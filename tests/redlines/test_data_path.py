"""The data path's red lines (L4-1..L4-5): each stage does its one thing to the documents
and nothing else, and none of them hears or steers the compute path.

prefetch: reads every document, in storage order, unchanged; shuffle: reorders only (see
test_executors_do_not_decide.py and tests/data/test_shuffler.py); filter: drops only;
pack: groups and pads with the placeholder only, in order.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.contract.route_table import default_table
from services.data.batch_packer import IGNORE, BatchPacker
from services.data.documents import Documents, TokenStore
from services.data.prefetcher import Prefetcher
from services.data.sample_filter import SampleFilter

from .wiring import MODULES, called_names, imported_modules, layer, reachable, source_tree

RNG = np.random.default_rng(20260101)


def _random_docs(n: int, *, max_len: int = 40, first: int = 0, epoch: int = 0, last: bool = True) -> Documents:
    parts = [RNG.integers(1, 250, size=int(k)).astype(np.uint16) for k in RNG.integers(0, max_len, size=n)]
    return Documents.join(
        parts, np.arange(first, first + n, dtype=np.int64), epoch, last, "train", "bytes", np.dtype(np.uint16)
    )


def _contents(docs: Documents) -> list[list[int]]:
    return [docs.tokens_T[docs.bounds_n1[k] : docs.bounds_n1[k + 1]].tolist() for k in range(len(docs))]


# ---------------------------------------------------------------------- L4-2 prefetcher


def test_the_prefetcher_hands_on_every_document_unchanged_in_storage_order(tmp_path):
    docs = _random_docs(57)
    path = tmp_path / "train.bin"
    docs.tokens_T.astype("<u2").tofile(path)
    store = TokenStore("t@v1", "train", path, np.dtype("<u2"), docs.bounds_n1.copy(), "bytes")
    bus = Bus()
    prefetcher = Prefetcher(bus.emitter(Module.L4_PREFETCHER))
    bus.subscribe(Module.L4_PREFETCHER, data_pb2.SetPrefetch, prefetcher.set_prefetch)
    bus.subscribe(Module.L4_PREFETCHER, data_pb2.ActivateSource, prefetcher.activate_source)
    got: list[Documents] = []
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.SamplesRead, lambda m, d: got.append(d))
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_PREFETCHER)(data_pb2.SetPrefetch(watermark=8, threads=3))
    bus.port(Module.L4_DATASET_VERSIONS, Module.L4_PREFETCHER)(
        data_pb2.ActivateSource(name="t", version="v1", split="train"), store
    )
    prefetcher.close()
    assert [c for d in got for c in _contents(d)] == _contents(docs)  # no drop, no edit, no reorder
    assert np.concatenate([d.index_n for d in got]).tolist() == list(range(57))
    assert [d.last for d in got] == [False] * (len(got) - 1) + [True]


def test_the_prefetcher_hears_nothing_from_the_compute_path():
    into = [r for r in default_table().routes() if Module.L4_PREFETCHER in r.receivers]
    senders = {s for r in into for s in r.senders}
    # Its parameters from L2-1 (SetPrefetch), its source from L4-1, its file reads from disk.
    assert senders <= {Module.L2_TRAINING_LOOP, Module.L4_DATASET_VERSIONS, Module.EXT_DISK_IO}
    assert {r.message for r in into if Module.L2_TRAINING_LOOP in r.senders} == {"surge.v1.SetPrefetch"}
    assert not [
        i for i in imported_modules(source_tree(Module.L4_PREFETCHER)) if i.split(".")[0] in ("torch", "psutil")
    ]


@pytest.mark.parametrize("module", [Module.L4_DATASET_VERSIONS, Module.L4_PREFETCHER], ids=Module.Name)
def test_the_data_modules_that_read_files_never_write_them(module):
    tree = source_tree(module)
    if module == Module.L4_DATASET_VERSIONS:
        # Managing versions (seed line 85: versions, paths, hashes; mount / switch / unmount)
        # includes removing a whole version on the user's DeleteDataset: that one handler may
        # remove the version's directory (and its emptied parent), and writes nothing.
        (delete,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "delete_dataset"]
        assert called_names(delete) & {"rmtree", "rmdir"} == {"rmtree", "rmdir"}
        tree.body = [_without(n, delete) for n in tree.body]
    writes = {
        "write",
        "write_bytes",
        "write_text",
        "pwrite",
        "unlink",
        "rename",
        "replace",
        "rmtree",
        "mkdir",
        "tofile",
        "save",
        "truncate",
        "remove",
    } & called_names(tree)
    assert writes == set()
    for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
        name = getattr(call.func, "attr", getattr(call.func, "id", ""))
        if name == "open":
            flags = [ast.unparse(a) for a in call.args[1:]]
            assert all("RDONLY" in f or f in ("'r'", "'rb'") for f in flags), flags


# ---------------------------------------------------------------------- L4-4 filter


def test_the_filter_output_is_an_ordered_subset_of_its_input_unchanged():
    bus = Bus()
    sample_filter = SampleFilter(bus.emitter(Module.L4_FILTER))
    bus.subscribe(Module.L4_FILTER, data_pb2.FilterRules, sample_filter.filter_rules)
    bus.subscribe(Module.L4_FILTER, data_pb2.SamplesShuffled, sample_filter.on_samples_shuffled)
    kept, reports = [], []
    bus.subscribe(Module.L4_BATCH_PACKER, data_pb2.SamplesFiltered, lambda m, d: kept.append(d))
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.FilterReport, lambda m, p: reports.append(m))
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER)(
        data_pb2.FilterRules(min_tokens=5, max_tokens=30, banned_tokens=[7])
    )
    sent = [_random_docs(40, first=40 * i, last=i == 2) for i in range(3)]
    for docs in sent:
        bus.publish(Module.L4_SHUFFLER, data_pb2.SamplesShuffled(count=len(docs)), docs)
    by_position = {int(d.index_n[k]): c for d in sent for k, c in enumerate(_contents(d))}
    out = [(int(d.index_n[k]), c) for d in kept for k, c in enumerate(_contents(d))]
    assert [p for p, _ in out] == sorted(p for p, _ in out)  # order kept
    assert all(by_position[p] == c for p, c in out)  # content untouched, nothing invented
    r = reports[-1]
    assert r.kept == len(out) and r.kept + r.dropped_too_short + r.dropped_too_long + r.dropped_banned == 120


# ---------------------------------------------------------------------- L4-5 packer


@pytest.mark.parametrize("separator", [-1, 0])
def test_the_batch_packer_keeps_every_token_in_order_and_pads_only_with_the_placeholder(separator):
    bus = Bus()
    packer = BatchPacker(bus.emitter(Module.L4_BATCH_PACKER))
    bus.subscribe(Module.L4_BATCH_PACKER, data_pb2.PackerConfig, packer.packer_config)
    bus.subscribe(Module.L4_BATCH_PACKER, data_pb2.SamplesFiltered, packer.on_samples_filtered)
    batches = []
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.MicroBatch, lambda m, p: batches.append(m))
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DataExhausted, lambda m, p: None)
    pad = 251
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_BATCH_PACKER)(
        data_pb2.PackerConfig(seq_len=16, micro_batch_size=3, pad_id=pad, mode=data_pb2.PACK, separator_id=separator)
    )
    docs = _random_docs(30, max_len=50)
    bus.publish(Module.L4_FILTER, data_pb2.SamplesFiltered(count=len(docs)), docs)
    stream = np.concatenate(
        [np.append(c, separator) if separator >= 0 else np.asarray(c, np.int64) for c in _contents(docs)]
    ).astype(np.int64)
    ids = np.concatenate([np.frombuffer(b.input_ids, "<i4").reshape(-1, 16) for b in batches]).ravel()
    labels = np.concatenate([np.frombuffer(b.labels, "<i4").reshape(-1, 16) for b in batches]).ravel()
    real = labels != IGNORE
    assert labels[real].tolist() == stream[1:].tolist()  # every token after the first, once, in order
    assert ids[real].tolist() == stream[:-1].tolist()
    assert set(ids[~real].tolist()) <= {pad}  # padding is the placeholder and nothing else


# ---------------------------------------------------------------------- the whole path


def test_no_data_module_hears_from_or_holds_anything_of_the_compute_path(tmp_path):
    from .wiring import build_data

    for inst in build_data(tmp_path).modules.values():
        for r in reachable(inst):
            assert layer(r.target._sender if hasattr(r.target, "_sender") else 0) == 4, r.path
    for route in default_table().routes():
        if route.receivers & {m for m in MODULES if layer(m) == 4}:
            assert not [s for s in route.senders if s in MODULES and layer(s) in (1, 3, 5)], route.message


def _without(node: ast.AST, fn: ast.FunctionDef) -> ast.AST:
    """``node`` with the function ``fn`` taken out of its class body (if it is there)."""
    if isinstance(node, ast.ClassDef):
        node.body = [n for n in node.body if n is not fn]
    return node
