"""Evaluation hooks (issue 31 item 4, ``eval.hooks``): L1-1 submits, by itself, the evaluation
job `surgectl evaluate JOB --command ...` submits (services/jobspec/evaluation.py
``evaluation_job``: one rank through the queue, its scores beside the job's metrics) of every
``every_versions``-th committed version of the job (its number ``<job>:N`` divisible by it)
and, with ``on_finish``, of its newest version when it FINISHES.

A submit is a decision of its own, made off the decision that saw the version (the deadline
pool's thread, no delay: it journals and may place ranks), under a request id of the job, the
version and the hook: a version relayed twice, or seen again by a restarted control, submits
once. A hook that cannot submit (a spec the evaluation's bounds refuse, a queue that refuses)
is a warning event on the job, never a fault: the training job is not touched.
"""

from __future__ import annotations

import yaml

from services.contract import Module, control_pb2
from services.control.orchestrator.job import JobState, _Job
from services.jobspec.evaluation import evaluation_job

ORCH = Module.L1_ORCHESTRATOR


def _number(version: str) -> int:
    """N of a version ``<job>:N`` (0: not numbered)."""
    tail = version.rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


class EvalHooks:
    """Evaluation hooks (a part of ``Orchestrator``, see core.py)."""

    def _hooks_on_version(self, job: _Job, version: str) -> None:
        """Under the lock: ``version`` of ``job`` committed; the hooks it fires submit soon."""
        n = _number(version)
        for i, hook in enumerate(job.spec.eval.hooks):
            if hook.every_versions and n and n % hook.every_versions == 0:
                self._hook_soon(job, i, version, f"version {n}, every {hook.every_versions}")

    def _hooks_on_finish(self, job: _Job) -> None:
        """Under the lock: ``job`` FINISHED; its on_finish hooks submit soon, of its newest version."""
        if not job.versions:
            return
        version = job.versions[-1][1]
        for i, hook in enumerate(job.spec.eval.hooks):
            if hook.on_finish:
                self._hook_soon(job, i, version, "the job finished")

    def _hook_soon(self, job: _Job, i: int, version: str, why: str) -> None:
        """Under the lock: submit hook ``i``'s evaluation of ``version`` soon, unless one of this
        hook's evaluations still waits or runs: then this version is skipped (said), so that
        versions committed faster than they are evaluated do not pile up in the queue (their
        versions deleted by the job's keep_last before their turn)."""
        prefix = f"eval-hook:{job.status.job_id}:"
        pending = next(
            (
                j
                for j in self._jobs.values()
                if j.request_id.startswith(prefix)
                and j.request_id.endswith(f":{i}")
                and j.status.state != JobState.TERMINATED
            ),
            None,
        )
        key = (job.status.job_id, i)
        if pending is None and key in self._hooks_submitting:  # (asked, not yet a job)
            pending = job
        if pending is not None:
            self._record(
                job, ORCH, "eval",
                f"eval.hooks[{i}] ({why}): no evaluation of {version}: job {pending.status.job_id} of this hook "
                "still waits or runs (one at a time)",
            )  # fmt: skip
            return
        self._hooks_submitting.add(key)
        self._deadlines.after(0.0, self._run_hook, (job.status.job_id, i, version, why))

    def _run_hook(self, job_id: str, i: int, version: str, why: str) -> None:
        """(The deadline pool's thread.) Submit hook ``i``'s evaluation of ``version``."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            hook = job.spec.eval.hooks[i]
            raw = evaluation_job(job.spec, job_id, version, hook.command, hook.hf, hook.timeout_seconds)
        request = control_pb2.SubmitJobRequest(
            spec_yaml=yaml.safe_dump(raw, sort_keys=False, allow_unicode=True),
            spec_path=f"eval.hooks[{i}] of {job_id}",
            request_id=f"eval-hook:{job_id}:{version}:{i}",  # (once, whoever asks again)
            priority=job.status.priority,
        )
        try:
            submitted = self.submit_job_request(request)
        except Exception as e:  # noqa: BLE001 - the hook's failure is said on the job, never its fault
            text = f"WARNING: eval.hooks[{i}] ({why}): no evaluation of {version} submitted: {e}"
        else:
            text = f"eval.hooks[{i}] ({why}): evaluation job {submitted.job_id} of {version} submitted"
        with self._lock:
            self._hooks_submitting.discard((job_id, i))
            job = self._jobs.get(job_id)
            if job is not None:
                self._record(job, ORCH, "eval", text)
                if job.status.state == JobState.TERMINATED:
                    self._keep(job)
