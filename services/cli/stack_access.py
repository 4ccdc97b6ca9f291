"""The tokens file a local stack checks (per-team access), kept across `restart` and `down`.

`surgectl up --tokens FILE` (or SURGE_TOKENS_FILE in up's environment) hands ``--tokens FILE``
to the store and control as part of their recorded command lines: `surgectl restart` and an
`up` that starts again what is down keep checking it whatever the environment of that later
command (it was read from the environment at each start before: a restart without the
variable opened every team's jobs to every caller, silently).

The file's path is also remembered in the run directory, which `down` keeps: an `up` after a
`down` with no tokens file is refused in one line naming the remembered file, unless
``--no-tokens`` says the stack is to be open from now on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.cli.errors import CliError
from services.common import paths
from services.common.access import TOKENS_FILE_ENV, TokensFileError, load_tokens

if TYPE_CHECKING:
    from services.cli.stack import ServiceProc


def _record() -> Path:
    return paths.run_dir() / "tokens_file"


def remembered() -> str | None:
    """The tokens file the last stack of this SURGE_HOME checked (None: it was open)."""
    try:
        return _record().read_text().strip() or None
    except FileNotFoundError:
        return None


def service_args(tokens: str | None, open_stack: bool) -> list[str]:
    """The store's and control's ``--tokens`` arguments for an `up` given ``tokens`` (a path,
    or None) and ``open_stack`` (`--no-tokens`). Checked before anything starts.

    Raises:
        CliError (exit 2): both given; the file unreadable or invalid (its own one line); none
            given while the last stack checked one.
    """
    if tokens and open_stack:
        raise CliError(f"--no-tokens: contradicts the tokens file {tokens} (--tokens or {TOKENS_FILE_ENV})", code=2)
    if tokens:
        path = _absolute(tokens)
        _check_loads(path)
        return ["--tokens", path]
    last = remembered()
    if last and not open_stack:
        raise CliError(
            f"the last stack of this SURGE_HOME checked tokens from {last} (per-team access): "
            f"`surgectl up --tokens {last}` keeps it, `surgectl up --no-tokens` starts this one open to every caller",
            code=2,
        )
    return []


def remember(args: list[str]) -> None:
    """After a successful `up`: remember the tokens file of ``args`` (from ``service_args``),
    or that the stack is open."""
    if args:
        _record().write_text(args[1] + "\n")
    else:
        _record().unlink(missing_ok=True)


def recorded(proc: ServiceProc) -> str | None:
    """The tokens file in a service's recorded command line (None: it checks none)."""
    args = list(proc.args or [])
    return args[args.index("--tokens") + 1] if "--tokens" in args[:-1] else None


def check_running(procs: dict[str, ServiceProc], tokens: str | None, open_stack: bool) -> None:
    """`up` over a running stack: ``tokens`` / ``open_stack`` asked of it must be what it
    checks already (a stack is not changed under its jobs).

    Raises:
        CliError (exit 2): they differ; nothing was changed."""
    if not (tokens or open_stack) or "control" not in procs:
        return
    now = recorded(procs["control"])
    wanted = _absolute(tokens) if tokens else None
    if now != wanted:
        checks = f"checks tokens from {now}" if now else "checks no tokens file (open to every caller)"
        raise CliError(
            f"the running stack {checks}: `surgectl down` then `surgectl up "
            f"{'--tokens ' + tokens if tokens else '--no-tokens'}` changes it; nothing was changed",
            code=2,
        )


def check_file(proc: ServiceProc) -> None:
    """Before a `restart` stops ``proc``: the tokens file of its command line still loads
    (an edit that broke it would leave the service down, refusing to start).

    Raises:
        CliError (exit 2): it does not; nothing was stopped."""
    path = recorded(proc)
    if path is not None:
        _check_loads(path, f"; {proc.name} was not stopped (fix the file, then restart it)")


def _absolute(tokens: str) -> str:
    """A tokens file's path as recorded (services start in another directory)."""
    return str(Path(tokens).expanduser().resolve())


def _check_loads(path: str, then: str = "") -> None:
    """Raises CliError (exit 2, the file's own one line and ``then``) if ``path`` does not load."""
    try:
        load_tokens(path)
    except TokensFileError as e:
        raise CliError(f"{e}{then}", code=2) from None


def check_local_read(job_id: str, what: str) -> None:
    """Before a command reads ``job_id``'s files from SURGE_HOME itself (``what``: `export`,
    `generate`, `eval`): when this SURGE_HOME's stack checks tokens, control is asked for the
    job with the caller's token first, as every command that goes through the services is,
    so a team's token does not read another team's weights by going around them. Without a
    tokens file (a single user's stack) nothing is asked: the files' permissions are the
    boundary.

    Raises:
        CliError: control refused the caller (one line, its words), does not know the job, or
            cannot be asked while tokens are checked (exit 1: start the stack).
    """
    if remembered() is None:
        return
    from services.cli import clients
    from services.contract import control_pb2

    try:
        clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10))
    except CliError as e:
        if not e.unreachable:
            raise
        raise CliError(
            f"{what}: this stack checks per-team tokens and control could not be asked whether you may read job "
            f"{job_id} ({e}): `surgectl up` first",
            code=1,
        ) from None


def not_found_text(error: LookupError) -> str:
    """A missing version's words for this caller: where the stack checks tokens, without the
    other jobs' versions the store's hint names (``CheckpointNotFound.bare``)."""
    bare = getattr(error, "bare", None) if remembered() else None
    return " ".join((bare or str(error)).split())


def check_any_latest(version: str) -> None:
    """``latest`` alone names the newest version of every job: where the stack checks tokens
    that may be another team's (refused then, naming it): ask for ``JOB:latest`` instead.

    Raises:
        CliError (exit 2): ``version`` is ``latest`` and tokens are checked."""
    if version.strip() == "latest" and remembered():
        raise CliError(
            "checkpoint latest: this stack checks per-team tokens, and the newest version of every job may be "
            "another team's: name the job, JOB:latest",
            code=2,
        )
