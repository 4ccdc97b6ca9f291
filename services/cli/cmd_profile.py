"""surgectl profile: a torch.profiler trace of a running job's next steps, from every rank."""

from __future__ import annotations

import json
import time

import typer
from rich.table import Table

from services.cli import clients, jsonout, render
from services.cli.app import OutputOpt, _say, app
from services.cli.errors import CliError
from services.cli.jobs import resolve_job
from services.cli.numbers import WEEK_S, float_option
from services.common import paths
from services.contract import control_pb2

PROFILE_MAX_STEPS = 100  # control's bound (services/control/orchestrator/profiles.py)
POLL_SECONDS = 1.0


@app.command("profile")
def profile_job(
    job: str = typer.Argument(..., help="job id or name (running)"),
    steps: int = typer.Option(3, "--steps", min=1, max=PROFILE_MAX_STEPS, help="how many steps to profile"),
    wait_seconds: float = float_option(
        600.0, "--wait-seconds", min=0.0, max=WEEK_S, help="how long to wait for every rank's files (0: do not wait)"
    ),
    output: str = OutputOpt,
) -> None:
    """Record a torch.profiler trace of a running job's next steps on every rank (and a CUDA
    memory snapshot on a GPU), from the step boundary the ranks agree on. The files are kept
    beside the job's metrics: <store>/metrics/JOB/profiles/cmd<N>/. Open a trace
    (.trace.json.gz) in https://ui.perfetto.dev or chrome://tracing, a memory snapshot in
    https://pytorch.org/memory_viz. The job trains on meanwhile; a profile that fails is
    reported, never a fault.

    Example: surgectl profile demo-3f2a1c --steps 5
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    job_id = resolve_job(job)
    st = clients.call(
        "control", lambda s: s.ProfileJob(control_pb2.ProfileJobRequest(job_id=job_id, steps=steps), timeout=10)
    )
    asked = st.profiles[-1]
    if output == "table":
        _say(
            f"{job_id}: profile #{asked.seq} of the next {steps} step{'s' if steps > 1 else ''} asked of "
            f"{asked.ranks} rank{'s' if asked.ranks > 1 else ''}"
            + (
                f"; waiting up to {wait_seconds:g} s for their files (Ctrl-C stops waiting, not the profile)"
                if wait_seconds
                else ""
            )
        )
    if not wait_seconds:
        if output == "json":
            print(json.dumps(jsonout.to_plain(asked), indent=2))
        else:
            _say(f"`surgectl events {job_id} --type profile` shows each rank's files as they are stored")
        return
    try:
        info = _wait(job_id, asked.seq, wait_seconds)
    except KeyboardInterrupt:
        raise CliError(
            f"interrupted: profile #{asked.seq} goes on; `surgectl events {job_id} --type profile` shows its files",
            code=130,
        ) from None
    if output == "json":
        print(json.dumps(jsonout.to_plain(info), indent=2))
    elif info.recorded:  # (none: the error below is all there is to say, not an empty table first)
        render.console.print(_table(info))
        if any(not r.error for r in info.recorded):
            _say("open a .trace.json.gz in https://ui.perfetto.dev (or chrome://tracing)")
        short = [r for r in info.recorded if not r.error and r.last_step - r.first_step + 1 < info.steps]
        if short:
            _say(
                f"cut short: steps {short[0].first_step}-{short[0].last_step}, "
                f"{short[0].last_step - short[0].first_step + 1} of {info.steps} (the run ended or stopped first)"
            )
    missing = info.ranks - len(info.recorded)
    failed = [r for r in info.recorded if r.error]
    if missing and info.lost:  # (control decided those reports never come: its ranks were relaunched, or the job ended)
        raise CliError(f"profile #{info.seq} lost: {info.lost}")
    if missing:
        raise CliError(
            f"profile #{info.seq}: {missing} of {info.ranks} ranks reported nothing within {wait_seconds:g} s "
            f"(`surgectl events {job_id} --type profile` shows them as they come)"
        )
    if failed:
        raise CliError(
            f"profile #{info.seq}: {len(failed)} of {info.ranks} ranks recorded no profile: {failed[0].error}"
        )


def _wait(job_id: str, seq: int, wait_seconds: float) -> control_pb2.ProfileInfo:
    """The profile ``seq`` once every rank reported, control marked it lost, the job ended, or
    ``wait_seconds`` passed."""
    deadline = time.monotonic() + wait_seconds
    with clients.stub("control") as s:
        while True:
            st = s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10)
            info = next((p for p in st.profiles if p.seq == seq), None)
            if info is None:  # (older than the newest the status keeps: someone asked for many since)
                raise CliError(
                    f"profile #{seq}: job {job_id}'s status no longer names it; see its events --type profile"
                )
            ended = st.state == control_pb2.TERMINATED
            if len(info.recorded) >= info.ranks or info.lost or ended or time.monotonic() >= deadline:
                return info
            time.sleep(POLL_SECONDS)


def _table(info: control_pb2.ProfileInfo) -> Table:
    t = Table(title=f"profile #{info.seq}")
    for col in ("rank", "steps", "MB", "seconds", "files, or why not"):
        t.add_column(col)
    root = paths.store_root()
    for r in sorted(info.recorded, key=lambda r: r.rank):
        steps = f"{r.first_step}-{r.last_step}" if r.last_step >= r.first_step else "-"
        where = r.error or "\n".join(str(root / f) for f in r.files)
        t.add_row(str(r.rank), steps, f"{r.bytes / 1e6:.1f}", f"{r.seconds:.2f}", where)
    return t
