"""`surgectl rollback` asked while one to the same version is in flight (an operator's trial: the
same line as a new rollback, though control folded it into the first): control's reply names the
rollback in flight (JobStatus.rollback_in_flight, typed), and surgectl says "already rolling back
to V (asked at ...)", exit 0. Over real gRPC through control's real servicer."""

from __future__ import annotations

import time

from services.contract import control_pb2
from services.contract.bus import Reply
from tests.integration.test_end_to_end import cli

from .test_drain import control_server  # noqa: F401 - fixture


class Control:
    """Control's orchestrator as its user port sees it: a RUNNING job; its first rollback
    starts, the next is folded into it."""

    def __init__(self, asked_unix: float):
        self.asked_unix, self.rollbacks = asked_unix, 0

    def __call__(self, request, payload=None):
        status = control_pb2.JobStatus(job_id="run-1", state=control_pb2.RUNNING)
        if type(request).__name__ == "JobQuery":
            return Reply(control_pb2.JobList(jobs=[status]) if not request.job_id else status)
        self.rollbacks += 1
        if self.rollbacks > 1:
            status.rollback_in_flight, status.rollback_asked_unix = "run-1:4", self.asked_unix
        return Reply(status)


def test_a_rollback_asked_again_says_it_is_already_rolling_back_and_exits_0(control_server, tmp_path):  # noqa: F811
    asked = time.time()  # (today: shown without its date)
    address = control_server(Control(asked))
    env = {"SURGE_CONTROL_ADDRESS": address}
    first = cli(tmp_path, "rollback", "run-1", "--version", "run-1:4", env=env)
    assert (first.returncode, first.stdout.strip()) == (0, "run-1: rolling back in place; now RUNNING"), first.stderr
    again = cli(tmp_path, "rollback", "run-1", "--version", "run-1:4", env=env)
    at = time.strftime("%H:%M:%S", time.localtime(asked))
    expected = f"run-1: already rolling back to run-1:4 (asked at {at}); nothing new asked"
    assert (again.returncode, again.stdout.strip(), again.stderr) == (0, expected, ""), again.stderr
