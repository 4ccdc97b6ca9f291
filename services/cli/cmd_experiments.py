"""surgectl compare and sweep: runs side by side, and families of runs."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import grpc
import typer
from rich.table import Table

from services.cli import clients, compare, observe, render, sweep
from services.cli.app import OutputOpt, _say, app
from services.cli.errors import CliError
from services.cli.jobs import checked_submission, resolve_job, send_submit
from services.cli.numbers import float_option
from services.cli.path_options import nonempty_path
from services.contract import control_pb2
from services.jobspec import JobSpecError, read_spec_mapping

RECONNECT_SECONDS = 120.0  # a sweep's wait outlasts a control restart (its journal restore)
TAG_VALUE_CHARS = 256  # a tag value's limit at control (orchestrator/annotations.py)


@app.command("compare")
def compare_jobs(
    jobs: list[str] = typer.Argument(..., help="two or more job ids or names"),
    out: Path | None = typer.Option(
        None, "--out", help="also write the curves overlaid (.png, .svg or .pdf)", parser=nonempty_path
    ),
    output: str = OutputOpt,
) -> None:
    """Compare jobs: the spec keys they set differently, their final and best losses and
    tokens/s, and (with --out) their curves overlaid in one plot.

    Example: surgectl compare demo-3f2a1c demo-9b1e07 --out compare.png
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    if len(jobs) < 2:
        raise CliError("JOBS: compare needs at least two jobs", code=2)
    if out is not None:
        render.check_plot_out(out)  # before the tables: a bad --out is found before any of them prints
    with clients.stub("control") as s:
        ids = [resolve_job(ref, s) for ref in jobs]
        if twice := sorted({j for j in ids if ids.count(j) > 1}):
            raise CliError(f"JOBS: {', '.join(twice)} named more than once", code=2)
        runs = [
            compare.Run(
                status=(st := s.GetJob(control_pb2.JobQuery(job_id=j, with_spec=True), timeout=10)),
                spec=compare.spec_mapping(st.spec_json),
                history=_history(s, j),
            )
            for j in ids
        ]
    scores = _scores_of(ids)
    if output == "json":
        print(json.dumps({**compare.as_json(runs), "scores": scores}, indent=2))
    else:
        render.console.print(_metrics_table(runs))
        diffs = compare.spec_differences(runs)
        render.console.print(
            _diff_table(runs, diffs) if diffs else "the specs set the same values (apart from their names)"
        )
        names = sorted({n for job_scores in scores.values() for n in job_scores})
        if names:
            table = Table("evaluation score", *(r.label for r in runs))
            for n in names:
                table.add_row(n, *(f"{scores[j][n]:g}" if n in scores[j] else "-" for j in ids))
            render.console.print(table)
    if out is not None:
        try:
            compare.overlay_plot(runs, out, " vs ".join(r.label for r in runs))
        except OSError as e:
            raise CliError(f"--out: cannot write {out}: {e.strerror or e}", code=2) from None
        if output == "json":  # (stdout is the JSON document alone)
            render.err_console.print(f"wrote {out}", markup=False, highlight=False, soft_wrap=True)
        else:
            _say(f"wrote {out}")


def _scores_of(ids: list[str]) -> dict[str, dict[str, float]]:
    """Each job's latest evaluation scores (`surgectl evaluate`) read through the store ({} for
    a job with none; the local records only when the store is down).

    Raises:
        CliError: the store refused one (another team's job), in one line."""
    from services.cli.job_records import job_scores
    from services.cli.scores import latest_scores

    out = {}
    for j in ids:
        latest = latest_scores(job_scores(j) or [])
        out[j] = {name: value for name, (value, _) in latest.items()}
    return out


@app.command("tag")
def tag_job(
    job: str = typer.Argument(..., help="job id or name"),
    tags: list[str] = typer.Argument(None, help="KEY=VALUE tags to set"),
    remove: list[str] = typer.Option([], "--remove", help="a tag KEY to remove (repeatable)"),
) -> None:
    """Set or remove a job's tags (in any state; kept across a control restart; shown by
    `status -o json` and `compare`).

    Example: surgectl tag demo-3f2a1c arm=baseline lr=3e-3
    """
    pairs = {}
    for item in tags or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"TAGS: {item!r}: expected KEY=VALUE", code=2)
        if not value.strip():  # (control refuses it too: annotations.py)
            raise CliError(f"TAGS: {item!r}: an empty value (`--remove {key}` removes a tag)", code=2)
        pairs[key] = value
    if not pairs and not remove:
        raise CliError("TAGS: give KEY=VALUE tags to set or --remove KEY", code=2)
    if both := sorted(set(pairs) & set(remove)):
        raise CliError(f"TAGS: {', '.join(both)} both set and removed", code=2)
    _annotate(control_pb2.AnnotateJobRequest(job_id=resolve_job(job), set_tags=pairs, remove_tags=remove))


@app.command("note")
def note_job(
    job: str = typer.Argument(..., help="job id or name"),
    text: str = typer.Argument(..., help="one line; recorded as an event of type 'note'"),
) -> None:
    """Add a note to a job's event log (in any state; `surgectl events JOB --type note`).

    Example: surgectl note demo-3f2a1c "loss spike at 400: bad shard?"
    """
    if not text.strip():
        raise CliError("TEXT: the note is empty", code=2)
    _annotate(control_pb2.AnnotateJobRequest(job_id=resolve_job(job), note=text))


def _annotate(req: control_pb2.AnnotateJobRequest) -> None:
    st = clients.call("control", lambda s: s.AnnotateJob(req, timeout=10))
    said = ", ".join(f"{k}={v}" for k, v in sorted(st.tags.items())) or "none"
    _say(f"{st.job_id}: tags {said}" + ("; note added" if req.note.strip() else ""))


def _history(stub, job_id: str) -> render.History:
    """Rank 0's steps from the store's records (read through the store, its access rules
    holding; the local file only when the store is down), at most 2,000 points a curve
    (job_records.chart_records: the final and best losses are kept exactly), else control's
    (sampled) event history; an empty history for a job that has not stepped yet."""
    from services.cli.job_records import chart_records

    records = chart_records(job_id, resolved=True)
    if records.text:
        try:
            return observe.history_from_text(records.text, records.where)
        except CliError:  # (no step records yet: nothing to compare but the spec)
            return render.History()
    return observe.history_from_events(stub.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=False), timeout=30))


def _num(x: float, fmt: str = "{:.4f}") -> str:
    return "-" if math.isnan(x) else fmt.format(x)


def _metrics_table(runs: list[compare.Run]) -> Table:
    t = Table(title="jobs")
    for col in (
        "job",
        "tags",
        "state",
        "steps",
        "final train",
        "best train (step)",
        "final held-out",
        "best held-out (step)",
        "tokens/s",
    ):
        t.add_column(col, overflow="fold")
    for r in runs:
        m = compare.summarize(r.history, r.status.tokens_per_second)
        t.add_row(
            r.status.job_id,
            " ".join(f"{k}={v}" for k, v in sorted(r.status.tags.items())),
            render.state_text(r.status),
            str(m.steps),
            _num(m.final_train),
            f"{_num(m.best_train)} ({m.best_train_step})" if not math.isnan(m.best_train) else "-",
            _num(m.final_eval),
            f"{_num(m.best_eval)} ({m.best_eval_step})" if not math.isnan(m.best_eval) else "-",
            _num(m.tokens_per_second, "{:,.0f}"),
        )
    return t


def _diff_table(runs: list[compare.Run], diffs: list[tuple[str, list[str]]]) -> Table:
    t = Table(title="spec differences")
    t.add_column("key", overflow="fold")
    for r in runs:
        t.add_column(r.status.job_id, overflow="fold")
    for key, values in diffs:
        t.add_row(key, *values)
    return t


@app.command("sweep")
def sweep_jobs(
    spec: Path = typer.Argument(..., help="the base job spec", parser=nonempty_path),
    grid: list[str] = typer.Option([], "--grid", help="KEY=V1,V2,...: one trial per value (repeatable: the product)"),
    draw: list[str] = typer.Option([], "--random", help="KEY=LOW:HIGH[:log]: drawn per trial (repeatable)"),
    count: int = typer.Option(4, "--trials", min=1, max=1000, help="with --random: draws per grid combination"),
    seed: int = typer.Option(0, "--seed", help="with --random: the draws' seed"),
    overrides: list[str] = typer.Option([], "--set", help="KEY=VALUE applied to every trial"),
    metric: str = typer.Option(
        "eval_loss", "--metric", help=f"what ranks the trials (lower is better): {' | '.join(sweep.METRICS)}"
    ),
    wait: bool = typer.Option(
        True, "--wait/--no-wait", help="wait for every trial and rank them (else submit and return)"
    ),
    early_stop: bool = typer.Option(False, "--early-stop", help="stop the worst trials at rungs (ASHA; needs --wait)"),
    min_steps: int = typer.Option(10, "--min-steps", min=1, help="with --early-stop: the first rung's step"),
    eta: int = typer.Option(3, "--eta", min=2, help="with --early-stop: keep the best 1/eta at each rung"),
    poll: float = float_option(2.0, "--poll-seconds", min=0.1, max=60.0, help="how often to read the trials' status"),
) -> None:
    """Submit a family of jobs from one spec through the queue, one per setting of the swept
    keys, and rank them by a metric; with --early-stop the worst are stopped at rungs.

    Example: surgectl sweep examples/jobs/demo.yaml --grid optimizer.lr=1e-3,3e-3 --random optimizer.weight_decay=0.01:0.1:log --trials 2
    """
    from services.cli import spec_tools

    if metric not in sweep.METRICS:
        raise CliError(f"--metric: expected one of {', '.join(sweep.METRICS)}, got {metric!r}", code=2)
    if early_stop and not wait:
        raise CliError("--early-stop: needs --wait (the sweep stops trials while it waits)", code=2)
    axes = [*map(sweep.parse_grid, grid), *map(sweep.parse_random, draw)]
    set_keys = {item.partition("=")[0].strip() for item in overrides}
    if both := sorted(set_keys & {a.key for a in axes}):
        raise CliError(f"sweep: {', '.join(both)} both --set and swept (one value or many, not both)", code=2)
    if "name" in {a.key for a in axes}:
        raise CliError("sweep: name is not swept (the sweep names its trials <name>-<sweep>-<i>)", code=2)
    settings = sweep.trials(axes, count, seed)
    base, text, _ = spec_tools.load_spec(spec, overrides)  # the base spec as given: bad -> one line, nothing submitted
    for axis in axes:  # a swept key the spec does not have: named with the option that swept it
        option = f"--grid {axis.key}" if axis.is_grid else f"--random {axis.key}"
        for value in axis.values or (str(axis.low),):
            try:
                spec_tools.apply_override(read_spec_mapping(text, str(spec)), f"{axis.key}={value}", option)
            except JobSpecError as e:
                raise CliError(str(e), code=2) from None
    if metric == "eval_loss" and not (base.eval.every_steps or base.eval.at_end):
        raise CliError(
            f"--metric eval_loss: {spec} never evaluates (eval.every_steps 0, eval.at_end false); "
            "use --metric train_loss or set eval.every_steps",
            code=2,
        )
    sweep_id = uuid.uuid4().hex[:6]
    names = [f"{base.name}-{sweep_id}-{i}" for i in range(len(settings))]
    # Every trial passes a submit's checks (its datasets mounted and verified, its init_from
    # found) before the first is sent: a bad trial leaves no trial behind.
    checked = [checked_submission(spec, _trial_overrides(overrides, t, name)) for name, t in zip(names, settings)]
    ladder = sweep.rungs(min_steps, eta, base.steps) if early_stop else []
    record = {"sweep": sweep_id, "spec": str(spec), "set": overrides, "metric": metric, "trials": []}
    try:
        for name, t, (text, source) in zip(names, settings, checked):
            st = send_submit(text, source)
            record["trials"].append({"job_id": st.job_id, "name": name, "settings": t})
            _write_record(record)  # (kept as it grows: an interruption leaves the record of what was sent)
            tags = {"sweep": sweep_id, **{k: v[:TAG_VALUE_CHARS] for k, v in t.items()}}
            clients.call(
                "control",
                lambda s, j=st.job_id, tags=tags: s.AnnotateJob(
                    control_pb2.AnnotateJobRequest(job_id=j, set_tags=tags), timeout=10
                ),
            )
            _say(f"submitted {st.job_id}: {', '.join(f'{k}={v}' for k, v in t.items())}")
    except KeyboardInterrupt:
        sent = len(record["trials"])
        raise CliError(
            f"interrupted after submitting {sent} of {len(settings)} trials: those keep running as jobs "
            f"(record: {_write_record(record)}); a sweep run again submits all of its trials anew",
            code=130,
        ) from None
    where = _write_record(record)
    _say(f"sweep {sweep_id}: {len(settings)} trial{'s' * (len(settings) != 1)} (record: {where})")
    if not wait:
        return
    try:
        results, stopped, failed = _wait(record, metric, sweep.Halving(ladder, eta), poll)
    except KeyboardInterrupt:
        ids = " ".join(t["job_id"] for t in record["trials"])
        raise CliError(
            f"interrupted: the trials keep running as jobs (`surgectl compare {ids}` ranks them later; "
            f"`surgectl stop JOB` ends one)",
            code=130,
        ) from None
    render.console.print(_ranking_table(record, results, stopped, failed, metric))
    _say(f"compare them: surgectl compare {' '.join(sweep.ranked(results)[:3])}")


def _trial_overrides(overrides: list[str], settings: dict[str, str], name: str) -> list[str]:
    return [*overrides, *(f"{k}={v}" for k, v in settings.items()), f"name={name}"]


def _write_record(record: dict) -> Path:
    from services.common import paths

    where = paths.surge_home() / "sweeps" / f"{record['sweep']}.json"
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(record, indent=2))
    return where


def _wait(
    record: dict, metric: str, halving: sweep.Halving, poll: float
) -> tuple[dict[str, float], set[str], set[str]]:
    """Read the trials' status every ``poll`` seconds until all have ended; at each rung a
    trial reached, stop it when ASHA says so. Returns each job's final metric, the jobs
    stopped early and the jobs that failed."""
    jobs = [t["job_id"] for t in record["trials"]]
    results: dict[str, float] = {}
    stopped: set[str] = set()
    failed: set[str] = set()
    unreachable_since: float | None = None
    with clients.stub("control") as s:
        while len(results) < len(jobs):
            try:
                statuses = {j: s.GetJob(control_pb2.JobQuery(job_id=j), timeout=10) for j in jobs if j not in results}
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    _say(
                        f"control unreachable; trying again for up to {RECONNECT_SECONDS:.0f} s (the trials keep running)"
                    )
                elif now - unreachable_since > RECONNECT_SECONDS:
                    ids = " ".join(jobs)
                    raise CliError(
                        f"control unreachable for {RECONNECT_SECONDS:.0f} s: the sweep stops waiting; its trials keep "
                        f"running as jobs (`surgectl compare {ids}` ranks them once control is back)"
                    ) from None
                time.sleep(poll)
                continue
            unreachable_since = None
            for j, st in statuses.items():
                value = _metric(st, metric)
                if st.state == control_pb2.TERMINATED:
                    results[j] = value
                    if st.outcome == control_pb2.FAILED:
                        failed.add(j)
                elif (
                    halving.rungs
                    and j not in stopped
                    and not math.isnan(value)  # (no evaluation yet: judged at the rung once it has one)
                    and not halving.reached(j, st.step, value)
                ):
                    if not _stop(s, j):
                        continue
                    stopped.add(j)
                    _say(
                        f"stopping {j} at step {st.step}: {metric} {_num(value)} not in the best 1/{halving.eta} at its rung"
                    )
            for j in sorted(halving.outranked(set(statuses) - set(results) - stopped)):
                # (judged again as later trials reach its rung: ASHA keeps the first ones to arrive)
                if _stop(s, j):
                    stopped.add(j)
                    _say(f"stopping {j}: no longer in the best 1/{halving.eta} of the trials at its rung")
            if len(results) < len(jobs):
                time.sleep(poll)
    return results, stopped, failed


def _stop(stub, job_id: str) -> bool:
    try:
        stub.StopJob(control_pb2.StopJobRequest(job_id=job_id), timeout=30)
    except grpc.RpcError as e:  # (it ended meanwhile: its end is read next round)
        _say(f"could not stop {job_id}: {e.details()}")
        return False
    return True


def _metric(st: control_pb2.JobStatus, metric: str) -> float:
    value = st.eval_loss if metric == "eval_loss" else st.train_loss
    return value if value and math.isfinite(value) else math.nan


def _ranking_table(record: dict, results: dict[str, float], stopped: set[str], failed: set[str], metric: str) -> Table:
    t = Table(title=f"sweep {record['sweep']} by {metric} (lower is better)")
    for col in ("#", "job", metric, "settings", "note"):
        t.add_column(col, overflow="fold")
    settings = {tr["job_id"]: tr["settings"] for tr in record["trials"]}
    for i, j in enumerate(sweep.ranked(results), 1):
        note = "failed" if j in failed else "stopped early" if j in stopped else ""
        t.add_row(str(i), j, _num(results[j]), ", ".join(f"{k}={v}" for k, v in settings[j].items()), note)
    return t
