"""A rank's exit classified from evidence (services/worker/exit_cause.py): real child processes
killed by signals, the real rank entry point exiting on a MemoryError, and, where this machine
lets a test make a memory cgroup, a real OOM kill read from the kernel's oom_kill counter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from services.common.process_exit import MEMORY_ERROR_EXIT_CODE
from services.contract import control_pb2
from services.worker.exit_cause import CGROUP_ROOT, ExitEvidence, OomCounter, classify

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _ended(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # (by its pid: only the child this test started)
            proc.wait()


def test_a_sigkill_from_elsewhere_is_killed_with_its_sender_unknown_and_no_oom():
    counter = OomCounter.of_process()
    before = counter.read()
    proc = _sleeper()
    os.kill(proc.pid, signal.SIGKILL)
    got = classify(ExitEvidence(_ended(proc), before, counter.read()))
    assert got.cause == control_pb2.EXIT_KILLED
    assert got.detail.startswith("killed by SIGKILL (sender unknown")
    if before is None:  # said, not guessed: an OOM kill could not be told apart here
        assert "no cgroup oom_kill counter readable" in got.detail


def test_a_sigterm_is_killed_and_names_the_node_agent_when_it_sent_it():
    proc = _sleeper()
    os.kill(proc.pid, signal.SIGTERM)
    code = _ended(proc)
    assert code == -signal.SIGTERM
    mine = classify(ExitEvidence(code, 0, 0, sender_pid=os.getpid()))  # this process plays the agent
    assert (mine.cause, mine.detail) == (control_pb2.EXIT_KILLED, "killed by SIGTERM (sent by its node agent)")
    other = classify(ExitEvidence(code, 0, 0))
    assert other.detail == "killed by SIGTERM (sender unknown)"


@pytest.mark.timeout(180)
def test_the_rank_entry_point_exits_with_the_memory_error_code_and_is_classified_memory_error():
    """The real ``services.rank`` main, with its session replaced (nothing to connect to):
    a MemoryError while it sets up ends the process with MEMORY_ERROR_EXIT_CODE."""
    script = textwrap.dedent(
        """
        import services.rank.__main__ as m

        class Session:
            step = 0
            def __init__(self, *a, **k): pass
            def receive_setup(self): raise MemoryError()
            def send_failed(self, *a): pass
            def wait_released(self): pass
            def close(self, timeout=0): pass

        m.Session = Session
        m.main(["--session", "127.0.0.1:1", "--job", "j", "--rank", "0"])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    code = _ended(proc, timeout=150.0)  # (it imports torch: slow on a loaded machine)
    assert code == MEMORY_ERROR_EXIT_CODE
    got = classify(ExitEvidence(code))
    assert (got.cause, got.detail) == (control_pb2.EXIT_MEMORY_ERROR, "MemoryError (exit code 75)")


@pytest.mark.parametrize(
    ("evidence", "cause"),
    [
        (ExitEvidence(0), control_pb2.EXIT_CLEAN),
        (ExitEvidence(1), control_pb2.EXIT_ERROR),
        (ExitEvidence(-9, 2, 3), control_pb2.EXIT_OOM_KILLED),
        (ExitEvidence(-9, 3, 3), control_pb2.EXIT_KILLED),
        (ExitEvidence(-9, None, 3), control_pb2.EXIT_KILLED),  # no count at launch: no evidence
        (ExitEvidence(-15, 2, 3), control_pb2.EXIT_KILLED),  # the OOM killer sends SIGKILL only
        (ExitEvidence(-9, 2, 3, sender_pid=os.getpid()), control_pb2.EXIT_KILLED),  # the agent's own SIGKILL
    ],
)
def test_the_evidence_table(evidence, cause):
    assert classify(evidence).cause == cause


def _memory_cgroup() -> tuple[Path, Path] | str:
    """A fresh memory cgroup under this process's own, limited to 64 MiB without swap:
    (its directory, the file its limit goes in), or why none can be made here."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    for line in own:
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and (CGROUP_ROOT / rel.lstrip("/") / "memory.max").exists():
            return CGROUP_ROOT / rel.lstrip("/"), Path("memory.max")
        if "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory" / rel.lstrip("/")
            if base.joinpath("memory.limit_in_bytes").exists():
                return base, Path("memory.limit_in_bytes")
    return "no cgroup v2 memory.max nor v1 memory controller under /sys/fs/cgroup for this process"


def test_a_process_killed_by_the_oom_killer_of_its_memory_cgroup_is_oom_killed(tmp_path):
    found = _memory_cgroup()
    if isinstance(found, str):
        pytest.skip(found)
    base, limit = found
    group = base / f"surge-oom-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {base} ({e.strerror}): not writable here")
    proc = None
    try:
        group.joinpath(limit).write_text(str(64 << 20))
        for swap in ("memory.memsw.limit_in_bytes", "memory.swap.max"):  # no swapping out of the OOM
            if group.joinpath(swap).exists():
                try:
                    group.joinpath(swap).write_text(str(64 << 20) if swap.startswith("memory.memsw") else "0")
                except OSError:
                    pass
        # It waits on stdin until it is in the cgroup, then takes 1 GiB a page at a time.
        grab = "import sys; sys.stdin.readline(); b = bytearray(1 << 30); [b.__setitem__(i, 1) for i in range(0, 1 << 30, 4096)]"
        proc = subprocess.Popen([sys.executable, "-c", grab], stdin=subprocess.PIPE)
        group.joinpath("cgroup.procs").write_text(str(proc.pid))
        counter = OomCounter.of_process(proc.pid)
        assert counter.path is not None and counter.path.parent == group, counter
        before = counter.read()
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        code = _ended(proc)
        got = classify(ExitEvidence(code, before, counter.read()))
        assert code == -signal.SIGKILL
        assert got.cause == control_pb2.EXIT_OOM_KILLED, got
        assert got.detail.startswith(f"OOM-killed (SIGKILL; its cgroup's oom_kill count rose {before} -> ")
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            group.rmdir()
        except OSError:
            pass
