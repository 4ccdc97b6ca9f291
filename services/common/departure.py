"""How long a node agent keeps its ranks after SIGTERM or SIGUSR1 (issue 30 item 5): the
deadline it announces to control, which moves the ranks away before it. Shared by the node
agent (services/worker) and the local stack (services/cli/stack.py), which must wait for it
before a SIGKILL when it restarts a worker."""

from __future__ import annotations

import os

DEPARTURE_ENV = "SURGE_WORKER_DEPARTURE_SECONDS"
# Kubernetes' terminationGracePeriodSeconds by default: the notice a pod gets before SIGKILL.
DEFAULT_DEPARTURE_SECONDS = 30.0


def departure_seconds_from_env() -> float:
    """The deadline set in the environment (the default where unset or malformed: the agent
    itself refuses a malformed value at its start, in one line)."""
    try:
        value = float(os.environ.get(DEPARTURE_ENV) or DEFAULT_DEPARTURE_SECONDS)
    except ValueError:
        return DEFAULT_DEPARTURE_SECONDS
    return value if value >= 0 else DEFAULT_DEPARTURE_SECONDS
