"""The job spec's ``liveness`` section as the fault detector's StartFaultMonitoring command.

Kept apart from the orchestrator, which only forwards it: the orchestrator keeps no clock on
anyone (tests/redlines/test_event_driven.py), the detector does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from services.contract import control_pb2
from services.control import fault_decision as fd
from services.jobspec import JobSpec


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (read once, at start-up); the
    default when unset, empty, not a number or not above 0."""
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if value > 0 else default


# After a control restart, how long the restored job's ranks get to re-attach before each
# one not heard from is declared silent (or lost with its worker, see the detector): the node agents' reconnect backoff (at most 2 s
# between attempts) plus their first heartbeat, with room for a loaded machine; never less
# than three heartbeat deadlines. SURGE_REATTACH_MIN_SECONDS overrides the 15 s (the test
# suite's stacks: 6 s, tests/conftest.py; a lost node there is then blamed 9 s sooner).
REATTACH_MIN_SECONDS = _env_seconds("SURGE_REATTACH_MIN_SECONDS", 15.0)


def start_monitoring(
    job_id: str,
    spec: JobSpec,
    *,
    restored: bool = False,
    placement: Mapping[int, str] | None = None,
    step: int = 0,
    generations: Mapping[int, int] | None = None,
) -> control_pb2.StartFaultMonitoring:
    """StartFaultMonitoring for ``job_id`` with the deadlines of ``spec.liveness`` (seconds).
    ``restored``: control restarted while the job ran; every rank must re-attach within
    max(REATTACH_MIN_SECONDS, 3 x heartbeat_timeout_seconds). ``placement``: rank -> the
    worker it ran on (or was launched on), as journaled (a rank missing: unknown), so that a
    rank whose node agent never re-attaches is reported lost with that worker; ``step``: the
    job's step as journaled, what such a rank is reported at; ``generations``: rank -> the
    newest generation launched of it, as journaled (an older one's exit is a replaced
    incarnation's)."""
    live = spec.liveness
    msg = control_pb2.StartFaultMonitoring(
        job_id=job_id,
        heartbeat_timeout_seconds=live.heartbeat_timeout_seconds,
        heartbeat_timeout_running_seconds=live.heartbeat_timeout_running_seconds,
        stall_min_seconds=live.stall_min_seconds,
        stall_step_factor=live.stall_step_factor,
        attribution_seconds=live.attribution_seconds,
        eval_seconds=live.phase_seconds.evaluation,
        eval_batches=spec.eval.batches,
        checkpoint_staging_seconds=live.phase_seconds.checkpoint_staging,
        compile_seconds=live.phase_seconds.compile,
        profile_export_seconds=live.phase_seconds.profile_export,
        # (pipeline stages run different layers: their compute per step is not compared)
        ranks_per_stage=spec.parallel.dp * spec.parallel.tp if spec.parallel.pp > 1 else 0,
        data_outage_seconds=fd.wait_seconds(spec.fault_policy, fd.DATA_OUTAGE),
    )
    if restored:
        msg.world_size = spec.world_size
        msg.reattach_seconds = max(REATTACH_MIN_SECONDS, 3 * live.heartbeat_timeout_seconds)
        msg.rank_worker_ids.extend((placement or {}).get(r, "") for r in range(spec.world_size))
        msg.step = max(step, 0)
        msg.rank_generations.extend((generations or {}).get(r, 0) for r in range(spec.world_size))
    return msg
