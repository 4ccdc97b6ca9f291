"""The node agent's warm spare rank processes (services/rank/spare.py).

While this node runs a job whose fault policy rebuilds in place (InitJob.rebuild_in_place),
or at all times on a node told to (``SURGE_WORKER_SPARE_RANKS`` set: a spare node, where a
lost node's rank is replaced), the agent keeps one spare process with every rank import done, so that a replacement rank
starts in well under a second instead of paying for an interpreter and torch. Any launch takes
a spare when one is ready; the spare is replaced right after, while such a job still runs
here. A spare holds host memory (one interpreter with torch, about 300 MB) and no device.

A spare is its own process group (killed with the agent's ranks) and ends on its own when
its stdin closes (the agent exited or retired it).

The spare that replaces one just taken starts ``REFILL_DELAY_SECONDS`` after the launch, not
at once: its import takes a whole core for 3-7 s on a 2-core host (measured), and started at
the launch it competed with the ranks it was meant to serve, which are then restoring,
rendezvousing and taking their first steps (in the goodput bench the recovery's first step
waited 1.2-2 s for its data while a refill imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from services.worker.rank_process import signal_group

SPARE_MODULE = "services.rank.spare"
REFILL_DELAY_SECONDS = 5.0  # after a launch: its ranks' start-up or recovery (module docstring)


class WarmSpares:
    """At most ``size`` warm spares, started on :meth:`keep_warm`, handed out by :meth:`take`.

    Args:
        env: the environment a spare starts with (the agent's, with the repository on
            PYTHONPATH); a rank's own environment is sent with its order.
        cwd: working directory (the repository root, as for a rank).
        log_path: where a spare writes until it becomes a rank (its start-up, an error).
        size: spares kept (the agent's ``SURGE_WORKER_SPARE_RANKS``, default 1).
        always: keep them at all times (a spare node: ``SURGE_WORKER_SPARE_RANKS`` set), not
            only while a job here rebuilds in place.
    """

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path, size: int = 1, *, always: bool = False):
        self._env, self._cwd, self._log_path, self._size = dict(env), cwd, log_path, size
        self.always = always
        self._lock = threading.Lock()
        self._ready: list[subprocess.Popen] = []
        self._closed = False
        self._refill: threading.Timer | None = None  # a keep_warm(after=...) not yet due

    def keep_warm(self, after: float = 0.0) -> None:
        """Start spares until ``size`` are alive (does not wait for their imports); ``after``
        seconds from now when ``after`` > 0 (a launch's ranks are starting: module docstring),
        unless retired or closed before then."""
        with self._lock:
            if self._refill is not None:
                self._refill.cancel()
                self._refill = None
            if after > 0:
                self._refill = threading.Timer(after, self._due)
                self._refill.daemon = True
                self._refill.start()
            else:
                self._fill()

    def _due(self) -> None:
        with self._lock:
            if threading.current_thread() is not self._refill:
                return  # cancelled (retired, closed, or a newer keep_warm) while it ran
            self._refill = None
            self._fill()

    def _fill(self) -> None:
        """(Under the lock.)"""
        self._ready = [p for p in self._ready if p.poll() is None]
        while not self._closed and len(self._ready) < self._size:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._log_path, "ab") as out:
                self._ready.append(
                    subprocess.Popen(
                        [sys.executable, "-m", SPARE_MODULE],
                        cwd=self._cwd,
                        env=self._env,
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The spares started and not handed out (alive or not yet reaped)."""
        with self._lock:
            return list(self._ready)

    def take(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen | None:
        """A spare made into the rank ``argv`` describes (its arguments after ``-m <module>``),
        or None when none is alive."""
        with self._lock:
            while self._ready:
                proc = self._ready.pop(0)
                if proc.poll() is not None:
                    continue
                order = {"argv": argv, "env": dict(env), "log": str(log_path)}
                try:
                    proc.stdin.write((json.dumps(order) + "\n").encode())
                    proc.stdin.close()
                except OSError:  # it died between the poll and the write
                    continue
                return proc
        return None

    def retire(self) -> None:
        """Retire every spare (no job here needs one now): close its stdin and kill its group."""
        self._retire(closing=False)

    def close(self) -> None:
        """Retire every spare and start none again (the agent is stopping)."""
        self._retire(closing=True)

    def _retire(self, closing: bool) -> None:
        with self._lock:
            self._closed = self._closed or closing
            if self._refill is not None:
                self._refill.cancel()
                self._refill = None
            spares, self._ready = self._ready, []
        for proc in spares:
            try:
                proc.stdin.close()
            except OSError:
                pass
            signal_group(proc.pid, 9)
            proc.wait()
