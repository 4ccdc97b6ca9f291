"""A job's own Prometheus series of L5-1 retired at the job's end (RetireCheckpointSeries).

The manager labels seven series by ``job`` (commits, the last commit's seconds, bytes and
written bytes, chunks swept, refusals by operation, versions found corrupt by cause). Nothing
told L5-1 that a job ended, so a finished job's label sets stayed on the store's /metrics
until the store restarted (issue 31 item 6). L1-1 decides the end and says so; the label sets
go ``linger_s`` later (Prometheus reads the last values first), through the composition root's
timer (``later``: L5-1 keeps no timer or thread of its own). The versions, the catalog and
the files are untouched, and a later commit of the job (a resumed job) makes its series again.
Not sent at a relaunch: the job's checkpoints still matter then.

The series describe the job's checkpointing while it runs, not its kept versions (listed by
CheckpointQuery): kept for every job whose versions stay, /metrics would grow with the store's
history. So an ended job gets none back: a sweep after its end (a deletion of one of its
versions, ``DeleteCheckpoint.job_ended`` saying so after a store restart) counts in no series
of it (session 35: a lone ``surge_checkpoint_chunks_swept_total{job}`` came back); its last
version's deletion removes what is left (manager.py ``_forget_series``).

A restarted store rebuilds the newest commit's time and step of every job its catalog holds
that has not ended (``_newest_from_catalog``, at start; was: only at the job's first save after
the restart, so a job whose saves all failed had none). Which jobs ended is kept on disk
(``ENDED``, the jobs L1-1 retired and that still have versions): the store is never told of
jobs by control, and an ended job's series must not come back at each restart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client.metrics import MetricWrapperBase

from services.contract import store_pb2
from services.store.checkpoint_manager.layout import _check_job_id

_log = structlog.get_logger("checkpoint_manager")

ENDED = "ended_jobs.json"  # under <root>/checkpoints: the jobs whose series were retired


class Series:
    """Mixin of ``CheckpointManager``: the job's label sets, listed and removed. Reads
    ``self._per_job`` ((metric, its label names), set by the manager), ``self._later`` and
    ``self._linger_s``."""

    _per_job: tuple[tuple[MetricWrapperBase, tuple[str, ...]], ...]
    _later: Callable[[float, Callable[..., Any], tuple], Any] | None
    _linger_s: float
    _ended: set[str]
    _dir: Path
    _chain: list[dict[str, Any]]
    _newest_known: set[str]
    _newest_unix: Any
    _newest_step: Any

    def retire_checkpoint_series(
        self, msg: store_pb2.RetireCheckpointSeries, payload: Any = None
    ) -> store_pb2.CheckpointSeriesRetired:
        """L1-1 ended the job: its label sets go from every per-job series after the linger
        (at once without a timer). ``series`` in the reply: how many it holds now.

        Raises:
            ValueError: ``job_id`` is not a safe name.
        """
        job = _check_job_id(msg.job_id)
        self._note_ended(job, True)  # (until a commit of it: manager.py)
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

    def _read_ended(self) -> set[str]:
        """The jobs recorded ended by an earlier process of this store (none if the file is
        missing or unreadable: their series would come back, nothing worse)."""
        try:
            return {j for j in json.loads((self._dir / ENDED).read_text()) if isinstance(j, str)}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, TypeError) as e:
            _log.warning("checkpoint_ended_jobs_unreadable", path=str(self._dir / ENDED), error=str(e))
            return set()

    def _note_ended(self, job: str, ended: bool) -> None:
        """``job`` ended (retired, a deletion's ``job_ended``) or made series again (a resumed
        job's commit); kept on disk when that changes. A write that fails is logged, never
        raised: a retire or a commit does not fail for it (a full disk)."""
        if (job in self._ended) == ended:
            return
        if ended:
            self._ended.add(job)
        else:
            self._ended.discard(job)
        held = {e["job_id"] for e in self._chain}  # (a job with no version left needs no word)
        path = self._dir / ENDED
        tmp = path.with_name(ENDED + ".tmp")
        try:
            tmp.write_text(json.dumps(sorted(self._ended & held)))
            os.replace(tmp, path)
        except OSError as e:
            _log.warning("checkpoint_ended_jobs_not_written", path=str(path), error=str(e))

    def _newest_from_catalog(self) -> None:
        """At start: the newest committed version's time and step of each job of the catalog
        that has not ended (the catalog's order is commit order, so the last entry of a job is
        its newest)."""
        newest: dict[str, dict[str, Any]] = {}
        for entry in self._chain:
            if entry["job_id"] not in self._ended and entry["n"] >= newest.get(entry["job_id"], {"n": -1})["n"]:
                newest[entry["job_id"]] = entry
        for job, entry in newest.items():
            self._newest_known.add(job)
            self._newest_unix.labels(job).set(entry["created_unix"])
            self._newest_step.labels(job).set(entry["step"])
