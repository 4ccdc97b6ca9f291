"""`surgectl down` drains running jobs; `surgectl up` brings drained jobs back (issue 12).

Down: every running or paused job is asked to pause with a checkpoint as a drain
(``PauseJobRequest.drain``; control journals it), and the stack stops only once each is
PAUSED (or ended). Asked again (a `down` cut short and run again), a drain answers the
job's status: the second `down` waits for what the first started. A job still warming up is asked once it runs; a recovering one
(FAULT_FROZEN: no rank trains) is left to control, which continues its recovery after `up`. Up: every job control reports
``drained`` is resumed from its drain checkpoint (``ResumeJob``), waiting for the node agents
to register first (a resume that finds too few free slots waits in control's queue, first;
an older control's refusal is asked again, up to a limit). A drained job whose ranks are
still there (`down` cut short before it stopped the stack) simply continues.

The CLI watches job states by asking control (GetJob) every fraction of a second: it is an
operator tool waiting for a condition, not a module (the laws bind the modules).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from services.cli import clients
from services.cli.errors import CliError, refusal_of
from services.common import save_failing
from services.contract import control_pb2

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
LIVE = (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED, JobState.FAULT_FROZEN)
POLL_S = 0.2


def live_jobs(stub) -> list[control_pb2.JobStatus]:
    """Jobs whose ranks may run (or be about to): what a stop of the stack would cut short."""
    return [j for j in stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs if j.state in LIVE]


def drain(stub, jobs: list[control_pb2.JobStatus], timeout_s: float, say: Callable[[str], None]) -> list[str]:
    """Pause each of ``jobs`` with a checkpoint, as a drain; return once every one is
    PAUSED (or TERMINATED). Returns the ids of the jobs drained (paused by this drain).

    Raises:
        CliError: a job did not pause within ``timeout_s`` (the stack is left running).
    """
    deadline = time.monotonic() + timeout_s
    for j in jobs:
        if j.state == JobState.FAULT_FROZEN:  # no ranks train: nothing to lose beyond the checkpoint it restores
            say(f"{j.job_id}: FAULT_FROZEN ({j.message}); not drained: control continues its recovery after `up`")
    pending = {j.job_id: j for j in jobs if j.state != JobState.FAULT_FROZEN}
    asked: set[str] = set()
    drained: list[str] = []
    unsafe: list[str] = []
    untils: list[str] = []  # (per unsafe job: when `down` again can save it)
    while pending:
        for job_id in list(pending):
            status = stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10)
            if job_id not in asked and status.state in (JobState.RUNNING, JobState.PAUSED):
                try:
                    status = stub.PauseJob(control_pb2.PauseJobRequest(job_id=job_id, drain=True), timeout=10)
                    asked.add(job_id)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    # a stop in flight: wait for it to end (another refusal: asked again)
                    if refusal_of(e) == control_pb2.REFUSED_STOP_PENDING:
                        asked.add(job_id)
            if status.state == JobState.FAULT_FROZEN:  # a fault meanwhile: its recovery drops the pause
                say(
                    f"{job_id}: FAULT_FROZEN ({status.message}); not drained: control continues its recovery after `up`"
                )
                pending.pop(job_id)
                continue
            if (
                job_id in asked
                and status.state == JobState.PAUSED
                and not status.drained
                and status.checkpoint_step < status.step
            ):
                # Its checkpoint of the pause could not be saved (the store away, or answering
                # and refusing the write: control's typed save_failing says which): the stack
                # must not take its ranks, or the steps since that checkpoint are lost.
                failing = status.save_failing
                why = f"; its save failed: {save_failing.why(failing)}" if failing.failed else ""
                unsafe.append(
                    f"{job_id} (paused at step {status.step}, newest checkpoint "
                    f"{status.checkpoint_version or 'none'} at step {status.checkpoint_step}{why})"
                )
                untils.append(save_failing.until(failing) if failing.failed else "once the store answers")
                pending.pop(job_id)
                continue
            if status.state == JobState.TERMINATED or (job_id in asked and status.state == JobState.PAUSED):
                if status.state == JobState.PAUSED:
                    drained.append(job_id)
                    # What `up` does with it, read from control's answer to the drain: a drain's own
                    # pause (a running job's; a refused drain's, asked again) is resumed, an operator's
                    # stays (said before the drain from the status it had: wrong for the second).
                    then = (
                        "`surgectl up` resumes it"
                        if status.drained
                        else f"stays PAUSED after `surgectl up` (`surgectl resume {job_id}` continues it)"
                    )
                    say(
                        f"{job_id}: PAUSED at step {status.step} ({status.checkpoint_version or 'no checkpoint'}); {then}"
                    )
                else:
                    say(f"{job_id}: ended meanwhile ({JobOutcome.Name(status.outcome)})")
                pending.pop(job_id)
        if pending and time.monotonic() > deadline:
            left = ", ".join(
                f"{j} ({JobState.Name(stub.GetJob(control_pb2.JobQuery(job_id=j), timeout=10).state)})" for j in pending
            )
            raise CliError(
                f"not drained within {timeout_s:.0f} s: {left}; the stack keeps running "
                "(`surgectl down` again waits for them, `surgectl up` lets them go on, `surgectl down --force` "
                "stops it anyway, losing their steps since their last checkpoint)"
            )
        if pending:
            time.sleep(POLL_S)
    if unsafe:
        # (when again: for the state the stack is in; was "once the store answers" for a store
        # that answered and refused the write, a full disk: fresh SRE's trial, F1)
        when = " and ".join(dict.fromkeys(untils))
        raise CliError(
            f"not drained: {'; '.join(unsafe)}: its steps since that checkpoint would be lost; the stack "
            f"keeps running (`surgectl down` again {when}, or `--force` to lose them)"
        )
    return drained


def park(stub, say: Callable[[str], None]) -> tuple[bool, list[control_pb2.JobStatus]]:
    """`surgectl down --force`: control parks every running or paused job at once
    (``PauseJobRequest.force``: no pause asked of its ranks, the next `up` resumes it from its
    newest checkpoint, no fault recorded). Returns whether any job was live, and control's
    answer for each job it parked (what it resumes from is said once the stack has stopped:
    :func:`resume_points`). A job control does not park (no checkpoint yet, a resize in
    flight) is said in one line; the stack stops all the same.

    Raises:
        grpc.RpcError: control could not list the jobs."""
    jobs, parked = live_jobs(stub), []
    for j in jobs:
        try:
            s = stub.PauseJob(control_pb2.PauseJobRequest(job_id=j.job_id, drain=True, force=True), timeout=10)
        except grpc.RpcError as e:
            say(f"{j.job_id}: not parked ({e.details()}); control decides about it after `up`")
            continue
        if s.drained:
            parked.append(s)
            say(f"{j.job_id}: parked at step {s.step}; its ranks stop with the stack")
        elif s.state == JobState.PAUSED and s.checkpoint_version:
            # Control parks every PAUSED job with a checkpoint: not drained, it was parked
            # before, as the operator's pause (kept: `up` resumes only drained jobs; was: "control
            # continues it after `up`", and two `up`s left it PAUSED, a fresh operator's trial).
            say(
                f"{j.job_id}: PAUSED at step {s.step} by the operator, not drained: `surgectl up` leaves it PAUSED "
                f"(`surgectl resume {j.job_id}` relaunches it from its newest checkpoint)"
            )
        else:
            say(f"{j.job_id}: {JobState.Name(s.state)}, not parked: control continues it after `up`")
    return bool(jobs), parked


def resume_points(parked: list[control_pb2.JobStatus], store_root) -> list[str]:
    """What `surgectl up` resumes each parked job from, said once the stack has stopped.

    Not control's answer to the park: a save whose commit was on its way then still lands
    (fresh user, session 25: `down --force` named :1, `up` resumed from :2, whose commit
    reached control after the park's answer). Once the ranks are gone no commit can come, and
    the store's catalog under ``store_root`` (the local stack's, read-only) holds what `up`'s
    resume chooses from: the newest version whose verdict is ok (``recorded_verdicts``: as
    recorded; the resume hashes the bytes again, so a version damaged since is passed over
    then). Where that catalog cannot be read here (a store elsewhere), or holds no version of
    the job, control's answer is given for what it is."""
    from services.store.checkpoint_manager import recorded_verdicts

    lines = []
    for s in parked:
        try:
            ok = [v.info for v in recorded_verdicts(store_root, s.job_id) if v.ok]
        except (ValueError, OSError):
            ok = []
        if not ok:
            lines.append(
                f"{s.job_id}: `surgectl up` resumes it from its newest checkpoint that verifies (when parked: "
                f"{s.checkpoint_version}, step {s.checkpoint_step}); the steps after it are lost"
            )
            continue
        info = max(ok, key=lambda i: (i.step, int(i.version.rpartition(":")[2] or 0)))  # (the resume's order)
        after = s.step - info.step  # (the steps it trained after that version, lost)
        lost = f"step {s.step} is lost" if after == 1 else f"steps {info.step + 1}-{s.step} are lost"
        lost = lost if after > 0 else "no step is lost"
        lines.append(f"{s.job_id}: `surgectl up` resumes it from {info.version} (step {info.step}); {lost}")
    return lines


def resume_drained(timeout_s: float, say: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Resume every job control reports drained, once its ranks fit (the node agents
    register with control after they answer their health check). Returns (resumed, failed
    with the reason)."""
    with clients.stub("control") as stub:
        drained = [j.job_id for j in stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs if j.drained]
        resumed, failed = [], []
        for job_id in drained:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    s = stub.ResumeJob(control_pb2.ResumeJobRequest(job_id=job_id), timeout=60)
                    resumed.append(job_id)
                    say(resumed_text(job_id, s))
                    break
                except grpc.RpcError as e:
                    details = e.details() or str(e.code())
                    capacity = (
                        e.code() == grpc.StatusCode.FAILED_PRECONDITION
                        and refusal_of(e) == control_pb2.REFUSED_NO_CAPACITY
                    )
                    if capacity and time.monotonic() < deadline:
                        time.sleep(0.5)  # the node agents are still registering
                        continue
                    failed.append(f"{job_id}: {details}")
                    break
    return resumed, failed


def resumed_text(job_id: str, s: control_pb2.JobStatus) -> str:
    """What `up` says of a drained job control answered the resume of with ``s``."""
    if s.state == JobState.STANDBY:  # its ranks do not fit yet: it waits in the queue, first
        return f"drained job {job_id} waits in the queue (#{s.queue_position}) to resume: {s.message}"
    if s.state in (JobState.RUNNING, JobState.PAUSED) and not s.drained:
        # `down` was cut short before it stopped the stack: its ranks were still there
        return f"drained job {job_id} continues at step {s.step} (its ranks were still there); now {JobState.Name(s.state)}"
    return (
        f"resumed drained job {job_id} from checkpoint {s.checkpoint_version} (step {s.step}); "
        f"now {JobState.Name(s.state)}"
    )
