"""The table is the wiring: Bus.host subscribes a module's handlers by name, and refuses a
missing or an extra one; services/contract/handlers.py (the Protocols) is kept fresh."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from services.contract import Module, data_pb2, engine_pb2
from services.contract.bus import Bus, RouteError
from services.contract.handlers_gen import REPO
from services.contract.route_table import RouteTable, default_table, handler_name


def test_the_committed_handler_protocols_are_what_make_contracts_generates():
    r = subprocess.run(
        [sys.executable, "-m", "services.contract.handlers_gen", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_handler_names_follow_the_message_kind():
    table = default_table()
    assert handler_name(table.route(engine_pb2.RunForward)) == "run_forward"
    assert handler_name(table.route(engine_pb2.StepCompleted)) == "on_step_completed"
    assert handler_name(table.route(data_pb2.MicroBatch)) == "on_micro_batch"


class Filter:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def filter_rules(self, msg, payload=None):
        self.seen.append(msg.min_tokens)

    def on_samples_shuffled(self, msg, payload=None):
        self.seen.append("samples")


def test_host_subscribes_every_routed_message_to_the_method_the_table_names():
    bus = Bus()
    f = Filter()
    bus.host(Module.L4_FILTER, f)
    assert sorted(bus.subscriptions()) == [
        ("surge.v1.FilterRules", Module.L4_FILTER),
        ("surge.v1.SamplesShuffled", Module.L4_FILTER),
    ]
    bus.command(Module.L2_TRAINING_LOOP, Module.L4_FILTER, data_pb2.FilterRules(min_tokens=3))
    assert f.seen == [3]


def test_host_refuses_a_missing_handler_in_one_line():
    class NoRules:
        def on_samples_shuffled(self, msg, payload=None): ...

    missing = r"^L4_FILTER \(NoRules\) has no handler filter_rules for surge\.v1\.FilterRules, which is routed to it$"
    with pytest.raises(RouteError, match=missing):
        Bus().host(Module.L4_FILTER, NoRules())


def test_host_refuses_a_handler_for_a_message_not_routed_to_the_module():
    class Greedy(Filter):
        def run_forward(self, msg, payload=None): ...

    extra = r"^L4_FILTER \(Greedy\) has a handler run_forward for surge\.v1\.RunForward, which is not routed to it$"
    with pytest.raises(RouteError, match=extra):
        Bus().host(Module.L4_FILTER, Greedy())


def test_host_takes_a_stated_exception_and_refuses_a_stale_one():
    class NoSamples:
        def filter_rules(self, msg, payload=None): ...

    bus = Bus()
    bus.host(Module.L4_FILTER, NoSamples(), not_handled={data_pb2.SamplesShuffled: "a test"})
    assert bus.subscriptions() == [("surge.v1.FilterRules", Module.L4_FILTER)]
    stale = r"^L4_FILTER \(Filter\) handles surge\.v1\.SamplesShuffled with on_samples_shuffled, but is hosted as not handling it$"
    with pytest.raises(RouteError, match=stale):
        Bus().host(Module.L4_FILTER, Filter(), not_handled={data_pb2.SamplesShuffled: "stale"})
    unrouted = r"^L4_FILTER \(NoSamples\) is hosted as not handling surge\.v1\.RunForward, which is not an implemented route to it$"
    with pytest.raises(RouteError, match=unrouted):
        Bus().host(
            Module.L4_FILTER, NoSamples(), not_handled={data_pb2.SamplesShuffled: "a test", engine_pb2.RunForward: "no"}
        )


def test_host_skips_a_receiver_its_route_marks_not_handled_and_refuses_one_that_handles_it():
    # SamplesShuffled to L4-3 marked not_handled on the route (a planted table): not required
    # and not subscribed; a module defining its handler anyway contradicts the route.
    routes = {r.message: r for r in default_table().routes()}
    marked = dataclasses.replace(
        routes["surge.v1.SamplesShuffled"], not_handled={Module.L4_FILTER: "planted: arrives another way"}
    )
    table = RouteTable({**routes, marked.message: marked})

    class NoSamples:
        def filter_rules(self, msg, payload=None): ...

    bus = Bus(table)
    bus.host(Module.L4_FILTER, NoSamples())
    assert bus.subscriptions() == [("surge.v1.FilterRules", Module.L4_FILTER)]
    contradicts = (
        r"^L4_FILTER \(Filter\) handles surge\.v1\.SamplesShuffled with on_samples_shuffled, "
        r"but its route says it does not \(not_handled\)$"
    )
    with pytest.raises(RouteError, match=contradicts):
        Bus(table).host(Module.L4_FILTER, Filter())
