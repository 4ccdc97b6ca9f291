"""Memory pressure on the node: the one thing the node agent samples.

The kernel sends no event when memory runs low, so :class:`MemorySampler` reads
/proc/meminfo every few seconds and reports only the crossings
(``WorkerEvent{memory_pressure}``), with hysteresis so memory hovering at the threshold
reports one crossing, not one per sample.
"""

from __future__ import annotations

import threading
from typing import Any

from services.contract import control_pb2
from services.worker.control_link import Emit
from services.worker.hardware import DEFAULT_MEMINFO

# Relieved only once available/total is this much above the threshold again, so memory
# hovering at the threshold reports one crossing, not one per sample.
MEMORY_PRESSURE_HYSTERESIS = 0.02


def read_meminfo(meminfo: str = DEFAULT_MEMINFO) -> tuple[int, int] | None:
    """(available, total) host memory in bytes from ``MemAvailable`` and ``MemTotal``.

    Returns None when the file cannot be read or lacks either field (kernels before 3.14
    have no ``MemAvailable``); never raises.
    """
    fields: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    fields[name] = int(rest.split()[0]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields or not fields.get("MemTotal"):
        return None
    return fields["MemAvailable"], fields["MemTotal"]


class MemorySampler:
    """Reports the node entering and leaving memory pressure (``WorkerEvent{memory_pressure}``).

    Every ``interval_seconds`` it reads ``meminfo``. Under pressure means
    ``MemAvailable / MemTotal < fraction``; relieved means the ratio is back at or above
    ``fraction + MEMORY_PRESSURE_HYSTERESIS``. Only the crossings are reported (the first
    sample counts as one when it is already under pressure); a sample that cannot be read
    changes nothing.

    Args:
        worker_id: stamped on every report.
        emit: queues one ``WorkerEvent`` for control; must not block.
        log: a structlog logger.
        meminfo: the file read (``/proc/meminfo``; tests pass a file they write).
        interval_seconds: seconds between samples, > 0.
        fraction: threshold on available/total, in (0, 1). Default 0.10 of the node's
            memory: below it the kernel is close to reclaiming page cache hard or to
            the OOM killer on a node running large ranks.

    Raises:
        ValueError: ``interval_seconds`` <= 0 or ``fraction`` outside (0, 1).
    """

    def __init__(
        self,
        worker_id: str,
        emit: Emit,
        log: Any,
        meminfo: str = DEFAULT_MEMINFO,
        interval_seconds: float = 2.0,
        fraction: float = 0.10,
    ):
        if not interval_seconds > 0:
            raise ValueError(f"worker: memory check interval: must be > 0 seconds, got {interval_seconds}")
        if not 0 < fraction < 1:
            raise ValueError(f"worker: memory pressure fraction: must be in (0, 1), got {fraction}")
        self._worker_id = worker_id
        self._emit = emit
        self._log = log
        self._meminfo = meminfo
        self._interval = interval_seconds
        self._fraction = fraction
        self._under = False
        self._unreadable_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _sample(self) -> None:
        """Read the file once and report a crossing if there is one."""
        reading = read_meminfo(self._meminfo)
        if reading is None:
            if not self._unreadable_logged:
                self._log.warning(
                    "cannot read MemAvailable/MemTotal; memory pressure not reported", meminfo=self._meminfo
                )
                self._unreadable_logged = True
            return
        available, total = reading
        ratio = available / total
        if not self._under and ratio < self._fraction:
            self._under = True
        elif self._under and ratio >= self._fraction + MEMORY_PRESSURE_HYSTERESIS:
            self._under = False
        else:
            return
        self._log.warning(
            "memory pressure" if self._under else "memory pressure relieved",
            available_bytes=available,
            total_bytes=total,
            threshold=self._fraction,
        )
        self._emit(
            control_pb2.WorkerEvent(
                memory_pressure=control_pb2.MemoryPressure(
                    worker_id=self._worker_id, available_bytes=available, total_bytes=total, under_pressure=self._under
                )
            )
        )

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._interval):
                return
