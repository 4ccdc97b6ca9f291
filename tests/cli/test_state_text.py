"""How `surgectl status` names a job's state: PREEMPTED is a STANDBY sub-state (issue 30 item 2);
a drain in flight is named, with the step its paused ranks save."""

from __future__ import annotations

import pytest

from services.cli.render import state_text
from services.contract import control_pb2

S = control_pb2.JobState


@pytest.mark.parametrize(
    ("status", "text"),
    [
        (control_pb2.JobStatus(state=S.STANDBY, queue_position=2), "STANDBY (queued #2)"),
        (
            control_pb2.JobStatus(state=S.STANDBY, queue_position=2, preempted_by="hi-1"),
            "PREEMPTED (by hi-1, queued #2)",
        ),
        (control_pb2.JobStatus(state=S.STANDBY, preempted_by="hi-1"), "PREEMPTED (by hi-1)"),
        (control_pb2.JobStatus(state=S.RUNNING, preempted_by="hi-1"), "RUNNING (preempted by hi-1: checkpointing)"),
        (control_pb2.JobStatus(state=S.RUNNING), "RUNNING"),
        # `surgectl down`'s drain: its paused ranks save a step (an operator's pause has no
        # checkpoint of it: `drained` False, `up` leaves it PAUSED; was shown "RUNNING"), or it
        # pauses at its next boundary
        (control_pb2.JobStatus(state=S.RUNNING, draining=True, draining_step=9), "RUNNING (draining: saving step 9)"),
        (
            control_pb2.JobStatus(state=S.RUNNING, draining=True, draining_step=9, drained=True),
            "RUNNING (draining: saving step 9)",
        ),
        (control_pb2.JobStatus(state=S.RUNNING, draining=True), "RUNNING (draining)"),
        (control_pb2.JobStatus(state=S.RUNNING, drained=True), "RUNNING (draining)"),  # (an older control)
    ],
)
def test_state_text(status, text):
    assert state_text(status) == text
