"""Every Prometheus series of a job labels it ``job`` (README "Observability": job series carry
``job`` and ``rank``; deploy/prometheus.yml's ``honor_labels: true`` keeps it the training job).
Session 35's trial found control's ``surge_rank_slowdown_ratio`` labelled ``job_id``: a
dashboard joining it with the store's series by ``job`` matched nothing. Read from the metrics'
declared label names (a series unset so far has none on /metrics to read)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

import services.control.metrics  # noqa: F401 (control's series, on the default registry)
from services.store.checkpoint_manager import CheckpointManager
from services.store.metric_series import LastRecords
from services.store.metrics_logger import MetricsLogger


def _label_names(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    collectors = registry._collector_to_names  # (the registry's own list of what it holds)
    names = {m._name: tuple(m._labelnames) for m in collectors if isinstance(m, MetricWrapperBase)}
    for m in collectors:  # (the store's record series are read at scrape time: metric_series.py)
        if isinstance(m, LastRecords):
            names.update(m.label_names())
    return names


def test_no_series_of_control_or_the_store_labels_a_job_job_id(tmp_path):
    store = CollectorRegistry()
    logger = MetricsLogger(tmp_path / "metrics", registry=store)
    try:
        CheckpointManager(tmp_path / "ckpt", registry=store)
        names = {**_label_names(REGISTRY), **_label_names(store)}
    finally:
        logger.close()
    assert names["surge_rank_slowdown_ratio"] == ("job", "rank")
    assert names["surge_train_loss"] == ("job", "rank")  # (the store's, for comparison)
    assert [n for n, labels in names.items() if "job_id" in labels] == []
