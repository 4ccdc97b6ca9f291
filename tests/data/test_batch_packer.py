"""L4-5: fixed-shape batches; padding is pad_id with label -100; pack rows share a boundary;
rows are dealt to ranks slot by slot."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from services.contract import data_pb2
from services.data import sample_index
from services.data.batch_packer import row_order
from services.data.errors import InvalidConfig

from .helpers import as_arrays, catalog, kept_all, packer_on_bus

X = -100  # label of padding


class Wired:
    """L4-5 on a bus with L2-1's ports; ``send`` hands it an epoch's kept documents (written
    to a token file, by reference) and asks for every batch of it (AssembleBatches)."""

    def __init__(self, cfg: data_pb2.PackerConfig):
        self.feed, self.assemble, self.batches, self.exhausted, self.port = packer_on_bus(cfg)
        self._dir = Path(tempfile.mkdtemp(prefix="packer-"))

    def send(self, *docs, epoch: int = 0, assemble: int | None = 1_000_000) -> None:
        self.feed(kept_all(catalog(self._dir / f"e{epoch}", *docs), epoch))
        if assemble:
            self.assemble(assemble)


def wired(
    mode, seq_len=4, batch=2, pad_id=9, separator_id=-1, start=None, rank=0, world_size=1, repeat=False, shuffle=False
):
    cfg = data_pb2.PackerConfig(
        seq_len=seq_len, micro_batch_size=batch, pad_id=pad_id, mode=mode, separator_id=separator_id, start=start,
        rank=rank, world_size=world_size, repeat=repeat, shuffle=shuffle, seed=1234,
    )  # fmt: skip
    w = Wired(cfg)
    return w, w.batches, w.exhausted


def send(w: Wired, *docs, epoch: int = 0) -> None:
    w.send(*docs, epoch=epoch)


def pos(b):
    return (b.next.epoch, b.next.row)


def test_pad_mode_pads_with_the_pad_id_and_labels_padding_minus_100():
    bus, batches, exhausted = wired(data_pb2.PAD)
    send(bus, [1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11])
    assert len(batches) == 2
    (i0, l0), (i1, l1) = as_arrays(batches[0]), as_arrays(batches[1])
    # [1,2,3] fills part of a row; [4] has no label so makes no row; the long document
    # continues on the next row, starting again at its boundary token 9.
    assert i0.tolist() == [[1, 2, 9, 9], [5, 6, 7, 8]]
    assert l0.tolist() == [[2, 3, X, X], [6, 7, 8, 9]]
    assert i1.tolist() == [[9, 10, 9, 9], [9, 9, 9, 9]]  # the last batch keeps its size: a padding row
    assert l1.tolist() == [[10, 11, X, X], [X, X, X, X]]
    assert [b.tokens for b in batches] == [6, 2]  # labels that are not -100
    assert pos(batches[0]) == (0, 2) and pos(batches[1]) == (1, 0)
    assert [(e.split, e.position.epoch, e.position.row, e.rows) for e in exhausted] == [("train", 1, 0, 3)]


def test_pack_mode_rows_are_seq_len_plus_one_tokens_input_row_minus_last_labels_row_minus_first():
    bus, batches, exhausted = wired(data_pb2.PACK, separator_id=0)
    bus.send(list(range(1, 11)), assemble=None)  # 10 tokens + separator = 11
    assert batches == [] and exhausted == []  # nothing is assembled until L2-1 asks
    bus.assemble(1)
    assert len(batches) == 1 and exhausted == []  # at most `count` batches per request
    ids, labels = as_arrays(batches[0])
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert labels.tolist() == [[2, 3, 4, 5], [6, 7, 8, 9]]  # row r = tokens[4r : 4r + 5]
    assert batches[0].tokens == 8 and pos(batches[0]) == (0, 2)
    assert batches[0].next.format == sample_index.FORMAT
    bus.assemble(5)
    assert len(batches) == 2 and len(exhausted) == 1  # the last (padded) batch, then the end


def test_pack_mode_separates_documents_and_pads_the_rest_at_the_end_of_the_epoch():
    bus, batches, exhausted = wired(data_pb2.PACK, separator_id=0)
    send(bus, [1, 2, 3], [4, 5])  # 7 tokens: not a full batch, the epoch's end pads it
    ids, labels = as_arrays(batches[0])
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 9, 9]]
    assert labels.tolist() == [[2, 3, 0, 4], [5, 0, X, X]]
    assert batches[0].tokens == 6 and pos(batches[0]) == (1, 0) and len(exhausted) == 1


def test_batches_asked_for_in_any_pieces_are_the_same_batches():
    docs = [list(range(10 * k + 1, 10 * k + 1 + (k % 7) + 2)) for k in range(30)]

    def run(pieces):
        bus, batches, exhausted = wired(data_pb2.PACK, seq_len=5, batch=3, separator_id=0, shuffle=True)
        bus.send(*docs, assemble=None)
        for count in pieces:
            bus.assemble(count)
        assert len(exhausted) == 1
        return [(b.input_ids, b.labels, pos(b)) for b in batches]

    assert run([1000]) == run([1, 2, 3, 4, 1000]) == run([1] * 30)


def test_the_batch_size_and_sequence_length_never_change():
    bus, batches, _ = wired(data_pb2.PAD, seq_len=8, batch=3)
    rng = np.random.default_rng(0)
    send(bus, *[rng.integers(1, 200, size=int(n)) for n in rng.integers(1, 40, size=25)])
    assert batches and {(b.batch_size, b.seq_len, len(b.input_ids), len(b.labels)) for b in batches} == {(3, 8, 96, 96)}


def test_a_resume_skips_the_rows_of_the_epoch_order_already_dealt():
    start = data_pb2.DataPosition(epoch=0, row=1)
    bus, batches, exhausted = wired(data_pb2.PAD, start=start)
    send(bus, [5, 6, 7, 8, 9, 10, 11])
    ids, labels = as_arrays(batches[0])
    assert ids.tolist()[0] == [9, 10, 9, 9] and labels.tolist()[0] == [10, 11, X, X]
    assert exhausted[0].rows == 1  # (rows this stream dealt of the epoch)


def test_a_start_by_document_and_offset_the_format_before_rows_is_refused():
    with pytest.raises(InvalidConfig, match=r"^packer\.start: a position by document/offset"):
        wired(data_pb2.PAD, start=data_pb2.DataPosition(epoch=0, document=22, offset=4))


def test_a_start_in_another_sample_sequence_format_is_refused_naming_both():
    wired(data_pb2.PAD, start=data_pb2.DataPosition(epoch=0, row=2))  # "" (before the field): the same sequence
    wired(data_pb2.PAD, start=data_pb2.DataPosition(epoch=0, row=2, format=sample_index.FORMAT))
    with pytest.raises(
        InvalidConfig, match=r"^packer\.start: position in sample-sequence format 'rows-v0', .* 'rows-v1'"
    ):
        wired(data_pb2.PAD, start=data_pb2.DataPosition(epoch=0, row=2, format="rows-v0"))


def test_a_bad_config_is_refused_with_the_field_named():
    with pytest.raises(InvalidConfig, match=r"^packer\.seq_len: must be > 0, got 0$"):
        wired(data_pb2.PACK, seq_len=0)
    with pytest.raises(InvalidConfig, match=r"packer\.mode: must be PACK or PAD, got PACK_MODE_UNSPECIFIED"):
        wired(data_pb2.PACK_MODE_UNSPECIFIED)


def test_rows_are_dealt_slot_by_slot_and_an_epoch_end_is_a_row_boundary_when_the_stream_repeats():
    docs = [list(range(10 * k + 1, 10 * k + 9)) for k in range(5)]  # 5 documents, 2 rows each
    per_rank = []
    for rank in range(2):
        bus, batches, exhausted = wired(data_pb2.PAD, batch=2, rank=rank, world_size=2, repeat=True)
        send(bus, *docs)  # 10 rows: 2 rounds of 2 x 2, 2 rows wait
        assert len(batches) == 2 and exhausted[0].rows == 10
        send(bus, *docs, epoch=1)  # the next epoch's rows complete the round
        assert len(batches) == 5
        per_rank.append(batches)
    single_bus, single, _ = wired(data_pb2.PAD, batch=4, repeat=True)
    send(single_bus, *docs)
    send(single_bus, *docs, epoch=1)
    for k in range(5):  # round k of the pair is micro-batch k of one rank taking both slots
        ids = np.concatenate([as_arrays(per_rank[0][k])[0], as_arrays(per_rank[1][k])[0]])
        assert ids.tolist() == as_arrays(single[k])[0].tolist()
        assert pos(per_rank[0][k]) == pos(per_rank[1][k]) == pos(single[k])
    assert pos(single[2]) == (1, 2)  # round 2 straddles the epochs: 2 rows of epoch 0, 2 of epoch 1


def test_a_rank_outside_the_deal_is_refused():
    with pytest.raises(InvalidConfig, match=r"^packer\.rank: rank 2 / world_size 2: need rank < world_size$"):
        wired(data_pb2.PACK, rank=2, world_size=2)


def long_documents(n=6, length=200):
    """``n`` documents of ``length`` tokens; document k's tokens are all ``k + 1`` (its id)."""
    return [[k + 1] * length for k in range(n)]


def document_of_rows(batch) -> list[set[int]]:
    ids, _ = as_arrays(batch)
    return [set(row.tolist()) - {0, 9} for row in ids]  # (0: separator, 9: padding)


def test_with_shuffle_on_a_global_batch_takes_rows_of_several_long_documents():
    # 6 documents of 200 tokens, seq_len 8: 25 rows each, a global batch of 2 ranks x 4 rows.
    per_rank = []
    for rank in range(2):
        bus, batches, exhausted = wired(data_pb2.PACK, seq_len=8, batch=4, rank=rank, world_size=2, shuffle=True)
        send(bus, *long_documents())
        per_rank.append(batches)
    assert exhausted[0].rows == 150  # (1,200 tokens: every one after the first a label once)
    spans = []
    for a, b in zip(*per_rank, strict=True):  # one global batch: both ranks' micro-batch
        docs = set().union(*document_of_rows(a), *document_of_rows(b))
        spans.append(len(docs))
    assert sum(s > 1 for s in spans) >= len(spans) - 1  # (in order, nearly every batch is one document)
    bus, in_order, _ = wired(data_pb2.PACK, seq_len=8, batch=8, shuffle=False)
    send(bus, *long_documents())
    assert sum(len(set().union(*document_of_rows(b))) > 1 for b in in_order) <= 6


def test_the_row_order_is_a_pure_function_of_seed_epoch_and_rows():
    a, b = row_order(1234, 0, 500), row_order(1234, 0, 500)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(500))
    assert not np.array_equal(a, row_order(1234, 1, 500))  # another epoch, another order
    assert not np.array_equal(a, row_order(99, 0, 500))
    assert row_order(1234, 0, 500, enabled=False).tolist() == list(range(500))
    # The packer's stream is that order: the same twice, another in the next epoch.
    runs = []
    for _ in range(2):
        bus, batches, _ = wired(data_pb2.PACK, seq_len=8, batch=4, shuffle=True, repeat=True)
        send(bus, *long_documents())
        send(bus, *long_documents(), epoch=1)
        runs.append([(bt.input_ids, pos(bt)) for bt in batches])
    assert runs[0] == runs[1]
    half = len(runs[0]) // 2
    assert [x for x, _ in runs[0][:half]] != [x for x, _ in runs[0][half : 2 * half]]


def test_a_shuffled_stream_resumed_at_a_row_continues_with_the_same_rows():
    bus, straight, _ = wired(data_pb2.PACK, seq_len=8, batch=4, shuffle=True)
    send(bus, *long_documents())
    k = 5  # resume after 5 micro-batches (20 rows)
    assert pos(straight[k - 1]) == (0, 20)
    bus, resumed, _ = wired(data_pb2.PACK, seq_len=8, batch=4, shuffle=True, start=straight[k - 1].next)
    send(bus, *long_documents())
    assert [(b.input_ids, b.labels, pos(b)) for b in resumed] == [(b.input_ids, b.labels, pos(b)) for b in straight[k:]]
