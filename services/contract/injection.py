"""Test-only fault injection at the bus: a module's handler raises, in any process.

``SURGE_FAULT_INJECT_HANDLER`` (read when this file is imported; :func:`configure` for tests) holds
``;``-separated rules::

    handler:<MODULE>:<Message>[:after=N][:times=K][:cause=<FailureCause name>][:delay=S][:in=<main module>]

``MODULE`` is a ``surge.v1.Module`` name (``L3_FORWARD_UNIT``), ``Message`` a routed message's
short or full name (``RunForward``). The bus calls :func:`check` right before it runs that
module's handler of that message: the ``N+1``-th call (``after``, default 0) and the ``K - 1``
after it (``times``, default 1) raise :class:`InjectedFault` in place of the handler, with
the given typed cause (default ``FAILURE_INTERNAL``). What happens next is what happens to any
exception escaping a handler: the module's failure event (services/contract/failures.py).
``delay``: those calls are held ``S`` seconds (a float) and then run the handler, raising
nothing: a module that is slow but alive (a store answering late on a loaded machine).
``in``: only in the process whose ``__main__`` module is that one or under it
(``services.store``): a relay stands in for a module of another process on its own bus (the
rank's store relay is L5-2 there too), and a rule for the module's own process must not fire
in the relay's.

No rule set: one dict lookup per handler call. A malformed value never fails the import
(every process, ``surgectl`` too, imports this file): no rule applies, and each service's
``main`` refuses to start with :func:`env_error`'s one line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from services.contract import route_pb2

ENV = "SURGE_FAULT_INJECT_HANDLER"  # (SURGE_FAULT_INJECT is services/rank/faults.py's step injections)


class InjectedFault(RuntimeError):
    """Raised in place of a handler by an injection rule (its ``failure_cause`` is the rule's)."""

    def __init__(self, module: int, message: str, cause: int):
        super().__init__(f"injected fault: {route_pb2.Module.Name(module)} handling {message}")
        self.failure_cause = cause


@dataclass
class _Rule:
    after: int = 0
    times: int = 1
    cause: int = route_pb2.FAILURE_INTERNAL
    delay: float = 0.0  # > 0: the call is held this long, then handled (no fault)
    calls: int = 0


_lock = threading.Lock()
_rules: dict[tuple[int, str], _Rule] = {}


def configure(spec: str) -> None:
    """Replace the rules with those of ``spec`` (the ``SURGE_FAULT_INJECT_HANDLER`` syntax; "" clears).

    Raises:
        ValueError: a malformed rule (the message names it).
    """
    rules: dict[tuple[int, str], _Rule] = {}
    for text in filter(None, (part.strip() for part in spec.split(";"))):
        parts = text.split(":")
        if len(parts) < 3 or parts[0] != "handler":
            raise ValueError(
                f"{ENV}: {text!r}: expected handler:<MODULE>:<Message>[:after=N][:times=K][:cause=NAME][:delay=S]"
                "[:in=MAIN]"
            )
        try:
            module = route_pb2.Module.Value(parts[1])
        except ValueError:
            raise ValueError(f"{ENV}: {text!r}: unknown module {parts[1]!r}") from None
        message = parts[2] if "." in parts[2] else f"surge.v1.{parts[2]}"
        rule, here = _Rule(), True
        for option in parts[3:]:
            key, _, value = option.partition("=")
            if key in ("after", "times") and value.isdigit():
                setattr(rule, key, int(value))
            elif key == "cause" and value in route_pb2.FailureCause.keys():  # noqa: SIM118 - an enum wrapper
                rule.cause = route_pb2.FailureCause.Value(value)
            elif key == "delay" and _seconds(value) is not None:
                rule.delay = _seconds(value)
            elif key == "in" and value:
                here = _main_is(value)
            else:
                raise ValueError(f"{ENV}: {text!r}: bad option {option!r}")
        if here:
            rules[(module, message)] = rule
    with _lock:
        _rules.clear()
        _rules.update(rules)


def _seconds(value: str) -> float | None:
    """``value`` as a finite number of seconds >= 0, else None."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def _main_is(name: str) -> bool:
    """Whether this process's ``__main__`` module is ``name`` or one under it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    main = getattr(spec, "name", "") or ""
    return main == name or main.startswith(name + ".")


def check(module: int, message: str) -> None:
    """The bus, before ``module``'s handler of ``message`` (full name) runs.

    Raises:
        InjectedFault: a rule says this call fails (a ``delay`` rule holds it instead).
    """
    if not _rules:
        return
    with _lock:
        rule = _rules.get((module, message))
        if rule is None:
            return
        rule.calls += 1
        fire = rule.after < rule.calls <= rule.after + rule.times
    if fire and rule.delay > 0:
        time.sleep(rule.delay)  # slow, not failed: the handler runs next
    elif fire:
        raise InjectedFault(module, message, rule.cause)


_env_error: str | None = None


def env_error() -> str | None:
    """Why ``SURGE_FAULT_INJECT_HANDLER`` (as read at import) is malformed, in one line; None if it is not."""
    return _env_error


try:
    configure(os.environ.get(ENV, ""))
except ValueError as _e:
    _env_error = str(_e)
