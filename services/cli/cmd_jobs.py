"""surgectl submit, status, spec, events, logs and plot: a job and what it reports."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import typer

from services.cli import clients, jsonout, render, stack
from services.cli.app import OutputOpt, _exit_for, app
from services.cli.errors import CliError
from services.cli.event_types import EVENT_TYPES, event_types
from services.cli.jobs import dry_run_job, follow_job, resolve_job, submit_job
from services.cli.numbers import WEEK_S, float_option
from services.cli.path_options import nonempty_path
from services.common import save_failing
from services.contract import Module, control_pb2


@app.command()
def submit(
    spec: Path = typer.Argument(..., help="job spec YAML", parser=nonempty_path),
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
    # Submitted: a Ctrl-C from here on must not leave a script to submit it again (a ghost job).
    render.interrupt_line = (
        f"interrupted: {status.job_id} was submitted (do not submit it again); `surgectl status {status.job_id}` "
        f"shows it, `surgectl stop {status.job_id}` ends it"
    )
    with stack.exit_on_interrupt(render.interrupt_line):
        render.console.print(f"submitted {status.job_id} ({render.state_text(status)})")
        if status.state == render.STATE.STANDBY and status.queue_position and status.message:
            # What it waits for, e.g. "queued: needs 64 ranks (parallel.dp=64), more than the 2
            # registered: waits for workers to join" (it holds back none of the jobs behind it).
            render.console.print(status.message, markup=False, highlight=False, soft_wrap=True)
    if follow:
        try:
            h = follow_job(status.job_id)
        except KeyboardInterrupt:
            render.stopped_following(_goes_on(status.job_id))
            raise typer.Exit(130) from None
        render.console.print(render.summary_table(h.last, h))
        _exit_for(h.last)


def _goes_on(job_id: str) -> str:
    """What a followed job does once the follow is interrupted: queued, it stays in the queue
    (`cancel` takes it out); else it keeps running (was: "keeps running ... `stop`" of a job
    still queued, a fresh user's trial). Its state asked once, briefly; unknown: running."""
    watch = f"`surgectl events {job_id} --follow` to watch"
    try:
        now = clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=2))
    except (CliError, KeyboardInterrupt):
        now = None
    if now is not None and now.state == control_pb2.STANDBY and now.queue_position:
        return f"{job_id} stays queued (#{now.queue_position}; {watch}, `surgectl cancel {job_id}` to take it out)"
    return f"{job_id} keeps running ({watch}, `surgectl stop {job_id}` to stop)"


@app.command()
def status(
    job: str | None = typer.Argument(None),
    output: str = OutputOpt,
    watch: bool = typer.Option(False, "--watch", "-w", help="redraw every --interval seconds until Ctrl-C"),
    interval: float = float_option(2.0, "--interval", min=0.2, max=3600.0, help="--watch: seconds between redraws"),
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
    if job is not None:  # (`status ''`: refused like `pause ''`; was: every job listed)
        job = resolve_job(job)
    if not watch:
        with stack.exit_on_interrupt("interrupted: status only reads, nothing was changed; `surgectl status` again"):
            jobs, cordoned, journal, store = _status_of(job)
        if output == "json":
            render.print_json(jobs)  # (json stays the list of jobs it always was)
            return
        render.console.print(_status_tables(jobs, cordoned, journal, store))
        if job:
            _scores_lines(job, store_answers=not store)
        else:
            _dashboard_line()
        return
    from rich.live import Live

    first = _status_tables(*_status_of(job))  # (a stack not up, a job refused: one line, as without --watch)
    try:
        if not render.console.is_terminal:  # piped: one view after another, each under its time
            view = first
            while True:
                render.console.print(f"-- {time.strftime('%H:%M:%S')}", markup=False, highlight=False)
                render.console.print(view)
                time.sleep(interval)
                view = _watched_view(job, interval)
        with Live(first, console=render.console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(_watched_view(job, interval), refresh=True)
    except KeyboardInterrupt:
        return  # (the operator's way out of a watch: exit 0)


def _watched_view(job: str | None, interval: float):
    """A redraw of the watch: the status, or, while a service does not answer (control restarting,
    the stack going down), that service's one line in its place; the watch goes on and shows the
    status again once it answers, as `events --follow` rides a restart. A refusal (the job
    unknown now) still ends it."""
    from rich.text import Text

    try:
        return _status_tables(*_status_of(job))
    except CliError as e:
        if e.code == 2:
            raise
        return Text(f"{e} -- tried again every {interval:g} s (Ctrl-C to stop)")


def _scores_lines(job: str, store_answers: bool = True) -> None:
    """The job's evaluation scores (`surgectl evaluate`), each name's latest with its version,
    read through the store (its access rules hold: a refusal shows none; the local records
    only when the store is down). A store that does not answer (``store_answers`` False: its
    health check failed, the status's first line says so) is not asked: status answers in its
    usual time and says which figures it could not read, and why (was: 25 s against a
    SIGSTOPped store, then nothing said)."""
    from services.cli.job_records import STATUS_READ_SECONDS, records_of_status
    from services.cli.scores import latest_scores, scores_records

    try:
        records = records_of_status(job, "scores", store_answers)
    except CliError:  # (refused by the store: the status control gave is still shown)
        return
    if records.text is None and records.where != "the store":
        why = (
            f"no answer to its health check in {clients.STORE_PROBE_SECONDS:g} s (deadline)"
            if not store_answers
            else f"no answer in {STATUS_READ_SECONDS:g} s (deadline)"
        )
        render.console.print(
            f"evaluation scores: not read: the store gave {why}, and this machine has no records of {job} "
            f"({records.where})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    latest = latest_scores(scores_records(records.text or ""))
    if latest:
        local = "" if records.where == "the store" else f"; read from {records.where}: the store does not answer"
        render.console.print(
            f"evaluation scores (its evaluation jobs: `surgectl evaluate`, eval.hooks{local}):",
            markup=False,
            highlight=False,
        )
        for name, (value, version) in sorted(latest.items()):
            render.console.print(f"  {name}: {value:g}  ({version})", markup=False, highlight=False, soft_wrap=True)


def _dashboard_line() -> None:
    """Where the local stack's dashboard answers, when one runs (its URL with the token:
    `surgectl dashboard`)."""
    from services.cli import dashboard

    if proc := dashboard.running():
        render.console.print(
            f"dashboard: {proc.base_url} (pid {proc.pid}; `surgectl dashboard` prints its URL with the token)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _status_of(job: str | None) -> tuple[list, list, str, str]:
    """(the jobs, the cordoned workers, what control says of its journal failing, the store's
    and, with a job running, the data service's outage when they do not answer): one job's
    status (no cordons, no journal), or every job's."""
    if job:
        one = clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))
        jobs, cordoned, journal = [one], [], ""
    else:
        listed = clients.call("control", lambda s: s.ListJobs(control_pb2.JobQuery(), timeout=10))
        jobs, cordoned, journal = list(listed.jobs), list(listed.cordoned), listed.journal_failing
    outages = [clients.store_outage()]
    if any(j.state in (control_pb2.RUNNING, control_pb2.WARMING_UP, control_pb2.FAULT_FROZEN) for j in jobs):
        outages.append(clients.data_outage())  # (the jobs that read from it)
    return jobs, cordoned, journal, "\n".join(o for o in outages if o)


def _status_tables(jobs: list, cordoned: list, journal: str = "", store: str = ""):
    """The status view: control's journal when it fails, the jobs, then the slow ranks and
    the cordoned workers when any; ``store``: the lines of the services that do not answer
    (the store's, the data service's)."""
    from rich.console import Group
    from rich.text import Text

    parts = [render.jobs_table(jobs)]
    if journal:  # (first: every decision is refused while it lasts; the jobs run on)
        parts.insert(0, Text(f"{journal}; decisions are refused, the jobs run on", style="bold red"))
    for j in reversed(jobs):  # (was: nothing said while every save was refused, the disk full: F7)
        if j.save_failing.failed and j.state != control_pb2.JobState.TERMINATED:
            newest = f"{j.checkpoint_version} (step {j.checkpoint_step})" if j.checkpoint_version else ""
            line = save_failing.status_line(j.job_id, j.save_failing, newest, paused=j.state == control_pb2.PAUSED)
            parts.insert(0, Text(line, style="bold red"))
    if store:  # the store's, the data service's (was: nothing said until a job's message named it)
        parts.insert(0, Text(store, style="bold red"))
    if any(j.slow_ranks for j in jobs):
        parts.append(render.slow_ranks_table(jobs))
    if any(j.links for j in jobs):
        parts.append(render.links_table(jobs))
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


ReconnectOpt = float_option(
    60.0,
    "--reconnect-seconds",
    min=0.0,
    max=WEEK_S,
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
    tail: int | None = typer.Option(
        None,
        "--tail",
        "-n",
        min=0,
        max=1_000_000,
        help="only the last N events (0: none; with --follow, only new ones)",
    ),
    timestamps: bool = typer.Option(False, "--timestamps", "-T", help="begin each line with the event's time (UTC)"),
) -> None:
    """Print a job's event log (decisions, state changes, faults, checkpoints); -o json
    prints JSON Lines. --type keeps the events of those types, --tail the last N of them
    (with --follow: the last N, then each new one): control selects them, so a long job's
    whole history is not sent. --follow rides through a control restart: it reconnects and
    goes on from the last event printed (each event once).

    --timestamps (-T) begins each line with the event's time, as `kubectl logs --timestamps`.

    Example: surgectl events demo-3f2a1c --type fault,decision --tail 20 --follow
    """
    from services.cli import follow as following

    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    kinds = sorted(event_types(types))
    job = resolve_job(job)

    def show(ev) -> None:
        if output == "json":
            print(jsonout.dumps_line(ev), flush=True)  # JSON Lines: one event per line
        else:
            src = Module.Name(ev.source) if ev.source else "-"
            when = f"{_utc(ev.unix_time)} " if timestamps else ""
            render.console.print(
                f"{when}{ev.seq:>5} {ev.type:>10} {src:<22} {ev.message}", markup=False, highlight=False
            )

    next_seq = 0
    if tail is not None or not follow:  # the history (its last N of the types asked), then what follows
        # (--tail 0 prints none: the newest event of any type is asked only for where the log ends)
        query = control_pb2.JobQuery(job_id=job, follow=False, tail=tail or 0, types=kinds)
        if tail == 0:
            query = control_pb2.JobQuery(job_id=job, follow=False, tail=1)
        with clients.stub("control") as s:
            history = list(s.WatchJob(query))
        for ev in history if tail != 0 else ():
            show(ev)
        # (none of those types yet: from the start, control skipping the others)
        next_seq = history[-1].seq + 1 if history else 0
    if follow:
        with _following(job):
            for ev in following.job_events(job, reconnect_seconds, from_seq=next_seq, types=kinds):
                show(ev)


@contextlib.contextmanager
def _following(job: str) -> Iterator[None]:
    """A Ctrl-C of `events --follow` / `logs --follow` (their usual end): one line saying the job
    goes on, exit 130 as `submit --follow`'s (was: main's "may have been cut short after it asked
    the stack something", for a command that only reads)."""
    try:
        yield
    except KeyboardInterrupt:
        render.stopped_following(f"{job} is not affected (`surgectl status {job}`)")
        raise typer.Exit(130) from None


def _utc(unix_time: float) -> str:
    """An event's time as ISO 8601 UTC to the millisecond (``2026-12-06T14:10:20.123Z``)."""
    millis = int(unix_time * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_time)) + f".{millis:03d}Z"


@app.command()
def logs(
    job: str,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines until the job ends"),
    rank: int | None = typer.Option(None, min=0, max=2**31 - 1, help="only this rank"),
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
    except CliError as e:
        # The stack is down: the local rank log files still hold every session's lines (`up`
        # keeps them), found by the id or the name. Never when control answered (a job it does
        # not know, or another team's: its files are not read past its refusal).
        local = None if follow or not e.unreachable else observe.local_job(job)
        if local is None and e.unreachable and not follow:
            # (was control's unreachability alone, as if `logs` needed the stack; it reads
            # this machine's files without it, and they have no job of that id or name)
            raise CliError(
                f"no rank logs of {job!r} on this machine ({observe.logs_dir()}), and control, which knows "
                f"every job, cannot be asked: {e}",
                unreachable=True,
            ) from None
        if local is None:
            raise
        job = local

    def show(line) -> None:
        print(line.text if output == "json" else line.human(), flush=True)

    if follow and rank is not None:  # (a rank the job never had would be waited for forever)
        known, world_size = _ranks_known(job)
        if world_size and rank >= world_size:
            raise CliError(f"--rank {rank}: no such rank of {job}: {known.rstrip('; ')}", code=2)
    if follow:  # as they come, until the job's ranks have exited
        from services.cli import follow as following

        with _following(job):
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
            known, world_size = _ranks_known(job)
            raise CliError(
                f"no log of rank {rank} of {job} ({known}control found no such rank log on the job's workers)",
                code=2 if world_size and rank >= world_size else 1,  # (no such rank: the operator's input)
            )
        raise CliError(f"no rank logs of {job} (control found none on the workers that ran its ranks)")


def _ranks_known(job: str) -> tuple[str, int]:
    """What a rank not found in the logs is measured against: ("its world size is N (ranks
    0-M); ", N) (a resized job's earlier ranks may have logs beyond it), or ("", 0) when
    control cannot say."""
    try:
        st = clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))
    except CliError:
        return "", 0
    ws = st.world_size
    return (
        f"its world size is {ws} (ranks 0-{ws - 1}); " if ws > 1 else ("its world size is 1 (rank 0); " if ws else ""),
        ws,
    )


@app.command()
def plot(
    job: str,
    out: Path | None = typer.Option(
        None, "--out", help="PNG to write (default: $SURGE_HOME/<job>-loss.png)", parser=nonempty_path
    ),
    rank: int | None = typer.Option(None, min=0, max=2**31 - 1, help="whose loss (default: the lowest rank recorded)"),
    metrics: Path | None = typer.Option(
        None, help="a metrics JSONL file (default: the job's records, read through the store)", parser=nonempty_path
    ),
) -> None:
    """Write a PNG of a job's loss (train and held-out) and tokens/s against step.

    The store's raw records of that rank, read through the store (a team's token reads its
    own jobs' only; the local store's <job>.jsonl when the stack is down): every step up to
    2,000, past that 2,000 points a curve (the store keeps each bucket's first, last, lowest and
    highest, so spikes show; --metrics FILE: every record of the file); else control's event
    history (steps sampled about once a second).

    Example: surgectl plot demo-3f2a1c --out demo.png
    """
    from services.cli import observe
    from services.cli.job_records import chart_records
    from services.common import paths

    if out is not None and not out.is_dir():
        render.check_plot_out(out)  # before the records are read
    if metrics is not None:
        if not metrics.is_file():
            raise CliError(f"--metrics {metrics}: no such file")
        h = observe.history_from_jsonl(metrics, rank)
        where = str(metrics)
    else:
        records = chart_records(job, rank)
        job = records.job
        if records.why:  # (a stopped store was not asked: said before what is drawn instead)
            render.console.print(
                f"the store did not answer its health check in {clients.STORE_PROBE_SECONDS:g} s ({records.why}); "
                + (f"read {records.where} instead" if records.text else f"no records of {job} in {records.where}"),
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        if records.text:
            h = observe.history_from_text(records.text, records.where, rank)
            where = records.where
        else:
            if rank is not None:
                raise CliError(f"--rank needs the raw step records (neither the store nor {records.where} has them)")
            with clients.stub("control") as s:
                h = observe.history_from_events(s.WatchJob(control_pb2.JobQuery(job_id=job, follow=False), timeout=30))
            where = "control's event history (sampled steps)"
    if not h.steps:
        raise CliError(f"job {job} has no step records yet; plot it once it has trained a step")
    default_name = f"{observe.safe_name(job)}-loss.png"
    target = out or paths.surge_home() / default_name
    if out is not None and out.is_dir():
        target = out / default_name  # a directory: the default name in it
    try:
        if out is None:
            target.parent.mkdir(parents=True, exist_ok=True)  # (SURGE_HOME, Surge's own folder)
        png = render.plot(h, target, f"{job}: loss and throughput")
    except OSError as e:
        field = "--out" if out is not None else "SURGE_HOME"
        raise CliError(f"{field}: cannot write {target}: {e.strerror or e}", code=2) from None
    first, last = h.steps[0], h.steps[-1]
    # A long job's chart is its points, not every step (each bucket's first, last, lowest and
    # highest kept): "1212 steps" of a 3,000-step job read as lost records.
    drawn = f"{len(h.steps)} steps" if len(h.steps) >= last - first + 1 else f"{len(h.steps)} of steps {first}-{last}"
    render.console.print(f"wrote {png} ({drawn} from {where})", markup=False, highlight=False, soft_wrap=True)


@app.command()
def samples(
    job: str,
    last: int = typer.Option(0, "--last", min=0, help="only the last N boundaries' samples (0: all)"),
    metrics: Path | None = typer.Option(
        None, help="a metrics JSONL file (default: the job's records, read through the store)", parser=nonempty_path
    ),
    output: str = OutputOpt,
) -> None:
    """Show a job's periodic samples (eval.sample_every_steps): each prompt's continuation
    by rank 0 at those steps, from the store's records, read through the store (a team's token
    reads its own jobs' only; the local store's <job>.jsonl when the stack is down).

    Example: surgectl samples demo-3f2a1c --last 2
    """
    import json

    from services.cli.job_records import job_records
    from services.cli.samples import read_samples, sample_records

    if output not in ("table", "json"):
        raise CliError(f"--output {output}: must be table or json", code=2)
    if metrics is not None:
        found = read_samples(metrics)
        if found is None:
            raise CliError(f"--metrics {metrics}: no such file")
    else:
        records = job_records(job, "sample")
        job = records.job
        if records.text is None:
            raise CliError(f"{records.where}: no such file (the store is unreachable; its records are on its machine)")
        found = sample_records(records.text)
    if last:
        keep = sorted({s.step for s in found})[-last:]
        found = [s for s in found if s.step in keep]
    if output == "json":
        typer.echo(json.dumps([s.__dict__ for s in found]))
        return
    if not found:
        typer.echo(f"job {job}: no samples yet (the spec's eval.sample_every_steps: 0 is none)")
        return
    for s in found:
        typer.echo(f"step {s.step} prompt {s.prompt_index} ({s.tokens} tokens, {s.seconds:.2f} s): {s.prompt!r}")
        typer.echo(f"  {s.shown!r}")
