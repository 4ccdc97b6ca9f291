"""Each registered worker's rank slots and devices, as control's slot census says them (its
/metrics: ``surge_slots``, ``surge_devices``), and its health as control's job list says it
(cordoned, quarantined or lost; ranks on it named slow; data-plane links to it named degraded or
down): what `surgectl workers` prints and the dashboard's cluster page shows."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.contract import control_pb2


@dataclass(frozen=True)
class Slots:
    """One registered worker's rank slots, as control's slot census says them (``surge_slots``)."""

    worker_id: str
    used: int
    free: int
    devices: tuple[tuple[str, str, int], ...] = ()  # (kind, name, count), control's ``surge_devices``

    def devices_text(self) -> str:
        """E.g. "2 x cuda NVIDIA H200", one line per kind and model."""
        return "; ".join(f"{n} x {kind} {name}".rstrip() for kind, name, n in self.devices) or "—"


def slots_of(exposition: str) -> list[Slots]:
    """The ``surge_slots`` and ``surge_devices`` samples of a Prometheus text exposition, one
    entry per worker."""
    found: dict[str, dict[str, int]] = {}
    devices: dict[str, list[tuple[str, str, int]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            worker, kind = sample.labels.get("worker_id", ""), sample.labels.get("kind", "")
            if family.name == "surge_slots":
                found.setdefault(worker, {})[kind] = int(sample.value)
            elif family.name == "surge_devices" and sample.value > 0:
                devices.setdefault(worker, []).append((kind, sample.labels.get("name", ""), int(sample.value)))
    return [Slots(w, k.get("used", 0), k.get("free", 0), tuple(devices.get(w, ()))) for w, k in sorted(found.items())]


def read_slots(metrics_url: str, timeout_s: float) -> list[Slots] | None:
    """Every worker's slots from control's /metrics at ``metrics_url``; None when it cannot be read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
            return slots_of(r.read().decode())
    except (OSError, ValueError):  # (ValueError: a URL that is none, or an exposition that does not parse)
        return None


@dataclass(frozen=True)
class WorkerHealth:
    """A worker's health as control's job list says it: each finding one line, none: healthy."""

    worker_id: str
    findings: tuple[str, ...]
    cordoned: bool  # no rank is placed on it (a cordon, a quarantine, its agent lost)


def health_of(
    workers: Sequence[str], jobs: Sequence[control_pb2.JobStatus], cordoned: Sequence[control_pb2.WorkerCordoned]
) -> list[WorkerHealth]:
    """The health of ``workers`` and of every worker the job list names (sorted by id)."""
    cordon = {c.worker_id: c for c in cordoned if not c.cleared}
    found: dict[str, list[str]] = {}
    for w, c in cordon.items():
        what = "quarantined" if c.quarantine else ("lost" if c.lost else ("held" if c.held else "cordoned"))
        # (a quarantine's reason names itself already: "quarantined: 3 rank faults ...", once)
        found.setdefault(w, []).append(c.reason if c.reason.startswith(f"{what}:") else f"{what}: {c.reason}")
    for j in jobs:
        for r in j.slow_ranks:
            found.setdefault(r.worker_id, []).append(f"slow: {j.job_id} rank {r.rank}: {r.detail}")
        for link in j.links:
            for w in link.worker_ids:
                found.setdefault(w, []).append(f"{link.fault_class} {' - '.join(link.worker_ids)}: {link.detail}")
    return [WorkerHealth(w, tuple(found.get(w, ())), w in cordon) for w in sorted(set(workers) | set(found))]
