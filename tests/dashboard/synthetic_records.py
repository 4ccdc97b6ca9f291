"""A synthetic job's metrics file in the metrics logger's exact line format, and dashboard
sources that read the store for real and answer control's calls from canned messages: the
large-job page test (test_large_job.py) and bench/dashboard_scale.py share them."""

from __future__ import annotations

import math
from pathlib import Path

from services.contract import control_pb2
from services.dashboard.sources import Sources

LINE = (
    '{{"type":"step","job_id":"{job}","rank":{rank},"step":{step},"loss":{loss:.10g},'
    '"learning_rate":{lr:.10g},"grad_norm":{gn:.10g},"tokens":524288,"tokens_per_second":{tps:.10g},'
    '"step_seconds":0.4321,"data_wait_seconds":0.0012,"forward_seconds":0.1234,"backward_seconds":0.2345,'
    '"reduction_seconds":0.0345,"optimizer_seconds":0.0123,"loss_scale":1.0,"epoch":1,'
    '"unix_time":{t:.3f},"world_size":{ranks},"flops_per_token":6100000000.0,"mfu":0.41,'
    '"commands_agreed":3,"skipped":false,"skip_reason":"","fault":"STEP_FAULT_KIND_UNSPECIFIED",'
    '"action":"STEP_VERDICT_ACTION_UNSPECIFIED","standing_order":0}}\n'
)
EVAL = (
    '{{"type":"eval","job_id":"{job}","rank":{rank},"step":{step},"loss":{loss:.10g},"tokens":65536,"seconds":1.5}}\n'
)
SAMPLE = (
    '{{"type":"sample","job_id":"{job}","rank":0,"step":{step},"prompt_index":0,"prompt":"def ",'
    '"text":"main():","tokens":8,"seconds":0.2,"temperature":0.0,"note":""}}\n'
)
SPIKE_EVERY = 7919


def write_job(path: Path, job: str, steps: int, ranks: int) -> int:
    """The synthetic records of ``job`` (module docstring); returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "w") as f:
        buf = []
        for step in range(1, steps + 1):
            base = 2.0 + 8.0 / math.sqrt(step)
            lr = 3e-4 * min(1.0, step / 1000)
            for rank in range(ranks):
                noise = ((step * 2654435761 + rank * 40503) % 1000) / 10000.0
                spike = 30.0 if step % SPIKE_EVERY == 0 else 0.0
                buf.append(
                    LINE.format(
                        job=job,
                        rank=rank,
                        step=step,
                        loss=base + noise + spike,
                        lr=lr,
                        gn=0.9 + noise + spike,
                        tps=120000.0 + 1000 * noise,
                        t=1765000000.0 + step * 0.43,
                        ranks=ranks,
                    )
                )
                if step % 1000 == 0:
                    buf.append(EVAL.format(job=job, rank=rank, step=step, loss=base + 0.05))
            if step % 5000 == 0:
                buf.append(SAMPLE.format(job=job, step=step))
            if len(buf) >= 20000:
                text = "".join(buf)
                f.write(text)
                written += len(text)
                buf = []
        text = "".join(buf)
        f.write(text)
        written += len(text)
    return written


class StoreOnlySources(Sources):
    """The store for real; control's answers canned (module docstring)."""

    def __init__(self, store: str, statuses: dict[str, control_pb2.JobStatus]):
        super().__init__(store, store)  # (control's channel is never used: every control call is below)
        self._statuses = statuses

    def jobs(self) -> control_pb2.JobList:
        return control_pb2.JobList(jobs=list(self._statuses.values()))

    def resolve(self, ref: str) -> str:
        return ref

    def job(self, job_id: str) -> control_pb2.JobStatus:
        return self._statuses[job_id]

    def events(self, job_id: str, tail: int = 0, types=()) -> list:
        return []

    def logs(self, job_id: str) -> list:
        return []
