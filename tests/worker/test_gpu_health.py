"""The node agent's GPU health sampler against a stand-in NVML library (tests/worker/fake_nvml:
the one boundary that cannot exist on a machine without a GPU). The sampler's reports are
read back as the routed events control receives."""

from __future__ import annotations

import importlib.util
import json
import queue
import time
from pathlib import Path

import pytest
import structlog

from services.contract import engine_pb2
from services.contract.relay import unpack
from services.worker.gpu_health import GpuHealthSampler

pytestmark = pytest.mark.timeout(30)

FAKE = Path(__file__).parent / "fake_nvml" / "pynvml.py"
GIB = 1 << 30
Error = engine_pb2.HardwareError.Error


def fake_nvml():
    """A fresh copy of the stand-in module (its Xid counter starts at zero)."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Devices:
    """The stand-in's state file (default.json under FAKE_NVML_DIR)."""

    def __init__(self, root: Path, n: int = 2):
        self.path = root / "default.json"
        self.state = {"devices": [{"total": 80 * GIB, "used": 1 * GIB} for _ in range(n)], "xids": []}
        self.write()

    def set(self, device: int, **values) -> None:
        self.state["devices"][device].update(values)
        self.write()

    def xid(self, device: int, xid: int) -> None:
        self.state["xids"].append([device, xid])
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.path)


@pytest.fixture
def devices(tmp_path, monkeypatch) -> Devices:
    monkeypatch.setenv("FAKE_NVML_DIR", str(tmp_path))
    return Devices(tmp_path)


def sampler(events: queue.Queue, **kw) -> GpuHealthSampler:
    return GpuHealthSampler("w0", events.put, structlog.get_logger("test"), nvml=fake_nvml(), **kw)


def reports(events: queue.Queue) -> list:
    out = []
    while not events.empty():
        out.append(unpack(events.get_nowait().routed))
    return out


def test_without_nvml_the_sampler_is_off_and_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NVML_DIR", str(tmp_path))  # no state file: no library
    events = queue.Queue()
    with structlog.testing.capture_logs() as logs:
        s = sampler(events)
        assert s.start() is False
        s.stop()
    assert s.devices == 0 and events.empty()
    assert [e["event"] for e in logs] == ["no NVML: GPU health not sampled"]
    assert "LibraryNotFound" in logs[0]["reason"]


def test_device_memory_pressure_is_reported_once_entering_and_once_relieved_with_hysteresis(devices):
    events = queue.Queue()
    s = sampler(events, memory_fraction=0.9)
    assert s.start() is True
    s.stop()  # (the thread sampled once already: healthy, nothing to say)
    assert reports(events) == []
    devices.set(1, used=72 * GIB)  # exactly 0.9: pressure
    s.sample()
    s.sample()  # the state holds: nothing more
    devices.set(1, used=71 * GIB)  # 0.8875: inside the hysteresis band, still under pressure
    s.sample()
    devices.set(1, used=70 * GIB)  # 0.875 < 0.88: relieved
    s.sample()
    assert reports(events) == [
        engine_pb2.DeviceMemoryUsage(
            worker_id="w0", device=1, used_bytes=72 * GIB, total_bytes=80 * GIB, under_pressure=True
        ),
        engine_pb2.DeviceMemoryUsage(
            worker_id="w0", device=1, used_bytes=70 * GIB, total_bytes=80 * GIB, under_pressure=False
        ),
    ]


def test_ecc_counts_are_reported_when_they_grow_and_a_device_without_ecc_is_skipped(devices):
    devices.set(0, ecc=False)
    events = queue.Queue()
    s = sampler(events)
    s.start()
    s.stop()
    devices.set(1, ecc_corrected=3)
    s.sample()
    s.sample()  # unchanged counts: nothing
    devices.set(1, ecc_uncorrected=1)
    s.sample()
    got = [(r.device, Error.Name(r.error), r.count, r.detail, r.uuid) for r in reports(events)]
    assert got == [
        (1, "ECC_CORRECTED", 3, "corrected ECC errors: 3 since the driver loaded", "GPU-fake-1"),
        (1, "ECC_UNCORRECTABLE", 1, "uncorrectable ECC errors: 1 since the driver loaded", "GPU-fake-1"),
    ]


def test_heat_and_hardware_slowdown_are_reported_when_they_appear_at_most_once_per_interval(devices, monkeypatch):
    from services.worker import gpu_health

    events = queue.Queue()
    s = sampler(events)
    s.start()
    s.stop()
    devices.set(0, temperature=91, slowdown=90)
    s.sample()
    s.sample()  # still hot: nothing more
    devices.set(0, temperature=60, reasons=0x4 | 0x8)  # cooled; power capped (no fault) and HW slowdown
    s.sample()
    devices.set(0, reasons=0x40)  # hardware thermal slowdown again, within the interval: not repeated
    s.sample()
    monkeypatch.setattr(gpu_health, "WARNING_INTERVAL_SECONDS", 0.0)
    devices.set(0, reasons=0)
    s.sample()
    devices.set(0, reasons=0x40)  # back after the interval: reported again
    s.sample()
    got = [(r.device, Error.Name(r.error), r.temperature_c) for r in reports(events)]
    assert got == [(0, "THERMAL", 91), (0, "THROTTLE", 60), (0, "THERMAL", 60)]


def test_only_the_devices_the_agent_registered_are_sampled(devices):
    devices.set(0, ecc_uncorrected=1)
    devices.set(1, ecc_uncorrected=2)
    events = queue.Queue()
    s = sampler(events, devices={1}, interval_seconds=60.0)
    s.start()
    s.stop()
    assert s.devices == 1
    assert [(r.device, r.count) for r in reports(events)] == [(1, 2)]


def test_an_xid_event_is_reported_from_the_event_thread(devices):
    events = queue.Queue()
    s = sampler(events, interval_seconds=60.0)
    assert s.start()
    try:
        devices.xid(1, 79)
        first = events.get(timeout=5.0)
    finally:
        s.stop()
    (error,) = [unpack(first.routed)]
    assert (error.worker_id, error.device, error.error, error.xid, error.detail) == ("w0", 1, Error.XID, 79, "Xid 79")
    assert abs(error.unix_time - time.time()) < 10


def test_without_an_event_set_the_counters_still_run(devices):
    devices.state["events"] = False
    devices.set(0, ecc_uncorrected=2)
    events = queue.Queue()
    with structlog.testing.capture_logs() as logs:
        s = sampler(events, interval_seconds=60.0)
        assert s.start()
        s.stop()
    assert "no NVML event set: Xid events not watched" in [e["event"] for e in logs]
    assert [(r.error, r.count) for r in reports(events)] == [(Error.ECC_UNCORRECTABLE, 2)]
