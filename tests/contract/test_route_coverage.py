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
import dataclasses
import functools
import inspect
from pathlib import Path

import pytest
import yaml

from services.contract import route_pb2
from services.contract.permissions_doc import REPO, counts_sentence
from services.contract.route_table import ROUTE_REASON, RouteTable, default_table
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


def _is_forwarder(handler) -> bool:
    """A relay's generic forwarder (``services/contract/relay.py``): it carries the message to
    another process and handles nothing itself, so it does not count as a receiver (the far
    process's subscription does). The purpose-built relays (a rank's store relay answering a
    flush, the data service's stream relay) do count, and so does the red-line wiring's
    stand-in for them."""
    try:
        source = inspect.getsourcefile(handler) or ""
    except TypeError:
        return False
    return source.endswith("services/contract/relay.py")


def handlers_in_roots(roots: list[wiring.Built]) -> dict[tuple[str, int], list]:
    """(message, module) -> the handlers the roots subscribe for it that handle it there
    (relays' forwarders left out)."""
    out: dict[tuple[str, int], list] = {}
    for root in roots:
        for bus in root.buses:
            for m, t, handler in bus.subscriptions:
                if not _is_forwarder(handler):
                    out.setdefault((t.DESCRIPTOR.full_name, m), []).append(handler)
    return out


def _constructs(handler, short: str) -> bool:
    """Whether the file that defines ``handler`` (its class's, for a bound method: the files
    of the class and of its bases, a module grown into a package of mixins) builds a message
    named ``short`` (a call ``short(...)`` / ``x_pb2.short(...)``)."""
    owner = getattr(handler, "__self__", None)
    paths = []
    for where in type(owner).__mro__ if owner is not None else (handler,):
        try:
            path = inspect.getsourcefile(where)
        except TypeError:
            continue
        if path:
            paths.append(path)
    return any(short in _calls_in(Path(path)) for path in paths)


@functools.cache
def _calls_in(path: Path) -> frozenset[str]:
    """Names called in ``path``, except what is handed straight to an emitter or a publish
    (``self._emit(X(...))``: published, not returned to a commander)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    emitted = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and any(w in wiring.dotted(node.func).lower() for w in ("emit", "publish"))
        for arg in node.args
    }
    return frozenset(
        wiring.dotted(node.func).rsplit(".", 1)[-1]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and id(node) not in emitted
    )


def replies_in_roots(table, handlers: dict[tuple[str, int], list]) -> set[tuple[str, int]]:
    """(event, module) of every event ``module`` receives as the reply to a command it sends:
    the command's receiver S has a handler of it in a root, and S's code builds the event
    (``Bus.command`` returns it to the commander, checking the route S -> module). A failure
    event the bus builds reaches the commander only as ``ModuleFailed``: not a reply here."""
    out = set()
    for e in table.routes():
        if e.kind != route_pb2.EVENT:
            continue
        short = _short(e.message)
        for r in e.receivers:
            for s in e.senders:
                for c in table.commands_between(r, s):
                    if c.kind == route_pb2.COMMAND and any(
                        _constructs(h, short) for h in handlers.get((c.message, s), ())
                    ):
                        out.add((e.message, r))
    return out


def unaccounted_receivers(table, handled: set[tuple[str, int]], replies: set[tuple[str, int]]) -> list[str]:
    """Every (message, receiver) of an IMPLEMENTED route that no root handles, that is no
    reply, and that the route does not mark ``not_handled`` with a reason: a promise the
    table makes and nothing keeps."""
    out = []
    for r in table.routes():
        if not r.implemented:
            continue
        for m in r.delivery:
            if (r.message, m) not in handled and (r.message, m) not in replies and not r.not_handled.get(m, "").strip():
                out.append(f"{_short(r.message)} to {Module.Name(m)}")
    return out


def stale_not_handled(table, handled: set[tuple[str, int]], replies: set[tuple[str, int]]) -> list[str]:
    """Every receiver a route marks ``not_handled`` that a root handles after all (or gets as
    a reply): the mark is stale."""
    return [
        f"{_short(r.message)} to {Module.Name(m)}"
        for r in table.routes()
        for m in r.not_handled
        if (r.message, m) in handled or (r.message, m) in replies
    ]


def test_every_routed_receiver_has_a_handler_a_reply_or_a_reason(roots):
    table = default_table()
    handlers = handlers_in_roots(roots)
    unheard = unaccounted_receivers(table, set(handlers), replies_in_roots(table, handlers))
    assert not unheard, (
        f"receivers of IMPLEMENTED routes that no composition root handles: {unheard} "
        '(subscribe the receiver, or give the route not_handled: {receiver: ... reason: "..."})'
    )


def test_no_route_marks_a_handled_receiver_not_handled(roots):
    table = default_table()
    handlers = handlers_in_roots(roots)
    stale = stale_not_handled(table, set(handlers), replies_in_roots(table, handlers))
    assert not stale, f"receivers marked not_handled that a root handles: {stale} (drop the mark)"


def test_every_implemented_route_has_a_receiver_in_a_composition_root(roots):
    table = default_table()
    handlers = handlers_in_roots(roots)
    received = set(handlers) | replies_in_roots(table, handlers)
    unheard = [
        f"{_short(r.message)} (to {', '.join(Module.Name(m) for m in r.delivery)})"
        for r in table.routes()
        if r.implemented and not any((r.message, m) in received for m in r.receivers)
    ]
    assert not unheard, (
        f"IMPLEMENTED routes with no receiver in any composition root: {unheard} "
        "(subscribe the receiver, or mark the route DEFERRED / SEED_ONLY with a reason)"
    )


def test_a_route_with_a_producer_and_a_receiver_is_marked_implemented(roots):
    # Both ends built: the DEFERRED / SEED_ONLY mark is stale (flip it to IMPLEMENTED).
    table = default_table()
    handlers = handlers_in_roots(roots)
    have, received = produced(roots), set(handlers) | replies_in_roots(table, handlers)
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


# ---------------------------------------------------------------- producers reachable


def construction_sites() -> dict[str, list[tuple[Path, str]]]:
    """Short name called -> (file, enclosing function, or "" at module level or in a
    decorated function) of every call
    ``Name(...)`` / ``mod.Name(...)`` in services/ (gen excluded)."""
    sites: dict[str, list[tuple[Path, str]]] = {}
    for path in (REPO / "services").rglob("*.py"):
        if "gen" in path.relative_to(REPO / "services").parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def visit(node: ast.AST, function: str, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                inner = function
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    # (a decorated function is registered by its decorator: a CLI command, a
                    # gRPC method's wrapper; reached as much as module-level code)
                    inner = "" if child.decorator_list else child.name
                if isinstance(child, ast.Call):
                    sites.setdefault(wiring.dotted(child.func).rsplit(".", 1)[-1], []).append((path, function))
                visit(child, inner)

        visit(tree, "")
    return sites


def referenced_names() -> dict[str, int]:
    """Name -> how often services/ (gen excluded) names it outside its own ``def`` line: a
    call, an attribute, a name passed as a callback."""
    counts: dict[str, int] = {}
    for path in (REPO / "services").rglob("*.py"):
        if "gen" in path.relative_to(REPO / "services").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def unreachable_producers(table, sites, referenced, handler_names: set[str]) -> list[str]:
    """IMPLEMENTED routes whose every construction in services/ sits in a function that no
    composition root reaches: not a subscribed handler and named nowhere else in services/
    (a one-level check: a producer only tests call is a promise nobody keeps)."""
    out = []
    for r in table.routes():
        where = sites.get(_short(r.message), [])
        if not r.implemented or not where:
            continue
        if not any(f == "" or f in handler_names or referenced.get(f, 0) > 0 for _, f in where):
            out.append(f"{_short(r.message)} (built only in {', '.join(sorted({f for _, f in where}))})")
    return out


def test_every_implemented_route_has_a_producer_a_root_reaches(roots):
    handler_names = {
        getattr(h, "__name__", "") for root in roots for bus in root.buses for _, _, h in bus.subscriptions
    }
    orphans = unreachable_producers(default_table(), construction_sites(), referenced_names(), handler_names)
    assert not orphans, f"IMPLEMENTED routes whose producer nothing outside tests calls: {orphans}"


# ---------------------------------------------------------------- reasons that can go stale


def defined_in(path: Path) -> set[str]:
    """The classes, functions and ``Class.method`` names ``path`` defines at its top level."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out |= {
                f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return out


def stale_tracking(table, repo: Path) -> list[str]:
    """Every ``tracked_by`` of the table (a route's own, a not_handled entry's) that names a
    file that does not exist under ``repo``, or a ``::Name`` that file does not define: the
    code its reason rests on was removed or renamed, so the reason is to be read again."""
    out = []
    for r in table.routes():
        for key, where in sorted(r.tracked_by.items()):
            path, _, name = where.partition("::")
            file = repo / path
            problem = ""
            if not path or not file.is_file():
                problem = "no such file"
            elif name and name not in defined_in(file):
                problem = f"{path} defines no {name}"
            if problem:
                who = _short(r.message) + ("" if key == ROUTE_REASON else f" to {Module.Name(key)}")
                out.append(f"{who}: tracked_by {where!r}: {problem}")
    return out


def test_every_reason_is_tracked_by_code_that_exists():
    stale = stale_tracking(default_table(), REPO)
    assert not stale, (
        "reasons resting on code that is gone (read the reason again, fix it or the route):\n" + "\n".join(stale)
    )


def test_every_deferred_route_is_tracked():
    untracked = [
        _short(r.message)
        for r in default_table().routes()
        if r.status == route_pb2.DEFERRED and not r.tracked_by.get(ROUTE_REASON)
    ]
    assert not untracked, f"DEFERRED routes without tracked_by: {untracked}"


# ---------------------------------------------------------------- the checks fail on a planted break


def _replaced(name: str, **changes) -> RouteTable:
    routes = {r.message: r for r in default_table().routes()}
    routes[name] = dataclasses.replace(routes[name], **changes)
    return RouteTable(routes)


def test_a_receiver_with_neither_handler_nor_reason_is_found(roots):
    handlers = handlers_in_roots(roots)
    table = default_table()
    assert unaccounted_receivers(table, set(handlers), replies_in_roots(table, handlers)) == []
    # MicroBatch reaches L3-3 as RunForward's payload; without its reason the pair is unkept.
    planted = _replaced("surge.v1.MicroBatch", not_handled={}, tracked_by={})
    assert unaccounted_receivers(planted, set(handlers), replies_in_roots(planted, handlers)) == [
        "MicroBatch to L3_FORWARD_UNIT"
    ]
    # A reason for a receiver that is handled after all is stale.
    handled = _replaced("surge.v1.StepCompleted", not_handled={Module.L1_ORCHESTRATOR: "planted"})
    assert "StepCompleted to L1_ORCHESTRATOR" in stale_not_handled(handled, set(handlers), set())


def test_a_failure_event_is_not_taken_for_a_reply(roots):
    # The seam this check closes: ReductionFailed reaches L2-2 (which commands L3-5) only as
    # ModuleFailed; the old rule counted any event of a module one commands as a reply.
    handlers = handlers_in_roots(roots)
    replies = replies_in_roots(default_table(), handlers)
    assert ("surge.v1.ReductionFailed", Module.L2_PARALLEL_STRATEGY) not in replies
    assert ("surge.v1.ParallelTopologyError", Module.L1_RESOURCE_ALLOCATOR) not in replies
    assert ("surge.v1.UpdateApplied", Module.L2_TRAINING_LOOP) in replies  # ApplyUpdate's answer


def test_a_reason_tracked_by_a_missing_file_or_name_is_found():
    track = "services/compute/shard_loader.py::ShardLoader.load_model"
    assert stale_tracking(_replaced("surge.v1.ReloadShards", tracked_by={ROUTE_REASON: track}), REPO) == []
    gone = _replaced("surge.v1.ReloadShards", tracked_by={ROUTE_REASON: "services/compute/no_such_file.py"})
    assert stale_tracking(gone, REPO) == ["ReloadShards: tracked_by 'services/compute/no_such_file.py': no such file"]
    renamed = _replaced("surge.v1.ReloadShards", tracked_by={ROUTE_REASON: track + "_v2"})
    assert stale_tracking(renamed, REPO) == [
        f"ReloadShards: tracked_by '{track}_v2': services/compute/shard_loader.py defines no ShardLoader.load_model_v2"
    ]


def test_a_producer_only_an_unreached_function_builds_is_found():
    sites = {"RunForward": [(REPO / "services/engine/training_loop/step.py", "_orphan")]}
    table = default_table()
    assert unreachable_producers(table, sites, {}, set()) == ["RunForward (built only in _orphan)"]
    assert unreachable_producers(table, sites, {"_orphan": 1}, set()) == []
