"""Control's cluster gauges (services/control/cluster_metrics.py): jobs by state, the queue's
length and wait, each worker's slots used and free and its devices, read from the published views when
scraped; and the job-end webhook (services/control/webhooks.py): one POST per job ending
FINISHED or FAILED, received by a local HTTP server, a failed one counted, never retried."""

from __future__ import annotations

import http.server
import json
import queue
import threading
import time

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.contract import control_pb2
from services.control import webhooks
from services.control.webhooks import WebhookSender

from .conftest import Plane, settle, spec_yaml
from .test_job_queue import finish, launched, submit

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def samples() -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, of the process's default registry."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def jobs_by_state() -> dict[str, float]:
    return {dict(k[1])["state"]: v for k, v in samples().items() if k[0] == "surge_jobs"}


def test_jobs_by_state_queue_length_and_wait_and_slots_per_worker_are_scraped_from_the_published_views(plane):
    wa = plane.register("wa", slots=1)
    wb = plane.register("wb", slots=2, cuda=2)
    a = submit(plane, "a", dp=2)  # wa's slot and one of wb's
    b, c = submit(plane, "b", dp=3), submit(plane, "c", dp=1)  # b needs every slot; c waits behind it
    assert (b.queue_position, c.queue_position) == (1, 2)
    got = samples()
    assert jobs_by_state() == {
        "STANDBY": 2,
        "WARMING_UP": 1,
        "RUNNING": 0,
        "PAUSED": 0,
        "FAULT_FROZEN": 0,
        "TERMINATED": 0,
    }
    assert got[("surge_queue_length", ())] == 2
    assert 0 <= got[("surge_queue_wait_seconds", ())] < 5
    slots = {dict(k[1])["worker_id"] + ":" + dict(k[1])["kind"]: v for k, v in got.items() if k[0] == "surge_slots"}
    assert slots == {"wa:used": 1, "wa:free": 0, "wb:used": 1, "wb:free": 1}
    devices = {
        (dict(k[1])["worker_id"], dict(k[1])["kind"], dict(k[1])["name"]): v
        for k, v in got.items()
        if k[0] == "surge_devices"
    }
    assert devices == {("wb", "cuda", "H200"): 2}  # (wa registered none: no series)
    time.sleep(1.1)
    assert samples()[("surge_queue_wait_seconds", ())] >= 1.0  # the oldest queued job's wait grows

    assert launched(wa) == launched(wb) == [a.job_id]
    for session, rank in ((wa, 0), (wb, 1)):
        plane.rank_event(session, a.job_id, rank, finished=_finished(rank))
    settle(lambda: plane.get(b.job_id).state, JobState.WARMING_UP)
    settle(lambda: (jobs_by_state()["TERMINATED"], samples()[("surge_queue_length", ())]), (1, 1))
    assert jobs_by_state()["WARMING_UP"] == 1 and jobs_by_state()["STANDBY"] == 1


def _finished(rank: int):
    from services.contract import engine_pb2

    return engine_pb2.TrainingLoopFinished(rank=rank, step=3)


class _Receiver:
    """A local HTTP server on 127.0.0.1 that records each POST's JSON body (and answers
    ``status``)."""

    def __init__(self, status: int = 200):
        got: queue.Queue = queue.Queue()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                got.put((self.path, self.headers["Content-Type"], json.loads(body)))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self.got = got
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture
def receiver():
    r = _Receiver()
    yield r
    r.close()


def _ended(job_id: str, outcome: int, step: int = 3) -> control_pb2.JobEvent:
    status = control_pb2.JobStatus(
        job_id=job_id,
        name="demo",
        state=JobState.TERMINATED,
        outcome=outcome,
        step=step,
        total_steps=3,
        message=f"{JobOutcome.Name(outcome)}: done",
    )
    return control_pb2.JobEvent(job_id=job_id, type="state", message="x", status=status, unix_time=123.0)


def test_the_sender_posts_finished_and_failed_once_each_and_ignores_other_events(receiver):
    sender = WebhookSender(receiver.url)
    try:
        running = _ended("j-0", JobOutcome.FINISHED)
        running.status.state = JobState.RUNNING
        sender.on_job_event(running)  # not an end
        step = _ended("j-0", JobOutcome.FINISHED)
        step.type = "step"
        sender.on_job_event(step)  # not a state change
        sender.on_job_event(_ended("j-1", JobOutcome.FINISHED))
        sender.on_job_event(_ended("j-2", JobOutcome.FAILED, step=1))
        sender.on_job_event(_ended("j-3", JobOutcome.STOPPED))  # not asked for by default
        path, kind, first = receiver.got.get(timeout=10)
        _, _, second = receiver.got.get(timeout=10)
    finally:
        sender.close()
    assert (path, kind) == ("/hook", "application/json")
    assert first == {
        "job_id": "j-1",
        "name": "demo",
        "outcome": "FINISHED",
        "step": 3,
        "total_steps": 3,
        "message": "FINISHED: done",
        "unix_time": 123.0,
    }
    assert (second["job_id"], second["outcome"], second["step"]) == ("j-2", "FAILED", 1)
    assert receiver.got.empty()


def _failures(reason: str) -> float:
    return REGISTRY.get_sample_value("surge_webhook_failures_total", {"reason": reason}) or 0.0


def test_a_failed_post_is_counted_and_never_retried_and_a_full_queue_drops_the_notice():
    bad = _Receiver(status=500)
    try:
        before = _failures("status")
        assert webhooks.post(bad.url, {"job_id": "j"}, timeout_s=5) is False
        assert _failures("status") == before + 1
        assert bad.got.qsize() == 1  # one POST, no retry
    finally:
        bad.close()
    before = _failures("unreachable")
    assert webhooks.post("http://127.0.0.1:1/none", {"job_id": "j"}, timeout_s=2) is False
    assert _failures("unreachable") == before + 1

    # A sender whose queue is full drops the notice (counted) and never blocks the caller.
    slow = WebhookSender("http://127.0.0.1:1/none", bound=1)
    slow._thread = webhooks._CLOSED  # (no sender thread: the queue stays full)
    before = _failures("queue_full")
    started = time.monotonic()
    slow.on_job_event(_ended("j-1", JobOutcome.FINISHED))
    slow.on_job_event(_ended("j-2", JobOutcome.FINISHED))
    assert time.monotonic() - started < 0.5
    assert _failures("queue_full") == before + 1


def test_a_job_s_own_webhook_hears_its_end_from_the_real_control_plane(plane: Plane, receiver):
    extra = f"notify: {{webhook: '{receiver.url}', outcomes: [FINISHED, STOPPED]}}"
    wa = plane.register("wa")
    job = plane.user(
        control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="hooked", dp=1, extra=extra), spec_path="job.yaml")
    )
    finish(plane, wa, job.job_id)
    _, _, body = receiver.got.get(timeout=10)
    assert (body["job_id"], body["name"], body["outcome"], body["step"]) == (job.job_id, "hooked", "FINISHED", 3)
    other = submit(plane, "plain")  # no notify, no stack webhook: nothing is sent
    finish(plane, wa, other.job_id)
    plane.c.webhooks.close(timeout_s=5)
    assert receiver.got.empty()
