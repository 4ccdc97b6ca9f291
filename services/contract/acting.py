"""On whose behalf the current code runs: the module whose handler the bus is executing.

The bus sets it around every handler call (``Bus.command`` / ``Bus.publish``), so code deep
inside a module (a helper, a library hook) can be attributed to the module without the module
saying so itself: the run-time boundary checks read it (a collective issued while a module
other than L3-5 acts is a boundary violation unless registered in docs/exceptions.md).

A ``contextvars.ContextVar``: each thread (and each asyncio task) sees its own value; a thread
started inside a handler starts with none (``MODULE_UNSPECIFIED``) unless it is started
through :func:`run_as`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

_ACTING: contextvars.ContextVar[int] = contextvars.ContextVar("surge_acting_module", default=0)


def acting_module() -> int:
    """The ``route_pb2.Module`` whose handler runs on this thread now (0: none)."""
    return _ACTING.get()


class acting:  # noqa: N801 (used as a function: ``with acting(module):``)
    """Run the body on behalf of ``module`` (restores the previous value after).

    A class, not a ``@contextmanager`` generator: the bus enters it around every handler it
    runs (~16 a rank's step; at control, every rank beat), and the generator cost ~0.8 us more
    each time (bench/bus_dispatch.py: a publish to 2 receivers 5.1 -> 3.6 us)."""

    __slots__ = ("_module", "_token")

    def __init__(self, module: int):
        self._module = module

    def __enter__(self) -> None:
        self._token = _ACTING.set(self._module)

    def __exit__(self, *exc: object) -> None:
        _ACTING.reset(self._token)


def run_as(module: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on behalf of ``module`` (for a thread target a module starts)."""
    with acting(module):
        return fn(*args, **kwargs)
