"""A job's own Prometheus series of L5-1 retired at the job's end (RetireCheckpointSeries).

The manager labels seven series by ``job`` (commits, the last commit's seconds, bytes and
written bytes, chunks swept, refusals by operation, versions found corrupt by cause). Nothing
told L5-1 that a job ended, so a finished job's label sets stayed on the store's /metrics
until the store restarted (issue 31 item 6). L1-1 decides the end and says so; the label sets
go ``linger_s`` later (Prometheus reads the last values first), through the composition root's
timer (``later``: L5-1 keeps no timer or thread of its own). The versions, the catalog and
the files are untouched, and a later commit of the job (a resumed job) makes its series again.
Not sent at a relaunch: the job's checkpoints still matter then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client.metrics import MetricWrapperBase

from services.contract import store_pb2
from services.store.checkpoint_manager.layout import _check_job_id

_log = structlog.get_logger("checkpoint_manager")


class Series:
    """Mixin of ``CheckpointManager``: the job's label sets, listed and removed. Reads
    ``self._per_job`` ((metric, its label names), set by the manager), ``self._later`` and
    ``self._linger_s``."""

    _per_job: tuple[tuple[MetricWrapperBase, tuple[str, ...]], ...]
    _later: Callable[[float, Callable[..., Any], tuple], Any] | None
    _linger_s: float

    def retire_checkpoint_series(
        self, msg: store_pb2.RetireCheckpointSeries, payload: Any = None
    ) -> store_pb2.CheckpointSeriesRetired:
        """L1-1 ended the job: its label sets go from every per-job series after the linger
        (at once without a timer). ``series`` in the reply: how many it holds now.

        Raises:
            ValueError: ``job_id`` is not a safe name.
        """
        job = _check_job_id(msg.job_id)
        held = sum(len(sets) for _, sets in self._label_sets(job))
        if self._later is None:
            self._remove_job_series(job, msg.reason)
        else:
            self._later(self._linger_s, self._remove_job_series, (job, msg.reason))
        return store_pb2.CheckpointSeriesRetired(job_id=job, series=held)

    def _label_sets(self, job: str) -> Iterable[tuple[MetricWrapperBase, set[tuple[str, ...]]]]:
        """Each per-job metric with the label values (in its label names' order) of ``job``'s
        children, read from what the metric exports (a counter's _total and _created alike)."""
        for metric, names in self._per_job:
            sets = {
                tuple(s.labels[n] for n in names)
                for family in metric.collect()
                for s in family.samples
                if s.labels.get("job") == job
            }
            yield metric, sets

    def _remove_job_series(self, job: str, reason: str) -> None:
        """The linger after the job's end is over: every label set of the job goes, whatever
        came meanwhile (a save's commit racing the end is the job's last)."""
        removed = 0
        for metric, sets in list(self._label_sets(job)):
            for labels in sets:
                try:
                    metric.remove(*labels)
                    removed += 1
                except KeyError:  # removed meanwhile (a second end of a resumed job)
                    pass
        _log.info("checkpoint_series_removed", job=job, series=removed, reason=reason)
