"""The job spec's ``liveness`` section as the fault detector's StartFaultMonitoring command.

Kept apart from the orchestrator, which only forwards it: the orchestrator keeps no clock on
anyone (tests/redlines/test_event_driven.py), the detector does.
"""

from __future__ import annotations

from services.contract import control_pb2
from services.jobspec import JobSpec


def start_monitoring(job_id: str, spec: JobSpec) -> control_pb2.StartFaultMonitoring:
    """StartFaultMonitoring for ``job_id`` with the deadlines of ``spec.liveness`` (seconds)."""
    live = spec.liveness
    return control_pb2.StartFaultMonitoring(
        job_id=job_id,
        heartbeat_timeout_seconds=live.heartbeat_timeout_seconds,
        stall_min_seconds=live.stall_min_seconds,
        stall_step_factor=live.stall_step_factor,
        attribution_seconds=live.attribution_seconds,
    )
