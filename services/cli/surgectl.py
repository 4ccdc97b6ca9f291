"""surgectl: drive Surge from a terminal.

Every error a user can cause is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from services.cli import clients, jsonout, render, stack
from services.cli.errors import CliError
from services.cli.event_types import EVENT_TYPES, event_types
from services.cli.jobs import dry_run_job, follow_job, resolve_job, submit_job
from services.contract import Module, control_pb2, data_pb2, store_pb2
from services.jobspec import STEP_FAULT_CLASSES

try:  # typer >= 0.2x parses with its own copy of click; older releases with click itself
    from typer._click import exceptions as _click
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click

HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=HELP,
    help="Surge (狂潮): distributed LM training as gRPC services.\n\n"
    "Example: surgectl up && surgectl submit examples/jobs/demo.yaml --follow",
)
dataset_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Prepare and list dataset versions.\n\nExample: surgectl dataset list",
)
app.add_typer(dataset_app, name="dataset")
delete_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Delete a job's records, a checkpoint version or a dataset version (refused while in use).\n\n"
    "Example: surgectl delete checkpoint demo-3f2a1c:2",
)
app.add_typer(delete_app, name="delete")

OutputOpt = typer.Option("table", "--output", "-o", help="table | json")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        render.console.print(f"surgectl {version('surge')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
) -> None:
    """Surge (狂潮): distributed LM training as gRPC services."""
    if not {"-h", "--help"} & set(sys.argv[1:]):
        check_home()


def check_home() -> None:
    """Refuse a SURGE_HOME that is (or lies under) something other than a directory, once
    for every command, before one of them creates ``run/``, ``datasets/`` or a plot in it.

    Raises:
        CliError (exit 2): ``SURGE_HOME: <path> is not a directory`` (naming the file in
            its way when that is an ancestor).
    """
    import os

    from services.common import paths

    home = paths.surge_home()
    name = "SURGE_HOME" if os.environ.get("SURGE_HOME") else "SURGE_HOME (default ./.surge)"
    for where in (home, *home.parents):
        if where.exists():
            if not where.is_dir():
                at = "" if where == home else f" ({where} is a file)"
                raise CliError(f"{name}: {home} is not a directory{at}", code=2)
            return


@app.command()
def up(
    workers: int = typer.Option(2, min=1, help="node agents to start"),
    resume_seconds: float = typer.Option(
        60.0,
        "--resume-seconds",
        min=0.0,
        help="how long a drained job waits for its ranks to fit before up gives up on it",
    ),
) -> None:
    """Start the local stack (control, store, data, workers) and wait until healthy; jobs
    drained by `surgectl down` are resumed from their drain checkpoint.

    Example: surgectl up --workers 2
    """
    from services.contract.injection import env_error

    if bad := env_error():  # every service would refuse to start with it
        raise CliError(bad, code=2)
    try:
        procs = stack.up(workers, exit_on_interrupt=True)  # Ctrl-C: what started is stopped, exit 130
    except stack.StackRunning as running:
        # Up again (idempotent): what is down is started again, the rest left running.
        procs = running.procs
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
        "(every service serves its own, see above); `surgectl audit` shows the routes used",
        soft_wrap=True,
    )
    from services.cli import drain

    with stack.exit_on_interrupt(
        "interrupted: the stack is up; drained jobs may not be resumed yet: "
        "`surgectl up` again (or `surgectl resume JOB`) resumes them"
    ):
        _, failed = drain.resume_drained(resume_seconds, _say)
    for line in failed:
        render.err_console.print(
            f"warning: drained job not resumed: {line} (`surgectl resume JOB` when it fits)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _say(text: str) -> None:
    render.console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command()
def down(
    force: bool = typer.Option(
        False,
        "--force",
        help="stop at once: running jobs are not drained (they lose their steps since their last checkpoint)",
    ),
    drain_seconds: float = typer.Option(
        300.0, "--drain-seconds", min=0.0, help="how long to wait for running jobs to checkpoint and pause"
    ),
) -> None:
    """Stop the local stack and every rank process it started. Running jobs are drained
    first: each checkpoints and pauses at a step boundary (journaled by control), and the
    next `surgectl up` resumes them; `--force` skips that (control parks them at once: the
    next `up` resumes them from their newest checkpoint, no fault recorded).

    Safe to interrupt: Ctrl-C while jobs drain leaves the stack running (a job asked to drain
    still checkpoints and pauses): `surgectl down` again finishes, `surgectl up` (or
    `surgectl resume JOB`) lets the jobs go on. Once the services are being stopped, Ctrl-C
    is ignored (seconds: SIGTERM, then SIGKILL).

    Example: surgectl down
    """
    drained = False
    if stack.read_stack():
        with stack.exit_on_interrupt(DOWN_INTERRUPTED):
            drained = _park_jobs() if force else _drain_running_jobs(drain_seconds)
    with stack.ignoring_interrupts():  # a stop cut in half would leave agents without their control
        stopped = stack.down(control_first=drained or force)
    render.console.print(f"stopped {', '.join(stopped)}" if stopped else "no stack was running")


DOWN_INTERRUPTED = (
    "interrupted: the stack keeps running; a job asked to drain still checkpoints and pauses "
    "(`surgectl down` again stops the stack once it has; `surgectl up` or `surgectl resume JOB` lets it go on)"
)


def _park_jobs() -> bool:
    """`down --force`: control parks every running or paused job at once (``drain.park``).
    True if any job was live (control then stops first: it never sees the ranks go)."""
    import grpc

    from services.cli import drain

    try:
        addr = clients.address("control")
    except CliError:
        return False
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
            return False


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
        except grpc.RpcError:
            render.err_console.print(
                f"control unreachable at {addr}: running jobs cannot be drained; stopping anyway",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return False
        if not jobs:
            return False
        names = ", ".join(f"{j.job_id} ({render.state_text(j)})" for j in jobs)
        _say(
            f"{len(jobs)} job{'s' if len(jobs) > 1 else ''} running: {names}; draining "
            "(checkpoint, then PAUSED; `surgectl up` resumes them; `surgectl down --force` skips this)"
        )
        try:
            drain.drain(stub, jobs, timeout_s, _say)
        except grpc.RpcError as e:
            raise clients.rpc_error(e, "control", addr) from None
    return True


@app.command()
def restart(
    service: str = typer.Argument(
        ..., help="control, data, store, or a worker as named by `surgectl up` (worker-0, ...)"
    ),
    grace_seconds: float = typer.Option(
        stack.STOP_GRACE_SECONDS, "--grace-seconds", min=0.0, help="wait this long after SIGTERM before SIGKILL"
    ),
) -> None:
    """Restart one service of the local stack on the same port, with the same arguments;
    the others keep running. Restarting control leaves running jobs running (the node
    agents re-attach their ranks); restarting a worker stops its ranks.

    Example: surgectl restart control
    """
    with stack.exit_on_interrupt(f"interrupted: {service} may be stopped; `surgectl up` starts again what is down"):
        old, new = stack.restart(service, grace_seconds)
    render.console.print(
        f"restarted {new.name}: pid {old.pid} -> {new.pid}, serving at {new.address}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


@dataset_app.command("prepare")
def dataset_prepare(
    name: str = typer.Option("stdlib", help="dataset name"),
    version: str = typer.Option("v1", help="version label (immutable once prepared)"),
    source: str | None = typer.Option(
        None,
        help="a directory (recursively), one file, or s3://BUCKET/PREFIX; .jsonl/.ndjson (also .gz, .zst): "
        "a document per line, .parquet: a document per row, any other file: one document "
        "(default: this Python's standard library)",
    ),
    tokenizer: str = typer.Option(
        "bytes",
        help="'bytes' (vocab 256), 'bpe:N' (train a byte-level BPE of N tokens on the train split) "
        "or a HF tokenizers JSON file",
    ),
    val_fraction: float = typer.Option(
        0.02, min=0.0, max=0.5, help="share of documents held out (by a hash of each document's id)"
    ),
    include: str | None = typer.Option(
        None,
        "--include",
        "--glob",
        help="glob of the --source files that are read (default: every file, hidden files and "
        "directories skipped, binary plain files skipped; for the standard library: '**/*.py')",
    ),
    text_field: str = typer.Option("text", help="the JSONL field / Parquet column holding each document's text"),
    workers: int | None = typer.Option(
        None, min=1, help="tokenizing processes (default: min(cores, 8)); the version is the same for any number"
    ),
    s3_endpoint: str = typer.Option(
        "", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint URL for an s3:// source (AWS_ENDPOINT_URL)"
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="no progress bar (none either when stderr is not a terminal)"
    ),
) -> None:
    """Tokenize a corpus into an immutable, hashed dataset version, streaming it through
    worker processes. A version without held-out documents is written with a warning: jobs on
    it cannot evaluate. Bad input (an unreadable file, a JSONL line without the text field)
    is one line naming the file and line; nothing is written then.

    Example: surgectl dataset prepare --name web --version v1 --source s3://corpora/web/ --text-field content
    """
    from services.cli.prepare_progress import prepare_progress
    from services.common import paths
    from services.data.errors import DataError
    from services.data.prepare import default_stdlib_source, default_workers, prepare_dataset

    src = source or str(default_stdlib_source())
    remote = "://" in src
    if not remote and not Path(src).exists():
        raise CliError(f"--source {src}: no such file or directory")
    try:
        with prepare_progress(render.err_console, quiet) as progress:
            info = prepare_dataset(
                src,
                name,
                version,
                paths.datasets_root(),
                tokenizer=tokenizer,
                val_fraction=val_fraction,
                include_glob=include if include is not None or source is not None else "**/*.py",
                text_field=text_field,
                workers=workers or default_workers(),
                storage_options={"endpoint_url": s3_endpoint} if remote and s3_endpoint else None,
                progress=progress,
            )
    except DataError as e:
        raise CliError(" ".join(str(e).split())) from None
    except OSError as e:  # named by where it failed: the home written to, or the source read
        where = str(e.filename or "")
        if where and not remote and Path(where).is_relative_to(Path(src).absolute()):
            raise CliError(f"--source: cannot read {where}: {e.strerror or e}") from None
        home = paths.datasets_root()
        raise CliError(f"SURGE_HOME: cannot write datasets under {home}: {e.strerror or e}", code=2) from None
    render.console.print(f"prepared {info}")  # (the info names the dataset and version first)
    for warning in info.warnings:
        render.err_console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


@dataset_app.command("push")
def dataset_push(
    dataset: str = typer.Argument(..., help="'name@version' prepared here (see `surgectl dataset list`)"),
    url: str = typer.Argument(..., help="s3://BUCKET or s3://BUCKET/PREFIX: the version goes to URL/name/version/"),
    s3_endpoint: str = typer.Option(
        "", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint URL (AWS_ENDPOINT_URL)"
    ),
) -> None:
    """Upload a prepared version to S3-compatible storage (its manifest last: a cut-short upload
    is not a version). The same version already there is a no-op; another is refused.

    Example: surgectl dataset push web@v1 s3://corpora/surge
    """
    from services.cli import dataset_transfer
    from services.common import paths

    _say(dataset_transfer.push(paths.datasets_root(), dataset, url, s3_endpoint))


@dataset_app.command("pull")
def dataset_pull(
    dataset: str = typer.Argument(..., help="'name@version' to fetch"),
    url: str = typer.Argument(..., help="s3://BUCKET or s3://BUCKET/PREFIX it was pushed to"),
    s3_endpoint: str = typer.Option(
        "", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint URL (AWS_ENDPOINT_URL)"
    ),
) -> None:
    """Download a pushed version into this machine's datasets, every file's SHA-256 checked
    before it appears (nothing is left on a mismatch).

    Example: surgectl dataset pull web@v1 s3://corpora/surge
    """
    from services.cli import dataset_transfer
    from services.common import paths

    _say(dataset_transfer.pull(paths.datasets_root(), dataset, url, s3_endpoint))


@dataset_app.command("list")
def dataset_list(output: str = OutputOpt) -> None:
    """List dataset versions known to the data service.

    Example: surgectl dataset list -o json
    """
    resp = clients.call("data", lambda s: s.List(data_pb2.DatasetQuery(), timeout=30))
    _show(resp.datasets, output, render.datasets_table)


@delete_app.command("job")
def delete_job(job: str = typer.Argument(..., help="job id or name")) -> None:
    """Forget an ended job: control's records of it (status, event log, steps). A live job
    is refused; its checkpoints stay.

    Example: surgectl delete job demo-3f2a1c
    """
    from services.cli import housekeeping

    with stack.exit_on_interrupt(_again("delete job", job)):
        _say(housekeeping.delete_job(job))


@delete_app.command("checkpoint")
def delete_checkpoint(version: str = typer.Argument(..., help="'<job>:<n>' (see `surgectl checkpoints`)")) -> None:
    """Delete a checkpoint version. Refused while in use: a save or load of it in flight,
    or the newest ok version of a job that has not ended (a relaunch resumes from it).

    Example: surgectl delete checkpoint demo-3f2a1c:2
    """
    from services.cli import housekeeping

    _say(housekeeping.delete_checkpoint(version))


@delete_app.command("dataset")
def delete_dataset(dataset: str = typer.Argument(..., help="'name@version' (see `surgectl dataset list`)")) -> None:
    """Delete a prepared dataset version. Refused while a live job reads it.

    Example: surgectl delete dataset notes@v1
    """
    from services.cli import housekeeping

    _say(housekeeping.delete_dataset(dataset))


@app.command()
def submit(
    spec: Path = typer.Argument(..., help="job spec YAML"),
    follow: bool = typer.Option(False, "--follow", "-f", help="show live progress until the job ends"),
    overrides: list[str] | None = typer.Option(
        None,
        "--set",
        metavar="KEY=VALUE",
        help="override a field of the file: a dotted path and a YAML value (repeatable), "
        "validated like the file, e.g. --set optimizer.lr=1e-3 --set steps=2000",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="validate, resolve the dataset, estimate memory per rank and print the effective spec; submit nothing",
    ),
    priority: int = typer.Option(
        0,
        "--priority",
        min=-1000,
        max=1000,
        help="queue priority, higher first (-1000..1000): a job whose ranks do not fit now waits, FIFO within priority",
    ),
) -> None:
    """Validate a job spec, check its dataset, submit it.

    Example: surgectl submit examples/jobs/demo.yaml --set optimizer.lr=1e-3 --dry-run
    """
    if dry_run:
        if follow:
            raise CliError("--follow: nothing is submitted with --dry-run, so there is nothing to follow", code=2)
        print(dry_run_job(spec, overrides or ()), end="", flush=True)
        return
    with stack.exit_on_interrupt("interrupted: the job may have been submitted (`surgectl status` lists the jobs)"):
        status = submit_job(spec, overrides or (), priority)
    render.console.print(f"submitted {status.job_id} ({render.state_text(status)})")
    if status.state == render.STATE.STANDBY and status.queue_position and status.message:
        # What it waits for, e.g. "queued: needs 64 ranks (parallel.dp=64), more than the 2
        # registered: waits for workers to join" (it holds back none of the jobs behind it).
        render.console.print(status.message, markup=False, highlight=False, soft_wrap=True)
    if follow:
        try:
            h = follow_job(status.job_id)
        except KeyboardInterrupt:
            render.err_console.print(
                f"stopped following; {status.job_id} keeps running "
                f"(`surgectl events {status.job_id} --follow` to watch, `surgectl stop {status.job_id}` to stop)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(130) from None
        render.console.print(render.summary_table(h.last, h))
        _exit_for(h.last)


@app.command()
def status(
    job: str | None = typer.Argument(None),
    output: str = OutputOpt,
    watch: bool = typer.Option(False, "--watch", "-w", help="redraw every --interval seconds until Ctrl-C"),
    interval: float = typer.Option(2.0, "--interval", min=0.2, max=3600.0, help="--watch: seconds between redraws"),
) -> None:
    """Show one job or all jobs, then, in tables, the ranks named slow (>= 1.5x their peers'
    compute per step, sustained) and (all jobs) the workers taken out of placement after a
    device's fatal error, with the reason. --watch redraws them every --interval seconds
    (a table only) until Ctrl-C.

    Example: surgectl status demo-3f2a1c -o json; surgectl status --watch
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    if watch and output != "table":
        raise CliError("--watch: redraws a table; -o json prints once (run it again, or poll)", code=2)
    if job:
        job = resolve_job(job)
    if not watch:
        jobs, cordoned = _status_of(job)
        if output == "json":
            render.print_json(jobs)  # (json stays the list of jobs it always was)
            return
        render.console.print(_status_tables(jobs, cordoned))
        return
    from rich.live import Live

    try:
        if not render.console.is_terminal:  # piped: one view after another, each under its time
            while True:
                render.console.print(f"-- {time.strftime('%H:%M:%S')}", markup=False, highlight=False)
                render.console.print(_status_tables(*_status_of(job)))
                time.sleep(interval)
        with Live(_status_tables(*_status_of(job)), console=render.console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(_status_tables(*_status_of(job)), refresh=True)
    except KeyboardInterrupt:
        return  # (the operator's way out of a watch: exit 0)


def _status_of(job: str | None) -> tuple[list, list]:
    """(the jobs, the cordoned workers): one job's status (no cordons), or every job's."""
    if job:
        return [clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))], []
    listed = clients.call("control", lambda s: s.ListJobs(control_pb2.JobQuery(), timeout=10))
    return list(listed.jobs), list(listed.cordoned)


def _status_tables(jobs: list, cordoned: list):
    """The status view: the jobs, then the slow ranks and the cordoned workers when any."""
    from rich.console import Group

    parts = [render.jobs_table(jobs)]
    if any(j.slow_ranks for j in jobs):
        parts.append(render.slow_ranks_table(jobs))
    if cordoned:
        parts.append(render.cordons_table(cordoned))
    return Group(*parts)


def _alias_of_status(ctx: typer.Context) -> None:
    """A word other tools use for listing jobs: refused with the command that does it."""
    raise CliError(f"no such command '{ctx.info_name}': `surgectl status` lists the jobs", code=2)


for _word in ("jobs", "list", "ls", "ps"):  # kept out of --help: a hint, not a second way
    app.command(_word, hidden=True)(_alias_of_status)


@app.command("spec")
def job_spec(job: str, output: str = typer.Option("yaml", "--output", "-o", help="yaml | json")) -> None:
    """Print a submitted job's effective spec: every default filled, --set overrides and a
    resume's new layout applied, as control journaled it. It is a job file: `surgectl
    submit` of it runs the same job again.

    Example: surgectl spec demo-3f2a1c > again.yaml
    """
    from services.cli.spec_tools import show_spec

    if output not in ("yaml", "json"):
        raise CliError(f"--output: expected 'yaml' or 'json', got {output!r}", code=2)
    job = resolve_job(job)
    s = clients.call("control", lambda st: st.GetJob(control_pb2.JobQuery(job_id=job, with_spec=True), timeout=10))
    if not s.spec_json:
        raise CliError(f"control did not send the spec of {job} (a control older than this surgectl?)")
    print(show_spec(s.spec_json, output), end="", flush=True)


ReconnectOpt = typer.Option(
    60.0,
    "--reconnect-seconds",
    min=0.0,
    help="with --follow: how long to keep reconnecting when control is unreachable (a control restart)",
)


_TYPES_HELP = f"only events of this type (repeatable or comma-separated: {', '.join(EVENT_TYPES)})"


@app.command()
def events(
    job: str,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep streaming until the job ends"),
    output: str = OutputOpt,
    reconnect_seconds: float = ReconnectOpt,
    types: list[str] = typer.Option([], "--type", "-t", help=_TYPES_HELP),
    tail: int = typer.Option(0, "--tail", "-n", min=0, max=1_000_000, help="only the last N events (0: all)"),
) -> None:
    """Print a job's event log (decisions, state changes, faults, checkpoints); -o json
    prints JSON Lines. --type keeps the events of those types, --tail the last N of them
    (with --follow: the last N, then each new one). --follow rides through a control restart:
    it reconnects and goes on from the last event printed (each event once).

    Example: surgectl events demo-3f2a1c --type fault,decision --tail 20 --follow
    """
    from services.cli import follow as following

    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    wanted = event_types(types)
    job = resolve_job(job)

    def show(ev) -> None:
        if wanted and ev.type not in wanted:
            return
        if output == "json":
            print(jsonout.dumps_line(ev), flush=True)  # JSON Lines: one event per line
        else:
            src = Module.Name(ev.source) if ev.source else "-"
            render.console.print(f"{ev.seq:>5} {ev.type:>10} {src:<22} {ev.message}", markup=False, highlight=False)

    next_seq = 0
    if tail or not follow:  # the history (its last N of the types asked), then what follows
        with clients.stub("control") as s:
            history = list(s.WatchJob(control_pb2.JobQuery(job_id=job, follow=False)))
        kept = [ev for ev in history if not wanted or ev.type in wanted]
        for ev in kept[-tail:] if tail else kept:
            show(ev)
        next_seq = history[-1].seq + 1 if history else 0
    if follow:
        for ev in following.job_events(job, reconnect_seconds, from_seq=next_seq):
            show(ev)


@app.command()
def logs(
    job: str,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines until the job ends"),
    rank: int | None = typer.Option(None, min=0, help="only this rank"),
    output: str = typer.Option("table", "--output", "-o", help="table (readable) | json (the lines as written)"),
    reconnect_seconds: float = ReconnectOpt,
) -> None:
    """Print a job's rank logs, all ranks merged by time; --follow streams until the job ends
    (merged by time within each half second) and rides through a control restart (no line
    twice).

    Control streams the lines (StreamLogs) from the node agents that ran the job's ranks,
    so it works from any machine that reaches control; on the machine of a local stack the
    rank log files are read directly (every `surgectl up` session's lines, each once).

    Example: surgectl logs demo-3f2a1c --follow
    """
    from services.cli import observe

    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    try:
        job = resolve_job(job)
    except CliError:
        # The stack is down (or control does not know the job): the local rank log files
        # still hold every session's lines (`up` keeps them), found by the id or the name.
        local = None if follow else observe.local_job(job)
        if local is None:
            raise
        job = local

    def show(line) -> None:
        print(line.text if output == "json" else line.human(), flush=True)

    if follow:  # as they come, until the job's ranks have exited
        from services.cli import follow as following

        for line in following.job_logs(job, -1 if rank is None else rank, reconnect_seconds):
            show(line)
        return
    merged = observe.local_rank_logs(job, -1 if rank is None else rank)  # the local stack: every session's lines
    if merged is None:
        query = control_pb2.LogQuery(job_id=job, follow=False, rank=-1 if rank is None else rank)
        with clients.stub("control") as s:
            merged = observe.merge(observe.parse(m.rank, m.line) for m in s.StreamLogs(query))
    for line in merged:
        show(line)
    if not merged:
        if rank is not None:
            raise CliError(f"no log of rank {rank} of {job} (control found no such rank log on the job's workers)")
        raise CliError(f"no rank logs of {job} (control found none on the workers that ran its ranks)")


@app.command()
def plot(
    job: str,
    out: Path | None = typer.Option(None, "--out", help="PNG to write (default: $SURGE_HOME/<job>-loss.png)"),
    rank: int | None = typer.Option(None, min=0, help="whose loss (default: the lowest rank recorded)"),
    metrics: Path | None = typer.Option(None, help="a metrics JSONL file (default: the local store's <job>.jsonl)"),
) -> None:
    """Write a PNG of a job's loss (train and held-out) and tokens/s against step.

    Every step from the store's raw records ($SURGE_HOME/store/metrics/<job>.jsonl) when
    they are on this machine, else control's event history (steps sampled about once a second).

    Example: surgectl plot demo-3f2a1c --out demo.png
    """
    from services.cli import observe
    from services.common import paths

    if metrics is None and not observe.metrics_file(job).is_file():
        job = resolve_job(job)  # a name, or a job whose records are not on this machine
    source = metrics or observe.metrics_file(job)
    if metrics is not None and not metrics.is_file():
        raise CliError(f"--metrics {metrics}: no such file")
    if source.is_file():
        h = observe.history_from_jsonl(source, rank)
        where = str(source)
    else:
        if rank is not None:
            raise CliError(f"--rank needs the raw step records ({source} is not on this machine)")
        with clients.stub("control") as s:
            h = observe.history_from_events(s.WatchJob(control_pb2.JobQuery(job_id=job, follow=False), timeout=30))
        where = "control's event history (sampled steps)"
    if not h.steps:
        raise CliError(f"job {job} has no step records yet; plot it once it has trained a step")
    default_name = f"{observe.safe_name(job)}-loss.png"
    target = out or paths.surge_home() / default_name
    if out is not None and out.is_dir():
        target = out / default_name  # a directory: the default name in it
    elif out is not None and out.suffix.lower() not in PLOT_SUFFIXES:
        raise CliError(f"--out: {out}: the file name must end in {', '.join(PLOT_SUFFIXES)}", code=2)
    try:
        png = render.plot(h, target, f"{job}: loss and throughput")
    except OSError as e:
        field = "--out" if out is not None else "SURGE_HOME"
        raise CliError(f"{field}: cannot write {target}: {e.strerror or e}", code=2) from None
    render.console.print(
        f"wrote {png} ({len(h.steps)} steps from {where})", markup=False, highlight=False, soft_wrap=True
    )


PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what matplotlib writes by the name's suffix (no other backend here)
NoCheckpointOpt = typer.Option(False, "--no-checkpoint", help="do not checkpoint the boundary step first")


@app.command()
def pause(job: str, no_checkpoint: bool = NoCheckpointOpt) -> None:
    """Pause a running job at a step boundary (every rank stops at the same step), after
    checkpointing that step (unless --no-checkpoint).

    Example: surgectl pause demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.PauseJobRequest(job_id=job, no_checkpoint=no_checkpoint)
    with stack.exit_on_interrupt(_again("pause", job)):
        s = clients.call("control", lambda st: st.PauseJob(req, timeout=10))
    if s.state == control_pb2.PAUSED:  # (asked again: it was paused already)
        _say(f"{job}: PAUSED at step {s.step}; `surgectl resume {job}` continues it")
        return
    _say(f"{job}: pause requested; now {render.state_text(s)} (it pauses at its next step boundary)")


@app.command()
def resume(
    job: str,
    from_version: str | None = typer.Option(
        None,
        "--from",
        help="the checkpoint version to continue from "
        "('<job>:<n>', see `surgectl checkpoints JOB`; default: the newest that verifies)",
    ),
    dp: int | None = typer.Option(
        None,
        "--dp",
        min=1,
        max=2**32 - 1,
        help="relaunch at this data-parallel size (the global batch must stay the job's)",
    ),
    micro_batch_size: int | None = typer.Option(
        None,
        "--micro-batch-size",
        min=1,
        max=2**32 - 1,
        help="rows per rank per micro-step at the new layout (default: the job's)",
    ),
    grad_accum: int | None = typer.Option(
        None,
        "--grad-accum",
        min=1,
        max=2**32 - 1,
        help="micro-steps per optimizer step at the new layout (default: the job's)",
    ),
) -> None:
    """Resume a job: a paused one where it paused; a stopped or failed one (or one drained
    by `surgectl down`) from its newest checkpoint that verifies, or --from VERSION, on ranks
    allocated again, bit-exactly where that checkpoint left off.

    --dp N (with --micro-batch-size / --grad-accum) relaunches it at another data-parallel
    size: the global batch (micro_batch_size x grad_accum x dp rows) must stay the job's, and
    the ranks must fit the cluster; the job's spec becomes the new layout and it continues on
    the same global batches (model and optimizer resharded). A paused job with running ranks
    is stopped first (`surgectl stop JOB`).

    Example: surgectl resume demo-3f2a1c --from demo-3f2a1c:4 --dp 1 --grad-accum 2
    """
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(
        job_id=job,
        from_version=from_version or "",
        dp=dp or 0,
        micro_batch_size=micro_batch_size or 0,
        grad_accum=grad_accum or 0,
    )
    with stack.exit_on_interrupt(_again("resume", job)):
        s = clients.call("control", lambda st: st.ResumeJob(req, timeout=90))
    if s.state == control_pb2.STANDBY:  # its ranks do not fit now: it waits in the queue, as a submit does
        why = s.message.removeprefix("queued: ")  # (control's status line, shown as it is)
        _say(f"{job}: resume waits in the queue (#{s.queue_position}): {why}; `surgectl cancel {job}` takes it out")
        return
    where = f" from checkpoint {s.checkpoint_version} (step {s.step})" if s.state == control_pb2.WARMING_UP else ""
    if where and req.dp + req.micro_batch_size + req.grad_accum:
        where += (
            f" at dp {s.dp} x micro_batch_size {s.micro_batch_size} x grad_accum {s.grad_accum}"
            f" ({s.world_size} rank{'' if s.world_size == 1 else 's'})"
        )
    render.console.print(
        f"{job}: resumed{where}; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True
    )


@app.command()
def thaw(job: str) -> None:
    """End a job's hold for inspection now (fault_policy.freeze_seconds): the recovery its
    fault policy decided (a relaunch) runs at once instead of when the hold runs out. A job
    not held is refused, nothing changed. (`surgectl stop JOB` ends a held job instead.)

    Example: surgectl thaw demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(job_id=job, thaw_only=True)
    s = clients.call("control", lambda st: st.ResumeJob(req, timeout=90))
    render.console.print(f"{job}: thawed; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def rollback(
    job: str,
    version: str | None = typer.Option(
        None, "--version", help="the committed version to go back to, JOB:N (default: the newest not known bad)"
    ),
) -> None:
    """Roll a RUNNING job back to a committed checkpoint in place: its ranks pause at a step
    boundary they agree on (no checkpoint), load the version into their live processes (none
    is relaunched) and train on from its step, bit-exactly as a relaunch from it would. The
    versions committed after it are kept, as another branch (`surgectl resume --from` names one).

    Example: surgectl rollback demo-3f2a1c --version demo-3f2a1c:4
    """
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(job_id=job, from_version=version or "", rollback_in_place=True)
    s = clients.call("control", lambda st: st.ResumeJob(req, timeout=90))
    render.console.print(
        f"{job}: rolling back in place; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True
    )


@app.command()
def scale(
    job: str,
    dp: int = typer.Option(..., "--dp", min=1, max=2**32 - 1, help="the new data-parallel size"),
    micro_batch_size: int | None = typer.Option(
        None,
        "--micro-batch-size",
        min=1,
        max=2**32 - 1,
        help="rows per rank per micro-step at the new size (default: the largest not above the job's that fits)",
    ),
    grad_accum: int | None = typer.Option(
        None, "--grad-accum", min=1, max=2**32 - 1, help="micro-steps per optimizer step at the new size"
    ),
    wait_seconds: float = typer.Option(
        300.0, "--wait-seconds", min=0.0, max=86400.0, help="how long to wait for the resize to be done (0: do not)"
    ),
) -> None:
    """Grow or shrink a RUNNING job's data-parallel size without restarting the ranks that
    stay: the ranks pause at the next step boundary (no checkpoint), the ranks above the new
    size are released or the new ones launched, and every rank rebuilds its process group at
    the new size; new ranks take the model and optimizer from a live peer's memory. The
    global batch (micro_batch_size x grad_accum x dp rows) is kept, so the job goes on at
    the same global batches. Refused with one line where the plan cannot take it (tp or
    pp > 1, FSDP2, a global batch that does not split over the new size). Waits until it is
    done; exit 1 if it was not (the new ranks did not fit: the job goes on at its size).

    Example: surgectl scale demo-3f2a1c --dp 3
    """
    import time  # (typer's start-up stays lean: only this command needs it)

    job = resolve_job(job)
    req = control_pb2.ScaleJobRequest(
        job_id=job, dp=dp, micro_batch_size=micro_batch_size or 0, grad_accum=grad_accum or 0
    )
    asked = time.time()
    with stack.exit_on_interrupt(_again("scale", job)):
        s = clients.call("control", lambda st: st.ScaleJob(req, timeout=30))
    if s.dp == dp and micro_batch_size in (None, s.micro_batch_size) and grad_accum in (None, s.grad_accum):
        render.console.print(
            f"{job}: already at dp {s.dp} x micro_batch_size {s.micro_batch_size} x grad_accum {s.grad_accum}; "
            "nothing to do",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    render.console.print(
        f"{job}: scale to dp {dp} requested; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True
    )
    if wait_seconds <= 0:
        return
    with stack.exit_on_interrupt(
        f"interrupted: stopped waiting; the resize goes on in control (`surgectl events {job}`)"
    ):
        done = _scale_outcome(job, asked, wait_seconds)
    if done is None:
        raise CliError(f"{job}: the resize was not done within {wait_seconds:g} s (see `surgectl events {job}`)")
    render.console.print(f"{job}: {done.message}", markup=False, highlight=False, soft_wrap=True)
    if done.status.dp != dp:
        raise typer.Exit(1)


def _scale_outcome(job: str, asked: float, wait_seconds: float) -> control_pb2.JobEvent | None:
    """The job's first ``scale`` event (done, not done or given up) after ``asked``, or
    None when none came within ``wait_seconds`` or the job ended first."""

    import grpc

    def first(stub) -> control_pb2.JobEvent | None:
        try:
            for ev in stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=wait_seconds):
                if ev.unix_time >= asked and ev.type == "scale":
                    return ev
                if ev.unix_time >= asked and ev.status.state == control_pb2.TERMINATED:
                    return None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # (the wait ran out: said by the caller)
                raise
        return None

    return clients.call("control", first)


@app.command()
def stop(job: str, no_checkpoint: bool = NoCheckpointOpt) -> None:
    """Stop a job at the next step boundary, after checkpointing that step (unless
    --no-checkpoint); `surgectl resume` continues it from there. A queued job leaves the
    queue (as with `surgectl cancel`).

    Example: surgectl stop demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.StopJobRequest(job_id=job, no_checkpoint=no_checkpoint)
    with stack.exit_on_interrupt(_again("stop", job)):
        s, ended = _stop_job(req)
    if ended:  # (asked again: it had stopped, or ended, before)
        _say(f"{job}: already {render.state_text(s)}; nothing to stop")
        return
    # A running job stops at its next step boundary, after the checkpoint: say so, so that the
    # state read back ("now RUNNING") is not taken for a stop that failed.
    later = (
        "" if s.state == control_pb2.TERMINATED else f" (it stops at its next step boundary; `surgectl status {job}`)"
    )
    render.console.print(
        f"{job}: stop requested; now {render.state_text(s)}{later}", markup=False, highlight=False, soft_wrap=True
    )


@app.command()
def cancel(job: str) -> None:
    """Take a queued job out of control's job queue (it never ran: TERMINATED, STOPPED). A job
    that is not queued is refused and left as it is (`surgectl stop` stops it).

    Example: surgectl cancel demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.StopJobRequest(job_id=job, queued_only=True)
    with stack.exit_on_interrupt(_again("cancel", job)):
        s, ended = _stop_job(req)
    if ended:  # (asked again: it left the queue, or ended, before)
        _say(f"{job}: already {render.state_text(s)}; nothing to take out of the queue")
        return
    _say(f"{job}: taken out of the queue; now {render.state_text(s)}")


def _stop_job(req: control_pb2.StopJobRequest) -> tuple[control_pb2.JobStatus, bool]:
    """StopJob; (the job's status, whether it had ended already: control's typed refusal
    REFUSED_ALREADY_ENDED, a stop or cancel run again, answered with its status)."""
    import grpc

    from services.cli.errors import refusal_of

    addr = clients.address("control")
    with clients.open_channel(addr) as ch:
        st = clients.new_stub("control", ch)
        try:
            try:
                return st.StopJob(req, timeout=10), False
            except grpc.RpcError as e:
                if refusal_of(e) != control_pb2.REFUSED_ALREADY_ENDED:
                    raise
            return st.GetJob(control_pb2.JobQuery(job_id=req.job_id), timeout=10), True
        except grpc.RpcError as e:
            raise clients.rpc_error(e, "control", addr) from None


def _again(command: str, job: str, rest: str = "") -> str:
    """What Ctrl-C during an operator command says: it may have reached control; run again, it is safe."""
    return (
        f"interrupted: the {command} may have reached control (`surgectl status {job}` shows where the job "
        f"stands); `surgectl {command} {job}{rest}` again is safe"
    )


@app.command()
def revoke(
    job: str,
    fault_class: str = typer.Argument(
        ...,
        help="the step fault class whose standing order to withdraw: one of " + ", ".join(STEP_FAULT_CLASSES),
    ),
) -> None:
    """Withdraw a running job's standing order for a class of step faults (a verdict its ranks
    hold in advance, e.g. the default skip_step for gradient_overflow): from a step boundary
    every rank has yet to reach, each such fault is decided by the fault policy one at a
    time. Ranks relaunched later get the policy's orders again.

    Example: surgectl revoke demo-3f2a1c gradient_overflow
    """
    job = resolve_job(job)
    req = control_pb2.RevokeOrderRequest(job_id=job, fault_class=fault_class)
    with stack.exit_on_interrupt(_again("revoke", job, f" {fault_class}")):
        s = clients.call("control", lambda st: st.RevokeOrder(req, timeout=10))
    _say(f"{job}: standing order for {fault_class} withdrawn at its next step boundary; now {render.state_text(s)}")


@app.command()
def uncordon(worker: str = typer.Argument(..., help="the worker id, as `surgectl status` lists it")) -> None:
    """End a worker's cordon: a sick node's quarantine (its rank faults piled up across jobs),
    or a device's. New and relaunched ranks may be placed on it again. A worker with no
    cordon is refused in one line.

    Example: surgectl uncordon worker-2
    """
    req = control_pb2.UncordonWorkerRequest(worker_id=worker)
    left = clients.call("control", lambda st: st.UncordonWorker(req, timeout=10)).cordoned
    still = f"; still cordoned: {', '.join(c.worker_id for c in left)}" if left else ""
    _say(f"{worker}: uncordoned; ranks may be placed on it again{still}")


@app.command()
def checkpoints(
    job: str | None = typer.Argument(None),
    output: str = OutputOpt,
    verify: bool = typer.Option(
        False,
        "--verify",
        help="re-hash every byte of the versions now (the store's scrub) and print one line per version; "
        "exit 1 when one is not intact",
    ),
    timeout: float = typer.Option(3600.0, "--timeout", min=1.0, help="seconds the store may take to verify"),
) -> None:
    """List committed checkpoint versions (oldest first), or verify them (--verify).

    Sizes are in decimal units (KB, MB, GB: powers of 1000), as the job's events say them.

    Example: surgectl checkpoints demo-3f2a1c --verify
    """
    job = resolve_job(job) if job else None
    if verify:
        _verify_checkpoints(job or "", output, timeout)
        return
    resp = clients.call("store", lambda s: s.List(store_pb2.CheckpointQuery(job_id=job or ""), timeout=10))
    if job and not resp.checkpoints:  # an unknown job is an error, a job without versions is not
        clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))
    _show(resp.checkpoints, output, render.checkpoints_table)


def _verify_checkpoints(job: str, output: str, timeout: float) -> None:
    """The store's scrub of ``job``'s versions (every job's if empty): each version re-hashed
    against its manifest and its verdict recorded (a version newly found corrupt is published
    like a background scrub's finding). One line per version; exit 1 when one is not ok."""
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    resp = clients.call("store", lambda s: s.Scrub(store_pb2.ScrubCheckpoints(job_id=job), timeout=timeout))
    if output == "json":
        render.print_json(resp)
    else:
        for v in resp.versions:
            _say(render.verdict_line(v))
        bad = sum(1 for v in resp.versions if not v.ok)
        _say(
            f"{len(resp.versions)} versions verified in {resp.seconds:.1f} s: "
            + (f"{bad} not intact" if bad else "all intact")
        )
    if any(not v.ok for v in resp.versions):
        raise typer.Exit(1)


@app.command()
def audit(
    output: str = OutputOpt,
    unused: bool = typer.Option(True, "--unused/--no-unused", help="also list the table's routes nothing used yet"),
) -> None:
    """Show the live permission matrix: messages sent per route, violations, unused routes.

    Asks every service of the running stack (each worker answers for its ranks too).
    Example: surgectl audit -o json
    """
    from services.cli import audit as audit_view

    reports, notes = audit_view.collect(audit_view.targets())
    v = audit_view.view(reports, notes)
    if output == "json":
        render.console.print_json(json.dumps(v.as_dict()))
        return
    if output != "table":
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    render.console.print(render.audit_table(v, unused))
    for note in v.notes:
        render.console.print(f"[yellow]note:[/yellow] {note}")
    total = sum(r.count for r in v.violations)
    summary = f"{len(v.used)} routes used, {len(v.unused)} unused"
    render.console.print(
        f"{summary}, [bold red]{total} violations[/bold red]" if total else f"{summary}, no violations"
    )


@app.command()
def generate(
    checkpoint: str = typer.Option("latest", help="version '<job>:<n>', '<job>:latest' or 'latest'"),
    prompt: str = typer.Option("def ", help="text to continue"),
    max_new_tokens: int = typer.Option(200, min=1, max=4096),
    temperature: float = typer.Option(0.8, min=0.0),
    top_k: int = typer.Option(40, min=0),
    seed: int = typer.Option(0),
) -> None:
    """Sample text from a committed checkpoint, in this process: no running stack needed
    (the version and its dataset's tokenizer are read under SURGE_HOME, every file checked).

    Example: surgectl generate --checkpoint latest --prompt 'def '
    """
    from services.cli import evaluation

    text = evaluation.generate(checkpoint, prompt, max_new_tokens, temperature, top_k, seed)
    render.console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command("eval")
def eval_checkpoint(
    version: str = typer.Argument(..., help="checkpoint version: '<job>:<n>', '<job>:latest' or 'latest'"),
    dataset: str | None = typer.Option(None, help="name@version (default: the dataset the job trained on)"),
    batches: int | None = typer.Option(
        None, min=1, max=1_000_000, help="micro-batches (default: the job's eval.batches x its dp ranks)"
    ),
    split: str = typer.Option("val", help="val (held out) or train"),
    output: str = OutputOpt,
) -> None:
    """Loss of a committed checkpoint on a dataset's held-out split, in this process: no
    running stack needed (the version and the dataset are read under SURGE_HOME, verified).

    Example: surgectl eval demo-3f2a1c:2 --dataset stdlib@v1 --batches 16
    """
    from services.cli import evaluation

    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    result = evaluation.evaluate(version, dataset, batches, split)
    if output == "json":
        import dataclasses

        print(json.dumps(dataclasses.asdict(result)))
    else:
        render.console.print(str(result), markup=False, highlight=False, soft_wrap=True)


@app.command()
def export(
    version: str = typer.Argument(..., help="checkpoint version '<job>:<n>', '<job>:latest' or 'latest'"),
    fmt: str = typer.Option("hf", "--format", help="hf (safetensors + config.json) | torch (a state_dict)"),
    out: Path = typer.Option(..., "--out", help="directory to write (absent or empty)"),
    force: bool = typer.Option(False, "--force", help="replace a non-empty --out"),
) -> None:
    """Write a committed checkpoint's model for other tools (no running stack needed).

    Example: surgectl export demo-1:latest --format hf --out ./demo-hf
    """
    from services.cli.export import export_version

    render.console.print(export_version(version, fmt, out, force), markup=False, highlight=False, soft_wrap=True)


@app.command()
def demo(spec: Path = typer.Argument(Path("examples/jobs/demo.yaml"))) -> None:
    """The main job: prepare data, start the stack, train, summarise, plot, sample, stop.

    Example: surgectl demo examples/jobs/demo.yaml
    """
    from services.cli.demo import run_demo

    run_demo(spec)


def _show(items, output: str, table) -> None:
    if output == "json":
        render.print_json(items)
    elif output == "table":
        render.console.print(table(items))
    else:
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)


def _exit_for(s: control_pb2.JobStatus) -> None:
    if s is not None and s.outcome == control_pb2.FAILED:
        raise CliError(f"job {s.job_id} failed: {s.message}")


def main() -> None:
    try:
        # Not standalone: a usage error (a bad option value, an unknown command) is printed
        # as one line below instead of click's framed box.
        code = app(standalone_mode=False)
    except _click.NoArgsIsHelpError as e:
        e.show()  # the help text, as a bare `surgectl` or group asks for it
        sys.exit(e.exit_code)
    except _click.UsageError as e:
        render.print_error(" ".join(e.format_message().split()))
        sys.exit(e.exit_code)
    except typer.Abort:
        render.err_console.print("interrupted")
        sys.exit(130)
    except CliError as e:
        render.print_error(str(e))
        sys.exit(e.code)
    except KeyboardInterrupt:
        render.err_console.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
