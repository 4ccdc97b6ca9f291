"""The one parser of surgectl's float options (durations, timeouts, weights): a value that is
not a finite number (``nan``, ``inf``, a word) is said to be so, instead of typer's range check,
which NaN fell through to ("should be less than or equal to N": every comparison with NaN is
false) and which ``inf`` passed wherever there was only a lower bound; a bound is said with the
option's name (click's usage error, exit 2). Durations stop at a week (``WEEK_S``): ``1e308``
would never end."""

from __future__ import annotations

import math
from collections.abc import Callable

import typer

WEEK_S = 7 * 86400.0


def number(min: float | None = None, max: float | None = None, *, above: float | None = None) -> Callable:  # noqa: A002
    """A typer ``parser``: the option's value as a finite float in [``min``, ``max``] (and >
    ``above``); the default (a float already, or None) as it is."""

    def parse(value):
        if value is None or isinstance(value, float):  # (the default)
            return value
        try:
            x = float(str(value).strip())
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a number") from None
        if not math.isfinite(x):
            raise typer.BadParameter(f"{value!r} is not a number (a finite one is needed)")
        if above is not None and not x > above:
            raise typer.BadParameter(f"must be > {above:g}, got {value}")
        if min is not None and x < min:
            raise typer.BadParameter(f"must be >= {min:g}, got {value}")
        if max is not None and x > max:
            raise typer.BadParameter(f"must be <= {max:g}{' (a week)' if max == WEEK_S else ''}, got {value}")
        return x

    return parse


def float_option(
    default, *decls: str, min: float | None = None, max: float | None = None, above: float | None = None, **kw
):  # noqa: A002
    """A typer option of a float read by ``number``; its range shows in `--help` as typer's own
    (``above``, which typer has no range for, is added to the help text)."""
    if above is not None and "help" in kw:
        kw["help"] = f"{kw['help']} (> {above:g})"
    return typer.Option(default, *decls, min=min, max=max, parser=number(min, max, above=above), **kw)
