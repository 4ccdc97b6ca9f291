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
``wait`` raising ``subprocess.TimeoutExpired``, ``kill``, ``send_signal``, ``returncode``: ``-N`` for a signal,
as Popen says it) and ``log``, the file its stdout and stderr go to (line-buffered: tests read
it while the rank runs). Only the test process calls these. One server per pytest process,
started by its first rank; :func:`stop_fork_server` ends it by its pid (tests/conftest.py, at
the session's end). :func:`run_ranks_to_end` is ``tests.conftest.run_to_end`` for rank
scripts: the same contract (every exit code 0, the outputs returned), the ranks forked.
A rank can also be the product's own rank module (``module="services.rank.__main__"``: its
``main(argv)`` run in the forked child, as services/rank/forkserver.py runs it).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from services.contract.comm_guard import BINDING_MODULES

# What a rank imports before its first step; paid once, in the fork server. (Python 3.11's
# server imports these on its own sys.path, the test process's working directory first: the
# tests' helpers under tests/engine are not on it, and are imported by each rank.)
# (and what the comm guard imports before its sweep: torch.distributed.pipelining alone, with
# the torch._dynamo it imports, is ~0.7 CPU-s a rank)
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", *BINDING_MODULES, "services.rank.__main__"]


class RankProcess:
    """One rank: ``script`` run as ``__main__`` with ``argv`` (or, ``script`` None, the
    ``main(argv)`` of ``module``), in ``cwd``, with ``env`` added to the environment, stdout and
    stderr to ``log_path`` (stderr to ``err_path`` instead where one is given: ``err``)."""

    def __init__(
        self,
        script: Path | None,
        argv: list[str],
        log_path: Path,
        cwd: Path,
        env: dict[str, str],
        module: str = "",
        err_path: Path | None = None,
    ) -> None:
        assert (script is None) != (not module), "a script or a module"
        self.log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed by the caller (finish_processes)
        self.err: IO[str] | None = open(err_path, "w") if err_path else None  # noqa: SIM115 - as log
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first rank)
        target = str(script) if script is not None else ""
        paths = (str(log_path), str(err_path or log_path))
        self._proc = ctx.Process(target=_run, args=(target, module, argv, paths, str(cwd), env), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid
        self.args = [target or f"-m {module}", *argv]

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

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def _run(script: str, module: str, argv: list[str], paths: tuple[str, str], cwd: str, env: dict[str, str]) -> None:
    """In the forked child: what ``python script *argv`` would do (``module``: what the
    product's rank fork server does, its ``main(argv)``), stdout and stderr to ``paths``."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target, path in zip((1, 2), paths, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stderr
    os.environ.update(env)
    os.chdir(cwd)
    # PYTHONPATH's folders after the script's, as the interpreter would put them: a rank
    # script may import helpers from a folder only its PYTHONPATH names (the fork server's
    # sys.path is the test process's when it started).
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:0] = extra
    if module:
        sys.argv = [module, *argv]
        importlib.import_module(module).main(argv)
        return
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # (as the interpreter puts a script's folder first)
    runpy.run_path(script, run_name="__main__")


def run_ranks_to_end(
    argvs: list[list[str]], timeout: float, tail: int = 3000, *, cwd: Path, env: dict | None = None
) -> list[str]:
    """``tests.conftest.run_to_end`` for ranks: one forked rank per ``[script, *argv]`` (in
    ``cwd``, ``env`` added to the environment), waited for (``timeout`` seconds each) and
    SIGKILLed by PID if still running; asserts every exit code is 0, the outputs' last
    ``tail`` characters in the message. Returns each rank's output (stdout and stderr)."""
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs = [
        RankProcess(
            Path(a[0]), [str(x) for x in a[1:]], logs / f"rank{i}.log", cwd, dict(os.environ if env is None else env)
        )
        for i, a in enumerate(argvs)
    ]
    try:
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.log.close()
    outputs = [Path(p.log.name).read_text(errors="replace") for p in procs]
    shutil.rmtree(logs, ignore_errors=True)
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-tail:] for o in outputs)
    return outputs


def stop_fork_server() -> None:
    """End this process's fork server (it holds the preloaded modules' memory until then):
    SIGKILL by its pid, as nothing of it needs saving (a clean exit finalizes torch and the
    rank's modules: seconds on a loaded host), then multiprocessing's own stop reaps it and
    forgets it, so that a later module starts a fresh one."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:  # (None: no rank was forked in this process)
        os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()
