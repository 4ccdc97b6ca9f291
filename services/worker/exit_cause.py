"""Why a rank process ended, from evidence the node agent holds, never from text (issue 29 item 6).

The evidence, in the order it is weighed (:func:`classify`):

* the kernel's OOM-kill counter of the cgroup the rank ran in, read when the agent starts it
  and again when it reaps it: cgroup v2 ``memory.events`` (``oom_kill N``), else cgroup v1
  ``memory.oom_control`` (``oom_kill N``, kernel 4.13+). A process killed by SIGKILL while
  that counter rose was killed by the OOM killer. The rank inherits the agent's cgroup at
  spawn, so the counter is the cgroup the two share: another process of that cgroup killed
  by the OOM killer at the moment the rank is SIGKILLed by someone else is read as the rank's
  OOM kill (one cgroup per rank would tell them apart; the agent does not make one);
* the rank's own exit code: ``MEMORY_ERROR_EXIT_CODE`` is the code a rank exits with when
  Python raised ``MemoryError`` at its top level (services/rank/__main__.py), any other
  non-zero code is an error exit of its own, 0 a clean exit;
* the signal that ended it (Popen's negative code), and its sender where known: the agent
  knows the signals it sent itself (a release, its grace's SIGKILL, its shutdown: such a
  SIGKILL is never read as an OOM kill); a signal from anyone else has an unknown sender
  (``sender_pid`` 0), said so in the detail. (The rank does not learn a sender's pid itself:
  ``sigwaitinfo`` in the rank would need a channel to tell its agent; not built.)

Where no counter is readable (no cgroup memory controller visible, e.g. a container without
cgroup namespaces mounted), a SIGKILL is ``EXIT_KILLED`` and the detail says that an OOM kill
could not be told apart.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from services.common.process_exit import MEMORY_ERROR_EXIT_CODE
from services.contract import control_pb2

ExitCause = control_pb2.ExitCause

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _oom_kill_count(path: Path) -> int | None:
    """The ``oom_kill N`` line of a cgroup's ``memory.events`` (v2) or ``memory.oom_control``
    (v1); None when the file or the line is not there."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class OomCounter:
    """The OOM-kill counter file of one cgroup (``path`` None: none readable)."""

    path: Path | None

    @classmethod
    def of_process(cls, pid: int | str = "self", root: Path = CGROUP_ROOT) -> OomCounter:
        """The counter of the cgroup ``pid`` is in (``/proc/<pid>/cgroup``): its v2 entry
        (``0::/path``, under ``root`` or ``root/unified``) if that has ``memory.events``, else
        its v1 memory controller's (``N:memory:/path`` under ``root/memory``)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return cls(None)
        candidates = []
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            rel = rel.lstrip("/")
            if controllers == "":
                candidates += [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
            elif "memory" in controllers.split(","):
                candidates.append(root / "memory" / rel / "memory.oom_control")
        for path in candidates:
            if _oom_kill_count(path) is not None:
                return cls(path)
        return cls(None)

    def read(self) -> int | None:
        """The count now (None: not readable)."""
        return _oom_kill_count(self.path) if self.path is not None else None


@dataclass(frozen=True)
class ExitEvidence:
    """What the agent knows of one ended rank process."""

    code: int  # Popen's returncode: negative = killed by that signal
    oom_before: int | None = None  # the cgroup's oom_kill count at launch (None: unreadable)
    oom_after: int | None = None  # ... at reap
    sender_pid: int = 0  # who sent the fatal signal, where known (0: unknown)


@dataclass(frozen=True)
class Classified:
    cause: int  # ExitCause
    detail: str  # one line for people: the cause and its evidence


def classify(ev: ExitEvidence) -> Classified:
    """The exit cause of ``ev``, with a one-line description of the evidence."""
    counted = ev.oom_before is not None and ev.oom_after is not None
    if ev.code == 0:
        return Classified(ExitCause.EXIT_CLEAN, "exited with code 0")
    if ev.code == MEMORY_ERROR_EXIT_CODE:
        return Classified(ExitCause.EXIT_MEMORY_ERROR, f"MemoryError (exit code {MEMORY_ERROR_EXIT_CODE})")
    if ev.code > 0:
        return Classified(ExitCause.EXIT_ERROR, f"exited with code {ev.code}")
    name = signal_name(-ev.code)
    agent = ev.sender_pid == os.getpid()  # (the agent's own SIGKILL is its, whatever the counter did)
    if -ev.code == signal.SIGKILL and counted and ev.oom_after > ev.oom_before and not agent:
        return Classified(
            ExitCause.EXIT_OOM_KILLED,
            f"OOM-killed ({name}; its cgroup's oom_kill count rose {ev.oom_before} -> {ev.oom_after})",
        )
    if ev.sender_pid:
        sender = "sent by its node agent" if agent else f"sent by pid {ev.sender_pid}"
    else:
        sender = "sender unknown"
    if -ev.code == signal.SIGKILL and not counted and not agent:
        sender += "; no cgroup oom_kill counter readable, an OOM kill cannot be told apart"
    return Classified(ExitCause.EXIT_KILLED, f"killed by {name} ({sender})")


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
