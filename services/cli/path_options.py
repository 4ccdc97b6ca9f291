"""The one rule of surgectl's path options and arguments (an output such as `export --out`,
`compare --out`, `plot --out`; an input such as `submit SPEC`): an empty value is said to be
empty. Why a parser of its own: typer turns ``""`` into ``Path("")``, which *is* ``.``, so
`export --out "" --force` replaced the current directory and `plot --out ""` wrote into it.
And an output's missing parent folder is refused, never created (a typo in it would leave a
stray tree): `compare`, `plot` and `export` agree, as the shell's ``>`` does."""

from __future__ import annotations

from pathlib import Path

import typer

from services.cli.errors import CliError


def nonempty_path(value) -> Path | None:
    """A typer ``parser``: the value as a Path; an empty (or blank) one is a usage error
    ("Invalid value for '--out': empty", exit 2). The default (None or a Path) as it is."""
    if value is None or isinstance(value, Path):
        return value
    if not str(value).strip():
        raise typer.BadParameter("empty (name a path; '.' is the current directory)")
    return Path(value)


def check_parent(out: Path, option: str = "--out") -> None:
    """Refuse an output whose parent folder is not there (or is not a folder).

    Raises:
        CliError (exit 2): one line naming ``option``, the path and its folder."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise CliError(f"{option}: {out}: its directory {parent} {what} (it is not created)", code=2)
