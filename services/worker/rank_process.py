"""A rank process as the node agent knows it: its record, and how it is started, signalled
and described when it ends.

One process per ``RankAssignment``, in its own process group (so helpers it starts die
with it), with its binding in its environment (the device it sees, its CPUs and threads:
:mod:`services.worker.device_binding`) and its output appended to
``<run_dir>/logs/<job>.rank<R>.log`` by the agent (a pipe read by ``rank_logs.LogPump``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.contract import engine_pb2
from services.worker.device_binding import RankBinding
from services.worker.exit_cause import OomCounter

REPO_ROOT = Path(__file__).resolve().parents[2]

END_OF_COMMANDS = object()  # closes a rank's command stream


@dataclass(eq=False)
class RankProcess:
    """One launched rank process. Mutable fields are guarded by ``NodeAgent._lock``."""

    job_id: str
    rank: int
    init: engine_pb2.InitJob
    assignment: engine_pb2.RankAssignment  # as L1-2 assigned it (the node's device: re-attach declares it)
    proc: subprocess.Popen
    log_path: Path
    log: Any = None  # its RankLog (services/worker/rank_logs.py): its output, rotated; None: none opened
    commands: queue.Queue = field(default_factory=queue.Queue)  # RankCommand | END_OF_COMMANDS
    session: str = "none"  # "none" -> "open" -> "closed": one session per process
    dead: bool = False  # proc.wait() returned
    released: bool = False
    grace_seconds: float = 0.0
    kill_timer: threading.Timer | None = None
    stream_closed: threading.Event = field(default_factory=threading.Event)
    loop_ended: bool = False  # its TrainingLoopFinished / TrainingLoopFailed was read off its stream
    exited: threading.Event = field(default_factory=threading.Event)  # RankExited emitted
    # What the agent last stated of it (RankProcessState), set by its waiter thread.
    process_state: int = 0
    stop_signal: int = 0
    told: engine_pb2.RankAssignment | None = None  # as the rank is told it (its device as it sees it)
    # Exit-cause evidence (services/worker/exit_cause.py): the cgroup OOM-kill counter the rank
    # shares with the agent and its count at launch, and the last signal the agent sent it.
    oom: OomCounter = field(default_factory=lambda: OomCounter(None))
    oom_at_launch: int | None = None
    agent_signal: int = 0


def wait_reporting_stops(proc: subprocess.Popen, stopped: Callable[[int], None], continued: Callable[[], None]) -> int:
    """``proc.wait()`` that also calls ``stopped(signal)`` / ``continued()`` each time the
    kernel tells this parent the process was stopped by a signal or continued (waitid with
    WSTOPPED | WCONTINUED: the parent hears it at once, nothing polls). Returns the exit code
    as ``Popen.wait`` does (the exit is only peeked at here, Popen reaps it)."""
    while True:
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WSTOPPED | os.WCONTINUED | os.WNOWAIT)
        except ChildProcessError:
            break  # reaped already (a Popen.poll elsewhere): its code is in proc.returncode
        if info is None or info.si_code not in (os.CLD_STOPPED, os.CLD_CONTINUED):
            break  # exited, killed or dumped: Popen reaps it below
        # Consume that stop or continue (WEXITED not asked: an exit since stays to be reaped).
        os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WCONTINUED | os.WNOHANG)
        if info.si_code == os.CLD_STOPPED:
            stopped(info.si_status)
        else:
            continued()
    return proc.wait()


SIMULATED_RANK_MODULE = "services.rank.simulated"  # the scale test bed's torch-free rank (issue 27 item 7)


def rank_module_for(init: engine_pb2.InitJob, default: str) -> str:
    """The module a rank of this launch runs: the simulated rank for a job spec with a
    ``simulate`` section (services/jobspec/training.py SimulateSpec), else the agent's ``default``.
    The spec was validated by control at submit; here only that section's presence is read."""
    try:
        simulated = json.loads(init.spec_json or "{}").get("simulate") is not None
    except (ValueError, AttributeError):
        simulated = False  # (not a spec this agent can read: the rank itself refuses it, one line)
    return SIMULATED_RANK_MODULE if simulated else default


def rank_command_line(module: str, session_address: str, job_id: str, rank: int) -> list[str]:
    """argv of one rank process (``python -m <module> --session ... --job ... --rank ...``)."""
    return [sys.executable, "-m", module, "--session", session_address, "--job", job_id, "--rank", str(rank)]


def rank_environment(base: Mapping[str, str], binding: RankBinding) -> dict[str, str]:
    """Environment of a rank process: the agent's, plus its binding's (device, CPUs, threads,
    torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE: services/worker/device_binding.py).

    A ``CUDA_VISIBLE_DEVICES`` the agent itself was started with is replaced for a rank on
    one GPU (the binding names the physical index, which is what the agent's registration
    already listed).
    """
    env = dict(base)
    env.update(binding.env)
    env["PYTHONUNBUFFERED"] = "1"  # its log is read while it runs
    # `-m services.rank` must resolve even when the agent was started elsewhere.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH", "")) if p)
    return env


def told_assignment(assignment: engine_pb2.RankAssignment, binding: RankBinding) -> engine_pb2.RankAssignment:
    """The assignment as the rank is told it: L1-2's, with the device the rank sees
    (``cuda:5`` on the node is ``cuda:0`` behind ``CUDA_VISIBLE_DEVICES=5``)."""
    told = engine_pb2.RankAssignment()
    told.CopyFrom(assignment)
    told.device = binding.device
    return told


def describe_stop(sig: int) -> str:
    """'stopped by SIGSTOP' (a signal number this platform does not name: 'stopped by signal N')."""
    try:
        return f"stopped by {signal.Signals(sig).name}"
    except ValueError:
        return f"stopped by signal {sig}"


def signal_group(pgid: int, sig: int) -> None:
    """Signal a rank's whole process group (the rank leads its own session), so helpers it
    started die with it. A group already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def safe_file_name(text: str) -> str:
    # job ids come from control, but they become file names here: no path tricks.
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".") or "_"
