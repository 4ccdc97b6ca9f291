"""`surgectl status` says in one line, above the jobs, when a job's recent saves failed and why
(``JobStatus.save_failing``, kept by control from the store's typed failures): with the disk
full and every save refused it said nothing, the checkpoint column just stayed behind (a fresh
SRE's trial, F7). Control's side (counted once per save, cleared at a commit):
tests/control/test_operator_actions.py."""

from __future__ import annotations

from rich.console import Console

from services.cli.cmd_jobs import _status_tables
from services.contract import control_pb2, route_pb2, store_pb2

JobState = control_pb2.JobState


def rendered(jobs: list, store: str = "") -> list[str]:
    console = Console(width=400, record=True)
    console.print(_status_tables(jobs, [], "", store))
    return console.export_text().splitlines()


def job(job_id: str, failing: control_pb2.SaveFailing | None = None, state=JobState.RUNNING) -> control_pb2.JobStatus:
    s = control_pb2.JobStatus(
        job_id=job_id, state=state, step=489, total_steps=4000, checkpoint_version=f"{job_id}:4", checkpoint_step=375
    )
    if failing is not None:
        s.save_failing.CopyFrom(failing)
    return s


NO_SPACE = control_pb2.SaveFailing(
    failed=3,
    first_step=400,
    step=480,
    cause=store_pb2.WRITE_REFUSED,
    write_error=route_pb2.WRITE_NO_SPACE,
    path="/h/store/checkpoints",
    reason="No space left on device",
)


def test_status_names_a_job_whose_saves_are_refused_for_no_space_first():
    lines = rendered([job("ok"), job("sre1", NO_SPACE)])
    assert lines[0] == (
        "checkpoint saves failing: sre1: 3 saves failed (steps 400-480): the store answered but refused the write: "
        "no space at /h/store/checkpoints; newest checkpoint sre1:4 (step 375); the next save tries again "
        "(free space at /h/store/checkpoints)"
    )
    assert not any(line.startswith("checkpoint saves failing: ok") for line in lines)


def test_status_names_a_store_that_does_not_answer_the_saves_and_the_store_outage_line_stays_first():
    away = control_pb2.SaveFailing(failed=1, first_step=400, step=400, cause=store_pb2.UNREACHABLE)
    lines = rendered([job("j", away)], store="store unreachable at 127.0.0.1:1: its process is gone")
    assert lines[0].startswith("store unreachable")
    assert lines[1] == (
        "checkpoint saves failing: j: 1 save failed (step 400): the store did not answer (unreachable); newest "
        "checkpoint j:4 (step 375); the next save tries again (once the store answers)"
    )


def test_status_says_nothing_of_saves_that_go_through_or_of_an_ended_job():
    ended = job("done", NO_SPACE, state=JobState.TERMINATED)
    assert not any("saves failing" in line for line in rendered([job("ok"), ended]))


def test_a_paused_job_whose_pause_save_failed_is_told_what_saves_its_step():
    # (was: "the next save tries again" of a paused job, which saves nothing by itself: a fresh
    # user's trial)
    away = control_pb2.SaveFailing(failed=1, first_step=39, step=39, cause=store_pb2.UNREACHABLE)
    (line,) = [x for x in rendered([job("p", away, state=JobState.PAUSED)]) if x.startswith("checkpoint saves")]
    assert line.endswith(
        "paused, it saves nothing by itself: `surgectl stop p` or `surgectl down` saves its step, "
        "`surgectl resume p` trains on to its next save (once the store answers)"
    ), line
