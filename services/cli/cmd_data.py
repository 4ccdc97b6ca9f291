"""surgectl dataset … and delete …: dataset versions, and deleting records, versions and datasets."""

from __future__ import annotations

from pathlib import Path

import typer

from services.cli import clients, render, stack
from services.cli.app import OutputOpt, _again, _say, _show, dataset_app, delete_app
from services.cli.errors import CliError
from services.cli.numbers import float_option
from services.contract import data_pb2


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
    val_fraction: float = float_option(
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
    from services.data.bpe import bpe_problem
    from services.data.errors import DataError, InvalidConfig
    from services.data.prepare import default_stdlib_source, default_workers, label_problem, prepare_dataset

    # The options are the user's input: each said in one line, exit 2, before any file is read.
    for option, value in (("--name", name), ("--version", version)):
        if problem := label_problem(value):
            raise CliError(f"{option}: {problem}", code=2)
    if problem := bpe_problem(tokenizer):
        raise CliError(f"--tokenizer {tokenizer}: {problem}", code=2)
    if tokenizer != "bytes" and not tokenizer.startswith("bpe:") and not Path(tokenizer).is_file():
        raise CliError(f"--tokenizer {tokenizer}: no such file ('bytes', 'bpe:N' or a tokenizers JSON file)", code=2)
    if source is not None and not source.strip():
        raise CliError("--source: empty", code=2)
    src = source or str(default_stdlib_source())
    remote = "://" in src
    if not remote and not Path(src).exists():
        raise CliError(f"--source {src}: no such file or directory", code=2)
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
    except InvalidConfig as e:  # the user's input (a source with no text, a bad include glob): exit 2
        raise CliError(" ".join(str(e).split()), code=2) from None
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
