"""Weighted mixtures (services/data/blend.py, mixture.py): the blend, the interleave of the
components' own streams, exact resume at another dp size, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from services.contract import data_pb2
from services.data import blend
from services.data.__main__ import build_stream
from services.data.blend import FORMAT, MARK, Blend
from services.data.errors import InvalidConfig
from services.data.prepare import prepare_dataset

from .helpers import as_arrays, open_stream

SEQ = 256


@pytest.fixture
def two(dataset, source, root):
    """``tiny@v1`` and ``half@v1`` (one of tiny's two packages: another corpus, fewer rows)."""
    prepare_dataset(source / "pkg1", "half", "v1", root, val_fraction=0.1)
    return [("tiny", "v1", 1.0), ("half", "v1", 3.0)]


def mixture(components, **kw) -> data_pb2.OpenStream:
    req = open_stream(seq_len=SEQ, repeat=True, **kw)
    req.ClearField("mount")
    for name, version, weight in components:
        req.mixture.add(mount=data_pb2.MountDataset(name=name, version=version), weight=weight)
    return req


def rows(batches) -> list[bytes]:
    out = []
    for b in batches:
        ids, labels = as_arrays(b)
        out += [i.tobytes() + lab.tobytes() for i, lab in zip(ids, labels)]
    return out


def pulled(root, req) -> list[data_pb2.MicroBatch]:
    return list(build_stream(root).batches(req))


def blended(root, components, *, world_size, micro_batch_size, rounds, start=None) -> list[bytes]:
    """The blended rows of ``rounds`` rounds from ``start``, rank by rank dealt back together."""
    per_rank = [
        pulled(
            root,
            mixture(
                components,
                rank=r,
                world_size=world_size,
                micro_batch_size=micro_batch_size,
                max_batches=rounds,
                start=start,
            ),
        )
        for r in range(world_size)
    ]
    out = []
    for m in range(rounds):
        for r in range(world_size):
            out += rows([per_rank[r][m]])
    return out


@pytest.mark.parametrize("weights", [[1, 1], [3, 1], [0.2, 0.5, 0.3], [1e-3, 1, 7]])
def test_the_blend_counts_follow_the_weights_within_one_at_every_prefix(weights):
    b = Blend(weights)
    w = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(w), np.int64)
    for i, (k, j) in enumerate(b.sources(0, 5000)):
        assert j == counts[k]  # the component's own rows are taken in order
        counts[k] += 1
        assert np.all(np.abs(counts - w * (i + 1)) <= 1), (i, counts)
        if i % 997 == 0:
            assert Blend(weights).counts(i + 1) == counts.tolist()  # a pure function of the row


def test_a_seek_from_the_walks_kept_in_the_process_gives_the_same_counts():
    weights, n = [0.3, 0.7], 2 * MARK + 7
    counts = [0, 0]
    blend._MARKS.pop((0.3, 0.7), None)  # (before the first Blend of these weights)
    for k, _ in Blend(weights).sources(0, n):  # one walk from 0 (marks every MARK rows)
        counts[k] += 1
    assert sorted(blend._MARKS[(0.3, 0.7)]) == [0, MARK, 2 * MARK]
    assert Blend(weights).counts(n) == counts and Blend(weights).counts(MARK + 1)[1] in (45876, 45877)


def test_a_mixture_stream_is_the_interleave_of_its_components_own_streams(two, root):
    n = 40  # rounds of 2 ranks x 3 rows: 240 blended rows, more than half@v1's epoch
    got = blended(root, two, world_size=2, micro_batch_size=3, rounds=n)
    sources = Blend([w for *_, w in two]).sources(0, len(got))
    need = [1 + max(j for k, j in sources if k == c) for c in range(len(two))]
    own = [
        pulled(root, open_stream(name=name, version=v, seq_len=SEQ, micro_batch_size=1, repeat=True, max_batches=m))
        for (name, v, _), m in zip(two, need)
    ]
    assert any(b.next.epoch >= 1 for b in own[1])  # the small one wraps its epochs on its own
    assert got == [rows([own[k][j]])[0] for k, j in sources]
    # Each component's own position rides with the batch, the same on every rank.
    batches = pulled(root, mixture(two, rank=1, world_size=2, micro_batch_size=3, max_batches=n))
    assert (batches[-1].next.epoch, batches[-1].next.row, batches[-1].next.format) == (0, 6 * n, FORMAT)
    epoch_ends = 0
    for m, b in enumerate(batches):  # (an epoch's end included: a component's own next is (e + 1, 0) there)
        counts = Blend([w for *_, w in two]).counts(6 * (m + 1))
        for c, pos in enumerate(b.components):
            assert pos.dataset == f"{two[c][0]}@{two[c][1]}" and pos.rows == counts[c]
            theirs = own[c][counts[c] - 1].next
            assert (pos.position.epoch, pos.position.row) == (theirs.epoch, theirs.row), (m, c)
            epoch_ends += theirs.row == 0
    assert epoch_ends


def test_a_mixture_resumes_exactly_at_a_saved_position_at_another_dp_size(two, root):
    full = blended(root, two, world_size=2, micro_batch_size=3, rounds=30)
    at = pulled(root, mixture(two, rank=0, world_size=2, micro_batch_size=3, max_batches=11))[-1].next
    assert at.row == 66
    same = blended(root, two, world_size=2, micro_batch_size=3, rounds=19, start=at)
    other = blended(root, two, world_size=3, micro_batch_size=2, rounds=19, start=at)
    assert same == full[66:] and other == full[66:]


def test_mixture_refusals_are_one_line_naming_the_field(two, root):
    plain = data_pb2.DataPosition(epoch=0, row=5, format="rows-v1")
    mixed = data_pb2.DataPosition(epoch=0, row=5, format=FORMAT)
    with pytest.raises(InvalidConfig, match=r"open_stream.start: .*'rows-v1'.*'mix-v1'") as e:
        pulled(root, mixture(two, max_batches=1, start=plain))
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidConfig, match=r"open_stream.start: .*'mix-v1'.*'rows-v1'"):
        pulled(root, open_stream(max_batches=1, start=mixed))
    with pytest.raises(InvalidConfig, match=r"open_stream.mixture: mixture component 1: weight must be > 0"):
        pulled(root, mixture([("tiny", "v1", 1.0), ("half", "v1", 0.0)], max_batches=1))
    both = mixture(two, max_batches=1)
    both.mount.name = "tiny"
    with pytest.raises(InvalidConfig, match=r"mount 'tiny' and mixture both given"):
        pulled(root, both)


def test_a_skip_passes_over_rows_across_epoch_ends_without_reading_them(two, root):
    req = open_stream(name="half", seq_len=SEQ, micro_batch_size=1, repeat=True)
    own = pulled(root, open_stream(name="half", seq_len=SEQ, micro_batch_size=1, repeat=True, max_batches=300))
    end = next(i for i, b in enumerate(own) if b.next.epoch == 1)  # epoch 0's last row
    for skip in (end + 1, end + 5, 2 * end + 3):
        relay = build_stream(root)
        relay.open(req)
        assert relay.next_batches(0, skip=skip) == []
        want = own[skip - 1].next
        assert (relay.position.epoch, relay.position.row) == (want.epoch, want.row), skip
        assert rows(relay.next_batches(1)) == rows([own[skip]])
        relay.close()
