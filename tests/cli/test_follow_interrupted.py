"""What `submit --follow` says when its follow is interrupted (Ctrl-C): a job still queued stays
queued, and `cancel` takes it out (was: "keeps running ... `surgectl stop`" of a queued job, a
fresh user's trial); a running one keeps running. Control is a stand-in server."""

from __future__ import annotations

from services.cli.cmd_jobs import _goes_on
from services.contract import control_pb2
from tests.ports import free_port

from .test_status_store_outage import write_stack
from .test_stop_store_down import control  # noqa: F401 - the stand-in control fixture


def test_an_interrupted_follow_names_what_the_job_does_now(surge_home, control):  # noqa: F811
    servicer, port = control
    write_stack(port, 1, free_port())
    servicer.status.state, servicer.status.queue_position = control_pb2.STANDBY, 2
    assert _goes_on("j") == (
        "j stays queued (#2; `surgectl events j --follow` to watch, `surgectl cancel j` to take it out)"
    )
    servicer.status.state, servicer.status.queue_position = control_pb2.RUNNING, 0
    assert _goes_on("j") == "j keeps running (`surgectl events j --follow` to watch, `surgectl stop j` to stop)"
