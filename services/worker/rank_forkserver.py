"""The node agent's side of the rank fork server (services/rank/forkserver.py).

A rank launched through the fork server is forked from a process that has imported torch and
the rank's modules already: it starts in milliseconds instead of the 2-3 s of a core (10 s on
a loaded 2-core host) an interpreter and its imports take, and a node's ranks share those
pages. The server starts with the node's first launch (which waits for its imports, as it
would have waited for its own) or at the agent's start on a spare node, and lives as long as
the agent; one that died is started again at the next launch, which meanwhile runs as a
new interpreter.

The rank is the agent's own child (the server forks it through a child that exits at once,
and this process is a ``PR_SET_CHILD_SUBREAPER``): the agent hears its stops and continues and
reaps it with ``waitid`` as it does a process it started itself (:class:`ForkedRank` stands in
for ``subprocess.Popen``). Being a subreaper, the agent also adopts whatever a rank leaves
behind when it dies (a helper process it started): :meth:`RankForkServer.reap_orphans` reaps
those, never a rank's pid.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from services.worker.rank_logs import LogPump, LogSettings, RankLog
from services.worker.rank_process import signal_group

SERVER_MODULE = "services.rank.forkserver"
READY_TIMEOUT_SECONDS = 120.0  # its imports, on a loaded host (measured 10 s at most on 2 cores)
# A zombie seen at two scans this far apart is an orphan nobody waits for. A scan reads every
# thread's children file (about 2 ms of CPU for the agent's ~40 threads): at 5 s apart it was
# 0.4 ms of CPU per second, a tenth of an agent's idle cost (bench/stack_cost.py); an orphan's
# zombie (a pid held, nothing else) may wait a minute to be reaped.
ORPHAN_SCAN_SECONDS = 30.0
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux ``prctl``). False where that
    is not possible: the fork server is then not used (its ranks would not be this process's
    children)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> list[str] | None:
    """This process's children, from ``/proc/self/task/*/children`` (each thread's: a child
    is listed under the thread that forked it, or adopted it): a few small files, where
    scanning every process of the machine (thousands on a busy node) cost the agent more CPU
    than anything else it does between beats (bench/stack_cost.py). The file is read
    racily (a child forked or reaped meanwhile may be missed): an orphan is reaped only once
    seen at two scans anyway. None where the kernel has no such file (CONFIG_PROC_CHILDREN):
    the caller then scans ``/proc``."""
    out: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found = False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.extend(f.read().split())
            found = True
        except OSError:
            continue  # a thread that ended, or no such file
    return out if found else None


class ForkedRank:
    """A rank forked by the server: the part of ``subprocess.Popen`` the agent uses (it is this
    process's child, adopted, so waiting and signalling work as for one it started)."""

    def __init__(self, pid: int, on_reaped) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._on_reaped = on_reaped
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reap(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self._reap(os.WNOHANG)) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return code

    def _reap(self, flags: int) -> int | None:
        # (As Popen: a poll while another thread waits returns None instead of blocking.)
        if not self._lock.acquire(blocking=not flags & os.WNOHANG):
            return None
        try:
            if self.returncode is not None:
                return self.returncode
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its code is unknown (as Popen says 0)
                pid, status = self.pid, 0
            if pid == 0:
                return None
            self.returncode = os.waitstatus_to_exitcode(status)
        finally:
            self._lock.release()
        self._on_reaped(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankForkServer:
    """One fork server of this node agent (module docstring).

    Args:
        env: the server's environment (the agent's, with the repository on PYTHONPATH); each
            rank's own environment is sent with its order.
        cwd: the server's working directory (a rank's is sent with its order).
        log_path: where the server writes (its start-up, an error).
        pump: the agent's log pump.
        log_settings: that log's rotation (default: ``LogSettings()`` without a flood bound).
        module: the module a forked rank runs (its ``main(argv)``; a test's stand-in).
        orphan_scan_seconds: how often orphans are looked for (:meth:`reap_orphans`).
    """

    def __init__(
        self,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        pump: LogPump,
        log_settings: LogSettings | None = None,
        module: str = "services.rank.__main__",
        orphan_scan_seconds: float = ORPHAN_SCAN_SECONDS,
    ):
        self._env, self._cwd, self._log_path, self._pump, self._module = dict(env), cwd, log_path, pump, module
        self._log_settings = log_settings or LogSettings(flood_bytes_per_s=0)
        self._lock = threading.Lock()  # one order at a time; also guards the fields below
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self._ranks: set[int] = set()  # pids handed out and not reaped: never an orphan's
        self._zombies: set[int] = set()  # unknown zombie children seen at the last scan
        self._scanner: threading.Thread | None = None
        self._scan_seconds = orphan_scan_seconds

    # ------------------------------------------------------------ the server process

    def start(self) -> None:
        """Start the server now (does not wait for its imports): a spare node's, ready before
        any rank is lost."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> socket.socket:
        """(Under the lock.) The server's socket, starting it when there is none alive."""
        if self._closed:
            raise OSError("the node agent is stopping")
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop_server()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read, write = self._pump.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(theirs.fileno()), "--module", self._module],
                cwd=self._cwd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=write,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # not in the agent's group: a Ctrl-C of the agent is its own
            )
        except OSError:
            os.close(read)
            ours.close()
            raise
        finally:
            os.close(write)
            theirs.close()
        self._pump.attach(read, RankLog(self._log_path, self._log_settings))
        ours.settimeout(READY_TIMEOUT_SECONDS)  # (the first answer waits for its imports)
        self._sock = ours
        if self._scanner is None:
            self._scanner = threading.Thread(target=self._scan_orphans, name="orphan-reaper", daemon=True)
            self._scanner.start()
        return ours

    def _stop_server(self) -> None:
        """(Under the lock.) End the server (its ranks live on: they are not its children)."""
        if self._sock is not None:
            self._sock.close()  # end of input: it exits
            self._sock = None
        if self._proc is not None:
            signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the server and start none again (the agent is stopping)."""
        with self._lock:
            self._closed = True
            self._stop_server()

    # ------------------------------------------------------------ launches

    def spawn(self, argv: list[str], env: Mapping[str, str], out_fd: int) -> ForkedRank:
        """Fork the rank ``argv`` describes (``python -m <module> ARGS``: ARGS are its
        arguments) with environment ``env``, its output to ``out_fd`` (the caller keeps and
        closes its copy). Raises OSError when the server cannot do it (the caller starts the
        rank as a new interpreter instead); a server that died is started again next time."""
        order = {"argv": argv[3:], "env": dict(env), "cwd": str(self._cwd), "title": " ".join(argv)}
        with self._lock:
            sock = self._ensure_started()
            try:
                socket.send_fds(sock, [json.dumps(order).encode()], [out_fd])
                reply = sock.recv(4096)
            except OSError:
                self._stop_server()  # (a timeout or a dead server: the next launch starts one)
                raise
            if not reply:
                self._stop_server()
                raise OSError("the rank fork server ended")
            answer = json.loads(reply)
            if "pid" not in answer:
                raise OSError(f"the rank fork server could not fork: {answer.get('error')}")
            self._ranks.add(answer["pid"])
        return ForkedRank(answer["pid"], self._reaped)

    def _reaped(self, pid: int) -> None:
        with self._lock:
            self._ranks.discard(pid)

    # ------------------------------------------------------------ adopted orphans

    def _scan_orphans(self) -> None:
        while True:
            time.sleep(self._scan_seconds)
            with self._lock:
                if self._closed:
                    return
            self.reap_orphans()

    def reap_orphans(self) -> list[int]:
        """Reap this process's zombie children that no one waits for: zombies at this scan and
        the last (a ``subprocess`` waiter reaps its own within milliseconds), never a rank's
        pid. Returns the pids reaped."""
        me = os.getpid()
        zombies = set()
        children = _children()
        for entry in os.listdir("/proc") if children is None else children:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == me:
                zombies.add(int(entry))
        with self._lock:
            due = (zombies & self._zombies) - self._ranks
            self._zombies = zombies - due
        reaped = []
        for pid in due:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
            except ChildProcessError:
                pass
        return reaped
