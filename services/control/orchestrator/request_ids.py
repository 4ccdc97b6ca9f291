"""Submits by request id (issue 28: every operator command is safe to interrupt).

`surgectl submit` sends one request id per invocation and the same one on each retry (a
reply lost to a control restart or a deadline): a retry of a submit whose job was created
must get that job, not a second one running the same spec. The id lives in the job's
journaled row (``JobStore.create_job``), so a restarted control knows it too; a job
deleted (`surgectl delete`) takes its id with it. An empty request id is an old client's
submit: never deduplicated."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from services.contract import control_pb2
from services.control.orchestrator.job import _Job
from services.control.orchestrator.refusals import RequestIdReused


def spec_sha256(spec_yaml: str) -> str:
    """What a retried submit's spec text is compared by (the text as sent, not the parsed
    spec: the journaled spec may since have been replaced, by a resume at a new layout)."""
    return hashlib.sha256(spec_yaml.encode()).hexdigest()


def submitted_before(jobs: Iterable[_Job], msg: control_pb2.SubmitJobRequest) -> _Job | None:
    """The job an earlier submit with ``msg.request_id`` created (None: no request id, or
    none known). A scan, not an index: the orchestrator's jobs are few and a submit is rare,
    and there is no second record to keep in step as jobs are forgotten.

    Raises:
        RequestIdReused: that submit carried another spec text (nothing is persisted).
    """
    if not msg.request_id:
        return None
    job = next((j for j in jobs if j.request_id == msg.request_id), None)
    if job is not None and job.spec_sha256 != spec_sha256(msg.spec_yaml):
        raise RequestIdReused(
            f"{msg.spec_path or 'job.yaml'}: request id {msg.request_id} already submitted job "
            f"{job.status.job_id} with another spec; a new submit needs a new request id"
        )
    return job
