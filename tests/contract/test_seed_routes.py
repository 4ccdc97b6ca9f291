"""The proto route table is exactly the seed's allowed inputs and outputs, as transcribed.

``seed_routes.yaml`` (next to this file) transcribes, for each of the seed's 20 modules, every
item of its "allowed inputs" (section 4) and "allowed outputs" (section 5) lists with the
proto messages that realise it, and each module's section-3 published events; its header
says how to read an entry. From it these tests build the set of routes
``(sender, message, receiver, kind)`` -- an input item gives counterpart -> message -> module,
an output item module -> message -> counterpart, plus the operator's routes and the
system's additions -- and compare it with the set the compiled protos declare
(``services.contract.route_table.default_table()``, each route option expanded to every
sender x receiver pair). Equality means nothing is missing and nothing is extra.

When a test fails:
* "routes in the protos but not in the transcription": a route option grants more than the
  seed (as transcribed) allows; narrow the option, or add the item / a recorded choice.
* "routes in the transcription but not in the protos": an item names a message or a
  counterpart the protos do not route; add the message or the sender/receiver.
Where the seed is ambiguous, record the decision as ``choice`` + ``reason`` on the item.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.contract import route_pb2
from services.contract.route_table import PROTO_FILES, default_table
from services.contract.validation import validate_table

HERE = Path(__file__).parent
T = yaml.safe_load((HERE / "seed_routes.yaml").read_text(encoding="utf-8"))
Module = route_pb2.Module

SEED_IDS = {
    "L1-1": Module.L1_ORCHESTRATOR,
    "L1-2": Module.L1_RESOURCE_ALLOCATOR,
    "L1-3": Module.L1_FAULT_DETECTOR,
    "L1-4": Module.L1_RECOVERY_CONTROLLER,
    "L2-1": Module.L2_TRAINING_LOOP,
    "L2-2": Module.L2_PARALLEL_STRATEGY,
    "L2-3": Module.L2_OPTIMIZER,
    "L2-4": Module.L2_MIXED_PRECISION,
    "L3-1": Module.L3_SHARD_LOADER,
    "L3-2": Module.L3_OPERATOR_ADAPTER,
    "L3-3": Module.L3_FORWARD_UNIT,
    "L3-4": Module.L3_BACKWARD_UNIT,
    "L3-5": Module.L3_GRADIENT_REDUCTION,
    "L4-1": Module.L4_DATASET_VERSIONS,
    "L4-2": Module.L4_PREFETCHER,
    "L4-3": Module.L4_SHUFFLER,
    "L4-4": Module.L4_FILTER,
    "L4-5": Module.L4_BATCH_PACKER,
    "L5-1": Module.L5_CHECKPOINT_MANAGER,
    "L5-2": Module.L5_METRICS_LOGGER,
}
# External endpoints a transcription may name (not seed modules): the operator's CLI, the
# node agent speaking for the hardware, disk I/O, storage, and the contract layer itself.
EXTERNAL = {"EXT_USER", "EXT_HARDWARE", "EXT_DISK_IO", "EXT_STORAGE", "EXT_CONTRACT"}
KINDS = {"command": route_pb2.COMMAND, "event": route_pb2.EVENT, "data": route_pb2.DATA}

# Items per module in the seed (shared/seeds/seed_routes_notes.md, part (b)): section-4
# inputs (including the three misplaced outputs), section-5 outputs, section-3 events.
SEED_COUNTS = {
    "L1-1": (4, 6, 6),
    "L1-2": (6, 6, 5),
    "L1-3": (6, 2, 4),
    "L1-4": (5, 5, 3),
    "L2-1": (7, 5, 4),
    "L2-2": (4, 4, 4),
    "L2-3": (3, 3, 3),
    "L2-4": (5, 6, 4),
    "L3-1": (5, 5, 4),
    "L3-2": (6, 5, 4),
    "L3-3": (3, 4, 3),
    "L3-4": (3, 4, 4),
    "L3-5": (4, 4, 3),
    "L4-1": (5, 5, 4),
    "L4-2": (5, 5, 4),
    "L4-3": (4, 3, 3),
    "L4-4": (4, 4, 3),
    "L4-5": (4, 3, 3),
    "L5-1": (5, 6, 4),
    "L5-2": (5, 3, 3),
}

Route = tuple[int, str, int, int]  # sender, message full name, receiver, kind


def module(token: str) -> int:
    if token in SEED_IDS:
        return SEED_IDS[token]
    if token in EXTERNAL:
        return Module.Value(token)
    raise AssertionError(f"{token!r} is neither a seed module id nor an external endpoint")


def full(name: str) -> str:
    return f"surge.v1.{name}"


def show(route: Route) -> str:
    s, msg, r, kind = route
    return f"{Module.Name(s)} -> {msg} -> {Module.Name(r)} ({route_pb2.Kind.Name(kind)})"


def item_routes(mod: str, side: str, item: dict) -> list[Route]:
    """The routes one transcribed item declares."""
    outgoing = side == "outputs" or item.get("misplaced", False)
    cps = item["to"] if outgoing else item["from"]
    proto = item["proto"]
    per_message = proto if isinstance(proto, dict) else {name: cps for name in proto}
    realised = item.get("realised_kind") or {}
    routes = []
    for name, counterparts in per_message.items():
        kind = KINDS[realised.get(name, item["kind"])]
        for cp in counterparts:
            pair = (module(mod), module(cp)) if outgoing else (module(cp), module(mod))
            routes.append((pair[0], full(name), pair[1], kind))
    return routes


def items():
    for mod, spec in T["modules"].items():
        for side in ("inputs", "outputs"):
            for item in spec[side]:
                yield mod, side, item


def transcribed_routes() -> set[Route]:
    routes: set[Route] = set()
    for mod, side, item in items():
        routes.update(item_routes(mod, side, item))
    for section in ("operator", "additions"):
        for entry in T[section]:
            for s in entry["from"]:
                for r in entry["to"]:
                    routes.add((module(s), full(entry["proto"]), module(r), KINDS[entry["kind"]]))
    return routes


def proto_routes() -> set[Route]:
    return {
        (s, route.message, r, route.kind)
        for route in default_table().routes()
        for s in route.senders
        for r in route.receivers
    }


def test_the_proto_route_table_is_exactly_the_transcribed_seed():
    want, have = transcribed_routes(), proto_routes()
    extra = sorted(have - want, key=show)
    missing = sorted(want - have, key=show)
    lines = []
    if extra:
        lines += ["routes in the protos but not in the transcription:"] + [f"  {show(r)}" for r in extra]
    if missing:
        lines += ["routes in the transcription but not in the protos:"] + [f"  {show(r)}" for r in missing]
    assert not lines, "\n".join(lines)


def test_all_20_modules_are_transcribed_with_every_seed_item():
    assert list(T["modules"]) == list(SEED_IDS)
    for mod, spec in T["modules"].items():
        counts = (len(spec["inputs"]), len(spec["outputs"]), len(spec["published_events"]))
        assert counts == SEED_COUNTS[mod], (
            f"{mod}: (inputs, outputs, published events) {counts} != seed {SEED_COUNTS[mod]}"
        )
        lines = [i["seed_line"] for i in spec["inputs"] + spec["outputs"]]
        assert lines == sorted(set(lines)), f"{mod}: seed lines out of order or repeated: {lines}"
        events = [e["seed_line"] for e in spec["published_events"]]
        assert events == sorted(set(events)) and events[-1] < lines[0], f"{mod}: section-3 lines {events}"


@pytest.mark.parametrize("mod", list(SEED_IDS))
def test_every_item_is_realised_by_a_routed_message_or_its_choice_is_recorded(mod):
    table = default_table()
    problems = []
    for side in ("inputs", "outputs"):
        for item in T["modules"][mod][side]:
            where = f"{mod} {side} line {item['seed_line']} ({item['message_zh']})"
            cpkey = "to" if side == "outputs" or item.get("misplaced") else "from"
            cps, proto = item[cpkey], item["proto"]
            for token in cps:
                module(token)  # a group token left unresolved fails here
            decided = bool(item.get("choice")) and bool(item.get("reason"))
            if not proto and not decided:
                problems.append(f"{where}: no message realises it and no choice/reason says why")
            if (f"seed_{cpkey}" in item or item.get("realised_kind") or item.get("misplaced")) and not decided:
                problems.append(f"{where}: resolution differs from the seed but records no choice/reason")
            if isinstance(proto, dict):
                union = sorted({c for cs in proto.values() for c in cs})
                if sorted(cps) != union:
                    problems.append(f"{where}: {cpkey} {cps} is not the union of its messages' modules {union}")
            for name in proto:
                route = table.route(full(name))
                if route is None:
                    problems.append(f"{where}: {name} has no route in the protos")
                    continue
                kind = (item.get("realised_kind") or {}).get(name, item["kind"])
                if route.kind != KINDS[kind]:
                    problems.append(
                        f"{where}: {name} is {route_pb2.Kind.Name(route.kind)} in the protos but the item "
                        f"says {kind} (record realised_kind with a choice)"
                    )
            if not cps and proto:
                problems.append(f"{where}: messages {proto} but no counterpart")
    assert not problems, "\n".join(problems)


def test_published_events_name_their_messages_and_observer_routes_exist():
    table = default_table()
    problems = []
    for mod, spec in T["modules"].items():
        for ev in spec["published_events"]:
            where = f"{mod} s3 line {ev['seed_line']} ({ev['event_zh']})"
            if not ev["proto"] and not ev.get("note"):
                problems.append(f"{where}: carried by no message and no note says why")
            if ev["observers"] and not ev["proto"]:
                problems.append(f"{where}: observers but no message")
            for name in ev["proto"]:
                route = table.route(full(name))
                if route is None or module(mod) not in route.senders:
                    problems.append(f"{where}: {name} is not routed from {mod}")
                    continue
                for obs in ev["observers"]:
                    if obs not in ("L1-3", "L5-2"):
                        problems.append(f"{where}: observer {obs} is neither the fault detector nor the metrics logger")
                    elif module(obs) not in route.receivers:
                        problems.append(f"{where}: {name} is not routed to its observer {obs}")
    assert not problems, "\n".join(problems)


def test_every_route_to_the_fault_detector_from_a_lower_module_is_a_published_event():
    """Observer routes are explicit: L1-3 observes only section-3 events (its red line 5)."""
    observed = {
        (SEED_IDS[mod], full(name))
        for mod, spec in T["modules"].items()
        for ev in spec["published_events"]
        if "L1-3" in ev["observers"]
        for name in ev["proto"]
    }
    # A module's failure event added where the seed lists none (additions marked failure).
    observed |= {
        (module(s), full(e["proto"]))
        for e in T["additions"]
        if e.get("failure") and "L1-3" in e["to"]
        for s in e["from"]
    }
    lower = {SEED_IDS[m] for m in SEED_IDS if not m.startswith("L1-")}
    unexplained = sorted(
        f"{Module.Name(s)} -> {route.message}"
        for route in default_table().routes()
        if Module.L1_FAULT_DETECTOR in route.receivers
        for s in route.senders
        if s in lower and (s, route.message) not in observed
    )
    assert not unexplained, f"routes to L1-3 that no published event accounts for: {unexplained}"


_TOKEN = re.compile(r"\b(L[1-5]-[1-5]) s([345]) (\d+)\b")


def test_proto_seed_references_point_at_the_items_each_message_realises():
    cited: dict[str, set[tuple[str, str, int]]] = {}
    for mod, side, item in items():
        sec = "4" if side == "inputs" else "5"
        for name in item["proto"]:
            cited.setdefault(full(name), set()).add((mod, sec, item["seed_line"]))
    for mod, spec in T["modules"].items():
        for ev in spec["published_events"]:
            for name in ev["proto"]:
                cited.setdefault(full(name), set()).add((mod, "3", ev["seed_line"]))
    problems = []
    for route in default_table().routes():
        tokens = {(m, s, int(n)) for m, s, n in _TOKEN.findall(route.seed)}
        realised = cited.get(route.message, set())
        for mod, sec, line in sorted(tokens - realised):
            problems.append(f"{route.message}: seed cites {mod} s{sec} {line}, an item it does not realise")
        if realised and not tokens:
            problems.append(f"{route.message}: realises seed items {sorted(realised)} but its seed option cites none")
    assert not problems, "\n".join(problems)


def test_operator_and_additions_entries_carry_a_reason_and_exist():
    table = default_table()
    for section in ("operator", "additions"):
        for entry in T[section]:
            assert entry.get("reason"), f"{section} {entry['proto']}: no reason"
            assert table.route(full(entry["proto"])) is not None, f"{section} {entry['proto']}: not routed"
    assert {s for e in T["operator"] for s in e["from"] + e["to"]} >= {"EXT_USER"}


def test_the_compiled_table_passes_start_up_validation():
    validate_table(default_table(), PROTO_FILES)
