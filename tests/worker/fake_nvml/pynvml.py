"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) at the NVML boundary, for machines with
no GPU: the node agent imports it as ``pynvml`` when this folder is on its PYTHONPATH.

What the devices say is read from a JSON file on every call, so a test changes a device's
state while the agent runs: ``$FAKE_NVML_DIR/<pid>.json`` (one agent process), else
``$FAKE_NVML_DIR/default.json``; neither (or no ``FAKE_NVML_DIR``): no library, as on a
machine without the driver (``nvmlInit`` raises NVMLError_LibraryNotFound). The file::

    {"devices": [{"total": bytes, "used": bytes, "ecc_uncorrected": n, "ecc_corrected": n,
                  "temperature": C, "slowdown": C, "reasons": bits, "ecc": true}],
     "xids": [[device, xid], ...],      # Xid events, each delivered once, in order
     "events": true}                    # false: the driver offers no event set

Only the functions and error classes services/worker/gpu_health.py calls exist here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's names
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801
    pass


_delivered = 0  # Xid events handed out so far


def _state() -> dict | None:
    root = os.environ.get("FAKE_NVML_DIR")
    if not root:
        return None
    for name in (f"{os.getpid()}.json", "default.json"):
        path = Path(root) / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except json.JSONDecodeError:  # (caught mid-write by the test: read it again)
            time.sleep(0.01)
            return json.loads(path.read_text())
    return None


def _device(handle) -> dict:
    return _state()["devices"][handle.index]


def nvmlInit() -> None:  # noqa: N802
    if _state() is None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")


def nvmlShutdown() -> None:  # noqa: N802
    pass


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_state()["devices"])


def nvmlDeviceGetHandleByIndex(index: int):  # noqa: N802
    return SimpleNamespace(index=index)


def nvmlDeviceGetIndex(handle) -> int:  # noqa: N802
    return handle.index


def nvmlDeviceGetUUID(handle) -> str:  # noqa: N802
    return f"GPU-fake-{handle.index}"


def nvmlDeviceGetMemoryInfo(handle):  # noqa: N802
    d = _device(handle)
    return SimpleNamespace(total=d["total"], used=d["used"], free=d["total"] - d["used"])


def nvmlDeviceGetTotalEccErrors(handle, error_type: int, counter_type: int) -> int:  # noqa: N802
    d = _device(handle)
    if not d.get("ecc", True):
        raise NVMLError_NotSupported("Not Supported")
    return d.get("ecc_uncorrected" if error_type == 1 else "ecc_corrected", 0)


def nvmlDeviceGetTemperature(handle, sensor: int) -> int:  # noqa: N802
    return _device(handle).get("temperature", 40)


def nvmlDeviceGetTemperatureThreshold(handle, threshold: int) -> int:  # noqa: N802
    return _device(handle).get("slowdown", 90)


def nvmlDeviceGetCurrentClocksThrottleReasons(handle) -> int:  # noqa: N802
    return _device(handle).get("reasons", 0)


def nvmlEventSetCreate():  # noqa: N802
    if not _state().get("events", True):
        raise NVMLError_NotSupported("Not Supported")
    return SimpleNamespace()


def nvmlDeviceRegisterEvents(handle, event_types: int, event_set) -> None:  # noqa: N802
    pass


def nvmlEventSetWait_v2(event_set, timeout_ms: int):  # noqa: N802
    global _delivered
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        xids = (_state() or {}).get("xids", [])
        if len(xids) > _delivered:
            device, xid = xids[_delivered]
            _delivered += 1
            return SimpleNamespace(device=SimpleNamespace(index=device), eventType=0x8, eventData=xid)
        if time.monotonic() >= deadline:
            raise NVMLError_Timeout("Timeout")
        time.sleep(0.05)


def nvmlEventSetFree(event_set) -> None:  # noqa: N802
    pass
