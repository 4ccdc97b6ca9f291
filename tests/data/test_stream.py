"""The whole pipeline in-process (real bus, real modules): resume, the deal to ranks, epochs, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

from services.contract import data_pb2, route_pb2
from services.data.__main__ import build_stream
from services.data.errors import (
    DatasetCorrupt,
    DatasetNotFound,
    InvalidConfig,
    NoDocuments,
)
from services.data.prepare import prepare_dataset

from .helpers import as_arrays, module_failure, open_stream

CORRUPT = route_pb2.FAILURE_DATA_CORRUPT


def stream(root, **kw) -> list[data_pb2.MicroBatch]:
    return list(build_stream(root).batches(open_stream(**kw)))


def key(b: data_pb2.MicroBatch):
    return b.input_ids, b.labels, (b.next.epoch, b.next.row)


@pytest.mark.parametrize("mode", [data_pb2.PACK, data_pb2.PAD])
def test_a_stream_opened_at_any_next_position_continues_exactly(dataset, root, mode):
    kw = dict(mode=mode, seq_len=32, micro_batch_size=3, min_tokens=40, banned_bytes=b"\0", rank=1, world_size=2)
    full = stream(root, **kw)
    assert len(full) > 20 and full[-1].next.epoch == 1
    assert any(b.next.row for b in full)  # (positions inside an epoch, not only its start)
    for k in range(0, len(full) - 1, 4):
        resumed = stream(root, start=full[k].next, **kw)
        assert [key(b) for b in resumed] == [key(b) for b in full[k + 1 :]], f"resume after batch {k}"


def documents_of(rows_ids, rows_labels) -> list[bytes]:
    """PAD rows holding whole documents back to bytes: first input, then every label."""
    out = []
    for ids, labels in zip(rows_ids, rows_labels):
        n = int((labels != -100).sum())
        if n:
            out.append(bytes([int(ids[0]), *labels[:n].tolist()]))
    return out


def test_ranks_see_disjoint_documents_that_together_are_the_split(dataset, root):
    tokens = np.fromfile(dataset.path / "train.bin", dtype="<u2")
    bounds = np.load(dataset.path / "train.idx.npy")
    split = sorted(tokens[bounds[i] : bounds[i + 1]].astype(np.uint8).tobytes() for i in range(len(bounds) - 1))
    per_rank = []
    for rank in range(3):
        docs = []
        for b in stream(root, mode=data_pb2.PAD, seq_len=4096, micro_batch_size=2, rank=rank, world_size=3):
            ids, labels = as_arrays(b)
            docs += documents_of(ids, labels)
        per_rank.append(docs)
    assert all(per_rank) and not set(per_rank[0]) & set(per_rank[1]) and not set(per_rank[1]) & set(per_rank[2])
    assert sorted(d for docs in per_rank for d in docs) == split


def rows_of(batches) -> list[tuple[bytes, bytes]]:
    """Every row of ``batches`` in order, as (input ids, labels) bytes; all-padding rows
    (a single pass's last round) left out."""
    out = []
    for b in batches:
        ids, labels = as_arrays(b)
        out += [(i.tobytes(), lab.tobytes()) for i, lab in zip(ids, labels) if (lab != -100).any()]
    return out


def test_repeat_goes_on_to_the_next_epoch_in_a_new_order(dataset, root):
    one = stream(root)
    both = stream(root, repeat=True, max_batches=2 * len(one))
    assert len(both) == 2 * len(one)
    first = rows_of(one)
    assert rows_of(both)[: len(first)] == first  # the epoch's rows; its end is a row boundary only
    assert [key(b) for b in both[: len(one) - 1]] == [key(b) for b in one[:-1]]
    second = rows_of(both)[len(first) :]
    # (2,090 rows an epoch: 522 batches and 2 rows, so the last two batches reach epoch 2)
    assert {b.next.epoch for b in both[len(one) : -2]} == {1} and both[-1].next.epoch == 2
    assert second[: len(first) // 2] != first[: len(first) // 2]  # epoch 1 is another order


def test_a_single_pass_gives_every_rank_as_many_batches_and_an_empty_one_just_ends(dataset, root):
    # More ranks than held-out documents (one row each): the last round is padded, so every
    # rank meets every collective of the evaluation; the surplus rank's batch is all padding.
    W = dataset.val_documents + 1
    kw = dict(split="val", mode=data_pb2.PAD, seq_len=8192, micro_batch_size=1, world_size=W)
    per_rank = [stream(root, rank=r, **kw) for r in range(W)]
    assert [len(b) for b in per_rank] == [1] * W
    assert [b[0].tokens > 0 for b in per_rank] == [True] * (W - 1) + [False]
    assert stream(root, split="val", min_tokens=10**6) == []  # nothing in the pass: it just ends


def test_max_batches_ends_the_stream_early(dataset, root):
    assert len(stream(root, repeat=True, max_batches=5)) == 5


def test_the_filter_report_rides_on_every_batch_and_adds_up(dataset, root):
    last = {}
    for split in ("train", "val"):
        batches = stream(root, split=split, min_tokens=50, banned_bytes=b"\0")
        assert [b.filter.kept for b in batches] == sorted(b.filter.kept for b in batches)  # cumulative
        assert all(b.tokens > 0 for b in batches)
        last[split] = batches[-1].filter
    for split, documents in (("train", dataset.train_documents), ("val", dataset.val_documents)):
        r = last[split]
        assert r.kept + r.dropped_too_short + r.dropped_too_long + r.dropped_banned == documents
    assert sum(r.dropped_banned for r in last.values()) == 1  # has_nul.py, in whichever split
    assert sum(r.dropped_too_short for r in last.values()) == 1  # mod_00.py: 11 bytes


def test_errors_end_the_stream_with_one_line_reasons(dataset, root):
    with pytest.raises(DatasetNotFound, match=r"^dataset tiny@v9 not found \(have: tiny@v1\)$"):
        stream(root, version="v9")
    with pytest.raises(InvalidConfig, match=r"^packer\.micro_batch_size: must be > 0, got 0$"):
        stream(root, micro_batch_size=0)
    with pytest.raises(InvalidConfig, match=r"^open_stream\.split: must be 'train' or 'val', got 'test'$"):
        stream(root, split="test")
    with pytest.raises(NoDocuments, match=r"split train: no document left after filtering in epoch 0"):
        stream(root, min_tokens=10**6, repeat=True)
    (dataset.path / "val.bin").write_bytes(bytes(reversed((dataset.path / "val.bin").read_bytes())))
    with module_failure(DatasetCorrupt, r"val\.bin: sha256 mismatch", "DatasetUnavailable", CORRUPT):
        stream(root, split="val", verify=True)


def test_the_pipeline_outpaces_a_rank_by_far(tmp_path):
    """8 x 256 micro-batches from a 4 MB dataset; a rank needs ~3 per second."""
    src = tmp_path / "big"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(200):
        (src / f"m{i}.py").write_bytes(rng.integers(32, 127, size=20_000, dtype=np.uint8).tobytes())
    root = tmp_path / "ds"
    prepare_dataset(src, "big", "v1", root)
    relay = build_stream(root)
    req = open_stream(name="big", seq_len=256, micro_batch_size=8, watermark=256, repeat=True, max_batches=1500)
    t0 = time.perf_counter()
    n = sum(1 for _ in relay.batches(req))
    rate = n / (time.perf_counter() - t0)
    print(f"in-process stream: {rate:.0f} micro-batches/s (8 x 256)")
    assert n == 1500 and rate > 300


def test_the_resume_position_travels_in_the_commands_own_fields_and_must_agree(dataset, root):
    full = stream(root, seq_len=16, micro_batch_size=2)
    start = full[3].next
    req = open_stream(seq_len=16, micro_batch_size=2, start=start)
    req.packer.start.CopyFrom(start)  # what the relay fills in from `start` itself
    assert [key(b) for b in build_stream(root).batches(req)] == [key(b) for b in full[4:]]
    req.packer.start.row += 1
    with pytest.raises(InvalidConfig, match=r"packer.start differs from start"):
        list(build_stream(root).batches(req))
    # A position by document (the format before rows were ordered) is refused, not misread.
    old = open_stream(seq_len=16, micro_batch_size=2, start=data_pb2.DataPosition(epoch=0, document=3, offset=5))
    with pytest.raises(InvalidConfig, match=r"start 0/3/5 .* is a position by document; a position is \(epoch, row\)"):
        list(build_stream(root).batches(old))


def global_rows(root, world: int, batch: int, rounds: int, **kw) -> tuple[list, list]:
    """The global stream as the ranks of a dp=``world`` job see it: round k is rank 0's k-th
    micro-batch, then rank 1's, ... -> (rows in order, each round's ``next`` position)."""
    per_rank = [
        stream(root, rank=r, world_size=world, micro_batch_size=batch, repeat=True, max_batches=rounds, **kw)
        for r in range(world)
    ]
    positions = []
    for k in range(rounds):
        nexts = {(b[k].next.epoch, b[k].next.row) for b in per_rank}
        assert len(nexts) == 1, f"round {k}: ranks disagree on the global position {nexts}"
        positions += list(nexts)
    rows = []
    for k in range(rounds):
        for r in range(world):
            ids, labels = as_arrays(per_rank[r][k])
            rows += [(i.tobytes(), lab.tobytes()) for i, lab in zip(ids, labels)]
    return rows, positions


@pytest.mark.parametrize("mode", [data_pb2.PACK, data_pb2.PAD])
def test_the_global_batches_do_not_depend_on_the_split_and_a_resume_at_another_dp_continues_them(dataset, root, mode):
    """Global batch G = 8 rows: dp 1 x 8, dp 2 x 4, dp 4 x 2 (or dp 2 x 2 x grad_accum 2:
    the same rounds), dp 8 x 1 see the same rows in the same order, over an epoch's end, and
    agree on the one global position; a stream resumed at a step's position under another
    split continues the same rows."""
    kw = dict(mode=mode, seq_len=256, min_tokens=40)
    G, steps = 8, 40
    ref, ref_pos = global_rows(root, 1, G, steps, **kw)
    in_epoch_1 = [e for e, _ in ref_pos].index(1) + 2  # a step well inside epoch 1
    assert in_epoch_1 < steps - 2 and ref_pos[in_epoch_1 - 1][0] == 1
    for world, batch in ((2, 4), (4, 2), (2, 2), (8, 1)):
        rows, positions = global_rows(root, world, batch, steps * G // (world * batch), **kw)
        assert rows == ref, f"dp {world} x {batch}"
        per_step = G // (world * batch)  # rounds per step (grad_accum, for dp 2 x 2)
        assert positions[per_step - 1 :: per_step] == ref_pos, f"dp {world} x {batch}"
    for s in (3, in_epoch_1):  # resume after step s (in epoch 0, in epoch 1) at dp 4 x 2 and dp 2 x 4
        start = data_pb2.DataPosition(epoch=ref_pos[s - 1][0], row=ref_pos[s - 1][1])
        for world, batch in ((4, 2), (2, 4)):
            rounds = (steps - s) * G // (world * batch)
            rows, _ = global_rows(root, world, batch, rounds, start=start, **kw)
            assert rows == ref[s * G :], f"resume after step {s} at dp {world} x {batch}"
