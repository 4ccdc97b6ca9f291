"""Whether a process id names a live process (shared by the CLI's stack and the node agent)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` names a process (one of another user's counts: signalling it is
    refused, not impossible)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
