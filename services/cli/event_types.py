"""The types of a job's events (``JobEvent.type``), for `surgectl events --type`.

Control's orchestrator records each event under one of these words (its ``_record`` calls;
tests/cli/test_events_filter.py checks every type it records is listed here, so a new one
cannot be filtered out by a stale list).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.cli.errors import CliError

EVENT_TYPES = (
    "state",  # a state change (STANDBY, WARMING_UP, RUNNING, PAUSED, FAULT_FROZEN, TERMINATED)
    "queue",  # queued, its place, what it waits for
    "resource",  # ranks placed, or not
    "rank",  # a rank's own report (started, paused, finished)
    "step",  # a step's summary (sampled)
    "skip",  # a step skipped by a standing order
    "eval",  # a held-out evaluation
    "checkpoint",  # a version saved, or a save that failed
    "data",  # the data service away, or back
    "fault",  # a fault report from the fault detector
    "decision",  # the fault policy's decision on an incident
    "recovery",  # a recovery's progress
    "scale",  # a resize
    "departure",  # a node leaving with notice: its checkpoint and move, or why not (a warning)
    "preemption",  # a higher-priority job preempts: who, the victims' checkpoints, their warnings
    "tags",  # the operator's tags set or removed (surgectl tag)
    "note",  # the operator's note (surgectl note)
    "profile",  # a profile asked (surgectl profile), and each rank's files
)


def event_types(values: Iterable[str]) -> set[str]:
    """The types asked for (each value one type or a comma-separated list; none: every type).

    Raises:
        CliError: a word that is not an event type (one line, naming the known ones).
    """
    values = list(values)
    if any(not v.strip(" ,") for v in values):  # (`--type ""`: a filter that names nothing is a mistake, not "all")
        raise CliError(f"--type: empty (one of: {', '.join(EVENT_TYPES)}, or leave --type out for every type)", code=2)
    wanted = {t.strip() for v in values for t in v.split(",") if t.strip()}
    unknown = sorted(wanted - set(EVENT_TYPES))
    if unknown:
        raise CliError(f"--type: unknown event type {', '.join(unknown)} (one of: {', '.join(EVENT_TYPES)})", code=2)
    return wanted
