"""Every route of the table is lived or says why not (issue 13, part 1).

A route is IMPLEMENTED, or SEED_ONLY / DEFERRED with a reason (``validation.py`` refuses a
route without a status, or a non-implemented one without a reason). An IMPLEMENTED route
must have

* a producer: a construction of the message somewhere in ``services/`` (generated code
  excluded). This half is a static scan of the source (an AST walk for calls ``Name(...)``
  or ``x_pb2.Name(...)``): a send is not observable without running every path, and a
  relay forwarding a parsed message constructs nothing, so a construction is the producer.
  A failure event (``failure: true``) is built by the bus from the route table when a
  handler of its module raises: it has a producer when the bus does that and a root
  subscribes a handler of its module;
* a receiver in a composition root: the real roots are built -- control's
  ``build``, data's ``build_registry`` / ``build_stream``, store's ``wire`` and the rank's
  ``compose`` (through ``tests/redlines/wiring.py``, relays standing in for the rank's remote
  peers) -- and their buses' subscriptions are read. A relay subscribed for a remote module
  counts (it stands in for it). An event that is a command's reply has no subscription: it
  is received by the commander that holds a port to its sender, so such a port counts.

The README states the counts; ``make contracts`` rewrites that sentence and this file keeps
it equal to the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from services.contract import route_pb2
from services.contract.permissions_doc import REPO, counts_sentence
from services.contract.route_table import default_table
from tests.redlines import wiring

Module = route_pb2.Module
SEED = yaml.safe_load((Path(__file__).parent / "seed_routes.yaml").read_text(encoding="utf-8"))


def _short(full: str) -> str:
    return full.removeprefix("surge.v1.")


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> list[wiring.Built]:
    tmp = tmp_path_factory.mktemp("roots")
    return [
        wiring.build_control(tmp),
        wiring.build_data(tmp),
        wiring.build_store(tmp),
        wiring.build_rank(tmp, load_model=False),
    ]


def constructed_in_services() -> set[str]:
    """Short names of every call ``Name(...)`` / ``mod.Name(...)`` in services/ (gen excluded)."""
    names: set[str] = set()
    for path in (REPO / "services").rglob("*.py"):
        if "gen" in path.relative_to(REPO / "services").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    names.add(f.id)
                elif isinstance(f, ast.Attribute):
                    names.add(f.attr)
    return names


def bus_publishes_failure_events() -> bool:
    """Whether the bus's handler-exception path builds failure events (a call of
    ``failure_event`` in services/contract/bus.py): then every module with a subscribed
    handler produces its failure event (``failure: true`` route) when that handler raises."""
    tree = ast.parse((REPO / "services" / "contract" / "bus.py").read_text(encoding="utf-8"))
    return any(
        isinstance(n, ast.Call) and wiring.dotted(n.func).split(".")[-1] == "failure_event" for n in ast.walk(tree)
    )


def produced(roots: list[wiring.Built]) -> set[str]:
    """Full names of the routed messages with a producer: constructed in services/, or a
    failure event of a module some root subscribes a handler for (the bus builds it)."""
    table = default_table()
    built = constructed_in_services()
    out = {r.message for r in table.routes() if _short(r.message) in built}
    if bus_publishes_failure_events():
        handling = {m for root in roots for bus in root.buses for m, _, _ in bus.subscriptions}
        out |= {r.message for r in table.routes() if r.failure and r.senders & handling}
    return out


def test_every_implemented_route_has_a_producer_in_services(roots):
    have = produced(roots)
    orphans = [_short(r.message) for r in default_table().routes() if r.implemented and r.message not in have]
    assert not orphans, (
        f"IMPLEMENTED routes that nothing in services/ produces: {orphans} "
        "(build the producer, or mark the route DEFERRED / SEED_ONLY with a reason)"
    )


def receivers_in_roots(roots: list[wiring.Built]) -> set[tuple[str, int]]:
    """(message, module) of every subscription of the roots' buses, and of every event
    received as a reply: the reply of a command from R to S reaches R when S's handler is
    subscribed (the bus checks the reply's route S -> R)."""
    subscribed = {(t.DESCRIPTOR.full_name, m) for root in roots for bus in root.buses for m, t, _ in bus.subscriptions}
    table = default_table()
    handled = {
        (c.message, s)
        for c in table.routes()
        if c.kind == route_pb2.COMMAND
        for s in c.receivers
        if (c.message, s) in subscribed
    }
    replies = set()
    for e in table.routes():
        if e.kind != route_pb2.EVENT:
            continue
        for r in e.receivers:
            for s in e.senders:
                if any((c.message, s) in handled for c in table.commands_between(r, s) if c.kind == route_pb2.COMMAND):
                    replies.add((e.message, r))
    return subscribed | replies


def test_every_implemented_route_has_a_receiver_in_a_composition_root(roots):
    received = receivers_in_roots(roots)
    unheard = [
        f"{_short(r.message)} (to {', '.join(Module.Name(m) for m in r.delivery)})"
        for r in default_table().routes()
        if r.implemented and not any((r.message, m) in received for m in r.receivers)
    ]
    assert not unheard, (
        f"IMPLEMENTED routes with no receiver in any composition root: {unheard} "
        "(subscribe the receiver, or mark the route DEFERRED / SEED_ONLY with a reason)"
    )


def test_a_route_with_a_producer_and_a_receiver_is_marked_implemented(roots):
    # Both ends built: the DEFERRED / SEED_ONLY mark is stale (flip it to IMPLEMENTED).
    have, received = produced(roots), receivers_in_roots(roots)
    stale = [
        _short(r.message)
        for r in default_table().routes()
        if not r.implemented and r.message in have and any((r.message, m) in received for m in r.receivers)
    ]
    assert not stale, f"routes marked not implemented whose producer and receiver both exist: {stale}"


def test_every_seed_listed_input_and_output_is_implemented_or_says_why_not():
    table = default_table()
    problems = []
    for mod, spec in SEED["modules"].items():
        for side in ("inputs", "outputs"):
            for item in spec[side]:
                where = f"{mod} {side} line {item['seed_line']}"
                if not item["proto"] and not (item.get("choice") and item.get("reason")):
                    problems.append(f"{where}: realised by no message and no reason recorded")
                for name in item["proto"]:
                    route = table.route(f"surge.v1.{name}")
                    if route is None:
                        problems.append(f"{where}: {name} has no route")
                    elif not route.implemented and not route.reason.strip():
                        problems.append(f"{where}: {name} is not implemented and says no reason")
    assert not problems, "\n".join(problems)


def test_the_readme_states_the_route_counts_of_the_table():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert counts_sentence() in readme
