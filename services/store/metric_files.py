"""A job's raw metric records on disk with a size bound (issue 29 item 8): the metrics
logger's ``<root>/metrics/<job>.jsonl`` is rotated at ``max_bytes`` the way
``logging.handlers.RotatingFileHandler`` rotates (``.jsonl.1`` the newest full file, up to
``.jsonl.<backups>``), and the file rotated out of the backups is not deleted but compacted
into the job's history, ``.jsonl.<backups + 1>`` (the oldest name, so every reader that takes
the files oldest first, `surgectl plot` included, reads it first).

Compaction thins, it never averages: the history keeps the step records of the first step
and of every step divisible by a stride (every rank's), each rank's newest step record in it, and
every evaluation record, the stride doubling until the history fits ``max_bytes``. A month-long
job keeps its whole curve, at a resolution that halves as it grows, and its newest ``backups``
files in full. On disk per job: at most ``(backups + 2) x max_bytes`` (plus a file being
compacted; unless its evaluation records and one step record per rank alone outgrow
``max_bytes``, which are never thinned).

Why each rank's newest step: the files are in arrival order, not step order. Each node's agent
sends its ranks' records on its own stream (services/worker/metric_stream.py), so one rank's
records can reach the store whole steps after another's: then a rank's newest steps are written
before the other rank's older ones, are rotated out first, and a stride thinned them all away,
the end of that rank's curve with them (ci8, tests/faults/test_footprint_live.py: rank 0's
steps 33-40 written, then rank 1's steps 22-40 in one batch, its agent's linger flushed at its
loop's end; the history kept rank 0's steps 1 and 32 of 40, and `surgectl plot` drew "2 of
steps 1-32"). Its newest step kept, a rank's curve ends where its records end, at any stride.

Settings (store environment, README "Environment"): ``SURGE_STORE_METRICS_MAX_BYTES``
(default 128 MiB; 0: never rotated), ``SURGE_STORE_METRICS_BACKUPS`` (default 3).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES_ENV = "SURGE_STORE_METRICS_MAX_BYTES"
BACKUPS_ENV = "SURGE_STORE_METRICS_BACKUPS"
DEFAULT_MAX_BYTES = 128 << 20  # ~200k step records of 600 bytes: 25k steps of an 8-rank job a file
DEFAULT_BACKUPS = 3
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a job's id names its files: nothing else
PENDING = ".pending-"  # a file rotated out, waiting for its compaction (no reader takes it)


@dataclass(frozen=True)
class MetricFileBound:
    """Raises ValueError (naming the variable) for a negative value."""

    max_bytes: int = DEFAULT_MAX_BYTES
    backups: int = DEFAULT_BACKUPS

    def __post_init__(self) -> None:
        for name, value in ((MAX_BYTES_ENV, self.max_bytes), (BACKUPS_ENV, self.backups)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")


def env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with this module's environment variables (one line), or None."""
    env = os.environ if env is None else env
    for name in (MAX_BYTES_ENV, BACKUPS_ENV):
        text = env.get(name, "").strip()
        if text and not text.isdigit():
            return f"{name}: expected a whole number >= 0, got {text!r}"
    return None


def bound_from_env(env: Mapping[str, str] | None = None) -> MetricFileBound:
    """The store's :class:`MetricFileBound` (checked by :func:`env_problem` first)."""
    env = os.environ if env is None else env
    max_bytes, backups = env.get(MAX_BYTES_ENV, "").strip(), env.get(BACKUPS_ENV, "").strip()
    return MetricFileBound(
        int(max_bytes) if max_bytes else DEFAULT_MAX_BYTES, int(backups) if backups else DEFAULT_BACKUPS
    )


def history_path(path: Path, bound: MetricFileBound) -> Path:
    return path.with_name(f"{path.name}.{bound.backups + 1}")


def rotate(path: Path, bound: MetricFileBound) -> Path | None:
    """Rotate ``path`` (closed by the caller; it is written anew after): ``.jsonl.i`` becomes
    ``.jsonl.i+1``, ``path`` becomes ``.jsonl.1``. The file rotated out of the backups is
    renamed to a pending name and returned, for :func:`compact` (None: none yet). Renames
    only: fast enough under the writer's lock."""
    pending = None
    oldest = path.with_name(f"{path.name}.{bound.backups}") if bound.backups else path
    if oldest.exists():
        pending = path.with_name(f"{path.name}{PENDING}{time.time_ns()}")
        os.rename(oldest, pending)
    for i in range(bound.backups - 1, 0, -1):
        src = path.with_name(f"{path.name}.{i}")
        if src.exists():
            os.rename(src, path.with_name(f"{path.name}.{i + 1}"))
    if bound.backups and path.exists():
        os.rename(path, path.with_name(f"{path.name}.1"))
    return pending


def compact(path: Path, pending: Path, bound: MetricFileBound) -> int:
    """Merge ``pending`` (a file :func:`rotate` returned) into ``path``'s history, thinned to
    fit ``bound.max_bytes`` (each rank's newest step record kept whatever the stride: the
    module docstring); the history is replaced atomically, then ``pending`` removed.
    Returns the stride kept (1: every record). Two passes over the files, holding only the
    bytes per step (and per rank, of its newest step) in memory, not the records: the history
    and a pending file are ``max_bytes`` each."""
    history = history_path(path, bound)
    sources = [f for f in (history, pending) if f.exists()]
    per_step: dict[int, int] = {}  # step -> bytes of its step records
    newest: dict[int, tuple[int, int]] = {}  # rank -> (its newest step, bytes of its records of it)
    always = 0  # bytes kept whatever the stride (evaluations, lines that are no step record)
    for line in _lines(sources):
        at = _step(line)
        if at is None:
            always += len(line)
            continue
        step, rank = at
        per_step[step] = per_step.get(step, 0) + len(line)
        last, size_of = newest.get(rank, (step, 0))
        if step > last:
            newest[rank] = (step, len(line))
        elif step == last:
            newest[rank] = (step, size_of + len(line))
    first = min(per_step, default=None)  # (the curve's start: kept)
    stride = 1

    def kept(step: int, k: int) -> bool:
        return step % k == 0 or step == first

    def size(k: int) -> int:
        ends = sum(n for step, n in newest.values() if not kept(step, k))
        return always + ends + sum(n for step, n in per_step.items() if kept(step, k))

    while size(stride) > bound.max_bytes > 0 and stride < 1 << 40:
        stride *= 2
    tmp = history.with_name(history.name + ".tmp")
    with open(tmp, "wb") as out:
        for line in _lines(sources):
            at = _step(line)
            if at is None or kept(at[0], stride) or newest[at[1]][0] == at[0]:
                out.write(line)
    os.replace(tmp, history)
    pending.unlink(missing_ok=True)
    return stride


def _lines(files: list[Path]):
    """The complete lines (bytes, with their newline) of ``files`` in order."""
    for f in files:
        try:
            with open(f, "rb") as fh:
                for line in fh:
                    if line.endswith(b"\n"):
                        yield line
        except FileNotFoundError:
            continue


def _step(line: bytes) -> tuple[int, int] | None:
    """The step and rank of a step record (None: an evaluation, or a line that is no record:
    kept)."""
    try:
        record = json.loads(line)
        return (int(record["step"]), int(record.get("rank") or 0)) if record.get("type") == "step" else None
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


METRICS_PART_BYTES = 1 << 20


def lines(files: list, record_type: str = "") -> Iterator[bytes]:
    """The whole lines of ``files`` in order, in parts of about METRICS_PART_BYTES; with
    ``record_type``, only the records of that ``type``. A line still being written (no newline
    yet) is left out; a file rotated away since it was listed is skipped."""
    marker = f'"{record_type}"'.encode()
    for path in files:
        try:
            f = open(path, "rb")  # noqa: SIM115 - read in parts below
        except FileNotFoundError:
            continue
        with f:
            for block in line_blocks(f):
                if record_type:
                    block = of_type(block, record_type, marker)
                if block:
                    yield block


def of_type(block: bytes, record_type: str, marker: bytes | None = None) -> bytes:
    """The lines of ``block`` (whole lines) that are records of ``record_type``."""
    marker = marker or f'"{record_type}"'.encode()
    return b"".join(line for line in block.splitlines(keepends=True) if _of_type(line, marker, record_type))


def _of_type(line: bytes, marker: bytes, record_type: str) -> bool:
    if marker not in line:  # (cheap: most lines are steps)
        return False
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("type") == record_type


def line_blocks(f) -> Iterator[bytes]:
    """An open file's bytes from where it stands, in parts of whole lines (about
    METRICS_PART_BYTES each); a last line with no newline yet (a write in progress) is left out."""
    rest = b""
    while block := f.read(METRICS_PART_BYTES):
        block = rest + block
        cut = block.rfind(b"\n") + 1
        block, rest = block[:cut], block[cut:]
        if block:
            yield block
