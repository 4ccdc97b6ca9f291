"""surgectl's Typer application and what its command modules share (options, output helpers).

The commands live in one module per concern (cmd_stack, cmd_data, cmd_jobs, cmd_experiments,
cmd_control, cmd_checkpoints); services/cli/surgectl.py imports them in the order `--help` lists them and
runs the app.
"""

from __future__ import annotations

import sys

import typer

from services.cli import render
from services.cli.errors import CliError
from services.contract import control_pb2

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
team_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Teams' quotas (admin): nominal slots, borrowing, hard limit, weight, cohort.\n\n"
    "Example: surgectl team set vision --nominal 8 --borrow-limit 4 --hard-limit 16 --weight 2 --cohort research",
)
app.add_typer(team_app, name="team")

OutputOpt = typer.Option("table", "--output", "-o", help="table | json")


NoCheckpointOpt = typer.Option(False, "--no-checkpoint", help="do not checkpoint the boundary step first")


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


def _say(text: str) -> None:
    render.console.print(text, markup=False, highlight=False, soft_wrap=True)


def _again(command: str, job: str, rest: str = "") -> str:
    """What Ctrl-C during an operator command says: it may have reached control; run again, it is safe."""
    return (
        f"interrupted: the {command} may have reached control (`surgectl status {job}` shows where the job "
        f"stands); `surgectl {command} {job}{rest}` again is safe"
    )


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
