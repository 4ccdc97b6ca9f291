"""GPU health on the node: the node agent's NVML sampler.

A device tells nobody when its memory fills, an ECC error is counted or its clocks are
throttled: :class:`GpuHealthSampler` asks NVML (``nvidia-ml-py``, ``import pynvml``) every
few seconds on a thread of its own and reports only the changes, up the agent's session as
routed events of EXT_HARDWARE:

* ``DeviceMemoryUsage``: a device's used memory crossed ``memory_fraction`` of its total
  (entering pressure), or fell back below it minus a hysteresis margin (relieved). To L1-2.
* ``HardwareError``: a device's volatile uncorrectable or corrected ECC count grew (the
  first sample counts from zero: errors since the driver loaded are news to control), an Xid
  event arrived, or a thermal / hardware-slowdown clock throttle reason appeared (the
  temperature at the device's slowdown threshold counts as thermal; a warning that comes and
  goes is reported at most every ``WARNING_INTERVAL_SECONDS``). To L1-3, which grades it (an uncorrectable
  ECC error or a fatal Xid excludes the node); the agent decides nothing.

Xid events come from an NVML event set (``nvmlEventSetWait_v2`` on a second thread, with a
timeout so that it stops); where the driver does not support event sets the sampler goes on
with the counters alone. A metric a device does not support (ECC on a consumer card) is
skipped for that device from its first ``NVMLError_NotSupported`` on.

No NVML (the package missing, no driver, no GPU): the sampler is off, said in one log line.
The registration's devices come from ``hardware.py`` (nvidia-smi), not from here.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from services.contract import Module, control_pb2, engine_pb2
from services.contract.relay import pack
from services.worker.control_link import Emit

Error = engine_pb2.HardwareError.Error

# Relieved only once used/total is this much below the threshold again, so memory hovering
# at the threshold reports one crossing, not one per sample (as memory_pressure.py does).
DEVICE_MEMORY_HYSTERESIS = 0.02
# Clock throttle reasons (nvml.h, nvmlClocksThrottleReason*; the same bits as the newer
# nvmlClocksEventReason*): heat, and the hardware slowdowns (an external power brake, HW
# slowdown). Not faults: idle, the applications-clocks setting, the display clock, sync boost
# and the software power cap (a busy device at its power limit is working as designed).
THERMAL_REASONS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown
OTHER_REASONS = 0x8 | 0x80  # HwSlowdown | HwPowerBrakeSlowdown
# A warning (heat, throttling) that clears and comes back is reported again at most this often
# (seconds): a device hovering at its limit would otherwise put an event into every job's log
# every few seconds.
WARNING_INTERVAL_SECONDS = 600.0
# NVML constants (nvml.h), named here so a stand-in library needs only the functions.
_UNCORRECTED, _CORRECTED = 1, 0  # nvmlMemoryErrorType_t
_VOLATILE_ECC = 0  # nvmlEccCounterType_t: since the driver loaded
_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
_THRESHOLD_SLOWDOWN = 1  # nvmlTemperatureThresholds_t
_EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
EVENT_WAIT_MS = 1000  # an event wait returns at least this often, so the thread can stop


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str = ""
    under_pressure: bool = False
    ecc: dict[int, int] = field(default_factory=lambda: {Error.ECC_UNCORRECTABLE: 0, Error.ECC_CORRECTED: 0})
    throttled: dict[int, bool] = field(default_factory=lambda: {Error.THERMAL: False, Error.THROTTLE: False})
    warned: dict[int, float] = field(default_factory=dict)  # warning -> when it was last reported (monotonic)
    unsupported: set[str] = field(default_factory=set)  # metrics NVML said this device (or driver) lacks
    failing: set[str] = field(default_factory=set)  # metrics whose query failed (logged once)


class GpuHealthSampler:
    """Samples every GPU NVML sees and reports the changes (module docstring).

    Args:
        worker_id: stamped on every report.
        emit: queues one ``WorkerEvent`` for control; must not block.
        log: a structlog logger.
        interval_seconds: seconds between samples, > 0.
        memory_fraction: used/total at or above which a device is under memory pressure, in
            (0, 1). Default 0.95: the caching allocator holds what it freed, so a training
            rank's device sits well above half; at 95 % the next larger activation or a save
            may not fit.
        devices: the NVML indices to sample: this agent's registered devices (an agent given
            some of a node's GPUs by CUDA_VISIBLE_DEVICES speaks for those only). None:
            every device NVML lists.
        nvml: the NVML bindings (default: ``import pynvml``; tests pass a stand-in module).

    Raises:
        ValueError: ``interval_seconds`` <= 0 or ``memory_fraction`` outside (0, 1).
    """

    def __init__(
        self,
        worker_id: str,
        emit: Emit,
        log: Any,
        interval_seconds: float = 5.0,
        memory_fraction: float = 0.95,
        devices: Collection[int] | None = None,
        nvml: Any = None,
    ):
        if not interval_seconds > 0:
            raise ValueError(f"worker: GPU check interval: must be > 0 seconds, got {interval_seconds}")
        if not 0 < memory_fraction < 1:
            raise ValueError(f"worker: GPU memory pressure fraction: must be in (0, 1), got {memory_fraction}")
        self._worker_id = worker_id
        self._emit = emit
        self._log = log
        self._interval = interval_seconds
        self._fraction = memory_fraction
        self._nvml = nvml
        self._only = None if devices is None else set(devices)
        self._devices: list[_Device] = []
        self._events: Any = None  # the NVML event set (None: counters only)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def devices(self) -> int:
        """How many devices are sampled (0: the sampler is off)."""
        return len(self._devices)

    def start(self) -> bool:
        """Initialise NVML and start sampling. False (one log line, nothing started) when
        there is no NVML: the package missing, no driver, no device."""
        try:
            nvml = self._nvml or importlib.import_module("pynvml")
            nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound / _DriverNotLoaded, ...
            self._log.info("no NVML: GPU health not sampled", reason=f"{type(e).__name__}: {e}")
            return False
        self._nvml = nvml
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                if self._only is not None and i not in self._only:
                    continue
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                self._devices.append(_Device(i, handle, _text(self._call(nvml.nvmlDeviceGetUUID, handle) or "")))
        except nvml.NVMLError as e:
            self._log.info("NVML lists no device: GPU health not sampled", reason=f"{type(e).__name__}: {e}")
            self._devices = []
        if not self._devices:
            self._shutdown_nvml()
            return False
        self._events = self._event_set()
        self._threads = [threading.Thread(target=self._run, name="gpu-health", daemon=True)]
        if self._events is not None:
            self._threads.append(threading.Thread(target=self._watch_events, name="gpu-events", daemon=True))
        for t in self._threads:
            t.start()
        self._log.info(
            "GPU health sampled", devices=len(self._devices), xid_events=self._events is not None, every=self._interval
        )
        return True

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5.0)
        if self._devices:
            if self._events is not None:
                self._call(self._nvml.nvmlEventSetFree, self._events)
            self._shutdown_nvml()

    # ------------------------------------------------------------ sampling

    def sample(self) -> None:
        """Sample every device once and report what changed (the thread's body; public for
        tests, which drive it without a thread)."""
        for d in self._devices:
            self._memory(d)
            self._ecc(d, Error.ECC_UNCORRECTABLE, _UNCORRECTED)
            self._ecc(d, Error.ECC_CORRECTED, _CORRECTED)
            self._clocks(d)

    def _memory(self, d: _Device) -> None:
        info = self._metric(d, "memory", self._nvml.nvmlDeviceGetMemoryInfo, d.handle)
        if info is None or not info.total:
            return
        ratio = info.used / info.total
        if not d.under_pressure and ratio >= self._fraction:
            d.under_pressure = True
        elif d.under_pressure and ratio < self._fraction - DEVICE_MEMORY_HYSTERESIS:
            d.under_pressure = False
        else:
            return
        self._log.warning(
            "device memory pressure" if d.under_pressure else "device memory pressure relieved",
            device=d.index,
            used_bytes=info.used,
            total_bytes=info.total,
            threshold=self._fraction,
        )
        self._send(
            engine_pb2.DeviceMemoryUsage(
                worker_id=self._worker_id,
                device=d.index,
                used_bytes=info.used,
                total_bytes=info.total,
                under_pressure=d.under_pressure,
            )
        )

    def _ecc(self, d: _Device, error: int, error_type: int) -> None:
        get = self._nvml.nvmlDeviceGetTotalEccErrors
        count = self._metric(d, f"ecc{error_type}", get, d.handle, error_type, _VOLATILE_ECC)
        if count is None or count <= d.ecc[error]:
            return
        d.ecc[error] = count
        what = "uncorrectable" if error == Error.ECC_UNCORRECTABLE else "corrected"
        self._error(d, error, f"{what} ECC errors: {count} since the driver loaded", count=count)

    def _clocks(self, d: _Device) -> None:
        # (nvmlDeviceGetCurrentClocksEventReasons in newer bindings; the older name stays as an alias)
        get_reasons = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        get_reasons = get_reasons or self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = self._metric(d, "throttle", get_reasons, d.handle) or 0
        temperature = self._metric(d, "temperature", self._nvml.nvmlDeviceGetTemperature, d.handle, _TEMPERATURE_GPU)
        slowdown = self._metric(
            d, "slowdown", self._nvml.nvmlDeviceGetTemperatureThreshold, d.handle, _THRESHOLD_SLOWDOWN
        )
        hot = bool(reasons & THERMAL_REASONS) or bool(temperature is not None and slowdown and temperature >= slowdown)
        for error, now, why in (
            (Error.THERMAL, hot, f"clocks throttled by heat at {temperature} C (slowdown at {slowdown} C)"),
            (Error.THROTTLE, bool(reasons & OTHER_REASONS), f"clocks throttled (NVML reasons 0x{reasons:x})"),
        ):
            due = time.monotonic() - d.warned.get(error, -WARNING_INTERVAL_SECONDS) >= WARNING_INTERVAL_SECONDS
            if now and not d.throttled[error] and due:
                d.warned[error] = time.monotonic()
                self._error(d, error, why, temperature_c=temperature or 0)
            d.throttled[error] = now  # (one that clears is reported again when it returns, once the interval passed)

    def _error(self, d: _Device, error: int, detail: str, **fields: Any) -> None:
        self._log.warning("device error", device=d.index, error=Error.Name(error), detail=detail)
        self._send(
            engine_pb2.HardwareError(
                worker_id=self._worker_id,
                device=d.index,
                detail=detail,
                error=error,
                unix_time=time.time(),
                uuid=d.uuid,
                **fields,
            )
        )

    def _send(self, fact: Any) -> None:
        self._emit(control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sampler bug must not end the agent; said, then tried again
                self._log.error("GPU health sample failed", error=f"{type(e).__name__}: {e}")
            if self._stop.wait(self._interval):
                return

    # ------------------------------------------------------------ Xid events

    def _event_set(self) -> Any:
        """An event set with every device's Xid events registered, or None where the driver
        does not offer one (the counters still run)."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for d in self._devices:
                nvml.nvmlDeviceRegisterEvents(d.handle, _EVENT_XID, events)
            return events
        except (nvml.NVMLError, AttributeError) as e:
            self._log.info("no NVML event set: Xid events not watched", reason=f"{type(e).__name__}: {e}")
            return None

    def _watch_events(self) -> None:
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while not self._stop.is_set():
            try:
                data = wait(self._events, EVENT_WAIT_MS)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as e:
                self._log.error("NVML event wait failed: Xid events no longer watched", error=str(e))
                return
            d = self._device_of(data.device)
            if d is None or not data.eventType & _EVENT_XID:
                continue
            self._error(d, Error.XID, f"Xid {data.eventData}", xid=int(data.eventData))

    def _device_of(self, handle: Any) -> _Device | None:
        """The device of an event's handle (NVML hands back its own handle object; its index
        names it). None when it names none of ours."""
        index = self._call(self._nvml.nvmlDeviceGetIndex, handle)
        return next((d for d in self._devices if d.index == index), None)

    # ------------------------------------------------------------ NVML calls

    def _metric(self, d: _Device, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or None: the device or its driver does not support it (not asked
        again) or NVML failed this time (logged the first time)."""
        if name in d.unsupported:
            return None
        nvml = self._nvml
        # (a driver older than the bindings lacks a newer function: FunctionNotFound)
        lacking = (
            nvml.NVMLError_NotSupported,
            getattr(nvml, "NVMLError_FunctionNotFound", nvml.NVMLError_NotSupported),
        )
        try:
            value = fn(*args)
        except lacking:
            d.unsupported.add(name)
            return None
        except nvml.NVMLError as e:
            if name not in d.failing:
                self._log.warning("NVML query failed", device=d.index, metric=name, error=f"{type(e).__name__}: {e}")
                d.failing.add(name)
            return None
        d.failing.discard(name)
        return value

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _shutdown_nvml(self) -> None:
        self._call(self._nvml.nvmlShutdown)


def _text(value: Any) -> str:
    """NVML strings are bytes in older bindings, str in newer ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
