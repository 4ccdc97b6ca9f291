"""L4-3: the order is a pure function of (seed, epoch), the same for every rank; content untouched."""

from __future__ import annotations

import numpy as np
import pytest

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.data.errors import InvalidConfig
from services.data.shuffler import Shuffler, epoch_order

from .helpers import catalog

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


def wired(tmp_path) -> tuple[Bus, list]:
    """A shuffler on a bus with the filter's inbox replaced by a recorder (a real subscriber)."""
    bus = Bus()
    shuffler = Shuffler(bus.emitter(Module.L4_SHUFFLER))
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.SamplesRead, shuffler.on_samples_read)
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.ShufflePlan, shuffler.shuffle_plan)
    out = []
    bus.subscribe(Module.L4_FILTER, data_pb2.SamplesShuffled, lambda m, order: out.append(order))
    cat = catalog(tmp_path, *[[i] * (i % 5 + 1) for i in range(N)])  # document i is made of the token i
    bus.publish(Module.L4_PREFETCHER, data_pb2.SamplesRead(count=N), cat)
    return bus, out


def plan(bus, epoch=0, start=None, seed=99):
    msg = data_pb2.ShufflePlan(seed=seed, epoch=epoch, enabled=True, start_document=start or 0)
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER)(msg)


def emitted(out) -> list[list[int]]:
    """The documents' tokens in the orders handed on (read through the catalog's handle)."""
    res = []
    for o in out:
        b = o.catalog.store.bounds_n1
        res.extend(o.catalog.reader.read(int(b[i]), int(b[i + 1] - b[i])).tolist() for i in o.order())
    return res


def test_one_plan_hands_on_the_epoch_order_with_contents_unchanged(tmp_path):
    bus, out = wired(tmp_path)
    assert out == []  # nothing without a plan
    plan(bus, epoch=2)
    order = epoch_order(99, 2, N)
    assert emitted(out) == [[int(i)] * (int(i) % 5 + 1) for i in order]
    assert [(o.epoch, o.seed, o.enabled) for o in out] == [(2, 99, True)]
    with pytest.raises(ValueError, match="read-only"):
        out[0].order()[0] = 3


def test_the_plan_names_no_rank_every_stream_reads_the_whole_global_order(tmp_path):
    """The order is global (the packer deals rows to ranks), so a data position means the
    same thing at any data-parallel size."""
    assert "rank" not in data_pb2.ShufflePlan.DESCRIPTOR.fields_by_name
    runs = []
    for k in range(2):
        bus, out = wired(tmp_path / str(k))
        plan(bus, epoch=1)
        runs.append(emitted(out))
    assert runs[0] == runs[1] and [toks[0] for toks in runs[0]] == epoch_order(99, 1, N).tolist()


def test_a_start_by_document_is_refused_a_stream_resumes_at_a_row(tmp_path):
    bus, out = wired(tmp_path)
    with pytest.raises(InvalidConfig, match=r"^shuffle\.start_document: 45: a stream resumes at a row"):
        plan(bus, epoch=1, start=45)
    assert out == []


def test_the_order_is_pinned_so_a_resumed_run_on_another_numpy_sees_the_same_data():
    # Golden values: PCG64 raw outputs and SeedSequence are stream-stable across NumPy releases.
    assert epoch_order(1234, 0, 12).tolist() == GOLDEN
