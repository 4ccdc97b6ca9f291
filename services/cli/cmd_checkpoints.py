"""surgectl checkpoints, audit, generate, eval, export and demo: what a job saved, and using it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from services.cli import clients, render
from services.cli.app import OutputOpt, _say, _show, app
from services.cli.errors import CliError
from services.cli.jobs import resolve_versions_job
from services.cli.numbers import float_option
from services.cli.path_options import nonempty_path
from services.contract import control_pb2, store_pb2


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
    timeout: float = float_option(3600.0, "--timeout", min=1.0, help="seconds the store may take to verify"),
) -> None:
    """List committed checkpoint versions (oldest first), or verify them (--verify).

    JOB is a job id or a job's name; a name is said first with the job id it resolved to.

    Sizes are in decimal units (KB, MB, GB: powers of 1000), as the job's events say them.

    Example: surgectl checkpoints demo-3f2a1c --verify
    """
    clients.store_answers("checkpoints")  # (a stopped store: said in 2 s, never a hang)
    named = job
    job = resolve_versions_job(job) if job else None  # (a deleted job's versions stay: its id works)
    if job and job != named and output == "table":  # (a name: which run it means, said once; -o json has job_id)
        _say(f"{named}: job {job}")
    if verify:
        _verify_checkpoints(job or "", output, timeout)
        return
    resp = clients.call("store", lambda s: s.List(store_pb2.CheckpointQuery(job_id=job or ""), timeout=10))
    if job and not resp.checkpoints:  # an unknown job is an error, a job without versions is not
        clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))
    listed = list(resp.checkpoints)
    if not job:
        listed = _of_my_team(listed)
    _show(listed, output, render.checkpoints_table)


def _of_my_team(versions: list) -> list:
    """Of every job's versions, those of the jobs control lists for this caller: a team's token
    sees its team's jobs only (``JobList.team_view``), so it lists their versions only. An
    admin's token, or no tokens file: every version. (The store itself takes the one cluster
    token and does not know teams: a gap, not a guard.)"""
    seen = clients.team_view()
    if seen is None or not seen[0]:  # (control down, the store up: the operator on the stack's host)
        return versions
    mine = {j.job_id for j in seen[1]}
    return [v for v in versions if v.job_id in mine]


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
    prompt: list[str] = typer.Option(
        ["def "], help="text to continue; repeat it for several (those of one length in tokens decode as one batch)"
    ),
    max_new_tokens: int = typer.Option(200, min=1, max=4096),
    temperature: float = float_option(0.8, min=0.0),
    top_k: int = typer.Option(40, min=0),
    seed: int = typer.Option(0, min=0, max=2**64 - 1, help="the sampler's seed (torch's generator: 0 to 2**64-1)"),
) -> None:
    """Sample text from a committed checkpoint, in this process: no running stack needed
    (the version and its dataset's tokenizer are read under SURGE_HOME, every file checked).
    Several --prompt: each continuation in their order, after a `--- prompt N of M` line.

    Example: surgectl generate --checkpoint latest --prompt 'def ' --prompt 'class '
    """
    from services.cli import evaluation

    if empty := [i for i, p in enumerate(prompt, 1) if not p]:  # (nothing to continue: a byte model wrote a NUL)
        raise CliError(f"--prompt: empty (prompt {empty[0]} of {len(prompt)}): give text to continue", code=2)
    texts = evaluation.generate_many(checkpoint, list(prompt), max_new_tokens, temperature, top_k, seed)
    for i, text in enumerate(texts, 1):
        if len(texts) > 1:
            render.console.print(f"--- prompt {i} of {len(texts)}", markup=False, highlight=False)
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
    if dataset is not None and not dataset.strip():  # (an unset variable: never the job's own by accident)
        raise CliError("--dataset: empty (NAME@VERSION; leave --dataset out for the job's own)", code=2)
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
    out: Path = typer.Option(
        ...,
        "--out",
        help="directory to write (absent or empty; missing parent folders are created)",
        parser=nonempty_path,
    ),
    force: bool = typer.Option(
        False, "--force", help="replace an earlier export in --out (one holding surge_spec.json)"
    ),
) -> None:
    """Write a committed checkpoint's model for other tools (no running stack needed).

    Example: surgectl export demo-1:latest --format hf --out ./demo-hf
    """
    from services.cli.export import export_version

    render.console.print(export_version(version, fmt, out, force), markup=False, highlight=False, soft_wrap=True)


@app.command()
def demo(spec: Path = typer.Argument(parser=nonempty_path, default=Path("examples/jobs/demo.yaml"))) -> None:
    """The main job: prepare data, start the stack, train, summarise, plot, sample, stop.

    Example: surgectl demo examples/jobs/demo.yaml
    """
    from services.cli.demo import run_demo

    run_demo(spec)
