"""structlog set-up: JSON lines (one event per line) in files, a console renderer on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, **bound: object) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``service``."""
    renderer = (
        structlog.dev.ConsoleRenderer()
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service, **bound)
