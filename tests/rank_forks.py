"""Rank processes of the multi-process tests (tests/engine's ``*_rank_main.py``,
tests/parallel/harness.py), forked from one process that has imported torch and the rank's
modules (multiprocessing's fork server), not each a new interpreter.

Why: a test rank (``python rebuild_rank_main.py ...``) spent about 4.4 CPU-s importing torch,
torch.distributed and the rank's modules before its first step, most of a rank's CPU in these
tests (26 ranks in test_rebuild_in_place.py: ~115 of its ~139 CPU-s). Forked, a rank runs the
same script from its first line (``runpy``, ``__name__ == "__main__"``: its own patches, the
comm guard it installs) with those modules already loaded, as the product's rank fork server
does (services/rank/forkserver.py; comm_guard wraps entry points already bound by loaded
modules). The fork server never runs a torch op, so no thread pool is forked.

:class:`RankProcess` has the part of ``subprocess.Popen`` the tests use (``pid``, ``poll``,
``wait`` raising ``subprocess.TimeoutExpired``, ``kill``, ``returncode``: ``-N`` for a signal,
as Popen says it) and ``log``, the file its stdout and stderr go to (line-buffered: tests read
it while the rank runs). Only the test process calls these. One server per pytest process,
started by its first rank; :func:`stop_fork_server` ends it by its pid (tests/conftest.py, at
the session's end).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

# What a rank imports before its first step; paid once, in the fork server. (Python 3.11's
# server imports these on its own sys.path, the test process's working directory first: the
# tests' helpers under tests/engine are not on it, and are imported by each rank.)
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "services.rank.__main__"]


class RankProcess:
    """One rank: ``script`` run as ``__main__`` with ``argv``, in ``cwd``, with ``env`` added to
    the environment, stdout and stderr to ``log_path``."""

    def __init__(self, script: Path, argv: list[str], log_path: Path, cwd: Path, env: dict[str, str]) -> None:
        self.log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed by the caller (finish_processes)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first rank)
        self._proc = ctx.Process(target=_run, args=(str(script), argv, str(log_path), str(cwd), env), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid
        self.args = [str(script), *argv]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def kill(self) -> None:
        self._proc.kill()


def _run(script: str, argv: list[str], log_path: str, cwd: str, env: dict[str, str]) -> None:
    """In the forked child: what ``python script *argv`` would do, output to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stderr
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # (as the interpreter puts a script's folder first)
    runpy.run_path(script, run_name="__main__")


def stop_fork_server() -> None:
    """End this process's fork server (it holds the preloaded modules' memory until then):
    SIGKILL by its pid, as nothing of it needs saving (a clean exit finalizes torch and the
    rank's modules: seconds on a loaded host), then multiprocessing's own stop reaps it and
    forgets it, so that a later module starts a fresh one."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:  # (None: no rank was forked in this process)
        os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()
