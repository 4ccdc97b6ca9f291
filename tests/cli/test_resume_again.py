"""`surgectl resume` asked again of a job that runs (an operator's trial: exit 1, "is RUNNING, not
PAUSED", where `pause` and `stop` asked again answer the job's state, exit 0): control's typed
refusal REFUSED_ALREADY_RUNNING makes it "already RUNNING; nothing to resume", exit 0. A resume
that asks for something (`--from`, a layout) of a running job is still refused, exit 1."""

from __future__ import annotations

from services.contract import control_pb2
from services.control.orchestrator import IllegalTransition
from tests.integration.test_end_to_end import cli

from .test_drain import ScriptedOrchestrator, control_server  # noqa: F401 - fixture

JobState = control_pb2.JobState
WORDS = "job {} is RUNNING, not PAUSED: resume continues a PAUSED job, or relaunches a STOPPED or FAILED one"


def test_a_resume_of_a_running_job_says_it_runs_already_and_exits_0(control_server, tmp_path):  # noqa: F811
    control = ScriptedOrchestrator(
        {"run-1": [JobState.RUNNING], "other-2": [JobState.RUNNING]},
        {
            "run-1": [IllegalTransition(WORDS.format("run-1"), control_pb2.REFUSED_ALREADY_RUNNING)],
            "other-2": [IllegalTransition(WORDS.format("other-2"))],  # (the same words, untyped)
        },
    )
    address = control_server(control)
    r = cli(tmp_path, "resume", "run-1", env={"SURGE_CONTROL_ADDRESS": address})
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "run-1: already RUNNING; nothing to resume", "")
    r = cli(tmp_path, "resume", "other-2", "--from", "other-2:1", env={"SURGE_CONTROL_ADDRESS": address})
    assert r.returncode == 1 and r.stderr.strip() == f"error: {WORDS.format('other-2')}", r.stderr
