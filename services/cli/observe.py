"""`surgectl logs` and `surgectl plot`: a job's rank logs and its loss/throughput curves.

Both read files of the local stack (the machine running `surgectl up`):

* rank logs: every node agent writes each rank's stdout/stderr (structlog JSON lines) to
  ``<run dir>/logs/<job>.rank<R>.log`` (``$SURGE_HOME/run/logs`` for the local stack),
  rotated at a size: ``.log.1`` .. ``.log.N`` hold the older lines, read oldest first;
  `surgectl logs` gets them from control (``StreamLogs``), which has the node agents that
  ran the job's ranks tail those files. The file readers below remain for local tools.
* step records: the store's metrics logger persists every raw ``StepCompleted`` /
  ``EvalCompleted`` as one JSON line in ``<store root>/metrics/<job>.jsonl`` (rotated at a
  size, older records in ``.jsonl.N`` and a thinned history: read oldest first)
  (``$SURGE_STORE_ROOT`` or ``$SURGE_HOME/store``). When that file is not on this machine,
  `plot` falls back to control's event history (``WatchJob``), whose step events are
  sampled (about one per second), so the curve is coarser.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from services.cli import render
from services.cli.errors import CliError
from services.common import paths
from services.common.rotated_files import read_rotated

_RANK_LOG = re.compile(r"^(?P<job>.+)\.rank(?P<rank>\d+)\.log(?:\.\d+)?$")  # (a rotated one: .log.N)
FIRST = ("timestamp", "level", "service", "job", "rank", "step", "event", "logger")


def safe_name(job: str) -> str:
    """The file-name form of a job id, as the node agent writes it."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", job).lstrip(".") or "_"


def logs_dir() -> Path:
    return paths.run_dir() / "logs"


def rank_logs(job: str, directory: Path | None = None) -> dict[int, Path]:
    """rank -> log file of ``job`` under ``directory`` (default: the local stack's): the one
    being written (``<job>.rank<R>.log``), also when only its rotated files are left; read
    it with its rotated files by :func:`read_rank_log`."""
    directory = directory or logs_dir()
    if not directory.is_dir():
        return {}
    want = safe_name(job)
    found = {}
    for f in directory.iterdir():
        m = _RANK_LOG.match(f.name)
        if m and m["job"] == want:
            found[int(m["rank"])] = directory / f"{want}.rank{m['rank']}.log"
    return dict(sorted(found.items()))


def read_rank_log(path: Path) -> str:
    """A rank's whole log text: its rotated files oldest first, then ``path``."""
    return read_rotated(path)


def local_job(ref: str) -> str | None:
    """The job id of ``ref`` (an id or a job's name) among the local stack's rank log files,
    for `surgectl logs` when control is not there to ask: the id itself if it has files, else
    the newest job (by its files' times) named ``ref``; None if none."""
    if rank_logs(ref):
        return ref
    return _newest_named(ref, logs_dir(), lambda name: (m := _RANK_LOG.match(name)) and m["job"])


def _newest_named(ref: str, directory: Path, job_of: Callable[[str], str | None]) -> str | None:
    """The job named ``ref`` (``<name>-<hex>``) whose files in ``directory`` (``job_of``: a
    file name's job id, None for another file) are the newest; None if none."""
    if not directory.is_dir():
        return None
    named = re.compile(rf"^{re.escape(safe_name(ref))}-[0-9a-f]+$")
    newest: dict[str, float] = {}
    for f in directory.iterdir():
        job = job_of(f.name)
        if job and named.match(job):
            newest[job] = max(newest.get(job, 0.0), f.stat().st_mtime)
    return max(newest, key=newest.__getitem__) if newest else None


@dataclass
class LogLine:
    rank: int
    text: str  # the line as written (without its newline)
    record: dict | None  # the JSON object, or None for a line that is not JSON

    @property
    def timestamp(self) -> str:
        return str(self.record.get("timestamp", "")) if self.record else ""

    def human(self) -> str:
        if self.record is None:
            return f"rank {self.rank}  {self.text}"
        r = dict(self.record)
        ts = str(r.pop("timestamp", ""))[11:23]
        level = str(r.pop("level", "")).upper()[:5]
        event = r.pop("event", "")
        for k in ("service", "job", "logger"):
            r.pop(k, None)
        rank = r.pop("rank", self.rank)
        step = r.pop("step", None)
        where = f"rank {rank}" + (f" step {step}" if step is not None else "")
        rest = " ".join(f"{k}={v}" for k, v in r.items())
        return f"{ts} {level:<5} {where:<16} {event}" + (f"  {rest}" if rest else "")


def parse(rank: int, text: str) -> LogLine:
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    return LogLine(rank, text, record if isinstance(record, dict) else None)


def read_all(files: dict[int, Path]) -> list[LogLine]:
    """Every line of every rank, ordered by timestamp (lines without one keep their place
    after the previous line of their rank)."""
    lines: list[tuple[str, int, int, LogLine]] = []
    for rank, f in files.items():
        last = ""
        for i, text in enumerate(read_rank_log(f).splitlines()):
            if not text.strip():
                continue
            line = parse(rank, text)
            last = line.timestamp or last
            lines.append((last, rank, i, line))
    lines.sort(key=lambda t: t[:3])
    return [t[3] for t in lines]


def local_rank_logs(job: str, rank: int = -1) -> list[LogLine] | None:
    """Every line of ``job``'s rank log files in the local stack's run dir, merged by time
    (``rank`` only, unless -1); None unless this CLI talks to a local stack
    (``SURGE_CONTROL_ADDRESS`` unset) that has such files.

    Why `surgectl logs` reads these first: every session's node agents append a rank's
    lines to the same file, so it holds the job's whole history, each line once, also the
    lines of an earlier `surgectl up` whose node agents are gone (StreamLogs asks only the
    node agents of this session that ran the job's ranks)."""
    import os

    if os.environ.get("SURGE_CONTROL_ADDRESS"):
        return None
    files = rank_logs(job)
    if rank >= 0:
        files = {r: f for r, f in files.items() if r == rank}
    if not files:
        return None
    try:
        return read_all(files)
    except OSError:
        return None


class TimeOrder:
    """Orders log lines by timestamp, batch by batch (a follow's poll window): a line
    without a timestamp sorts at its rank's previous timestamp, remembered across batches,
    so it stays after the line it followed in its file. Ties keep arrival order per rank.

    Timestamps are compared as strings: every Surge process writes ISO-8601 UTC
    (services/common/logs.py), which sorts lexically in time order."""

    def __init__(self) -> None:
        self._last: dict[int, str] = {}
        self._seen = 0

    def order(self, lines: Iterable[LogLine]) -> list[LogLine]:
        keyed: list[tuple[str, int, int, LogLine]] = []
        for line in lines:
            self._last[line.rank] = line.timestamp or self._last.get(line.rank, "")
            keyed.append((self._last[line.rank], line.rank, self._seen, line))
            self._seen += 1
        keyed.sort(key=lambda t: t[:3])
        return [t[3] for t in keyed]


def merge(lines: Iterable[LogLine]) -> list[LogLine]:
    """``lines`` (each rank's in file order) ordered by timestamp; lines without one keep
    their place after the previous line of their rank."""
    return TimeOrder().order(lines)


def follow(
    job: str, finished: Callable[[], bool], poll_s: float = 0.5, directory: Path | None = None
) -> Iterator[LogLine]:
    """Lines as they are written, until ``finished()`` (asked between polls) and no file has
    grown since; rank files that appear later (a relaunch) are picked up. The lines read in
    one poll (every rank's growth within ``poll_s`` seconds) come out merged by timestamp
    (:class:`TimeOrder`); a line read in a later poll never comes before them."""
    offsets: dict[Path, tuple[int, int]] = {}  # file -> (inode, bytes read of it)
    partial: dict[Path, str] = {}
    order = TimeOrder()
    while True:
        done = finished()  # asked before reading: nothing written before the end is missed
        grew = False
        batch: list[LogLine] = []
        for rank, f in rank_logs(job, directory).items():
            chunk = _grown(f, offsets)
            if not chunk:
                continue
            grew = True
            text = partial.pop(f, "") + chunk.decode(errors="replace")
            *complete, rest = text.split("\n")
            if rest:
                partial[f] = rest
            batch.extend(parse(rank, t) for t in complete if t.strip())
        yield from order.order(batch)
        if done and not grew:
            return
        time.sleep(poll_s)


def _grown(f: Path, offsets: dict[Path, tuple[int, int]]) -> bytes:
    """What ``f`` gained since the last read; across a rotation (``f`` is a new file, the one
    read so far became ``f.1``) the rest of the old file, then the new one from its start."""
    ino, read = offsets.get(f, (0, 0))
    out = b""
    try:
        if ino and os.stat(f).st_ino != ino:  # rotated since: finish the old file first
            old = f.with_name(f.name + ".1")
            with open(old, "rb") as fh:
                if os.fstat(fh.fileno()).st_ino == ino:
                    fh.seek(read)
                    out = fh.read()
            read = 0
        with open(f, "rb") as fh:
            fh.seek(read)
            out += (chunk := fh.read())
            offsets[f] = (os.fstat(fh.fileno()).st_ino, read + len(chunk))
    except OSError:
        return out
    return out


# ---------------------------------------------------------------------------------- plot


def metrics_file(job: str) -> Path:
    return paths.store_root() / "metrics" / f"{job}.jsonl"


def local_metrics_job(ref: str) -> str | None:
    """The job id of ``ref`` (an id or a job's name) among the local store's metric files, for
    `plot` and `compare` when control is not there to ask (as ``local_job`` for `logs`): the id
    itself if it has a file, else the newest job (by its file's time) named ``ref``; None if none."""
    if metrics_file(ref).is_file():
        return ref
    return _newest_named(
        ref, metrics_file(ref).parent, lambda name: name.removesuffix(".jsonl") if name.endswith(".jsonl") else None
    )


def step_records(
    text: str, path: Path, strict: bool = True
) -> tuple[dict[int, dict[int, dict]], dict[int, dict[int, float]]]:
    """A metrics file's records (``text``: the file and its rotated files, oldest first), per
    rank: each step's record (a step recorded twice, replayed after a rollback, keeps its last)
    and each evaluation's held-out loss. A line that is not JSON is a CliError naming it when
    ``strict``, else passed over (a write cut short by a crash: a page shows the rest)."""
    steps: dict[int, dict[int, dict]] = {}
    evals: dict[int, dict[int, float]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            if strict:
                raise CliError(f"{path}: line {n} is not JSON; the metrics file is damaged") from None
            continue
        if not isinstance(r, dict) or "step" not in r:
            continue
        rk = int(r.get("rank", 0))
        if r.get("type") == "step":
            steps.setdefault(rk, {})[int(r["step"])] = r
        elif r.get("type") == "eval":
            evals.setdefault(rk, {})[int(r["step"])] = number(r.get("loss"))
    return steps, evals


def history_from_jsonl(path: Path, rank: int | None = None) -> render.History:
    """Train loss, tokens/s and held-out loss per step of one rank (default: the lowest
    rank present; each rank reports its own loss, tokens/s counts all ranks). A step
    recorded twice (replayed after a rollback) keeps its last record."""
    return history_from_text(read_rotated(path), path, rank)  # (its rotated files and history first)


def history_from_text(text: str, path: Path | str, rank: int | None = None) -> render.History:
    """``history_from_jsonl`` of a metrics file's text (``path``: where it came from, for the
    errors: a file, or the store's records read through the service)."""
    steps, evals = step_records(text, path)
    if not steps:
        raise CliError(f"{path}: no step records yet")
    if rank is None:
        rank = min(steps)
    elif rank not in steps:
        present = ", ".join(map(str, sorted(steps)))  # (the user's --rank: exit 2, as `logs --rank` says it)
        raise CliError(f"--rank {rank}: no step records of rank {rank} in {path} (ranks present: {present})", code=2)
    h = render.History()
    for step, r in sorted(steps[rank].items()):
        h.steps.append(step)
        h.loss.append(number(r.get("loss")))
        h.tokens_per_second.append(number(r.get("tokens_per_second")))
    for step, loss in sorted(evals.get(rank, {}).items()):
        if not math.isnan(loss):
            h.eval_steps.append(step)
            h.eval_loss.append(loss)
    return h


def history_from_events(events) -> render.History:
    """The same from control's WatchJob history (step events are sampled there)."""
    h = render.History()
    for ev in events:
        h.add(ev)
    if s := h.last:  # the final point: the status after the last event
        if s.step and (not h.steps or s.step > h.steps[-1]) and s.train_loss:
            h.steps.append(s.step)
            h.loss.append(s.train_loss)
            h.tokens_per_second.append(s.tokens_per_second)
    return h


def number(v) -> float:
    """A record's value as a float: NaN where absent or not a number (the metrics logger
    writes NaN and Infinity as strings)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return float(v) if isinstance(v, (int, float)) else math.nan
