"""The data path's red lines (L4-1..L4-5): each stage does its one thing to the documents
and nothing else, and none of them hears or steers the compute path.

prefetch: hands on every document (by reference), and reads them unchanged; shuffle:
reorders only (see
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
from services.data.batch_packer import IGNORE
from services.data.documents import Catalog
from services.data.prefetcher import Prefetcher
from services.data.sample_filter import SampleFilter
from tests.data.helpers import catalog, epoch_of, kept_all, packer_on_bus, token_store

from .wiring import MODULES, called_names, imported_modules, layer, reachable, source_tree

RNG = np.random.default_rng(20260101)


def _random_parts(n: int, *, max_len: int = 40) -> list[np.ndarray]:
    return [RNG.integers(1, 250, size=int(k)).astype(np.uint16) for k in RNG.integers(0, max_len, size=n)]


def _contents(cat: Catalog, ids) -> list[list[int]]:
    """Documents ``ids`` (storage ids) of ``cat``, read through its read handle."""
    b = cat.store.bounds_n1
    return [cat.reader.read(int(b[i]), int(b[i + 1] - b[i])).tolist() for i in ids]


# ---------------------------------------------------------------------- L4-2 prefetcher


def test_the_prefetcher_hands_on_every_document_unchanged_in_storage_order(tmp_path):
    parts = _random_parts(57)
    store = token_store(tmp_path, *parts)
    bus = Bus()
    prefetcher = Prefetcher(bus.emitter(Module.L4_PREFETCHER))
    bus.subscribe(Module.L4_PREFETCHER, data_pb2.SetPrefetch, prefetcher.set_prefetch)
    bus.subscribe(Module.L4_PREFETCHER, data_pb2.ActivateSource, prefetcher.activate_source)
    got: list[Catalog] = []
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.SamplesRead, lambda m, d: got.append(d))
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_PREFETCHER)(data_pb2.SetPrefetch(watermark=8, threads=3))
    bus.port(Module.L4_DATASET_VERSIONS, Module.L4_PREFETCHER)(
        data_pb2.ActivateSource(name="t", version="v1", split="train"), store
    )
    (cat,) = got  # one catalog: the split's documents by reference
    assert cat.store is store and len(cat) == 57
    assert _contents(cat, range(57)) == [p.tolist() for p in parts]  # no drop, no edit, no reorder
    ranges = [(int(store.bounds_n1[i]), len(parts[i])) for i in range(57)]
    assert [a.tolist() for a in cat.reader.read_many(ranges)] == [p.tolist() for p in parts]
    prefetcher.close()


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


def test_the_filter_output_is_an_ordered_subset_of_its_input_unchanged(tmp_path):
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
    parts = _random_parts(120)
    cat = catalog(tmp_path, *parts)
    order = epoch_of(cat, seed=3, enabled=True)
    bus.publish(Module.L4_SHUFFLER, data_pb2.SamplesShuffled(count=120), order)
    (out,) = kept
    assert out.order is order and out.catalog is cat  # the same references: nothing edited
    doc_idx = out.doc_idx().tolist()
    position = {d: k for k, d in enumerate(order.order().tolist())}
    assert [position[d] for d in doc_idx] == sorted(position[d] for d in doc_idx)  # order kept
    want = [i for i, p in enumerate(parts) if 5 <= len(p) <= 30 and 7 not in p.tolist()]
    assert sorted(doc_idx) == want  # exactly those that break no rule
    r = reports[-1]
    assert r.kept == len(doc_idx) and r.kept + r.dropped_too_short + r.dropped_too_long + r.dropped_banned == 120


# ---------------------------------------------------------------------- L4-5 packer


@pytest.mark.parametrize("separator", [-1, 0])
def test_the_batch_packer_keeps_every_token_in_order_and_pads_only_with_the_placeholder(tmp_path, separator):
    pad = 251
    feed, assemble, batches, exhausted, _ = packer_on_bus(
        data_pb2.PackerConfig(seq_len=16, micro_batch_size=3, pad_id=pad, mode=data_pb2.PACK, separator_id=separator)
    )
    parts = _random_parts(30, max_len=50)
    feed(kept_all(catalog(tmp_path, *parts)))
    assemble()
    assert len(exhausted) == 1
    stream = np.concatenate(
        [np.append(c, separator) if separator >= 0 else np.asarray(c, np.int64) for c in parts]
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
