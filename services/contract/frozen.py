"""Configuration pushed once at initialisation, then frozen (DESIGN.md law 1).

A module that takes its configuration as a command (``FilterRules``, ``PackerConfig``,
``ParallelPlan``, ...) keeps it in a :class:`FrozenConfig`. The first push is the
initialisation; any later push is refused with :class:`ConfigFrozen`, because the seed
lists no command that changes that configuration. Where the seed *does* list one (the
shuffler's per-round plan, the operator adapter's 切换加速模式指令, the dataset manager's
切换数据集版本指令), the module does not use this helper for it.

Self-contained on purpose: no imports from the rest of ``services``, so any layer may use it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from services.contract.failures import Refusal

T = TypeVar("T")


class ConfigFrozen(RuntimeError, Refusal):
    """A configuration change arrived after initialisation and the seed lists no command
    for it. ``fault_class`` lets a rank report it in a ``TrainingLoopFailed``."""

    fault_class = "config_frozen"


class FrozenConfig(Generic[T]):
    """A write-once slot for one piece of init-time configuration.

    Args:
        owner: the module, as the route table names it (``"L4_FILTER"``).
        what: the setting held, in words (``"filter rules"``).
        error: the exception raised on a second push: :class:`ConfigFrozen` or a subclass
            (a service may map its own subclass to a status code).

    Example::

        self._rules = FrozenConfig[data_pb2.FilterRules]("L4_FILTER", "filter rules")
        self._rules.set(msg)   # the init push
        self._rules.set(msg)   # ConfigFrozen: L4_FILTER: filter rules already set at init; ...
    """

    __slots__ = ("_owner", "_what", "_error", "_value", "_set")

    def __init__(self, owner: str, what: str, *, error: type[ConfigFrozen] = ConfigFrozen):
        if not issubclass(error, ConfigFrozen):
            raise TypeError(f"FrozenConfig: error must subclass ConfigFrozen, got {error!r}")
        self._owner, self._what, self._error = owner, what, error
        self._value: T | None = None
        self._set = False

    def set(self, value: T) -> T:
        """Hold ``value`` (the init push) and return it.

        Raises:
            ConfigFrozen (or ``error``): a value was already pushed.
        """
        self.require_unset()
        self._value, self._set = value, True
        return value

    def require_unset(self) -> None:
        """Refuse now if a value was already pushed (call before validating a new push, so a
        second push is refused as frozen whatever its content).

        Raises:
            ConfigFrozen (or ``error``): a value was already pushed.
        """
        if self._set:
            raise self._error(
                f"{self._owner}: {self._what} already set at init; the seed lists no command to change it"
            )

    @property
    def is_set(self) -> bool:
        return self._set

    def get(self) -> T:
        """The pushed value.

        Raises:
            RuntimeError: nothing was pushed yet (a wiring fault: the module was used
                before its initialisation command).
        """
        if not self._set:
            raise RuntimeError(f"{self._owner}: {self._what} has not been pushed yet")
        return self._value  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "set" if self._set else "unset"
        return f"FrozenConfig({self._owner}: {self._what}, {state})"
