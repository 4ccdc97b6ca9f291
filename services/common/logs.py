"""structlog set-up for every Surge process.

One event is one line. In files (the local stack sends each service's stderr to
``$SURGE_HOME/run/logs/<service>.log``, each rank's to ``<job>.rank<R>.log``) that line is a
JSON object; on a terminal it is structlog's human console rendering. ``SURGE_LOG_FORMAT``
(``json`` | ``console``) overrides the choice, ``SURGE_LOG_LEVEL`` the level (default INFO;
DEBUG | INFO | WARNING | ERROR | CRITICAL); any other value of either is refused.

Every line carries ``timestamp``, ``level``, ``service``, then ``job``, ``rank`` and ``step``
when known, then ``event``; these keys come first, in that order. The fields given to
``configure`` hold for every logger of the process, also module-level
``structlog.get_logger()`` ones and records of the standard ``logging`` module (gRPC,
torch): they all go through the one handler, so lines never interleave. A ``job_id=`` field
is written as ``job`` (one name for one thing across services). ``bind(step=...)`` puts a
field on every later line of the current thread/context (``unbind`` removes it).

A log line is written once, not once per rank: an event about the whole job that every rank
would log identically is logged with ``once=True``, and only rank 0 writes it (processes
without a rank, the services, write it as usual).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import IO, Any

import structlog

FIRST_KEYS = ("timestamp", "level", "service", "job", "rank", "step", "event")
FORMAT_ENV, LEVEL_ENV = "SURGE_LOG_FORMAT", "SURGE_LOG_LEVEL"

_HANDLER_NAME = "surge"
FORMATS = ("json", "console")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env_problem() -> str | None:
    """One line naming ``SURGE_LOG_FORMAT`` / ``SURGE_LOG_LEVEL`` and the allowed values if
    either is set to something else (case-insensitive; empty means unset), else None.
    ``configure`` refuses such a process; ``surgectl up`` asks first, before starting anything."""
    fmt = os.environ.get(FORMAT_ENV, "")
    if fmt and fmt.lower() not in FORMATS:
        return f"{FORMAT_ENV}: expected one of {', '.join(FORMATS)}, got {fmt!r}"
    level = os.environ.get(LEVEL_ENV, "")
    if level and level.upper() not in LEVELS:
        return f"{LEVEL_ENV}: expected one of {', '.join(LEVELS)}, got {level!r}"
    return None


def bind(**fields: Any) -> None:
    """Add ``fields`` (e.g. ``step=12``) to every later line of this thread/context."""
    structlog.contextvars.bind_contextvars(**fields)


def unbind(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)


class _Defaults:
    """Adds the process-wide fields (service, job, rank, ...) to every event."""

    def __init__(self, fields: Mapping[str, Any]):
        self._fields = dict(fields)

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for k, v in self._fields.items():
            event.setdefault(k, v)
        return event


def _job_name(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if "job_id" in event:
        job = event.pop("job_id")
        event.setdefault("job", job)
    return event


class _OncePerJob:
    """Drops ``once=True`` events on every rank but 0."""

    def __init__(self, rank: Any):
        self._skip = rank is not None and str(rank) != "0"

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if event.pop("once", False) and self._skip:
            raise structlog.DropEvent
        return event


def _first_keys(logger: Any, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    ordered = {k: event.pop(k) for k in FIRST_KEYS if k in event}
    ordered.update(event)
    return ordered


def _use_console(stream: IO[str]) -> bool:
    fmt = os.environ.get(FORMAT_ENV, "").lower()
    if fmt in ("json", "console"):
        return fmt == "console"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is written, not to the one it was at
    ``configure`` time: a process that swaps it later (a test runner capturing each test's
    output, then closing that capture) never has its lines go to a closed stream, and
    its threads' lines land where the rest of its output goes now."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:  # type: ignore[override]
        return sys.stderr


def configure(service: str, stream: IO[str] | None = None, **bound: object) -> structlog.stdlib.BoundLogger:
    """Configure logging for this process and return a logger bound to ``service``.

    Args:
        service: written as ``service`` on every line of the process.
        stream: where lines go (default: the process's ``sys.stderr`` at the time of each line).
        bound: more process-wide fields, e.g. ``job=..., rank=...`` in a rank process.

    Calling it again replaces the previous set-up (no line is ever written twice).

    Raises:
        SystemExit(2): ``SURGE_LOG_FORMAT`` or ``SURGE_LOG_LEVEL`` has a value not listed
            above; one line ``error: <VAR>: expected one of ...`` on stderr first (a usage
            error, exit 2 like a service's bad port).
    """
    problem = env_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    explicit = stream is not None
    stream = stream if explicit else sys.stderr
    level = getattr(logging, (os.environ.get(LEVEL_ENV) or "INFO").upper())
    defaults = {"service": service, **bound}
    if "job_id" in defaults:
        defaults.setdefault("job", defaults.pop("job_id"))
    console = _use_console(stream)

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _Defaults(defaults),
        _job_name,
        _OncePerJob(defaults.get("rank")),
    ]
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([] if console else [structlog.processors.format_exc_info]),
            _first_keys,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream) if explicit else _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):  # ours from an earlier call, or a library's default
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)

    structlog.reset_defaults()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    log = structlog.get_logger(service).bind(**defaults)
    _log_uncaught(log)
    return log


def _log_uncaught(log: Any) -> None:
    """An exception nobody caught is one event too (with its traceback), not a bare
    multi-line traceback between the JSON lines."""
    import threading

    def on_main(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        log.critical("uncaught_exception", error=f"{kind.__name__}: {value}", exc_info=(kind, value, tb))

    def on_thread(args) -> None:
        if args.exc_type is SystemExit:
            return
        log.critical(
            "uncaught_exception",
            thread=getattr(args.thread, "name", None),
            error=f"{args.exc_type.__name__}: {args.exc_value}",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )

    sys.excepthook = on_main
    threading.excepthook = on_thread
