"""What the dashboard's sources ask control for: a job page's events are the newest N of the
page's types (control selects them), and the whole step/eval history is read only for the
curves' fallback, when the store has no step records."""

from __future__ import annotations

import pytest

from services.contract import control_pb2
from services.dashboard.sources import Sources
from tests.ports import free_port

pytestmark = pytest.mark.timeout(30)
STEP_RECORD = (
    '{"type": "step", "rank": 0, "step": 1, "loss": 2.5, "lr": 0.1, "grad_norm": 1.0, "tokens_per_second": 10}\n'
)


class Control:
    """Control's WatchJob, recording each query; answers a step event and an eval event."""

    def __init__(self):
        self.queries: list[control_pb2.JobQuery] = []

    def WatchJob(self, query, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.queries.append(query)
        st = control_pb2.JobStatus(step=3, train_loss=1.5, eval_loss=float("nan"))
        return iter([control_pb2.JobEvent(job_id=query.job_id, seq=9, type="step", status=st)])


class Canned(Sources):
    def __init__(self, records: str | None):
        super().__init__(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")  # (never called: below)
        self._control = Control()
        self._records = records

    def records(self, job_id, record_type="", ranks=(), points=0):
        return None if self._records is None else (self._records, "the store")


def test_events_ask_control_for_the_tail_and_the_types():
    src = Canned("")
    try:
        src.events("j", 200, ["fault", "decision"])
        src.events("j")
        (tailed, every) = src._control.queries
        assert (tailed.job_id, tailed.tail, list(tailed.types), tailed.follow) == (
            "j",
            200,
            ["decision", "fault"],
            False,
        )
        assert (every.tail, list(every.types)) == (0, [])
    finally:
        src.close()


def test_the_curves_read_step_and_eval_events_only_when_the_store_has_no_steps():
    for records in (None, ""):  # the store unreadable, or without this job's records
        src = Canned(records)
        try:
            assert src.job_records("j").series.steps == [3]
            (query,) = src._control.queries
            assert (query.tail, sorted(query.types)) == (0, ["eval", "step"])
            assert src.series("j").steps == [3] and len(src._control.queries) == 2
        finally:
            src.close()
    src = Canned(STEP_RECORD)
    try:
        assert src.job_records("j").series.steps == [1] and src.series("j").steps == [1]
        assert src._control.queries == []  # the store had them: no event read at all
    finally:
        src.close()
