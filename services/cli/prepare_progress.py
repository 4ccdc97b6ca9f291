"""The progress line of ``surgectl dataset prepare``: documents, MB read and MB/s.

Shown on stderr only when it is a terminal and ``--quiet`` is not given; otherwise the
callback is None and ``prepare_dataset`` reports nothing while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn


@contextmanager
def prepare_progress(console: Console, quiet: bool) -> Iterator[Callable[[int, int, int], None] | None]:
    """``with prepare_progress(console, quiet) as progress:`` -> a ``(documents, source
    bytes read, source bytes)`` callback for ``prepare_dataset``, or None when nothing is shown."""
    if quiet or not console.is_terminal:
        yield None
        return
    bar = Progress(
        TextColumn("preparing"),
        BarColumn(),
        TextColumn("{task.fields[documents]:,} documents"),
        DownloadColumn(binary_units=False),  # MB read of the source (as stored)
        TransferSpeedColumn(),  # MB/s
        TimeElapsedColumn(),
        console=console,
        transient=True,  # the summary line replaces it
    )
    task = bar.add_task("prepare", total=None, documents=0)
    with bar:
        yield lambda documents, done, total: bar.update(task, completed=done, total=total, documents=documents)
