"""L4-4: the filter only drops and counts; kept documents pass unchanged and in order."""

from __future__ import annotations

import pytest

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.data.errors import InvalidConfig
from services.data.sample_filter import SampleFilter

from .helpers import make_docs


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


def send(bus, docs) -> None:
    bus.publish(Module.L4_SHUFFLER, data_pb2.SamplesShuffled(count=len(docs)), docs)


def contents(docs) -> list[list[int]]:
    return [docs.tokens_T[docs.bounds_n1[k] : docs.bounds_n1[k + 1]].tolist() for k in range(len(docs))]


def counts(report) -> tuple[int, int, int, int]:
    return report.kept, report.dropped_too_short, report.dropped_too_long, report.dropped_banned


def test_filter_only_drops_and_counts():
    bus, kept, reports = wired(min_tokens=3, max_tokens=6, banned_bytes=b"\0", banned_tokens=[255])
    docs = make_docs([1, 2], [1, 2, 3], [0, 1, 2, 3], [1] * 7, [4, 255, 5], [9, 8, 7, 6, 5, 4], [], first=10)
    send(bus, docs)
    assert contents(kept[0]) == [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    assert kept[0].index_n.tolist() == [11, 15]  # shard positions travel with the documents
    assert counts(reports[-1]) == (2, 2, 1, 2)  # [1,2] and [] short; 7 long; NUL and 255 banned


def test_the_report_is_cumulative_and_an_empty_last_batch_still_travels():
    bus, kept, reports = wired(min_tokens=2)
    send(bus, make_docs([1], [1, 2]))
    send(bus, make_docs([3], last=True))
    assert [counts(r) for r in reports] == [(1, 1, 0, 0), (1, 2, 0, 0)]
    assert [(len(d), d.last) for d in kept] == [(1, False), (0, True)]


def test_without_bounds_everything_passes_as_the_same_object():
    bus, kept, _ = wired()
    docs = make_docs([1], [], [2, 3])
    send(bus, docs)
    assert kept[0] is docs  # nothing copied, nothing changed


def test_received_documents_are_read_only():
    bus, kept, _ = wired()
    send(bus, make_docs([1, 2, 3]))
    with pytest.raises(ValueError, match="read-only"):
        kept[0].tokens_T[0] = 7


def test_banned_bytes_need_the_bytes_tokenizer():
    bus, _, _ = wired(banned_bytes=b"\0")
    with pytest.raises(InvalidConfig, match=r"filter\.banned_bytes: needs the bytes tokenizer.*use banned_tokens"):
        send(bus, make_docs([1, 2], tokenizer="/data/tok.json"))


def test_rules_are_pushed_once_and_must_be_consistent():
    bus, _, _ = wired(min_tokens=1)
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER)
    with pytest.raises(InvalidConfig, match="rules already set"):
        port(data_pb2.FilterRules(min_tokens=5))
    with pytest.raises(InvalidConfig, match=r"filter\.max_tokens: 3 is below min_tokens 5"):
        wired(min_tokens=5, max_tokens=3)
