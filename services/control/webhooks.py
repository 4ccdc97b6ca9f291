"""Webhooks on a job's end: control POSTs a small JSON when a job ends FINISHED or FAILED
(or STOPPED, where its spec's ``notify.outcomes`` asks).

Where the URL comes from: the job spec's ``notify.webhook`` (services/jobspec/training.py
``NotifySpec``), else the stack's (control's ``--webhook`` / SURGE_CONTROL_WEBHOOK); none: no POST.

Off the event path: the ``WebhookSender`` stands in for the operator (EXT_USER) as a
receiver of the orchestrator's ``JobEvent``, like ``WatchHub``; its handler only looks at
the event's status and puts the ended job on a bounded queue (``put_nowait``: a full queue
drops it, counted). One sender thread, started with the first notice, reads the job's spec
from the journal and POSTs with a timeout. A POST that fails (refused, an HTTP status >= 300,
a timeout) is logged and counted in ``surge_webhook_failures_total{reason}``, never retried
and never affects the job; ``surge_webhooks_sent_total`` counts those answered 2xx.

Body (JSON): ``{"job_id", "name", "outcome" (FINISHED|FAILED|STOPPED), "step",
"total_steps", "message", "unix_time"}``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import structlog
from prometheus_client import Counter

from services.contract import control_pb2
from services.jobspec import spec_from_json

QUEUE_BOUND = 256  # ended jobs waiting for their POST; beyond it a notice is dropped (counted)
TIMEOUT_S = 5.0  # per POST (connect and answer)

SENT = Counter("surge_webhooks_sent_total", "Job-end webhook POSTs answered with a 2xx status.")
FAILURES = Counter(
    "surge_webhook_failures_total",
    "Job-end webhook POSTs that failed (never retried), by reason: unreachable, timeout, status, queue_full, spec.",
    ["reason"],
)
_log = structlog.get_logger("webhooks")
_CLOSED = threading.Thread(target=lambda: None)  # the sender's place once closed: none starts again
_OUTCOMES = {control_pb2.FINISHED: "FINISHED", control_pb2.FAILED: "FAILED", control_pb2.STOPPED: "STOPPED"}


class WebhookSender:
    """Job-end notices to webhooks, from one thread.

    Args:
        default_url: the stack's webhook ("" none), for jobs whose spec names none.
        spec_json: the job's effective spec as journaled (a read on the sender thread).
        timeout_s: per POST.
        bound: notices waiting at most.
    """

    def __init__(
        self,
        default_url: str = "",
        spec_json: Callable[[str], str | None] | None = None,
        timeout_s: float = TIMEOUT_S,
        bound: int = QUEUE_BOUND,
    ):
        self._default = default_url
        self._spec_json = spec_json or (lambda job_id: None)
        self._timeout = timeout_s
        self._queue: queue.Queue[control_pb2.JobEvent | None] = queue.Queue(maxsize=bound)
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def on_job_event(self, msg: control_pb2.JobEvent, payload: Any = None) -> None:
        """(The orchestrator's publishing thread.) A job's state change to TERMINATED is
        queued for its POST; nothing else is done here."""
        if msg.type != "state" or msg.status.state != control_pb2.TERMINATED:
            return
        if msg.status.outcome not in _OUTCOMES:
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            FAILURES.labels("queue_full").inc()
            _log.error("webhook notice dropped: queue full", job_id=msg.job_id, bound=self._queue.maxsize)
            return
        if self._thread is None:
            with self._start:
                if self._thread is None:  # (closed: _CLOSED; a notice after close is not sent)
                    self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)
                    self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the sender once the notices queued are sent, waiting for it up to
        ``timeout_s`` (a POST still unanswered then goes on, on its daemon thread)."""
        with self._start:
            thread, self._thread = self._thread, _CLOSED
        if thread is None or thread is _CLOSED:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        thread.join(timeout_s)

    # ---- the sender thread -------------------------------------------------------------

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            try:
                self._notify(msg)
            except Exception:  # noqa: BLE001 - the sender outlives any one notice
                FAILURES.labels("internal").inc()
                _log.exception("webhook notice failed", job_id=msg.job_id)

    def _notify(self, msg: control_pb2.JobEvent) -> None:
        s = msg.status
        outcome = _OUTCOMES[s.outcome]
        url, on = self._default, ("FINISHED", "FAILED")
        raw = self._spec_json(msg.job_id)
        if raw:
            try:
                notify = spec_from_json(raw).notify
            except ValueError as e:  # a journaled spec is valid; an old one may lack nothing we need
                FAILURES.labels("spec").inc()
                _log.error("webhook: the job's spec cannot be read", job_id=msg.job_id, error=str(e))
                return
            url, on = notify.webhook or self._default, tuple(notify.outcomes)
        if not url or outcome not in on:
            return
        body = {
            "job_id": s.job_id,
            "name": s.name,
            "outcome": outcome,
            "step": s.step,
            "total_steps": s.total_steps,
            "message": s.message,
            "unix_time": msg.unix_time or time.time(),
        }
        post(url, body, self._timeout, job_id=s.job_id)


def post(url: str, body: dict, timeout_s: float, job_id: str = "") -> bool:
    """POST ``body`` as JSON to ``url``; True if answered 2xx. Failures are logged and
    counted, never raised."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "surge-control"},
        method="POST",
    )
    reason = ""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            if 200 <= answer.status < 300:
                SENT.inc()
                _log.info("webhook sent", job_id=job_id, url=url, outcome=body.get("outcome"), status=answer.status)
                return True
            reason, detail = "status", f"HTTP {answer.status}"
    except urllib.error.HTTPError as e:
        reason, detail = "status", f"HTTP {e.code}"
    except TimeoutError:
        reason, detail = "timeout", f"no answer within {timeout_s:g} s"
    except (urllib.error.URLError, OSError) as e:
        cause = getattr(e, "reason", e)
        reason = "timeout" if isinstance(cause, TimeoutError) else "unreachable"
        detail = str(cause)
    FAILURES.labels(reason).inc()
    _log.error("webhook failed", job_id=job_id, url=url, reason=reason, detail=detail)
    return False
