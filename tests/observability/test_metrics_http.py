"""A service's /metrics server (services/common/metrics_http.py): the registry's text on a
scrape, a serving thread that does not wake twice a second with no scrape, and a shutdown
that does not wait for the thread's (once a minute) poll."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common.grpc_server import serve_metrics
from tests.ports import free_port

pytestmark = pytest.mark.timeout(60)


def wakeups(threads: list[threading.Thread]) -> int:
    total = 0
    for t in threads:
        status = open(f"/proc/self/task/{t.native_id}/status").read()
        total += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
    return total


def test_the_registry_is_served_its_thread_sleeps_until_a_scrape_and_shutdown_is_prompt():
    port = free_port()
    before = set(threading.enumerate())
    http = serve_metrics("test", "127.0.0.1", port)
    served = [t for t in threading.enumerate() if t not in before]  # the server's own threads
    assert served
    time.sleep(0.2)
    woken = wakeups(served)
    time.sleep(1.6)  # (prometheus_client's server polled every 0.5 s: 3 wake-ups here)
    assert wakeups(served) - woken <= 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "python_info" in text or "process_cpu_seconds_total" in text  # the default registry's
    t0 = time.monotonic()
    http.shutdown()
    assert time.monotonic() - t0 < 10  # (not the minute's poll)
    assert not any(t.is_alive() for t in served if t.name == "metrics-http")


def test_a_private_registry_and_its_name_filter():
    from services.common import metrics_http

    registry = CollectorRegistry()
    Counter("surge_test_things", "Things.", registry=registry).inc(3)
    port = free_port()
    http = metrics_http.start("127.0.0.1", port, registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics?name[]=surge_test_things_total"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "surge_test_things_total 3.0" in text
    finally:
        http.shutdown()
    assert not http.thread.is_alive()
