"""Profiling on demand (`surgectl profile JOB --steps N`, issue 31 item 3): L1-1 numbers the
request as a boundary command (ProfileSteps), so every rank profiles the same steps, and
keeps what the ranks report (ProfileRecorded) in the job's status (``JobStatus.profiles``,
journaled with it) and its events (type "profile"). A profile is a measurement: one that
fails is shown, never graded as a fault. One whose ranks are relaunched (a recovery, a
resume) or whose job ends before every rank reported is marked lost here, by L1-1: those
reports never come. (A part of ``Orchestrator``, see core.py.)
"""

from __future__ import annotations

import time
from typing import Any

from services.contract import Module, control_pb2, engine_pb2
from services.control.orchestrator.job import _numbered
from services.control.orchestrator.refusals import BadProfileRequest, IllegalTransition

JobState = control_pb2.JobState
ORCH = Module.L1_ORCHESTRATOR
PROFILE_MAX_STEPS = 100  # a trace of every operator of 100 steps is already hundreds of MB on a GPU
PROFILES_KEPT = 8  # the newest profiles a job's status names (their files stay with the store)


class Profiling:
    """``profile_job_request`` and ``on_profile_recorded`` (and ``_lose_profiles``, which
    the job's relaunches and its end call): a part of ``Orchestrator``."""

    def profile_job_request(self, msg: control_pb2.ProfileJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Ask a RUNNING job's ranks to profile their next ``msg.steps`` steps from the boundary
        they agree on. Answers the job's status; its last ``profiles`` entry is this one.

        Raises:
            JobNotFound; BadProfileRequest (steps out of 1..PROFILE_MAX_STEPS);
            IllegalTransition (the job is not RUNNING).
        """
        if not 1 <= msg.steps <= PROFILE_MAX_STEPS:
            raise BadProfileRequest(f"steps: {msg.steps} is not in 1..{PROFILE_MAX_STEPS}")
        with self._lock:
            job = self._get(msg.job_id)
            if job.status.state != JobState.RUNNING:
                raise IllegalTransition(
                    f"job {msg.job_id} is {JobState.Name(job.status.state)}: only a running job's steps can be profiled"
                )
            cmd = _numbered(job, engine_pb2.ProfileSteps(steps=msg.steps))
            profiles = job.status.profiles
            profiles.add(seq=cmd.seq, steps=msg.steps, ranks=job.status.world_size, requested_unix=time.time())
            while len(profiles) > PROFILES_KEPT:
                del profiles[0]
            self._record(
                job,
                ORCH,
                "profile",
                f"profile #{cmd.seq}: the next {msg.steps} step{'s' if msg.steps > 1 else ''} of every rank, "
                f"from the step boundary every rank agrees on (command #{cmd.seq} to the ranks)",
            )
            self._loop(cmd)
            return self._snapshot(job)

    def on_profile_recorded(self, msg: engine_pb2.ProfileRecorded, payload: Any = None) -> None:
        """A rank's profile stored (or not): kept with the profile it answers, and said in
        the job's events. A report of a profile the status no longer names (older than the
        newest PROFILES_KEPT), or a rank's second report, is dropped. Every rank reports, one
        record each: not waited for when applied by the event applier (commit_later.py)."""
        with self._lock:
            self._commit_later(msg)
            job = self._jobs.get(msg.job_id)
            info = next((p for p in job.status.profiles if p.seq == msg.seq), None) if job else None
            if info is None or any(r.rank == msg.rank for r in info.recorded):
                return
            info.recorded.add().CopyFrom(msg)
            self._record(job, Module.L2_TRAINING_LOOP, "profile", profile_text(msg))

    def _lose_profiles(self, job, why: str) -> None:
        """Under the lock: the job's outstanding profiles (not every rank reported) are lost
        for ``why`` (their ranks were relaunched, or the job ended): a rank that was killed,
        or never got to the profiled steps, never reports, and the operator waiting on it
        (`surgectl profile`) is told so instead of waiting until its timeout. Said in the
        job's events; ``ProfileInfo.lost`` in its status (journaled with it). A report
        that still comes is kept as any other."""
        for info in job.status.profiles:
            if info.lost or len(info.recorded) >= info.ranks:
                continue
            info.lost = why
            self._record(job, ORCH, "profile", lost_text(info))


def lost_text(info: control_pb2.ProfileInfo) -> str:
    """A lost profile, as the job's events and `surgectl profile` say it."""
    return f"profile #{info.seq} lost: {info.lost}"


def profile_text(msg: engine_pb2.ProfileRecorded) -> str:
    """One rank's report, as the job's events say it."""
    steps = f"step {msg.first_step}" if msg.first_step == msg.last_step else f"steps {msg.first_step}-{msg.last_step}"
    if msg.error:
        return f"rank {msg.rank}: profile #{msg.seq} not recorded: {msg.error}"
    return (
        f"rank {msg.rank}: profile #{msg.seq} of {steps} stored, {msg.bytes / 1e6:.1f} MB "
        f"({msg.seconds:.2f} s profiled): {', '.join(msg.files)}"
    )
