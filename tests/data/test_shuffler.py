"""L4-3: the order is a pure function of (seed, epoch), the same for every rank; content untouched."""

from __future__ import annotations

import numpy as np

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.data.shuffler import Shuffler, epoch_order

from .helpers import make_docs

N = 50
GOLDEN = [5, 6, 3, 9, 7, 4, 1, 10, 11, 2, 8, 0]  # epoch_order(1234, 0, 12)


def test_shuffle_is_a_pure_function_of_seed_and_epoch():
    a = epoch_order(1234, 3, N)
    assert np.array_equal(a, epoch_order(1234, 3, N))
    assert sorted(a.tolist()) == list(range(N))
    assert not np.array_equal(a, epoch_order(1234, 4, N))  # another epoch
    assert not np.array_equal(a, epoch_order(1235, 3, N))  # another seed
    assert not np.array_equal(a, np.arange(N))


def test_shuffle_disabled_keeps_storage_order():
    assert epoch_order(1234, 3, N, enabled=False).tolist() == list(range(N))


def wired(chunk: int = 7) -> tuple[Bus, list]:
    """A shuffler on a bus with the filter's inbox replaced by a recorder (a real subscriber)."""
    bus = Bus()
    shuffler = Shuffler(bus.emitter(Module.L4_SHUFFLER), chunk_documents=chunk)
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.SamplesRead, shuffler.on_samples_read)
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.ShufflePlan, shuffler.shuffle_plan)
    out = []
    bus.subscribe(Module.L4_FILTER, data_pb2.SamplesShuffled, lambda m, docs: out.append(docs))
    docs = [[i] * (i % 5 + 1) for i in range(N)]  # document i is made of the token i
    for lo in range(0, N, 20):
        batch = make_docs(*docs[lo : lo + 20], first=lo, epoch=-1, last=lo + 20 >= N)
        bus.publish(Module.L4_PREFETCHER, data_pb2.SamplesRead(count=len(batch)), batch)
    return bus, out


def plan(bus, epoch=0, start=None, seed=99):
    msg = data_pb2.ShufflePlan(seed=seed, epoch=epoch, enabled=True, start_document=start or 0)
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER)(msg)


def emitted(out) -> list[tuple[int, list[int]]]:
    """(order position, document tokens) in emission order."""
    res = []
    for d in out:
        for k in range(len(d)):
            res.append((int(d.index_n[k]), d.tokens_T[d.bounds_n1[k] : d.bounds_n1[k + 1]].tolist()))
    return res


def test_one_plan_emits_the_epoch_order_in_chunks_with_contents_unchanged():
    bus, out = wired()
    plan(bus, epoch=2)
    order = epoch_order(99, 2, N)
    got = emitted(out)
    assert [pos for pos, _ in got] == list(range(N))
    assert [toks for _, toks in got] == [[int(i)] * (int(i) % 5 + 1) for i in order]
    assert [len(d) for d in out] == [7] * 7 + [1] and [d.last for d in out] == [False] * 7 + [True]
    assert {d.epoch for d in out} == {2}


def test_the_plan_names_no_rank_every_stream_reads_the_whole_global_order():
    """The order is global (the packer deals rows to ranks), so a data position means the
    same thing at any data-parallel size."""
    assert "rank" not in data_pb2.ShufflePlan.DESCRIPTOR.fields_by_name
    runs = []
    for _ in range(2):
        bus, out = wired()
        plan(bus, epoch=1)
        runs.append(emitted(out))
    assert runs[0] == runs[1] and [toks[0] for _, toks in runs[0]] == epoch_order(99, 1, N).tolist()


def test_a_start_position_skips_the_documents_already_used():
    bus, out = wired()
    plan(bus, epoch=1, start=45)
    got = emitted(out)
    assert [pos for pos, _ in got] == [45, 46, 47, 48, 49]
    assert [toks[0] for _, toks in got] == epoch_order(99, 1, N)[45:].tolist()


def test_past_the_end_an_empty_last_chunk_still_marks_the_epoch_end():
    bus, out = wired()
    plan(bus, start=N)
    assert [(len(d), d.last) for d in out] == [(0, True)]


def test_the_order_is_pinned_so_a_resumed_run_on_another_numpy_sees_the_same_data():
    # Golden values: PCG64 raw outputs and SeedSequence are stream-stable across NumPy releases.
    assert epoch_order(1234, 0, 12).tolist() == GOLDEN
