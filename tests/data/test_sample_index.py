"""The sample index gives exactly the global sample sequence of the in-memory algorithm
(``reference_sequence.py``), so positions in existing checkpoints stay valid."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from services.contract import data_pb2
from services.data import sample_index
from services.data.__main__ import build_stream
from services.data.errors import InvalidConfig
from services.data.sample_index import FORMAT, count_rows, cut_rows, open_epoch

from .helpers import open_stream
from .reference_sequence import reference_batches


def _corpus(dataset):
    tokens = np.fromfile(dataset.path / "train.bin", dtype="<u2")
    return tokens, np.load(dataset.path / "train.idx.npy")


def _got(root, req):
    return [(b.input_ids, b.labels, b.tokens, (b.next.epoch, b.next.row)) for b in build_stream(root).batches(req)]


CASES = [
    # (mode, shuffle, seq_len, separator, filter)
    (data_pb2.PACK, True, 32, 0, dict(min_tokens=40, banned_bytes=b"\0")),
    (data_pb2.PACK, False, 16, -1, dict(max_tokens=900)),
    (data_pb2.PAD, True, 32, 0, dict(min_tokens=2, banned_tokens=[ord("9"), ord("Z")])),
    (data_pb2.PAD, False, 24, 0, {}),
    (data_pb2.PACK, True, 7, 10, dict(banned_tokens=[ord("7")], max_tokens=2000)),
]


@pytest.mark.parametrize("mode,shuffle,seq_len,separator,rules", CASES)
@pytest.mark.parametrize("world_size", [1, 3])
def test_the_index_stream_is_the_in_memory_sequence(
    dataset, root, mode, shuffle, seq_len, separator, rules, world_size
):
    tokens, bounds = _corpus(dataset)
    banned_tokens = rules.pop("banned_tokens", [])
    for repeat in (False, True):
        req = open_stream(
            mode=mode, shuffle=shuffle, seq_len=seq_len, separator_id=separator, micro_batch_size=2,
            rank=world_size - 1, world_size=world_size, repeat=repeat, seed=11, **rules,
        )  # fmt: skip
        req.filter.banned_tokens.extend(banned_tokens)
        want = reference_batches(tokens, bounds, req, epochs=2)
        if repeat:
            req.max_batches = len(want)
        got = _got(root, req)
        assert got == want, (repeat, len(got), len(want))
        assert len(got) > 10
        # Resumed at positions inside and at the end of the epoch: the same continuation.
        for k in sorted({1, len(want) // 3, len(want) // 2 - 1}):
            start = data_pb2.DataPosition(epoch=want[k][3][0], row=want[k][3][1])
            resumed = open_stream(
                mode=mode, shuffle=shuffle, seq_len=seq_len, separator_id=separator, micro_batch_size=2,
                rank=world_size - 1, world_size=world_size, repeat=repeat, seed=11, start=start, **rules,
            )  # fmt: skip
            resumed.filter.banned_tokens.extend(banned_tokens)
            want_r = reference_batches(tokens, bounds, resumed, epochs=2)
            if repeat:
                resumed.max_batches = len(want_r)
            assert _got(root, resumed) == want_r, (repeat, k)


def test_streams_opening_together_build_an_epoch_once_and_atomically(tmp_path):
    built = []

    def build():
        built.append(1)
        time.sleep(0.2)  # (long enough for the others to wait on the lock)
        rows = cut_rows(np.array([5, 9, 3]), 4, data_pb2.PACK, 0)
        return np.arange(3), rows, np.arange(len(rows))[::-1].copy(), 17

    with ThreadPoolExecutor(6) as pool:
        indices = list(pool.map(lambda _: open_epoch(tmp_path, 0, {"k": 1}, build), range(6)))
    assert len(built) == 1
    assert all(i.rows == 5 and i.row(0) == (2, 0, 4) for i in indices)  # 20 tokens: rows at 0, 4, .., 16
    assert sorted(p.name for p in tmp_path.iterdir()) == [".epoch-0.lock", "epoch-0"]  # no temporary left
    meta = json.loads((tmp_path / "epoch-0" / "meta.json").read_text())
    assert (meta["format"], meta["rows"], meta["tokens"], meta["key"]) == (FORMAT, 5, 17, {"k": 1})
    # An epoch directory without its meta.json (a crash mid-way) is rebuilt.
    (tmp_path / "epoch-0" / "meta.json").unlink()
    open_epoch(tmp_path, 0, {"k": 1}, build)
    assert len(built) == 2 and (tmp_path / "epoch-0" / "meta.json").is_file()


def test_a_failed_build_or_a_dead_builder_leaves_no_half_index(tmp_path):
    def failing():
        raise OSError("disk full")

    def build():
        rows = cut_rows(np.array([5, 9, 3]), 4, data_pb2.PACK, 0)
        return np.arange(3), rows, np.arange(len(rows)), 17

    with pytest.raises(OSError, match="disk full"):
        open_epoch(tmp_path, 0, {"k": 1}, failing)
    assert not (tmp_path / "epoch-0").exists()
    # A builder killed mid-write left its temporary: the next build (holding the lock) clears it.
    (tmp_path / ".epoch-0.tmp-999999").mkdir()
    (tmp_path / ".epoch-0.tmp-999999" / "doc_idx.npy").write_bytes(b"\x93NUMPY")
    assert open_epoch(tmp_path, 0, {"k": 1}, build).rows == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".epoch-0.lock", "epoch-0"]
    # A machine that died before writeback (no fsync) may leave a file cut short under the
    # final name: found short of meta.json's counts, the epoch is rebuilt, not served.
    sample = tmp_path / "epoch-0" / "sample_idx.npy"
    sample.write_bytes(sample.read_bytes()[:-24])
    rebuilt = []
    index = open_epoch(tmp_path, 0, {"k": 1}, lambda: rebuilt.append(1) or build())
    assert rebuilt == [1] and index.rows == 5 and index.row(4) == (2, 0, 4)


def _rows_by_search(lengths, seq_len, separator):
    """PACK's rows as first written: a binary search per row for the unit it starts in."""
    ends = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64) + (1 if separator >= 0 else 0))])
    T = int(ends[-1])
    R = -(-(T - 1) // seq_len) if T >= 2 else 0
    starts = np.arange(R, dtype=np.int64) * seq_len
    doc = np.searchsorted(ends, starts, side="right") - 1
    return np.stack([doc, starts - ends[doc], np.minimum(seq_len + 1, T - starts)], axis=1).reshape(R, 3)


@pytest.mark.parametrize("chunk", [3, sample_index.CHUNK])
def test_rows_are_cut_as_the_search_defines_them_and_counted_before_the_order_is_known(chunk, monkeypatch):
    monkeypatch.setattr(sample_index, "CHUNK", chunk)  # (rows cut a chunk at a time: chunk edges too)
    rng = np.random.default_rng(3)
    for _ in range(300):
        lengths = rng.integers(0, rng.integers(1, 50), size=rng.integers(0, 60))  # (empty documents too)
        seq_len, separator = int(rng.integers(1, 20)), int(rng.choice([-1, 0, 5]))
        rows = cut_rows(lengths, seq_len, data_pb2.PACK, separator)
        assert np.array_equal(rows, _rows_by_search(lengths, seq_len, separator)), (lengths, seq_len, separator)
        for mode in (data_pb2.PACK, data_pb2.PAD):
            n = len(cut_rows(lengths, seq_len, mode, separator))
            assert count_rows(rng.permutation(lengths), seq_len, mode, separator) == n  # any order


def test_the_index_lives_next_to_the_version_and_goes_with_it(dataset, root):
    list(build_stream(root).batches(open_stream(max_batches=2, repeat=True)))
    (key,) = (root / ".index" / "tiny" / "v1").glob("*/epoch-0")
    assert (key / "meta.json").is_file() and not list(dataset.path.glob(".index*"))


def test_a_stream_in_another_sample_sequence_format_is_refused_naming_both(dataset, root):
    old = open_stream(start=data_pb2.DataPosition(epoch=0, row=4, format="rows-v0"))
    with pytest.raises(
        InvalidConfig, match=r"^open_stream\.start: position in sample-sequence format 'rows-v0', .*'rows-v1'"
    ):
        list(build_stream(root).batches(old))
