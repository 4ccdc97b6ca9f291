"""``raised_in_module``: the block's command failed in the module it commanded.

Since issue 13 (failures are data) the bus turns an exception escaping a module's handler
into that module's failure event and raises ``ModuleFailed`` to the commander; the error the
handler raised is its ``error``. Used like ``pytest.raises``; ``.value`` is that error."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from services.contract.failures import ModuleFailed


@dataclass
class Raised:
    value: BaseException | None = None
    failed: ModuleFailed | None = None


@contextmanager
def raised_in_module(
    error_type: type[BaseException], match: str = "", *, event: str = "", cause: int = 0
) -> Iterator[Raised]:
    """Expect ``ModuleFailed`` whose handler error is an ``error_type`` matching ``match``
    (and, when given, whose failure event is ``event`` with typed ``cause``)."""
    raised = Raised()
    with pytest.raises(ModuleFailed) as failed:
        yield raised
    raised.failed, raised.value = failed.value, failed.value.error
    assert isinstance(raised.value, error_type), repr(raised.value)
    assert re.search(match, str(raised.value)), str(raised.value)
    if event:
        assert failed.value.event.DESCRIPTOR.name == event
    if cause:
        assert failed.value.failure.cause == cause
