"""Terminal output: tables, the live progress bar of a followed job, the loss-curve PNG."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from services.cli import jsonout
from services.cli.errors import CliError
from services.common.sizes import size_text
from services.contract import control_pb2, store_pb2

# Piped (not a terminal), rich would lay tables out for 80 columns and wrap or cut their
# cells; a pipe gets each row on one line instead (unless COLUMNS says otherwise).
PIPE_WIDTH = 1000
RULE_PIPE_WIDTH = 100  # a console.rule's width then


def _width(stream) -> int | None:
    import os

    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None  # rich's own choice: the terminal's width, or COLUMNS
    return PIPE_WIDTH


class _Console(Console):
    """rich's Console, PIPE_WIDTH columns wide when its stream is not a terminal (asked at
    every print: tests and callers swap sys.stdout). COLUMNS too is read at every print, not
    once when the console is made (rich's own Console keeps the COLUMNS of that moment for
    good: a module imported while a test had set it kept that width for every later table)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if kwargs.get("width") is None:
            self._width = None  # (rich's size property reads COLUMNS itself, each time)

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        width = None if self._width is not None else _width(self.file)
        return ConsoleDimensions(width, size.height) if width else size

    @size.setter
    def size(self, value: tuple[int, int]) -> None:
        Console.size.fset(self, value)

    def rule(self, title="", *, characters="─", style="rule.line", align="center") -> None:
        """A rule as wide as a terminal, not PIPE_WIDTH, when piped."""
        if self._width is not None or not _width(self.file):
            return super().rule(title, characters=characters, style=style, align=align)
        from rich.rule import Rule

        self.print(Rule(title, characters=characters, style=style, align=align), width=RULE_PIPE_WIDTH)


console = _Console()
err_console = _Console(stderr=True)

STATE = control_pb2.JobState
OUTCOME = control_pb2.JobOutcome


def state_text(s: control_pb2.JobStatus) -> str:
    text = STATE.Name(s.state)
    if s.state == STATE.TERMINATED and s.outcome:
        text += f" ({OUTCOME.Name(s.outcome)})"
    elif s.state == STATE.PAUSED and s.drained:
        text += " (drained)"  # by `surgectl down`: the next `up` resumes it
    elif s.state == STATE.RUNNING and s.draining and s.draining_step:
        text += f" (draining: saving step {s.draining_step})"  # its paused ranks save for `surgectl down`
    elif s.state == STATE.RUNNING and (s.draining or s.drained):
        text += " (draining)"  # `surgectl down`'s checkpoint and pause in flight (drained: an older control)
    elif s.state == STATE.STANDBY and s.preempted_by:  # (a STANDBY sub-state: it comes back by itself)
        text = f"PREEMPTED (by {s.preempted_by}" + (f", queued #{s.queue_position})" if s.queue_position else ")")
    elif s.state == STATE.RUNNING and s.preempted_by:
        text += f" (preempted by {s.preempted_by}: checkpointing)"
    elif s.state == STATE.STANDBY and s.queue_position:
        text += f" (queued #{s.queue_position})"  # control's job queue: `message` says what it waits for
    notes = []
    if s.state not in (STATE.STANDBY, STATE.TERMINATED):
        if on := landed_text(s):  # the kind an ``any`` job landed on, which its team's quota counts
            notes.append(f"any: {on}")
        if s.borrowed_slots:
            # ranks beyond its team's nominal quota (issue 30): the first reclaimed when lenders need them
            notes.append(f"{s.borrowed_slots} borrowed")
    return text + (f" ({', '.join(notes)})" if notes else "")


def landed_text(s: control_pb2.JobStatus) -> str:
    """Where a ``parallel.device: any`` job's ranks were last placed when GPUs are among them:
    ``on gpu``, ``on 2 gpu + 2 cpu``; "" for a job of one kind, one not placed, or one on CPU
    slots only (every job of a CPU-only cluster: nothing to tell; -o json has
    ``placed_by_kind`` always)."""
    p = s.placed_by_kind
    if (s.device or "any") != "any" or not s.HasField("placed_by_kind") or not p.gpu:
        return ""
    return f"on {p.gpu} gpu + {p.cpu} cpu" if p.cpu else "on gpu"


def fmt_loss(x: float) -> str:
    return "—" if x == 0 or math.isnan(x) else f"{x:.3f}"


def tokens_per_second(s: control_pb2.JobStatus) -> str:
    """A job's tokens/s as every table shows it (jobs table, end-of-run summary)."""
    return f"{s.tokens_per_second:,.0f}"


def print_json(messages) -> None:
    print(jsonout.dumps(list(messages)))


# Whether a Ctrl-C's one line was printed (surgectl's main prints a line of its own for an
# interruption that reached it unsaid: typer turns a KeyboardInterrupt into a bare exit 130).
interrupt_said = False
interrupt_line = ""  # that line of main's, when a command knows better than its generic one


def stopped_following(what_goes_on: str) -> None:
    """A Ctrl-C of a `--follow`/`--wait`: one line on stderr saying what keeps running."""
    global interrupt_said
    interrupt_said = True
    err_console.print(f"stopped following; {what_goes_on}", markup=False, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    """One line on stderr, printed literally (user text may hold [brackets])."""
    err_console.print(Text("error: ", style="red") + Text(message), highlight=False, soft_wrap=True)


def _id_column(t: Table, name: str) -> None:
    t.add_column(name, no_wrap=True, min_width=len(name))


def jobs_table(jobs) -> Table:
    t = Table(title="jobs")
    _id_column(t, "job")
    for col in ("state", "step", "train loss", "eval loss", "tokens/s", "checkpoint", "message"):
        t.add_column(col)
    for j in jobs:
        t.add_row(
            j.job_id,
            state_text(j),
            "evaluation" if is_evaluation(j) else f"{j.step}/{j.total_steps}",
            fmt_loss(j.train_loss),
            fmt_loss(j.eval_loss),
            "—" if is_evaluation(j) else tokens_per_second(j),
            j.checkpoint_version or "—",
            j.message,
        )
    return t


def workers_table(slots, health) -> Table:
    """`surgectl workers`: each worker's devices, rank slots (used, free; "?" when control's
    /metrics was not read) and health (``worker_slots.health_of``)."""
    t = Table(title="workers", caption="`surgectl drain WORKER --deadline S`, `surgectl uncordon WORKER`")
    _id_column(t, "worker")
    for col in ("devices", "slots used", "slots free", "health"):
        t.add_column(col)
    by_id = {s.worker_id: s for s in slots or ()}
    for h in health:
        s = by_id.get(h.worker_id)
        t.add_row(
            h.worker_id,
            s.devices_text() if s else "?",
            str(s.used) if s else "?",
            str(s.free) if s else "?",
            Text("\n".join(h.findings), style="bold red") if h.findings else "healthy",
        )
    return t


def is_evaluation(j: control_pb2.JobStatus) -> bool:
    """An evaluation job (`surgectl evaluate`, eval.hooks): control says so in its status
    (``JobStatus.evaluation``; was: only read from ``spec_json``, which `status` is not sent,
    so a finished one showed "0/60" steps and 0 tokens/s), or its spec's ``evaluation:`` is set;
    it takes no training steps (its ``steps`` are its source job's)."""
    if j.evaluation:
        return True
    try:
        return bool(json.loads(j.spec_json or "{}").get("evaluation"))
    except (ValueError, AttributeError):
        return False


def slow_ranks_table(jobs) -> Table:
    """The ranks control names slow (``JobStatus.slow_ranks``: >= 1.5x their peers' median
    compute per step, sustained), with the worker they run on and the finding."""
    t = Table(title="slow ranks", caption="fault_policy actions.slow_rank: ignore (report only) | replace | shrink")
    _id_column(t, "job")
    for col in ("rank", "worker", "since step", "finding"):
        t.add_column(col)
    for j in jobs:
        for r in j.slow_ranks:
            t.add_row(j.job_id, str(r.rank), r.worker_id or "—", str(r.step), r.detail)
    return t


def links_table(jobs) -> Table:
    """The data-plane links control names faulty (``JobStatus.links``: degraded, or cut while
    the job ran across it), with their nodes and each end's measured loss."""
    t = Table(title="faulty links", caption="fault_policy actions.link_down: exclude_node; link_degraded: ignore")
    _id_column(t, "job")
    for col in ("link", "fault", "finding"):
        t.add_column(col)
    for j in jobs:
        for f in j.links:
            t.add_row(j.job_id, " <-> ".join(f.worker_ids), f.fault_class, f.detail)
    return t


def cordons_table(cordoned) -> Table:
    """Workers taken out of placement for every job (``JobList.cordoned``), with the reason
    and how the cordon ends."""
    import time

    cordoned = list(cordoned)
    t = Table(
        title="unhealthy workers: no rank is placed on them",
        caption="`surgectl uncordon WORKER` ends a cordon at once"
        + ("; a lost worker's ends when its node agent registers again" if any(c.lost for c in cordoned) else ""),
    )
    for col in ("worker", "since", "reason", "until"):
        t.add_column(col)
    for c in cordoned:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.unix_time)) if c.unix_time else "—"
        # A quarantine (a sick node) is the operator's to end; a device's cordon also ends
        # when its node agent registers again.
        # (was: a device's or a drain's cordon said to end with `surgectl restart WORKER`,
        # which restarts a leaving node's agent; the operator's way is the uncordon)
        until = f"`surgectl uncordon {c.worker_id}`"
        if not c.quarantine:
            until += " (or a new node agent of it registering)"
        if c.lost:  # (its agent is gone: nothing runs there; `up` starts what is down)
            until = "a node agent of it registers again (`surgectl up` starts what is down)"
        if c.held:  # (its agent is silent, maybe stopped or starved: its next beat ends the hold)
            until = "its node agent beats again"
        t.add_row(c.worker_id, since, c.reason, until)
    return t


def audit_table(view, show_unused: bool = True) -> Table:
    """The live permission matrix (``services.cli.audit.AuditView``): routes that carried
    messages, refused sends in red, then (``show_unused``) the table's unused routes, dim."""
    t = Table(title=f"routes of {', '.join(view.processes)}")
    for col in ("sender", "message", "receiver", "kind", "count", "where"):
        t.add_column(col, justify="right" if col == "count" else "left")

    def short(message: str) -> str:
        return message.removeprefix("surge.v1.")

    def where(by: dict[str, int]) -> str:
        return " · ".join(f"{p} {n:,}" for p, n in by.items())

    for r in view.used:
        t.add_row(r.sender, short(r.message), r.receiver, r.kind, f"{r.count:,}", where(r.by_process))
    for r in view.violations:
        t.add_row(
            r.sender, short(r.message), r.receiver, "VIOLATION", f"{r.count:,}", where(r.by_process), style="bold red"
        )
    if show_unused:
        for r in view.unused:
            t.add_row(r.sender, short(r.message), r.receiver, r.kind, "0", "", style="dim")
    return t


def checkpoint_kind(info) -> tuple[str, int]:
    """(kind, bytes its save wrote) of a CheckpointInfo: ("baseline", every chunk),
    ("delta", the chunks that changed) or ("full", the whole version: plain files)."""
    if not info.chunk_path:
        return "full", info.bytes
    return ("baseline" if info.baseline else "delta"), info.written_bytes


def _parent_text(version: str, parent: str) -> str:
    """The parent's number when it is of the same job ("11" for "J:11"), else the whole name."""
    if not parent:
        return "—"
    job, _, _ = version.rpartition(":")
    pjob, _, n = parent.rpartition(":")
    return n if pjob == job else parent


def verdict_line(v) -> str:
    """One CheckpointVerdict as a line: "J:3  ok  (1.5 MB)", or the version, its cause and the
    store's reason (which names the file or chunk, e.g. "chunks/1/<sha>: sha256 mismatch")."""
    if v.ok:
        return f"{v.info.version}  ok  ({size_text(v.info.bytes)})"
    cause = store_pb2.VerdictCause.Name(v.cause).removeprefix("VERDICT_").lower()
    return f"{v.info.version}  {cause.upper()}  {v.reason}"


def checkpoints_table(infos) -> Table:
    """One row a version: its parent (the number, of the same job), step, kind (baseline: its
    save wrote every chunk; delta: only the chunks that changed; full: a version of plain
    files), its whole size and what its save wrote (``size_text``: decimal units, as the job's
    checkpoint events say them), its checkpoint format (``fmt``; `-o json` also has
    ``surge_version``, the release that wrote it), and its manifest's hash (the first 12 hex
    digits; `-o json` has every field in bytes)."""
    t = Table(title="checkpoints")
    _id_column(t, "version")
    t.add_column("parent")
    t.add_column("step", justify="right")
    t.add_column("kind")
    t.add_column("size", justify="right")
    t.add_column("written", justify="right")
    t.add_column("fmt", justify="right")
    t.add_column("sha256")
    for c in infos:
        kind, written = checkpoint_kind(c)
        t.add_row(
            c.version,
            _parent_text(c.version, c.parent),
            str(c.step),
            kind,
            size_text(c.bytes),
            size_text(written),
            str(c.checkpoint_format or 1),
            c.manifest_sha256[:12],
        )
    return t


def datasets_table(datasets) -> Table:
    t = Table(title="datasets")
    _id_column(t, "dataset")
    for col in ("tokenizer", "vocab", "train docs", "train tokens", "val docs", "val tokens", "sha256"):
        t.add_column(col)
    for d in datasets:
        t.add_row(
            f"{d.name}@{d.version}",
            d.tokenizer,
            str(d.vocab_size),
            f"{d.train_documents:,}",
            f"{d.train_tokens:,}",
            f"{d.val_documents:,}",
            f"{d.val_tokens:,}",
            d.manifest_sha256[:12],
        )
    return t


@dataclass
class History:
    """What a followed job reported, for the summary and the plot."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    last: control_pb2.JobStatus | None = None

    def add(self, ev: control_pb2.JobEvent) -> None:
        """Take one event of the job's log: a new step or evaluation adds a point."""
        s = ev.status
        self.last = s
        if ev.type == "step" and s.step and (not self.steps or s.step > self.steps[-1]):
            self.steps.append(s.step)
            self.loss.append(s.train_loss)
            self.tokens_per_second.append(s.tokens_per_second)
        if ev.type == "eval" and not math.isnan(s.eval_loss):
            self.eval_steps.append(s.step)
            self.eval_loss.append(s.eval_loss)


def follow(events, quiet_types: frozenset[str] = frozenset({"step"}), training: bool = True) -> History:
    """Render a WatchJob stream as a progress bar (``training``: steps, loss, tokens/s; else a
    spinner and the time: an evaluation job takes no steps); return what it showed."""
    h = History()
    columns = (
        (
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        if training
        else (SpinnerColumn(), TimeElapsedColumn())
    )
    progress = Progress(TextColumn("[bold]{task.description}"), *columns, console=console)
    task = None
    with progress:
        for ev in events:
            h.add(ev)
            s = ev.status
            if task is None:
                task = progress.add_task(s.job_id, total=s.total_steps or None, loss="—", tps="—")
            progress.update(task, completed=s.step, loss=fmt_loss(s.train_loss), tps=f"{s.tokens_per_second:,.0f}")
            if ev.type not in quiet_types:
                said = ev.message.removeprefix(f"{ev.type} ")  # the label column names it once, not twice
                progress.console.print(Text(f"{ev.type:>10} ", style="dim") + Text(said), highlight=False)
    return h


def mfu_text(s: control_pb2.JobStatus) -> str:
    """``12.3 % of 989 TFLOP/s per device (data sheet: NVIDIA H200 bf16)``: MFU with what it divides by."""
    return f"{100 * s.mfu:.1f} % of {s.peak_tflops:.3g} TFLOP/s per device ({s.peak_source})"


def summary_table(s: control_pb2.JobStatus, h: History, extra: dict[str, str] | None = None) -> Table:
    t = Table(title=f"summary of {s.job_id}", show_header=False)
    t.add_column("what")
    t.add_column("value")
    rows = {
        "outcome": state_text(s),
        "steps": "evaluation" if is_evaluation(s) else f"{s.step}/{s.total_steps}",
        "final train loss": f"{fmt_loss(s.train_loss)} nats/token",
        "final held-out loss": f"{fmt_loss(s.eval_loss)} nats/token",
        # control's one definition, as `surgectl status` shows it (tokens / step seconds
        # of the job's steps but the first; services/control/orchestrator/training.py _throughput)
        "tokens/s (steps after the first)": tokens_per_second(s),
        # (JobStatus.tokens_seen: tokens processed, the steps a recovery replayed counted again)
        "tokens seen (replays counted again)": f"{s.tokens_seen:,}",
        # over the same steps as the tokens/s row (control's JobStatus.mfu), not the last step's
        **({"MFU (steps after the first)": mfu_text(s)} if s.peak_tflops else {}),
        "training wall time": f"{s.elapsed_seconds:.1f} s",
        "checkpoint": s.checkpoint_version or "—",
        **(extra or {}),
    }
    for k, v in rows.items():
        t.add_row(k, v)
    return t


PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what matplotlib writes by the name's suffix (no other backend here)


def loss_and_rate_axes():
    """A figure of two axes, loss (nats/token) and tokens/s against step: (plt, fig, ax1, ax2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, label in ((ax1, "loss (nats/token)"), (ax2, "tokens/s")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return plt, fig, ax1, ax2


def check_plot_out(out: Path, option: str = "--out") -> None:
    """Refuse a plot's file named by the user before any work is done (the tables printed, the
    records read): a suffix matplotlib does not write, a folder, or a parent folder that is not
    there. A missing folder is not created: a typo in it (`--out reslts/a.png`) would otherwise
    leave a stray tree behind, and `plot`, `compare` and the shell's `>` agree on this.

    Raises:
        CliError (exit 2): one line naming ``option`` and the path."""
    if out.is_dir():
        raise CliError(
            f"{option}: {out} is a directory; name a file in it (ending in {', '.join(PLOT_SUFFIXES)})", code=2
        )
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise CliError(f"{option}: {out}: the file name must end in {', '.join(PLOT_SUFFIXES)}", code=2)
    from services.cli.path_options import check_parent

    check_parent(out, option)


def save_figure(plt, fig, out: Path, title: str) -> Path:
    """Title, lay out and write ``fig`` to ``out`` (PNG, SVG or PDF by its suffix), whose folder
    exists (:func:`check_plot_out`); closed either way."""
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def plot(h: History, out: Path, title: str) -> Path:
    """Write loss (train and held-out) and tokens/s against step to ``out`` (PNG)."""
    plt, fig, ax1, ax2 = loss_and_rate_axes()
    ax1.plot(h.steps, h.loss, label="train", lw=1)
    if h.eval_steps:
        ax1.plot(h.eval_steps, h.eval_loss, "o-", label="held-out")
    ax1.legend()
    ax2.plot(h.steps, h.tokens_per_second, lw=1, color="tab:green")
    return save_figure(plt, fig, out, title)
