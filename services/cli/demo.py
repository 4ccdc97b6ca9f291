"""`make demo`: the whole system on its main job, end to end, leaving nothing running."""

from __future__ import annotations

import time
from pathlib import Path

from services.cli import render, stack
from services.cli.errors import CliError
from services.cli.jobs import follow_job, sample_text, submit_job
from services.common import paths
from services.contract import control_pb2
from services.jobspec import JobSpecError, load_job_spec

SAMPLE_PROMPT = "def "


def run_demo(spec_path: Path) -> None:
    t0 = time.monotonic()
    try:
        spec = load_job_spec(spec_path)
    except JobSpecError as e:
        raise CliError(str(e), code=2) from None
    _ensure_dataset(spec.data.name, spec.data.version)
    started_here = stack.read_stack() is None
    if started_here:
        render.console.rule("starting the stack")
        t_up = time.monotonic()
        stack.up(num_workers=spec.world_size)
        render.console.print(f"stack up in {time.monotonic() - t_up:.1f} s")
    job_id = ""  # (none submitted yet)
    try:
        render.console.rule(f"training {spec_path}")
        status = submit_job(spec_path)
        job_id = status.job_id
        history = follow_job(status.job_id)
        final = history.last
        png = render.plot(
            history, paths.surge_home() / f"{final.job_id}-loss.png", f"{final.job_id}: loss and throughput"
        )
        sample = ""
        if final.checkpoint_version:
            sample = sample_text(final.checkpoint_version, SAMPLE_PROMPT, 160, 0.8, 40, 0)
        render.console.print(
            render.summary_table(
                final,
                history,
                {
                    "loss curve": str(png),
                    "demo wall time (so far)": f"{time.monotonic() - t0:.1f} s",
                },
            )
        )
        if sample:
            render.console.rule(f"sample from {final.checkpoint_version}, prompt {SAMPLE_PROMPT!r}")
            render.console.print(sample, markup=False, highlight=False)
        if final.outcome != control_pb2.FINISHED:
            raise CliError(f"job {final.job_id} did not finish: {render.state_text(final)} {final.message}")
    except BaseException:  # (a Ctrl-C, a failure) while its job may be live: stopped before the stack
        if started_here and job_id:
            with stack.ignoring_interrupts():  # (bounded: STOP_WAIT_S)
                said = stop_live_job(job_id)
            if said:
                render.interrupt_line = "interrupted: the demo's job is stopped (above), and the stack it started"
                render.console.print(said, markup=False, highlight=False, soft_wrap=True)
        raise
    finally:
        if started_here:
            stopped = stack.down()
            render.console.print(
                stopped_line(len(stopped), time.monotonic() - t0, job_id),
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


# How long an interrupted demo waits for its job's stop (no checkpoint: the next step boundary
# the ranks agree on; the demo's steps take well under a second).
STOP_WAIT_S = 30.0


def stop_live_job(job_id: str) -> str:
    """The demo interrupted (or failed) with its job live: stop it and wait for its end, so that
    stopping the stack leaves no job RUNNING for the next `surgectl up` to find without its ranks
    (was: a worker_lost fault, a restart spent, and the job trained again from its newest
    checkpoint, or from scratch, unasked). The line to say; "" when the job had ended."""
    import grpc

    from services.cli import clients

    try:
        with clients.open_channel(clients.address("control")) as ch:
            stub = clients.new_stub("control", ch)
            s = stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10)
            if s.state == control_pb2.TERMINATED:
                return ""
            s = stub.StopJob(control_pb2.StopJobRequest(job_id=job_id, no_checkpoint=True), timeout=10)
            deadline = time.monotonic() + STOP_WAIT_S
            while s.state != control_pb2.TERMINATED and time.monotonic() < deadline:
                time.sleep(0.2)
                s = stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10)
    except (grpc.RpcError, CliError) as e:
        why = e.details() if isinstance(e, grpc.RpcError) else str(e)
        return f"{job_id}: not stopped ({why}); control decides about it at the next `surgectl up`"
    if s.state != control_pb2.TERMINATED:
        return (
            f"{job_id}: not ended {STOP_WAIT_S:g} s after its stop ({render.state_text(s)}); "
            "control decides about it at the next `surgectl up`"
        )
    if not s.checkpoint_version:
        return f"{job_id}: stopped at step {s.step}, before its first checkpoint"
    return (
        f"{job_id}: stopped at step {s.step}; `surgectl up`, then `surgectl resume {job_id}`, continues it "
        f"from {s.checkpoint_version}"
    )


def stopped_line(services: int, total_s: float, job_id: str) -> str:
    """The demo's last line: the stack it started is stopped, and what reads the job then (a
    fresh user's `surgectl status` after `make demo` found no stack and nothing said why)."""
    line = f"stack stopped ({services} services); total {total_s:.1f} s"
    if not job_id:
        return line
    return (
        f"{line}. `surgectl up` starts it again to read {job_id} (`surgectl status {job_id}`, `events`, "
        f"the dashboard); `surgectl logs {job_id}` and `surgectl plot {job_id}` read its files without it"
    )


def _ensure_dataset(name: str, version: str) -> None:
    from services.data.prepare import default_stdlib_source, prepare_dataset

    root = paths.datasets_root()
    if (root / name / version / "manifest.json").exists():
        return
    if name != "stdlib":
        raise CliError(
            f"dataset {name}@{version} is not prepared "
            f"(surgectl dataset prepare --name {name} --version {version} --source DIR)"
        )
    render.console.rule(f"preparing {name}@{version} from {default_stdlib_source()}")
    t = time.monotonic()
    info = prepare_dataset(default_stdlib_source(), name, version, root)
    render.console.print(f"prepared in {time.monotonic() - t:.1f} s: {info}")
