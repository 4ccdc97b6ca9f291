"""L4-4: the filter only drops and counts; kept documents pass (by reference) unchanged and in order."""

from __future__ import annotations

import pytest

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.data.errors import InvalidConfig
from services.data.sample_filter import SampleFilter

from .helpers import catalog, epoch_of


def wired(**rules) -> tuple[Bus, list, list]:
    bus = Bus()
    f = SampleFilter(bus.emitter(Module.L4_FILTER))
    bus.subscribe(Module.L4_FILTER, data_pb2.FilterRules, f.filter_rules)
    bus.subscribe(Module.L4_FILTER, data_pb2.SamplesShuffled, f.on_samples_shuffled)
    kept, reports = [], []
    bus.subscribe(Module.L4_BATCH_PACKER, data_pb2.SamplesFiltered, lambda m, docs: kept.append(docs))
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.FilterReport, lambda m, p: reports.append(m))
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER)(data_pb2.FilterRules(**rules))
    return bus, kept, reports


def send(bus, order) -> None:
    bus.publish(Module.L4_SHUFFLER, data_pb2.SamplesShuffled(count=len(order.catalog)), order)


def contents(kept) -> list[list[int]]:
    """The kept documents' tokens in the epoch's order, read through the catalog's handle."""
    b = kept.catalog.store.bounds_n1
    return [kept.catalog.reader.read(int(b[i]), int(b[i + 1] - b[i])).tolist() for i in kept.doc_idx()]


def counts(report) -> tuple[int, int, int, int]:
    return report.kept, report.dropped_too_short, report.dropped_too_long, report.dropped_banned


def test_filter_only_drops_and_counts(tmp_path):
    bus, kept, reports = wired(min_tokens=3, max_tokens=6, banned_bytes=b"\0", banned_tokens=[255])
    cat = catalog(tmp_path, [1, 2], [1, 2, 3], [0, 1, 2, 3], [1] * 7, [4, 255, 5], [9, 8, 7, 6, 5, 4], [])
    send(bus, epoch_of(cat))
    assert contents(kept[0]) == [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    assert kept[0].doc_idx().tolist() == [1, 5]  # storage ids travel, not tokens
    assert counts(reports[-1]) == (2, 2, 1, 2)  # [1,2] and [] short; 7 long; NUL and 255 banned


def test_kept_documents_follow_the_epoch_order(tmp_path):
    bus, kept, _ = wired(min_tokens=2)
    cat = catalog(tmp_path, *[[i] * (i % 3 + 1) for i in range(30)])
    order = epoch_of(cat, seed=5, enabled=True)
    send(bus, order)
    want = [int(i) for i in order.order() if i % 3 > 0]
    assert kept[0].doc_idx().tolist() == want
    assert [c[0] for c in contents(kept[0])] == want  # document i is made of i


def test_the_report_is_cumulative_over_the_epochs_of_a_stream(tmp_path):
    bus, kept, reports = wired(min_tokens=2)
    cat = catalog(tmp_path, [1], [1, 2], [3])
    send(bus, epoch_of(cat, 0))
    send(bus, epoch_of(cat, 1))
    assert [counts(r) for r in reports] == [(1, 2, 0, 0), (2, 4, 0, 0)]
    assert [(int(k.keep_n.sum()), k.epoch) for k in kept] == [(1, 0), (1, 1)]


def test_banned_tokens_are_found_across_read_chunks(tmp_path, monkeypatch):
    import services.data.sample_filter as sf

    monkeypatch.setattr(sf, "SCAN_CHUNK_TOKENS", 3)  # documents straddle the scan's reads
    bus, kept, reports = wired(banned_tokens=[7])
    docs = [[1, 2, 3, 4, 5], [6, 7], [], [8, 9, 10, 11, 12, 13, 7], [1] * 8, [7]]
    send(bus, epoch_of(catalog(tmp_path, *docs)))
    assert kept[0].doc_idx().tolist() == [0, 2, 4]
    assert counts(reports[-1]) == (3, 0, 0, 3)


def test_the_verdicts_are_read_only(tmp_path):
    bus, kept, _ = wired(min_tokens=2)
    send(bus, epoch_of(catalog(tmp_path, [1, 2, 3], [1])))
    with pytest.raises(ValueError, match="read-only"):
        kept[0].keep_n[1] = True


def test_banned_bytes_need_the_bytes_tokenizer(tmp_path):
    bus, _, _ = wired(banned_bytes=b"\0")
    with pytest.raises(InvalidConfig, match=r"filter\.banned_bytes: needs the bytes tokenizer.*use banned_tokens"):
        send(bus, epoch_of(catalog(tmp_path, [1, 2], tokenizer="/data/tok.json")))


def test_rules_are_pushed_once_and_must_be_consistent():
    bus, _, _ = wired(min_tokens=1)
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER)
    with pytest.raises(InvalidConfig, match="rules already set"):
        port(data_pb2.FilterRules(min_tokens=5))
    with pytest.raises(InvalidConfig, match=r"filter\.max_tokens: 3 is below min_tokens 5"):
        wired(min_tokens=5, max_tokens=3)
