"""surgectl evaluate: an evaluation job (JobSpec.evaluation, services/jobspec/evaluation.py)
of a job's checkpoint, submitted through control's queue like any job."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable

import typer
import yaml

from services.cli import clients, render
from services.cli.app import _say, app
from services.cli.errors import CliError
from services.cli.jobs import follow_job, resolve_job, send_submit
from services.cli.numbers import float_option
from services.contract import control_pb2
from services.jobspec.base import JobSpecError
from services.jobspec.evaluation import evaluation_job


@app.command()
def evaluate(
    job: str,
    command: str = typer.Option(..., "--command", help="the evaluation command (split as a shell would)"),
    version: str | None = typer.Option(
        None, "--version", help="the job's checkpoint version: N, latest, or JOB:N (default: the job's latest)"
    ),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="export the version in Hugging Face form (SURGE_EVAL_HF_DIR)"),
    timeout: float = float_option(3600.0, "--timeout", min=1.0, help="seconds the command may run"),
    wait: bool = typer.Option(False, "--wait", help="follow the evaluation job to its end and print its scores"),
) -> None:
    """Evaluate a job's checkpoint with a command, as a one-rank job through control's queue.

    The job loads the version, writes it in Hugging Face form, and runs the command with
    SURGE_EVAL_CHECKPOINT (the version's directory), SURGE_EVAL_HF_DIR (the export) and
    SURGE_EVAL_OUTPUT (where it writes its scores: a JSON object of name -> number, or
    lm-evaluation-harness's --output_path) in its environment. The scores are recorded beside
    the job's metrics: `surgectl status JOB` shows them. A command that fails or writes no
    score fails the evaluation job only.

    Example: surgectl evaluate demo --command "lm_eval --model hf --model_args pretrained=$SURGE_EVAL_HF_DIR ..."
    """
    from services.cli.init_from import committed
    from services.jobspec import parse_job_spec, spec_from_json

    if version is not None and not version.strip():  # (an unset variable: never the latest by accident)
        raise CliError("--version: empty (a checkpoint version JOB:N; leave --version out for the latest)", code=2)
    job_id = resolve_job(job)
    argv = [_absolute_if_here(arg) for arg in shlex.split(command)]
    if not argv:
        raise CliError("--command: empty", code=2)
    status = clients.call(
        "control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job_id, with_spec=True), timeout=10)
    )
    source = spec_from_json(status.spec_json)
    pinned = evaluated_version(job_id, version, lambda ref: committed(ref, "--version").version)
    try:
        raw = evaluation_job(source, job_id, pinned, argv, hf, timeout)
        text = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
        parse_job_spec(text, "evaluate")  # (one line naming the field if the command or timeout is out of bounds)
    except JobSpecError as e:
        raise CliError(str(e), code=2) from None
    submitted = send_submit(text, f"evaluate {job_id}")
    where = f"queued at {submitted.queue_position}" if submitted.queue_position else "placed"
    _say(f"evaluation job {submitted.job_id} of {pinned}: {where}")
    if not wait:
        return
    try:
        follow_job(submitted.job_id, training=False)
    except KeyboardInterrupt:
        render.stopped_following(
            f"evaluation job {submitted.job_id} keeps running "
            f"(`surgectl status {submitted.job_id}`; its scores join {job_id}'s when it ends)"
        )
        raise typer.Exit(130) from None
    end = clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=submitted.job_id), timeout=10))
    if end.outcome != control_pb2.JobOutcome.FINISHED:
        what = (
            end.message
            if end.message.startswith(control_pb2.JobOutcome.Name(end.outcome))
            else (f"{control_pb2.JobOutcome.Name(end.outcome)}: {end.message}")
        )  # (the status message names the outcome already: "FAILED: ...")
        raise CliError(f"evaluation job {submitted.job_id} {what}")
    from services.cli.job_records import job_scores

    mine = [s for s in job_scores(job_id) or () if s.eval_job_id == submitted.job_id]
    for line in mine:
        for name, value in sorted(line.scores.items()):
            _say(f"  {name}: {value:g}")


def evaluated_version(job_id: str, version: str | None, pin: Callable[[str], str]) -> str:
    """The committed version (``<job_id>:<n>``) `evaluate JOB --version V` scores: V is one of
    JOB's (``N``, ``latest``, or ``JOB:N`` with JOB by id or name; left out: the latest); ``pin``
    resolves a ``<job>:<n|latest>`` to the committed version it names.

    Raises:
        CliError (exit 2): V names another job's version; its scores would be filed under
            JOB (fresh37b: they were, beside JOB's own, at the other run's step).
    """
    ref = version or "latest"
    pinned = pin(ref if ":" in ref else f"{job_id}:{ref}")
    owner = pinned.rpartition(":")[0]
    if owner != job_id:
        raise CliError(
            f"--version {version}: a version of job {owner}, not of {job_id} "
            f"(`surgectl evaluate {owner} --version {pinned}` scores it as that job's)",
            code=2,
        )
    return pinned


def _absolute_if_here(arg: str) -> str:
    """``arg`` made absolute when it names a file or directory that exists here (relative to
    where `surgectl evaluate` runs): the command runs in the evaluation's own directory on the
    rank's node, where a relative path the user typed (the README's
    ``python examples/eval/perplexity.py held_out.txt``) names nothing. Other words (flags,
    names, ``$SURGE_EVAL_*``) are left as typed."""
    if not arg or os.path.isabs(arg) or arg.startswith("-") or "$" in arg or not os.path.exists(arg):
        return arg
    return os.path.abspath(arg)
