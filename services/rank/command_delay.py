"""Test-only: commands delivered late to one rank (off unless ``SURGE_COMMAND_DELAY`` is set).

What a command delayed on its way to one rank looks like (an applier backlog, an agent
reconnecting, a GC pause): the rank's session reader holds a named command ``seconds``
before handing it on, and the commands behind it wait too (delivery stays in order, as the
stream's is). The boundary agreement (services/common/boundary_commands.py) must give every
rank the same boundary anyway::

    SURGE_COMMAND_DELAY="<Type>[+<Type>...]:<seconds>[:rank=<r>][:job=<name>][,...]"

e.g. ``PauseTraining+StopTraining+RevokeStandingOrder:5:rank=1`` (the message's short name;
rank 0 when no rank is named; every job, unless ``job`` names one: a stack that other tests'
jobs share delays only that job's commands). Read by the real rank's session (services/rank/__main__.py)
and the simulated one's (services/rank/simulated/session.py). Torch-free.
"""

from __future__ import annotations

import os
import time

DELAY_ENV = "SURGE_COMMAND_DELAY"


def parse_delays(text: str, rank: int, job_id: str = "") -> dict[str, float]:
    """Command short name -> seconds, for ``rank`` of job ``job_id`` (its name: the id less
    its ``-<hex>`` suffix, services/control/orchestrator/core.py), from ``text`` (the variable's value).

    Raises:
        ValueError: an entry that does not parse (the message quotes it).
    """
    out: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            names, seconds, *opts = entry.split(":")
            who, job = 0, ""
            for opt in opts:
                key, value = opt.split("=")
                if key == "rank":
                    who = int(value)
                elif key == "job" and value:
                    job = value
                else:
                    raise ValueError(key)
            delay = float(seconds)
        except ValueError:
            raise ValueError(
                f"{DELAY_ENV}: {entry!r}: expected <Type>[+<Type>...]:<seconds>[:rank=<r>][:job=<name>]"
            ) from None
        if who == rank and (not job or job_id.rsplit("-", 1)[0] == job):
            out.update({name: delay for name in names.split("+") if name})
    return out


class CommandDelay:
    """The delays of one rank (empty: none; the usual case costs one dict lookup)."""

    def __init__(self, delays: dict[str, float]):
        self._delays = delays

    @classmethod
    def from_env(cls, rank: int, job_id: str = "") -> CommandDelay:
        text = os.environ.get(DELAY_ENV, "")
        return cls(parse_delays(text, rank, job_id) if text else {})

    def hold(self, type_name: str) -> None:
        """Sleep the delay named for the command ``type_name`` (full or short name), if any."""
        seconds = self._delays.get(type_name.rsplit(".", 1)[-1]) if self._delays else None
        if seconds:
            time.sleep(seconds)
