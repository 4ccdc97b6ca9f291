"""The one parser of surgectl's number options (durations, timeouts): a value that is not a
number (``nan``, a word) is said to be so, instead of the range check's "should be less than or
equal to N" that NaN fell through to (every comparison with NaN is false); a bound is said
with the option's name (click's usage error, exit 2). Durations stop at a week: ``inf`` or
``1e308`` would never end (a Ctrl-C does)."""

from __future__ import annotations

import math
from collections.abc import Callable

import typer

WEEK_S = 7 * 86400.0


def number(low: float | None = None, high: float | None = None, *, above: float | None = None) -> Callable:
    """A typer ``parser``: the option's value as a float in [``low``, ``high``] (and > ``above``)."""

    def parse(value) -> float:
        if isinstance(value, bool) or value is None:
            raise typer.BadParameter(f"{value!r} is not a number")
        try:
            x = float(value if isinstance(value, (int, float)) else str(value).strip())
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a number") from None
        if math.isnan(x):
            raise typer.BadParameter(f"{value} is not a number")
        if above is not None and not x > above:
            raise typer.BadParameter(f"{value} is not > {above:g}")
        if low is not None and x < low:
            raise typer.BadParameter(f"{value} is below {low:g}")
        if high is not None and x > high:
            raise typer.BadParameter(f"{value} is above {high:g}" + (" (a week)" if high == WEEK_S else ""))
        return x

    return parse


def float_option(
    default, *names: str, low: float | None = None, high: float | None = None, above: float | None = None, help: str
):
    """A float option read by ``number`` (its bounds said in the help, as typer's own ranges are)."""
    bounds = [f"> {above:g}" if above is not None else "", f">= {low:g}" if low is not None else ""]
    bounds.append(f"<= {high:g}" if high is not None else "")
    said = ", ".join(b for b in bounds if b)
    return typer.Option(default, *names, parser=number(low, high, above=above), metavar="FLOAT",
                        help=f"{help} [{said}]" if said else help)  # fmt: skip
