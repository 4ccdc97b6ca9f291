"""The rank's communication settings, from its job spec (pushed once, in InitJob): how long
a collective may wait for a peer, and how NCCL handles a failed communicator.

Computed by the rank's composition root and given to L2-2 (its group's timeouts) and to the
process environment (NCCL reads its settings when a group is made); L2-2 keeps no view of
the job's liveness settings (they are L1-3's deadlines).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from services.jobspec import LivenessSpec

# The floor of a collective's timeout (seconds): torchft's Manager and ProcessGroup default
# (``timeout=timedelta(seconds=60)``, torchft/manager.py, torchft/process_group.py).
COLLECTIVE_TIMEOUT_FLOOR_S = 60.0


def collective_timeout_s(liveness: LivenessSpec, compiles: bool = False, data_outage_s: float = 0.0) -> float:
    """How long a collective of the job's process group may wait for a peer (seconds): the
    group's timeout, after which NCCL's watchdog aborts its communicator (gloo raises).

    ``liveness.collective_timeout_seconds`` when the spec sets it; else derived from the
    job's liveness deadlines so it never fires before L1 has judged: L1 hears a dead rank
    within ``heartbeat_timeout_seconds`` (a running but silent one within
    ``heartbeat_timeout_running_seconds``) and a stalled one after ``stall_min_seconds``, and
    orders the rebuild, which aborts the survivors' communicator at once
    (services/engine/parallel_strategy.py). The timeout is the backstop for when
    that order does not come: twice the longest of those deadlines, at least
    :data:`COLLECTIVE_TIMEOUT_FLOOR_S` (60 s with the defaults, where a constant 300 s was).
    A job that compiles waits out ``phase_seconds.compile`` too: a replacement compiling its
    first step keeps its healed peers in that step's first collective that long. So does a
    data service down (``data_outage_s``, fault_policy.data_outage_seconds): a rank whose
    read-ahead ran out first waits for it, its peers in the step's collective, while L1-1 waits
    (that plus the longest deadline above: 330 s for a job with the default 300 s; a job that
    wants a shorter backstop sets ``collective_timeout_seconds`` or ``data_outage_seconds``).
    """
    if liveness.collective_timeout_seconds > 0:
        return liveness.collective_timeout_seconds
    judged = max(liveness.heartbeat_timeout_running_seconds, liveness.stall_min_seconds)
    timeout = max(COLLECTIVE_TIMEOUT_FLOOR_S, 2 * judged)
    if compiles:
        timeout = max(timeout, liveness.phase_seconds.compile)
    if data_outage_s > 0:
        timeout = max(timeout, data_outage_s + judged)
    return timeout


def side_timeout_s(liveness: LivenessSpec, compiles: bool = False, data_outage_s: float = 0.0) -> float:
    """The timeout of the side groups (the store relay's gloo groups, ``side_groups``): a
    save's agreement and DCP write wait for the slowest peer's staging, whose budget is
    ``phase_seconds.checkpoint_staging``; never shorter than a collective's."""
    return max(collective_timeout_s(liveness, compiles, data_outage_s), liveness.phase_seconds.checkpoint_staging)


def nccl_environment(timeout_s: float) -> dict[str, str]:
    """The NCCL settings of a rank whose group is ``nccl`` (read by ProcessGroupNCCL when a
    group is made; an operator's own value of any of them is kept).

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly): on a timeout or an NCCL error the
      watchdog aborts the communicators and leaves the process alive; the rank's next use
      of the group raises, typed as a communication failure by the guard around it, and the
      rebuild proceeds. torch 2.13's default, 3 (SkipCleanUp), and 1 (TearDown) end the
      process instead (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, ErrorHandlingMode),
      so no survivor could be kept.
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump first (it delays the abort by
      up to ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``; L1 has the fault's record already).
    * ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: the monitor that kills a process whose watchdog
      hangs (an ``ncclCommAbort`` that never returns) fires after one collective timeout,
      not torch's 480 s: such a rank cannot be kept and L1 relaunches it.
    * ``TORCH_NCCL_BLOCKING_WAIT=0``: the CPU does not block in ``wait()``; a failure shows
      at the next use of the group (as with 2 above).
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(1, round(timeout_s))),
        "TORCH_NCCL_BLOCKING_WAIT": "0",
    }


def apply_nccl_environment(timeout_s: float, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :func:`nccl_environment` in ``env`` (this process's, before its group is made),
    keeping any the operator set. Returns what is in effect."""
    for name, value in nccl_environment(timeout_s).items():
        env.setdefault(name, value)
    return {name: env[name] for name in nccl_environment(timeout_s)}
