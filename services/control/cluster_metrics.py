"""Gauges of the cluster's state on control's /metrics, computed when scraped.

* ``surge_jobs{state}``: jobs by ``JobState`` (every state, zeros included);
* ``surge_job_state{job,state}``: 1 for each job not ended, labelled with its state (an ended
  job has none): "RUNNING and not stepping", "PAUSED for an hour" can be written;
* ``surge_job_step{job}``, ``surge_job_checkpoint_step{job}``, ``surge_job_checkpoint_every_steps{job}``:
  each such job's step, the step of its newest committed checkpoint (0: none) and its
  checkpoint interval in steps (its spec's ``checkpoint.every_steps``; 0: at the end only).
  Control's journal holds them: a store or control restart leaves them there (the store's own
  per-job series wait for its next commit), and a store outage does not blind them, so "no
  checkpoint committed for N intervals" is ``step - checkpoint_step > N * every_steps``;
* ``surge_queue_length``: jobs waiting in control's queue;
* ``surge_queue_wait_seconds``: how long the oldest queued job that can run has waited (0: none
  queued); a job that can never run as things stand is left out (it is counted by cause in the
  next gauge), so a queue-wait alert is not held up for ever by one;
* ``surge_queue_cannot_run{cause}``: queued jobs that can never run as things stand, by cause:
  ``quota`` (more slots than their team may ever hold) or ``cluster`` (more slots of their
  kind than are registered at all); each starts by itself once that changes;
* ``surge_slots{worker_id,kind}``: a registered worker's rank slots, ``used`` or ``free``;
* ``surge_devices{worker_id,kind,name}``: the devices a registered worker reported, counted by
  kind ("cpu", "cuda") and model name (the dashboard's cluster page shows them).

Why a collector: these are facts of the orchestrator's and the allocator's state, and
setting gauges as decisions go would put metric work on the event path. The scrape reads
what is already published instead: the orchestrator's ``JobViews`` (the statuses and queue
places published after each decision, under that file's leaf lock, never the decision
lock) and the allocator's slot census (a copy of a few integers under its own short lock).
Each registers its reader here as it is built (``watch_jobs`` / ``watch_slots``), weakly:
the newest one is read (one per control process; tests build more).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from services.contract import control_pb2


class JobCensus(NamedTuple):
    """What ``JobViews.census`` answers: jobs by state, the queue's length, the wall time
    (unix seconds) its oldest entry that can run was queued at (0: none) and its jobs that can
    never run as things stand, by cause (JobStatus.cannot_run)."""

    by_state: dict[int, int]
    queued: int
    oldest_queued_unix: float
    cannot_run: dict[str, int] = {}  # noqa: RUF012 - a NamedTuple's default, never changed
    active: tuple[ActiveJob, ...] = ()  # every job not ended (ActiveJob, below)


CANNOT_RUN_CAUSES = ("quota", "cluster")  # (JobStatus.cannot_run's values)


class ActiveJob(NamedTuple):
    """A job not ended, as its published view says (the per-job gauges)."""

    job_id: str
    state: int  # JobState
    step: int
    checkpoint_step: int  # its newest committed checkpoint's step (0: none)
    checkpoint_every: int  # its spec's checkpoint.every_steps


class SlotCensus(NamedTuple):
    worker_id: str
    used: int
    free: int
    devices: tuple[tuple[str, str], ...] = ()  # (kind, name) of each device it registered


_readers: dict[str, Callable[[], Callable[[], object] | None]] = {}


def _weak(fn: Callable[[], object]) -> Callable[[], Callable[[], object] | None]:
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)  # type: ignore[arg-type, return-value]


def watch_jobs(census: Callable[[], JobCensus]) -> None:
    """The gauges of jobs and the queue read ``census()`` (a bound method, held weakly)."""
    _readers["jobs"] = _weak(census)


def watch_slots(census: Callable[[], list[SlotCensus]]) -> None:
    """``surge_slots`` reads ``census()`` (a bound method, held weakly)."""
    _readers["slots"] = _weak(census)


def _read(name: str):
    ref = _readers.get(name)
    fn = ref() if ref is not None else None
    return fn() if fn is not None else None


class ClusterCollector:
    """The custom collector (registered once on the process's default registry)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("surge_jobs", "Jobs known to control, by state.", labels=["state"])
        length = GaugeMetricFamily("surge_queue_length", "Jobs waiting in control's queue.")
        wait = GaugeMetricFamily(
            "surge_queue_wait_seconds",
            "Seconds the oldest job in control's queue that can run has waited (0: none queued; jobs that can never "
            "run as things stand are in surge_queue_cannot_run instead).",
        )
        never = GaugeMetricFamily(
            "surge_queue_cannot_run",
            "Queued jobs that can never run as things stand, by cause (quota: beyond what their team may ever "
            "hold; cluster: more slots of their kind than are registered).",
            labels=["cause"],
        )
        job_state = GaugeMetricFamily(
            "surge_job_state", "1 for each job not ended, labelled with its state.", labels=["job", "state"]
        )
        step = GaugeMetricFamily("surge_job_step", "Each job's step (jobs not ended).", labels=["job"])
        checkpoint_step = GaugeMetricFamily(
            "surge_job_checkpoint_step",
            "The step of each job's newest committed checkpoint (0: none; jobs not ended; from control's journal).",
            labels=["job"],
        )
        every = GaugeMetricFamily(
            "surge_job_checkpoint_every_steps",
            "Checkpoint interval in steps of each job not ended (its spec's checkpoint.every_steps; 0: at the end only).",
            labels=["job"],
        )
        census: JobCensus | None = _read("jobs")
        if census is not None:
            for name, number in control_pb2.JobState.items():
                if number != control_pb2.JOB_STATE_UNSPECIFIED:
                    jobs.add_metric([name], census.by_state.get(number, 0))
            length.add_metric([], census.queued)
            oldest = census.oldest_queued_unix
            wait.add_metric([], max(0.0, time.time() - oldest) if oldest else 0.0)
            for cause in CANNOT_RUN_CAUSES:
                never.add_metric([cause], census.cannot_run.get(cause, 0))
            for job in census.active:
                job_state.add_metric([job.job_id, control_pb2.JobState.Name(job.state)], 1)
                step.add_metric([job.job_id], job.step)
                checkpoint_step.add_metric([job.job_id], job.checkpoint_step)
                every.add_metric([job.job_id], job.checkpoint_every)
        slots = GaugeMetricFamily(
            "surge_slots", "Rank slots of each registered worker, used or free.", labels=["worker_id", "kind"]
        )
        devices = GaugeMetricFamily(
            "surge_devices",
            "Devices each registered worker reported, by kind and model name.",
            labels=["worker_id", "kind", "name"],
        )
        for s in _read("slots") or ():
            slots.add_metric([s.worker_id, "used"], s.used)
            slots.add_metric([s.worker_id, "free"], s.free)
            for (kind, name), n in sorted(Counter(s.devices).items()):
                devices.add_metric([s.worker_id, kind, name], n)
        yield from (jobs, job_state, step, checkpoint_step, every, length, wait, never, slots, devices)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only (so the registry checks duplicates without collecting).
        yield GaugeMetricFamily("surge_jobs", "", labels=["state"])
        yield GaugeMetricFamily("surge_job_state", "", labels=["job", "state"])
        yield GaugeMetricFamily("surge_job_step", "", labels=["job"])
        yield GaugeMetricFamily("surge_job_checkpoint_step", "", labels=["job"])
        yield GaugeMetricFamily("surge_job_checkpoint_every_steps", "", labels=["job"])
        yield GaugeMetricFamily("surge_queue_length", "")
        yield GaugeMetricFamily("surge_queue_wait_seconds", "")
        yield GaugeMetricFamily("surge_queue_cannot_run", "", labels=["cause"])
        yield GaugeMetricFamily("surge_slots", "", labels=["worker_id", "kind"])
        yield GaugeMetricFamily("surge_devices", "", labels=["worker_id", "kind", "name"])


REGISTRY.register(ClusterCollector())
