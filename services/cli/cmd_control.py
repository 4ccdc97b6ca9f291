"""surgectl pause, resume, thaw, rollback, scale, stop, cancel, revoke, workers, uncordon and drain: operator commands."""

from __future__ import annotations

import json
import math
import time

import typer

from services.cli import clients, render, stack
from services.cli.app import NoCheckpointOpt, OutputOpt, _again, _say, app
from services.cli.errors import CliError
from services.cli.jobs import resolve_job, resolve_versions_job
from services.cli.numbers import WEEK_S, float_option
from services.cli.worker_slots import Slots, WorkerHealth, health_of, read_slots
from services.contract import control_pb2
from services.jobspec import STEP_FAULT_CLASSES


@app.command()
def pause(job: str, no_checkpoint: bool = NoCheckpointOpt) -> None:
    """Pause a running job at a step boundary (every rank stops at the same step), after
    checkpointing that step (unless --no-checkpoint).

    Example: surgectl pause demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.PauseJobRequest(job_id=job, no_checkpoint=no_checkpoint)
    with stack.exit_on_interrupt(_again("pause", job)):
        s = clients.call("control", lambda st: st.PauseJob(req, timeout=10))
    if s.state == control_pb2.PAUSED:  # (asked again: it was paused already)
        _say(f"{job}: PAUSED at step {s.step}; `surgectl resume {job}` continues it")
        return
    _say(f"{job}: pause requested; now {render.state_text(s)} (it pauses at its next step boundary)")


@app.command()
def resume(
    job: str,
    from_version: str | None = typer.Option(
        None,
        "--from",
        help="the checkpoint version to continue from "
        "('<job>:<n>', see `surgectl checkpoints JOB`; default or 'latest': the newest that verifies)",
    ),
    dp: int | None = typer.Option(
        None,
        "--dp",
        min=1,
        max=2**32 - 1,
        help="relaunch at this data-parallel size (the global batch must stay the job's)",
    ),
    micro_batch_size: int | None = typer.Option(
        None,
        "--micro-batch-size",
        min=1,
        max=2**32 - 1,
        help="rows per rank per micro-step at the new layout (default: the job's)",
    ),
    grad_accum: int | None = typer.Option(
        None,
        "--grad-accum",
        min=1,
        max=2**32 - 1,
        help="micro-steps per optimizer step at the new layout (default: the job's)",
    ),
) -> None:
    """Resume a job: a paused one where it paused; a stopped or failed one (or one drained
    by `surgectl down`) from its newest checkpoint that verifies, or --from VERSION, on ranks
    allocated again, bit-exactly where that checkpoint left off.

    --dp N (with --micro-batch-size / --grad-accum) relaunches it at another data-parallel
    size: the global batch (micro_batch_size x grad_accum x dp rows) must stay the job's, and
    the ranks must fit the cluster; the job's spec becomes the new layout and it continues on
    the same global batches (model and optimizer resharded). A paused job with running ranks
    is stopped first (`surgectl stop JOB`).

    Example: surgectl resume demo-3f2a1c --from demo-3f2a1c:4 --dp 1 --grad-accum 2
    """
    if from_version is not None and not from_version.strip():  # (`--from ""`: not "the newest", a mistake)
        raise CliError("--from: empty (a checkpoint version JOB:N; leave --from out for the newest)", code=2)
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(
        job_id=job,
        from_version=_own_version(job, from_version, "--from"),
        dp=dp or 0,
        micro_batch_size=micro_batch_size or 0,
        grad_accum=grad_accum or 0,
    )
    with stack.exit_on_interrupt(_again("resume", job)):
        s, running = _or_already(lambda st: st.ResumeJob(req, timeout=90), job, control_pb2.REFUSED_ALREADY_RUNNING)
    if running:  # (asked again: it runs already, as a stop asked again of a stopped job)
        _say(f"{job}: already {render.state_text(s)}; nothing to resume")
        return
    if s.state == control_pb2.STANDBY:  # its ranks do not fit now: it waits in the queue, as a submit does
        why = s.message.removeprefix("queued: ")  # (control's status line, shown as it is)
        _say(f"{job}: resume waits in the queue (#{s.queue_position}): {why}; `surgectl cancel {job}` takes it out")
        return
    where = f" from checkpoint {s.checkpoint_version} (step {s.step})" if s.state == control_pb2.WARMING_UP else ""
    if where and req.dp + req.micro_batch_size + req.grad_accum:
        where += (
            f" at dp {s.dp} x micro_batch_size {s.micro_batch_size} x grad_accum {s.grad_accum}"
            f" ({s.world_size} rank{'' if s.world_size == 1 else 's'})"
        )
    render.console.print(
        f"{job}: resumed{where}; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True
    )


@app.command()
def thaw(job: str) -> None:
    """End a job's hold for inspection now (fault_policy.freeze_seconds): the recovery its
    fault policy decided (a relaunch) runs at once instead of when the hold runs out. A job
    not held is refused, nothing changed. (`surgectl stop JOB` ends a held job instead.)

    Example: surgectl thaw demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(job_id=job, thaw_only=True)
    s = clients.call("control", lambda st: st.ResumeJob(req, timeout=90))
    render.console.print(f"{job}: thawed; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def rollback(
    job: str,
    version: str | None = typer.Option(
        None,
        "--version",
        help="the committed version to go back to, JOB:N (default or 'latest': the newest not known bad)",
    ),
) -> None:
    """Roll a RUNNING job back to a committed checkpoint in place: its ranks pause at a step
    boundary they agree on (no checkpoint), load the version into their live processes (none
    is relaunched) and train on from its step, bit-exactly as a relaunch from it would. The
    versions committed after it are kept, as another branch (`surgectl resume --from` names one).

    Example: surgectl rollback demo-3f2a1c --version demo-3f2a1c:4
    """
    if version is not None and not version.strip():  # (an unset variable: never "the newest" by accident)
        raise CliError("--version: empty (a checkpoint version JOB:N; leave --version out for the newest)", code=2)
    job = resolve_job(job)
    req = control_pb2.ResumeJobRequest(
        job_id=job, from_version=_own_version(job, version, "--version"), rollback_in_place=True
    )
    s = clients.call("control", lambda st: st.ResumeJob(req, timeout=90))
    if s.rollback_in_flight:  # (control folded it into the same rollback in flight: nothing new was asked)
        asked = f" (asked at {_local_time(s.rollback_asked_unix)})" if s.rollback_asked_unix else ""
        line = f"{job}: already rolling back to {s.rollback_in_flight}{asked}; nothing new asked"
    else:
        line = f"{job}: rolling back in place; now {render.state_text(s)}"
    render.console.print(line, markup=False, highlight=False, soft_wrap=True)


def _local_time(unix: float) -> str:
    """``unix`` as this machine's local time, with its date when that is not today."""
    when, now = time.localtime(unix), time.localtime()
    same_day = when[:3] == now[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", when)


def _own_version(job: str, version: str | None, flag: str) -> str:
    """The version ``flag`` names for ``job``'s resume or rollback: "" (the newest usable, as
    with the flag left out) for ``latest`` and ``<job>:latest``, the README's VERSION forms
    (were refused as unknown versions).

    Raises:
        CliError (exit 2): ``<other job>:latest``: a resume or rollback loads its own job's versions.
    """
    if not version:
        return ""
    if version == "latest":
        return ""
    ref, sep, n = version.rpartition(":")
    if sep and n == "latest":
        if resolve_job(ref) != job:
            raise CliError(f"{flag} {version}: names another job's versions; {job} loads one of its own", code=2)
        return ""
    if sep and ref and n.isdigit() and ref != job:  # (a job's name works as its id does)
        return f"{resolve_versions_job(ref, unknown_as_is=True)}:{n}"
    return version


@app.command()
def scale(
    job: str,
    dp: int = typer.Option(..., "--dp", min=1, max=2**32 - 1, help="the new data-parallel size"),
    micro_batch_size: int | None = typer.Option(
        None,
        "--micro-batch-size",
        min=1,
        max=2**32 - 1,
        help="rows per rank per micro-step at the new size (default: the largest not above the job's that fits)",
    ),
    grad_accum: int | None = typer.Option(
        None, "--grad-accum", min=1, max=2**32 - 1, help="micro-steps per optimizer step at the new size"
    ),
    wait_seconds: float = float_option(
        300.0, "--wait-seconds", min=0.0, max=86400.0, help="how long to wait for the resize to be done (0: do not)"
    ),
) -> None:
    """Grow or shrink a RUNNING job's data-parallel size without restarting the ranks that
    stay: the ranks pause at the next step boundary (no checkpoint), the ranks above the new
    size are released or the new ones launched, and every rank rebuilds its process group at
    the new size; new ranks take the model and optimizer from a live peer's memory. The
    global batch (micro_batch_size x grad_accum x dp rows) is kept, so the job goes on at
    the same global batches. Refused with one line where the plan cannot take it (tp or
    pp > 1, FSDP2, a global batch that does not split over the new size), and, before any rank
    pauses, where the new ranks do not fit the free slots now (exit 1). Waits until it is
    done; exit 1 if it was not (a slot was taken meanwhile: the job goes on at its size).

    Example: surgectl scale demo-3f2a1c --dp 3
    """

    job = resolve_job(job)
    req = control_pb2.ScaleJobRequest(
        job_id=job, dp=dp, micro_batch_size=micro_batch_size or 0, grad_accum=grad_accum or 0
    )
    asked = time.time()
    with stack.exit_on_interrupt(_again("scale", job)):
        s = clients.call("control", lambda st: st.ScaleJob(req, timeout=30))
    if s.dp == dp and micro_batch_size in (None, s.micro_batch_size) and grad_accum in (None, s.grad_accum):
        render.console.print(
            f"{job}: already at dp {s.dp} x micro_batch_size {s.micro_batch_size} x grad_accum {s.grad_accum}; "
            "nothing to do",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    render.console.print(
        f"{job}: scale to dp {dp} requested; now {render.state_text(s)}", markup=False, highlight=False, soft_wrap=True
    )
    if wait_seconds <= 0:
        return
    with stack.exit_on_interrupt(
        f"interrupted: stopped waiting; the resize goes on in control (`surgectl events {job}`)"
    ):
        done = _scale_outcome(job, asked, wait_seconds)
    if done is None:
        raise CliError(f"{job}: the resize was not done within {wait_seconds:g} s (see `surgectl events {job}`)")
    render.console.print(f"{job}: {done.message}", markup=False, highlight=False, soft_wrap=True)
    if done.status.dp != dp:
        raise typer.Exit(1)


def _scale_outcome(job: str, asked: float, wait_seconds: float) -> control_pb2.JobEvent | None:
    """The job's first ``scale`` event (done, not done or given up) after ``asked``, or
    None when none came within ``wait_seconds`` or the job ended first."""

    import grpc

    def first(stub) -> control_pb2.JobEvent | None:
        try:
            for ev in stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=wait_seconds):
                if ev.unix_time >= asked and ev.type == "scale":
                    return ev
                if ev.unix_time >= asked and ev.status.state == control_pb2.TERMINATED:
                    return None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # (the wait ran out: said by the caller)
                raise
        return None

    return clients.call("control", first)


@app.command()
def stop(job: str, no_checkpoint: bool = NoCheckpointOpt) -> None:
    """Stop a job at the next step boundary, after checkpointing that step (unless
    --no-checkpoint); `surgectl resume` continues it from there. A queued job leaves the
    queue (as with `surgectl cancel`). Refused, nothing changed, while the store does not
    answer (the checkpoint would fail): again once it answers, or --no-checkpoint.

    Example: surgectl stop demo-3f2a1c
    """
    job = resolve_job(job)
    if not no_checkpoint:
        _store_for_the_stop_checkpoint(job)
    req = control_pb2.StopJobRequest(job_id=job, no_checkpoint=no_checkpoint)
    with stack.exit_on_interrupt(_again("stop", job)):
        s, ended = _stop_job(req)
    if ended:  # (asked again: it had stopped, or ended, before)
        _say(f"{job}: already {render.state_text(s)}; nothing to stop")
        return
    # A running job stops at its next step boundary, after the checkpoint: say so, so that the
    # state read back ("now RUNNING") is not taken for a stop that failed.
    later = (
        "" if s.state == control_pb2.TERMINATED else f" (it stops at its next step boundary; `surgectl status {job}`)"
    )
    render.console.print(
        f"{job}: stop requested; now {render.state_text(s)}{later}", markup=False, highlight=False, soft_wrap=True
    )


def _store_for_the_stop_checkpoint(job: str) -> None:
    """A running job's stop checkpoints its step in the store (a paused one's too, unless a
    checkpoint holds the step it paused at). With the store not answering its health check,
    the stop is refused and nothing changes, as `down`'s drain is (before: the job stopped,
    the save failed, its steps after the newest checkpoint lost); `--no-checkpoint` stops it
    knowingly. A queued or ended job needs no store.

    Raises:
        CliError: the store did not answer (exit 1).
    """
    s = clients.call("control", lambda st: st.GetJob(control_pb2.JobQuery(job_id=job), timeout=10))
    saved = s.state == control_pb2.PAUSED and (s.drained or s.checkpoint_step >= s.step)
    if s.state not in (control_pb2.RUNNING, control_pb2.PAUSED) or saved:
        return  # (queued or ended; or paused at a step its checkpoint holds: the stop saves nothing)
    outage = clients.store_outage()
    if outage:
        newest = f"checkpoint {s.checkpoint_version} (step {s.checkpoint_step})" if s.checkpoint_version else "none yet"
        raise CliError(
            f"not stopped: {job}'s stop checkpoints its step in the store, which did not answer its health "
            f"check in {clients.STORE_PROBE_SECONDS:g} s ({outage}); `surgectl stop {job}` again once it "
            f"answers, or `surgectl stop {job} --no-checkpoint` to stop it now, losing its steps after its "
            f"newest checkpoint ({newest})",
            unreachable=True,
        )


@app.command()
def cancel(job: str) -> None:
    """Take a queued job out of control's job queue (it never ran: TERMINATED, STOPPED). A job
    that is not queued is refused and left as it is (`surgectl stop` stops it).

    Example: surgectl cancel demo-3f2a1c
    """
    job = resolve_job(job)
    req = control_pb2.StopJobRequest(job_id=job, queued_only=True)
    with stack.exit_on_interrupt(_again("cancel", job)):
        s, ended = _stop_job(req)
    if ended:  # (asked again: it left the queue, or ended, before)
        _say(f"{job}: already {render.state_text(s)}; nothing to take out of the queue")
        return
    _say(f"{job}: taken out of the queue; now {render.state_text(s)}")


def _stop_job(req: control_pb2.StopJobRequest) -> tuple[control_pb2.JobStatus, bool]:
    """StopJob; (the job's status, whether it had ended already: control's typed refusal
    REFUSED_ALREADY_ENDED, a stop or cancel run again, answered with its status)."""
    return _or_already(lambda st: st.StopJob(req, timeout=10), req.job_id, control_pb2.REFUSED_ALREADY_ENDED)


def _or_already(call, job_id: str, already: int) -> tuple[control_pb2.JobStatus, bool]:
    """``call`` on control's stub; (the job's status, whether control refused it as done
    already: the typed refusal ``already``, answered with the job's status as it is)."""
    import grpc

    from services.cli.errors import refusal_of

    addr = clients.address("control")
    with clients.open_channel(addr) as ch:
        st = clients.new_stub("control", ch)
        try:
            try:
                return call(st), False
            except grpc.RpcError as e:
                if refusal_of(e) != already:
                    raise
            return st.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10), True
        except grpc.RpcError as e:
            raise clients.rpc_error(e, "control", addr) from None


@app.command()
def revoke(
    job: str,
    fault_class: str = typer.Argument(
        ...,
        help="the step fault class whose standing order to withdraw: one of " + ", ".join(STEP_FAULT_CLASSES),
    ),
) -> None:
    """Withdraw a running job's standing order for a class of step faults (a verdict its ranks
    hold in advance, e.g. the default skip_step for gradient_overflow): from a step boundary
    every rank has yet to reach, each such fault is decided by the fault policy one at a
    time. Ranks a rebuild or a rollback in place keeps hold it withdrawn (a rank launched beside
    them is launched without it); a recovery that relaunches every rank gives them the policy's
    orders again, and says so in its events.

    Example: surgectl revoke demo-3f2a1c gradient_overflow
    """
    if fault_class not in STEP_FAULT_CLASSES:  # (bad input: said before control is asked)
        raise CliError(
            f"fault_class {fault_class!r}: not a step fault class; one of {', '.join(STEP_FAULT_CLASSES)}", code=2
        )
    job = resolve_job(job)
    req = control_pb2.RevokeOrderRequest(job_id=job, fault_class=fault_class)
    with stack.exit_on_interrupt(_again("revoke", job, f" {fault_class}")):
        s = clients.call("control", lambda st: st.RevokeOrder(req, timeout=10))
    _say(f"{job}: standing order for {fault_class} withdrawn at its next step boundary; now {render.state_text(s)}")


@app.command()
def workers(
    output: str = OutputOpt,
    metrics: str = typer.Option(
        "", "--metrics", help="control's /metrics URL (its slot census); default: the local stack's control"
    ),
) -> None:
    """List the registered workers: each one's devices, rank slots (used, free) and health
    (cordoned, quarantined or lost, with the reason; ranks on it named slow; data-plane links to
    it named degraded or down). The worker ids are what `drain` and `uncordon` take. Slots come
    from control's /metrics (the local stack's, or --metrics URL); when it cannot be read the
    workers control's job list names (cordoned, quarantined, lost, slow ranks, links) are still
    listed, their slots shown as "?".

    Example: surgectl workers; surgectl workers -o json
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    if metrics and not metrics.startswith(("http://", "https://")):  # (bad input: not "did not answer")
        raise CliError(f"--metrics: expected an http:// or https:// URL of control's /metrics, got {metrics!r}", code=2)
    url = metrics or stack.control_metrics_url()
    listed = clients.call("control", lambda st: st.ListJobs(control_pb2.JobQuery(), timeout=10))
    slots = read_slots(url, timeout_s=10) if url else None
    health = health_of([s.worker_id for s in slots or ()], listed.jobs, listed.cordoned)
    unread = ""
    if slots is None:
        where = f"control's /metrics at {url} did not answer" if url else "no local stack here: pass --metrics URL"
        unread = f"slots not read ({where}); " + (
            'the workers control\'s job list names are shown, their slots as "?"' if health else "no worker listed"
        )
    if output == "json":
        by_id = {s.worker_id: s for s in slots or ()}
        print(json.dumps([_worker_json(h, by_id.get(h.worker_id)) for h in health], indent=2))
    elif health:
        render.console.print(render.workers_table(slots, health))
        if slots is not None:
            _say(f"{len(slots)} workers registered; rank slots: {sum(s.used for s in slots)} used, "
                 f"{sum(s.free for s in slots)} free")  # fmt: skip
    elif slots is not None:
        _say("no worker is registered")
    if unread:
        raise CliError(unread)


def _worker_json(h: WorkerHealth, s: Slots | None) -> dict:
    return {
        "worker_id": h.worker_id,
        "devices": [{"kind": k, "name": n, "count": c} for k, n, c in s.devices] if s else None,
        "slots_used": s.used if s else None,
        "slots_free": s.free if s else None,
        "placeable": not h.cordoned,
        "health": list(h.findings),
    }


@app.command()
def uncordon(worker: str = typer.Argument(..., help="the worker id, as `surgectl workers` lists it")) -> None:
    """End a worker's cordon: a sick node's quarantine (its rank faults piled up across jobs),
    or a device's. New and relaunched ranks may be placed on it again. A worker with no
    cordon is refused in one line.

    Example: surgectl uncordon worker-2
    """
    if not worker.strip():  # (control's "UncordonWorker: worker_id is required" named its RPC, not the argument)
        raise CliError("WORKER: empty (a worker id, as `surgectl workers` lists it)", code=2)
    req = control_pb2.UncordonWorkerRequest(worker_id=worker)
    left = clients.call("control", lambda st: st.UncordonWorker(req, timeout=10)).cordoned
    still = f"; still cordoned: {', '.join(c.worker_id for c in left)}" if left else ""
    _say(f"{worker}: uncordoned; ranks may be placed on it again{still}")


@app.command(name="drain")
def drain_node(
    worker: str = typer.Argument(..., help="the worker id, as `surgectl workers` lists it"),
    deadline: float = float_option(..., "--deadline", above=0.0, max=WEEK_S, help="seconds until the node leaves"),
) -> None:
    """Move every job off a node that leaves within DEADLINE seconds: nothing new is placed
    on it, and each job with ranks there checkpoints at a step boundary every rank agrees on,
    then continues on other slots from that checkpoint (no step lost, no fault). A deadline
    too short for the job's last measured save moves it at once from its newest checkpoint,
    with a warning in its events. `surgectl uncordon` makes the node placeable again.

    Example: surgectl drain worker-2 --deadline 120
    """
    if not 0 < deadline < math.inf:  # (NaN and inf too)
        raise CliError(f"--deadline must be a finite number of seconds > 0, got {deadline:g}", code=2)
    if not worker.strip():
        raise CliError("WORKER: empty (a worker id, as `surgectl workers` lists it)", code=2)
    req = control_pb2.DrainWorkerRequest(worker_id=worker, deadline_seconds=deadline)
    moved = clients.call("control", lambda st: st.DrainWorker(req, timeout=10)).jobs
    jobs = (
        f"; moving {', '.join(j.job_id for j in moved)} (`surgectl events JOB --type departure`)"
        if moved
        else "; no job's ranks on it"
    )
    _say(f"{worker}: draining, leaves within {deadline:g} s; nothing new is placed on it{jobs}")
