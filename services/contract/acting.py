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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_ACTING: contextvars.ContextVar[int] = contextvars.ContextVar("surge_acting_module", default=0)


def acting_module() -> int:
    """The ``route_pb2.Module`` whose handler runs on this thread now (0: none)."""
    return _ACTING.get()


@contextmanager
def acting(module: int) -> Iterator[None]:
    """Run the body on behalf of ``module`` (restores the previous value after)."""
    token = _ACTING.set(module)
    try:
        yield
    finally:
        _ACTING.reset(token)


def run_as(module: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on behalf of ``module`` (for a thread target a module starts)."""
    with acting(module):
        return fn(*args, **kwargs)
