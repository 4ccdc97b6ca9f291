"""Start-up validation: a broken route table or wiring is refused with one clear line.

``validate_table`` checks the law itself (every message routed or marked plumbing, known
modules only, no empty or kindless route); ``validate_wiring`` checks one process's bus
against it. The last tests start the real services with a deliberately broken table (the
test harness replaces the process's default table before the composition root runs; the
services have no test hook) and expect exit status 78 and the one-line reason.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from services.contract import Module, data_pb2, engine_pb2, route_pb2
from services.contract.bus import Bus
from services.contract.route_table import PROTO_FILES, Route, RouteTable, default_table
from services.contract.validation import EXIT_CONTRACT, ContractError, validate_table, validate_wiring

REPO = Path(__file__).resolve().parents[2]


def routes() -> dict[str, Route]:
    return {r.message: r for r in default_table().routes()}


def table_with(name: str, **changes) -> RouteTable:
    table = routes()
    table[name] = dataclasses.replace(table[name], **changes)
    return RouteTable(table)


def test_the_compiled_protos_pass():
    validate_table()
    validate_table(default_table(), PROTO_FILES)


def test_a_message_without_a_route_is_refused():
    table = routes()
    del table["surge.v1.RunForward"]
    with pytest.raises(ContractError, match=r"^surge\.v1\.RunForward has no route in the route table$"):
        validate_table(RouteTable(table))


def test_a_route_naming_a_module_that_does_not_exist_is_refused():
    # proto3 enums are open: 77 parses, and names no module.
    with pytest.raises(
        ContractError, match=r"^surge\.v1\.RunForward names unknown module 77, which is not a surge\.v1\.Module$"
    ):
        validate_table(table_with("surge.v1.RunForward", senders=frozenset({Module.L2_TRAINING_LOOP, 77})))
    with pytest.raises(ContractError, match=r"^surge\.v1\.ForwardDone names MODULE_UNSPECIFIED"):
        validate_table(table_with("surge.v1.ForwardDone", receivers=frozenset({Module.MODULE_UNSPECIFIED})))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"senders": frozenset()}, "has a route with no senders"),
        ({"receivers": frozenset()}, "has a route with no receivers"),
        ({"kind": route_pb2.KIND_UNSPECIFIED}, r"has a route with no kind \(command, event or data\)"),
        (
            {"status": route_pb2.ROUTE_STATUS_UNSPECIFIED},
            r"has a route with no status \(IMPLEMENTED, SEED_ONLY or DEFERRED\)",
        ),
        ({"status": route_pb2.DEFERRED}, r"is DEFERRED without a reason; say why in reason: \"\.\.\.\""),
        (
            {"status": route_pb2.SEED_ONLY, "reason": "  "},
            r"is SEED_ONLY without a reason; say why in reason: \"\.\.\.\"",
        ),
        (
            {"status": route_pb2.DEFERRED, "reason": "not built"},
            r"is DEFERRED without tracked_by; name the file or test its reason rests on: tracked_by: \"path::Name\"",
        ),
        (
            {"not_handled": {Module.L1_ORCHESTRATOR: "planted"}},
            r"says L1_ORCHESTRATOR does not handle it, but does not route it there",
        ),
        (
            {"not_handled": {Module.L2_OPTIMIZER: " "}},
            r"says L2_OPTIMIZER does not handle it without a reason; say why in reason: \"\.\.\.\"",
        ),
    ],
)
def test_an_incomplete_route_is_refused(change, error):
    with pytest.raises(ContractError, match=rf"^surge\.v1\.ApplyUpdate {error}$"):
        validate_table(table_with("surge.v1.ApplyUpdate", **change))


def test_a_route_for_an_unknown_or_plumbing_message_is_refused():
    extra = Route(
        "surge.v1.Nope", frozenset({Module.L2_TRAINING_LOOP}), frozenset({Module.L2_OPTIMIZER}), route_pb2.COMMAND, ""
    )
    with pytest.raises(ContractError, match=r"^the route table names surge\.v1\.Nope, which no service proto defines$"):
        validate_table(RouteTable({**routes(), extra.message: extra}))
    device = dataclasses.replace(extra, message="surge.v1.Device")
    with pytest.raises(ContractError, match=r"^surge\.v1\.Device is plumbing but the route table routes it$"):
        validate_table(RouteTable({**routes(), device.message: device}))


def _file(name: str, build) -> object:
    """A proto file built at run time (in its own pool), importing route.proto."""
    pool = descriptor_pool.DescriptorPool()
    for dep in (descriptor_pb2.DESCRIPTOR, route_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(proto)
        pool.Add(proto)
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"surge/test/{name}.proto",
        package="surge.test",
        syntax="proto3",
        dependency=["surge/v1/route.proto"],
    )
    msg = fdp.message_type.add(name=name)
    build(msg.options)
    pool.Add(fdp)
    return pool.FindFileByName(fdp.name)


def test_a_dynamically_built_message_without_route_or_plumbing_is_refused():
    fd = _file("Unmarked", lambda options: None)
    with pytest.raises(
        ContractError, match=r"^surge\.test\.Unmarked has no route: give it option \(surge\.v1\.route\)"
    ):
        validate_table(RouteTable.from_proto((fd,)), files=(fd,))


def test_a_dynamically_built_message_with_both_options_is_refused():
    def both(options):
        route = options.Extensions[route_pb2.route]
        route.senders.append(Module.L2_TRAINING_LOOP)
        route.receivers.append(Module.L2_OPTIMIZER)
        route.kind = route_pb2.COMMAND
        options.Extensions[route_pb2.plumbing] = "a helper"

    fd = _file("Both", both)
    with pytest.raises(ContractError, match=r"^surge\.test\.Both has both a route and a plumbing option"):
        validate_table(RouteTable.from_proto((fd,)), files=(fd,))


def test_a_dynamically_built_route_with_an_unknown_module_number_is_refused():
    def strange(options):
        route = options.Extensions[route_pb2.route]
        route.senders.append(77)
        route.receivers.append(Module.L1_ORCHESTRATOR)
        route.kind = route_pb2.EVENT
        route.status = route_pb2.IMPLEMENTED

    fd = _file("Strange", strange)
    table = RouteTable.from_proto((fd,))
    assert table.route("surge.test.Strange").senders == {77}
    with pytest.raises(ContractError, match=r"^surge\.test\.Strange names unknown module 77"):
        validate_table(table, files=(fd,))


# ---------------------------------------------------------------- wiring


def test_a_correctly_wired_bus_passes():
    bus = Bus()
    bus.subscribe(Module.L4_FILTER, data_pb2.FilterRules, lambda m, p=None: None)
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER)
    validate_wiring(bus, {Module.L2_TRAINING_LOOP, Module.L4_FILTER})


class _WiredBus:
    """A bus as validate_wiring sees it: its table and its subscriptions."""

    def __init__(self, table: RouteTable, subscriptions: list[tuple[str, int]]):
        self.table = table
        self._subscriptions = subscriptions

    def subscriptions(self):
        return self._subscriptions


def test_a_subscription_not_routed_to_its_module_is_refused():
    # The bus refuses this at subscribe time; the start-up check catches any way around it.
    bus = _WiredBus(default_table(), [("surge.v1.FilterRules", Module.L4_SHUFFLER)])
    with pytest.raises(
        ContractError, match=r"^L4_SHUFFLER subscribes to surge\.v1\.FilterRules, which is not routed to it$"
    ):
        validate_wiring(bus, {Module.L4_SHUFFLER})
    bus = _WiredBus(default_table(), [("surge.v1.Nope", Module.L4_SHUFFLER)])
    with pytest.raises(ContractError, match=r"^L4_SHUFFLER subscribes to surge\.v1\.Nope, which has no route$"):
        validate_wiring(bus, {Module.L4_SHUFFLER})


def test_a_subscription_by_a_module_the_process_does_not_host_is_refused():
    bus = Bus()
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, lambda m, p=None: None)
    with pytest.raises(
        ContractError,
        match=r"^L2_OPTIMIZER subscribes to surge\.v1\.ApplyUpdate, but this process does not host L2_OPTIMIZER$",
    ):
        validate_wiring(bus, {Module.L2_TRAINING_LOOP})


def test_a_hosted_module_that_does_not_exist_or_is_not_in_the_table_is_refused():
    with pytest.raises(
        ContractError, match=r"^this process hosts unknown module 77, which is not a surge\.v1\.Module$"
    ):
        validate_wiring(Bus(), {Module.L2_TRAINING_LOOP, 77})
    only = routes()["surge.v1.ApplyUpdate"]
    with pytest.raises(ContractError, match=r"^this process hosts L4_FILTER, which no route in the table names$"):
        validate_wiring(Bus(RouteTable({only.message: only})), {Module.L2_OPTIMIZER, Module.L4_FILTER})


def test_a_port_that_could_only_fail_at_its_first_send_is_refused_at_start_up():
    # The loop holds typed ports to the filter and the shuffler; nothing here handles
    # ShufflePlan, so the shuffler port's one command would fail at its first send.
    bus = Bus()
    bus.subscribe(Module.L4_FILTER, data_pb2.FilterRules, lambda m, p=None: None)
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_FILTER, commands=(data_pb2.FilterRules,))
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER, commands=(data_pb2.ShufflePlan,))
    with pytest.raises(
        ContractError,
        match=(
            r"^L2_TRAINING_LOOP holds a port to send surge\.v1\.ShufflePlan to L4_SHUFFLER, "
            r"but no handler of L4_SHUFFLER for it is subscribed in this process$"
        ),
    ):
        validate_wiring(bus, {Module.L2_TRAINING_LOOP, Module.L4_FILTER, Module.L4_SHUFFLER})
    # An untyped port stands for every implemented route between its ends.
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.ShufflePlan, lambda m, p=None: None)
    validate_wiring(bus, {Module.L2_TRAINING_LOOP, Module.L4_FILTER, Module.L4_SHUFFLER})
    bus.port(Module.L2_TRAINING_LOOP, Module.L4_PREFETCHER)
    with pytest.raises(
        ContractError, match=r"^L2_TRAINING_LOOP holds a port to send surge\.v1\.SetPrefetch to L4_PREFETCHER"
    ):
        validate_wiring(bus, {Module.L2_TRAINING_LOOP, Module.L4_FILTER, Module.L4_SHUFFLER, Module.L4_PREFETCHER})


def test_a_real_root_missing_a_handler_refuses_to_start_with_one_line(tmp_path, monkeypatch, capsys):
    # The data service's composition root, with its stream bus forgetting to host L4-3: the
    # relay's typed port to the shuffler has no handler, and main refuses before serving.
    import services.data.__main__ as data_main

    class ForgetsTheShuffler(Bus):
        def host(self, module, obj, **kwargs):
            if module != Module.L4_SHUFFLER:
                super().host(module, obj, **kwargs)

    monkeypatch.setattr(data_main, "Bus", ForgetsTheShuffler)
    assert data_main.main(["--port", "0", "--data-root", str(tmp_path)]) == EXIT_CONTRACT
    err = [line for line in capsys.readouterr().err.splitlines() if "refusing to start" in line]
    assert err == [
        "data: refusing to start: L2_TRAINING_LOOP holds a port to send surge.v1.ShufflePlan to L4_SHUFFLER, "
        "but no handler of L4_SHUFFLER for it is subscribed in this process"
    ]


# ---------------------------------------------------------------- real processes

# Runs a service's composition root in a fresh process after replacing the process's
# default route table with a broken one.
_HARNESS = textwrap.dedent(
    """
    import dataclasses, runpy, sys
    from services.contract import route_table as rt
    routes = {r.message: r for r in rt.default_table().routes()}
    service, how, message = sys.argv[1:4]
    if how == "unrouted":
        del routes[message]
    else:  # a sender that is not a module
        routes[message] = dataclasses.replace(routes[message], senders=routes[message].senders | {77})
    rt._DEFAULT = rt.RouteTable(routes)
    sys.argv = [service, *sys.argv[4:]]
    runpy.run_module(service, run_name="__main__")
    """
)


@pytest.mark.parametrize(
    ("service", "how", "message", "args", "line"),
    [
        (
            "services.store",
            "unrouted",
            "surge.v1.SaveCheckpoint",
            ["--port", "0", "--metrics-port", "0", "--root", "{tmp}"],
            "store: refusing to start: surge.v1.SaveCheckpoint has no route in the route table",
        ),
        (
            "services.data",
            "unknown",
            "surge.v1.OpenStream",
            ["--port", "0", "--data-root", "{tmp}"],
            "data: refusing to start: surge.v1.OpenStream names unknown module 77, which is not a surge.v1.Module",
        ),
        (
            "services.control",
            "unrouted",
            "surge.v1.FaultReport",
            ["--port", "0", "--db", "{tmp}/control.db", "--data", "127.0.0.1:1", "--store", "127.0.0.1:1"],
            "control: refusing to start: surge.v1.FaultReport has no route in the route table",
        ),
        (
            "services.worker",
            "unknown",
            "surge.v1.LaunchRanks",
            ["--port", "0", "--control", "127.0.0.1:1", "--run-dir", "{tmp}"],
            "worker: refusing to start: surge.v1.LaunchRanks names unknown module 77, which is not a surge.v1.Module",
        ),
    ],
    ids=["store", "data", "control", "worker"],
)
def test_a_service_with_a_broken_table_refuses_to_start(tmp_path, service, how, message, args, line):
    env = {**os.environ, "SURGE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run(
        [sys.executable, "-c", _HARNESS, service, how, message, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_CONTRACT, proc.stderr
    assert line in proc.stderr.splitlines(), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
