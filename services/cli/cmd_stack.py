"""surgectl up, down and restart: the local stack's processes."""

from __future__ import annotations

import typer

from services.cli import clients, dashboard, render, stack, stack_access, up_lock
from services.cli.app import _say, app
from services.cli.errors import CliError
from services.cli.numbers import WEEK_S, float_option
from services.common import paths
from services.common.access import TOKENS_FILE_ENV
from services.contract import control_pb2


@app.command()
def up(
    workers: int | None = typer.Option(None, min=1, help="node agents to start (default: 2)"),
    resume_seconds: float = float_option(
        60.0,
        "--resume-seconds",
        min=0.0,
        max=WEEK_S,
        help="how long a drained job waits for its ranks to fit before up gives up on it",
    ),
    with_dashboard: bool | None = typer.Option(
        None,
        "--dashboard/--no-dashboard",
        help=f"start the web dashboard beside the stack (default: yes; {dashboard.UP_ENV}=0 makes it no)",
    ),
    tokens: str | None = typer.Option(
        None,
        "--tokens",
        envvar=TOKENS_FILE_ENV,
        help="tokens file binding callers to teams: each team sees and controls its own jobs only; "
        "kept by `restart` and remembered for the next `up` (default: none)",
    ),
    no_tokens: bool = typer.Option(
        False, "--no-tokens", help="start open to every caller although the last stack checked a tokens file"
    ),
) -> None:
    """Start the local stack (control, store, data, workers) and its web dashboard, and wait
    until healthy; jobs drained by `surgectl down` are resumed from their drain checkpoint.

    Example: surgectl up --workers 2
    """
    from services.contract.injection import env_error

    if bad := env_error():  # every service would refuse to start with it
        raise CliError(bad, code=2)
    stack.check_writable(paths.run_dir() / "logs")  # (one line before the lock file is made there)
    with up_lock.held():  # a second `up` meanwhile says this one runs, exit 1, and touches nothing
        _up(workers, resume_seconds, with_dashboard, tokens, no_tokens)


def _up(
    workers: int | None, resume_seconds: float, with_dashboard: bool | None, tokens: str | None, no_tokens: bool
) -> None:
    try:
        # Ctrl-C: what started is stopped, exit 130
        procs = stack.up(workers or 2, exit_on_interrupt=True, tokens=tokens, open_stack=no_tokens)
    except stack.StackRunning as running:
        # Up again (idempotent): what is down is started again, the rest left running; what
        # it was asked to change is refused, never silently left as it is.
        procs = running.procs
        stack_access.check_running(procs, tokens, no_tokens)
        kept = sum(1 for name in procs if name.startswith("worker-"))
        if workers is not None and workers != kept:
            raise CliError(
                f"--workers: the running stack has {kept} workers, not {workers} "
                "(`surgectl down` then `surgectl up --workers N` changes it); nothing was changed",
                code=2,
            ) from None
        if running.down:
            with stack.exit_on_interrupt("interrupted: `surgectl up` again starts what is still down"):
                started = stack.start_missing(procs)
            _say(f"started again what was down: {', '.join(started)} (the rest of the stack kept running)")
        else:
            _say("the stack is already up (`surgectl status` shows its jobs)")
    for p in procs.values():
        render.console.print(
            f"{p.name:>10}  pid {p.pid:<7} {p.address}  /metrics :{p.metrics_port:<6} log {p.log}", soft_wrap=True
        )
    render.console.print(
        f"stack is up; metrics: http://127.0.0.1:{procs['store'].metrics_port}/metrics "
        "(every service serves its own, see above); `surgectl audit` shows the routes used; "
        "`surgectl dashboard` prints the web dashboard's URL",
        soft_wrap=True,
    )
    if dashboard.wanted_at_up(with_dashboard):
        try:
            with stack.exit_on_interrupt("interrupted: the stack is up; `surgectl dashboard` starts the dashboard"):
                proc = dashboard.start()
            render.console.print(dashboard.url_line(proc), soft_wrap=True, markup=False, highlight=False)
        except CliError as e:  # the stack is up and usable without it: said, not failed
            render.err_console.print(
                f"warning: the dashboard did not start: {e} (`surgectl dashboard` tries again)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    for line in _resume_drained(resume_seconds):
        render.err_console.print(
            f"warning: drained job not resumed: {line} (`surgectl resume JOB` when it fits)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _resume_drained(resume_seconds: float) -> list[str]:
    """Resume the jobs `surgectl down` drained; the lines of those that were not. A control
    that checks tokens (``--tokens``) and does not know this shell's SURGE_AUTH_TOKEN (none,
    or no admin's) is said in one line naming the fix, the stack left up (was: exit 1 with
    "ListJobs: not authenticated", the stack up and the drained jobs left as they were)."""
    import grpc

    from services.cli import drain

    try:
        with stack.exit_on_interrupt(
            "interrupted: the stack is up; drained jobs may not be resumed yet: "
            "`surgectl up` again (or `surgectl resume JOB`) resumes them"
        ):
            return drain.resume_drained(resume_seconds, _say)[1]
    except CliError as e:
        if e.status not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise
        raise CliError(
            f"the stack is up, but the jobs `surgectl down` drained (if any) were not resumed: {e}; "
            "set SURGE_AUTH_TOKEN to an admin token of the stack's tokens file, then `surgectl up` "
            "again resumes them (it leaves the running stack as it is)"
        ) from None


@app.command()
def down(
    force: bool = typer.Option(
        False,
        "--force",
        help="stop at once: running jobs are not drained (they lose their steps since their last checkpoint)",
    ),
    drain_seconds: float = float_option(
        300.0,
        "--drain-seconds",
        min=0.0,
        max=WEEK_S,  # (inf would never end; Ctrl-C stops a drain wait anyway)
        help="how long to wait for running jobs to checkpoint and pause",
    ),
) -> None:
    """Stop the local stack and every rank process it started. Running jobs are drained
    first: each checkpoints and pauses at a step boundary (journaled by control), and the
    next `surgectl up` resumes them; `--force` skips that (control parks them at once: the
    next `up` resumes them from their newest checkpoint, no fault recorded).

    Safe to interrupt: Ctrl-C while jobs drain leaves the stack running (a job asked to drain
    still checkpoints and pauses): `surgectl down` again finishes, `surgectl up` (or
    `surgectl resume JOB`) lets the jobs go on. Once the services are being stopped, Ctrl-C
    is ignored (seconds: SIGTERM, then SIGKILL). A control that does not answer (before or
    during the drain) while node agents run: refused, nothing stopped (start it again, then
    `down`; or `--force`).

    Example: surgectl down
    """
    drained, parked = False, []
    # Held to the end: an `up` meanwhile would stop the drain or start services this `down` then
    # leaves running (a second control on the same journal); a `down` started during an `up`
    # would stop what that `up` goes on starting. Refused either way, one line, exit 1.
    with up_lock.held("this `down`", name="down"):
        if stack.read_stack():
            _require_whole_view()
            with stack.exit_on_interrupt(DOWN_INTERRUPTED):
                drained, parked = _park_jobs() if force else (_drain_running_jobs(drain_seconds), [])
        with stack.ignoring_interrupts():  # a stop cut in half would leave agents without their control
            stopped = stack.down(control_first=drained or force)
            if dashboard.stop():  # (it reads the stack: nothing to show once the stack is gone)
                stopped.append("dashboard")
    render.console.print(f"stopped {', '.join(stopped)}" if stopped else "no stack was running")
    if parked:  # (the ranks are gone: no commit can land after this)
        from services.cli import drain

        for line in drain.resume_points(parked, paths.store_root()):
            _say(line)


@app.command("dashboard")
def dashboard_url(
    stop: bool = typer.Option(False, "--stop", help="stop the dashboard (the stack keeps running)"),
) -> None:
    """Print the URL of the local stack's web dashboard, starting it when it is not running:
    read-only pages of the cluster, the queue, each job (curves, events, checkpoints, logs)
    and jobs compared. The URL holds the token (SURGE_AUTH_TOKEN, else one made for this
    stack); the first page opened sets it as a cookie. `surgectl up` starts it (unless
    --no-dashboard); `surgectl down` stops it too.

    Example: surgectl dashboard
    """
    if stop:
        _say("dashboard stopped" if dashboard.stop() else "no dashboard was running")
        return
    proc = dashboard.start()
    render.console.print(
        dashboard.url_line(proc),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _require_whole_view(command: str = "down") -> None:
    """`down` (and `restart`) stop services every team's jobs use: refused (one line, nothing
    stopped) for a caller control shows one team's jobs only (a tokens file binds identities to
    teams; the caller is no admin), whose stop would leave the other teams' jobs to die with
    the stack. A control that does not answer says nothing here (the stack is down already, or
    broken: `down` and `restart` are how it is mended); for `restart`, neither does one that
    fails to answer in 3 s (a hung control is what it restarts)."""
    if command == "restart":
        try:
            seen = clients.team_view(timeout=3.0)
        except CliError:
            seen = None
    else:
        seen = clients.team_view()
    if seen is not None and seen[0]:
        raise CliError(
            f"surgectl {command} stops services every team's jobs run on: it needs an admin token "
            f"(yours sees team {seen[0]}'s jobs only); nothing was stopped"
        )


DOWN_INTERRUPTED = (
    "interrupted: the stack keeps running; a job asked to drain still checkpoints and pauses "
    "(`surgectl down` again stops the stack once it has; `surgectl up` or `surgectl resume JOB` lets it go on)"
)


def _park_jobs() -> tuple[bool, list]:
    """`down --force`: control parks every running or paused job at once (``drain.park``).
    Whether any job was live (control then stops first: it never sees the ranks go), and
    control's status of each job parked."""
    import grpc

    from services.cli import drain

    try:
        addr = clients.address("control")
    except CliError:
        return False, []
    with clients.open_channel(addr) as ch:
        try:
            return drain.park(clients.new_stub("control", ch), _say)
        except grpc.RpcError:
            render.err_console.print(
                f"control unreachable at {addr}: running jobs cannot be parked; stopping anyway",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return False, []


def _drain_running_jobs(timeout_s: float) -> bool:
    """Drain the live jobs of the local stack's control (if it answers). True if any was."""
    import grpc

    from services.cli import drain

    try:
        addr = clients.address("control")
    except CliError:
        return False
    with clients.open_channel(addr) as ch:
        stub = clients.new_stub("control", ch)
        try:
            jobs = drain.live_jobs(stub)
        except grpc.RpcError as e:
            if not _ranks_may_run():  # no node agent left: no rank to lose, nothing to drain
                return False
            raise _not_drained(e, addr) from None
        if not jobs:
            return False
        running = [j for j in jobs if j.state != control_pb2.PAUSED]
        paused = [j for j in jobs if j.state == control_pb2.PAUSED and not j.drained]
        drained = [j.job_id for j in jobs if j.state == control_pb2.PAUSED and j.drained]
        if running:
            names = ", ".join(f"{j.job_id} ({render.state_text(j)})" for j in running)
            _say(
                f"{len(running)} job{'s' if len(running) > 1 else ''} running: {names}; draining "
                "(checkpoint, then PAUSED; `surgectl up` resumes them; `surgectl down --force` skips this)"
            )
        if paused:  # (what `up` does with each is said once it is drained: drain.drain)
            names = ", ".join(j.job_id for j in paused)
            _say(f"PAUSED: {names}; checkpointing")
        if drained:  # (an earlier `down`'s drain, interrupted)
            _say(f"drained already: {', '.join(drained)}; `surgectl up` resumes them")
        try:
            drain.drain(stub, jobs, timeout_s, _say)
        except grpc.RpcError as e:  # control went away (or broke) during the drain
            raise _not_drained(e, addr) from None
    return True


def _ranks_may_run() -> bool:
    """Whether a node agent of the local stack still runs (its ranks may train): a `down`
    without control would stop them unseen, and the next `up` would recover every such job
    as a lost worker (a fault, a restart spent)."""
    procs = stack.read_stack() or {}
    down = set(stack.down_services(procs))
    return any(name.startswith("worker-") and name not in down for name in procs)


def _not_drained(error, addr: str) -> CliError:
    """`down` (not --force) whose control does not answer, before or during the drain: nothing
    is stopped (was: every rank stopped unseen, exit 0, and the next `up` recovered each job
    as worker_lost, spending a restart)."""
    mapped = clients.rpc_error(error, "control", addr)
    if not mapped.unreachable:
        return mapped
    again = clients.start_again_hint("control").split("`")[1]  # `surgectl up` or `surgectl restart control`
    return CliError(
        f"control unreachable at {addr}: running jobs cannot be drained; nothing was stopped "
        f"(`{again}`, then `surgectl down` drains them; `surgectl down --force` stops the stack now: "
        "the next `up` then recovers its jobs as lost workers)"
    )


@app.command()
def restart(
    service: str = typer.Argument(
        ..., help="control, data, store, or a worker as named by `surgectl up` (worker-0, ...)"
    ),
    grace_seconds: float = float_option(
        stack.STOP_GRACE_SECONDS,
        "--grace-seconds",
        min=0.0,
        max=86400.0,
        help="wait this long after SIGTERM before SIGKILL",
    ),
) -> None:
    """Restart one service of the local stack on the same port, with the same arguments;
    the others keep running. Restarting control leaves running jobs running (the node
    agents re-attach their ranks); restarting a worker stops its ranks.

    Example: surgectl restart control
    """
    up_lock.check_none("this `restart`")  # (it would start a second copy of a service `up` starts)
    _require_whole_view("restart")
    with stack.exit_on_interrupt(f"interrupted: {service} may be stopped; `surgectl up` starts again what is down"):
        old, new = stack.restart(service, grace_seconds)
    render.console.print(
        f"restarted {new.name}: pid {old.pid} -> {new.pid}, serving at {new.address}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
