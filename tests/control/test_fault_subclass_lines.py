"""A fault's subclass in the operator's lines (an operator's trial: a rank behind a SIGSTOPped node
agent showed as `worker_lost` in `events` and `status`, though L1-3 names its cause, typed, as the
subclass `agent_silent`): the fault event, the decision and the status message name it as
`worker_lost (agent_silent)`, from ``FaultReport.subclass``, never from the detail's words.
In-process through the real bus (fixtures of test_fault_policy.py)."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2
from services.control.fault_decision import named

from .test_fault_policy import decisions, plane, running, store  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(30)


def lost(job_id: str, subclass: str, detail: str) -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id=job_id,
        grade=control_pb2.SEVERE,
        fault_class="worker_lost",
        subclass=subclass,
        rank=1,
        worker_id="wb",
        detail=detail,
        source=Module.L1_FAULT_DETECTOR,
    )


def test_a_rank_lost_behind_a_silent_node_agent_is_named_with_its_subclass(plane, store):  # noqa: F811
    job_id, _ = running(plane, "wa", "wb")
    # (the detail's words say nothing of the agent: the name comes from the typed field)
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, lost(job_id, "agent_silent", "no beat for 3.0 s after step 5"))
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults == ["SEVERE worker_lost (agent_silent): no beat for 3.0 s after step 5"], faults
    assert decisions(plane, job_id)[0].startswith("restart_ranks after worker_lost (agent_silent) of rank 1 on wb")
    states = [e.status.message for e in plane.events(job_id) if e.type == "state"]
    assert "recovering from worker_lost (agent_silent) of rank 1" in states, states


def test_a_report_without_a_narrower_subclass_keeps_its_class_alone():
    assert named("worker_lost", lost("j", "", "x")) == "worker_lost"
    assert named("worker_lost", lost("j", "worker_lost", "x")) == "worker_lost"
    assert (
        named("checkpoint_error", lost("j", "checkpoint_integrity", "x")) == "checkpoint_error (checkpoint_integrity)"
    )
