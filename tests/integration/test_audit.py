"""The permission law at run time, on real processes: a planted unauthorized send is refused
and counted on /metrics, and `surgectl audit` shows the live matrix of a running stack.

Every process started here is killed by PID at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import channel
from services.contract import Module, audit_pb2, audit_pb2_grpc
from tests.conftest import REPO, down_and_reap, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
SURGECTL = [sys.executable, "-m", "services.cli.surgectl"]


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SURGE_HOME": str(home), "COLUMNS": "200"}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        env.pop(var, None)
    return subprocess.run([*SURGECTL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def stack_info(home: Path) -> dict:
    return json.loads((home / "run" / "stack.json").read_text())["services"]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics of a process as {(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def audit(address: str) -> audit_pb2.AuditReport:
    with channel(address, module=Module.EXT_USER) as ch:  # as surgectl audit
        return audit_pb2_grpc.AuditServiceStub(ch).Audit(audit_pb2.AuditRequest(), timeout=30)


def test_a_planted_unauthorized_send_is_refused_and_counted_on_metrics(tmp_path):
    port, metrics_port = free_ports(2)
    env = {**os.environ, "SURGE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.planted_violation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--data-root",
            str(tmp_path / "datasets"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        samples = scrape(metrics_port)
        refused = ("surge_boundary_violations_total", (("message", "surge.v1.FilterRules"), ("sender", "L4_SHUFFLER")))
        assert samples.get(refused) == 1.0, sorted(k for k in samples if "boundary" in k[0])
        report = audit(f"127.0.0.1:{port}")
        assert report.process == "data"
        assert [(v.sender, v.message, v.receiver, v.count) for v in report.violations] == [
            (Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER, 1)
        ]
        assert not [r for r in report.routes if r.message == "surge.v1.FilterRules"]  # never delivered
    finally:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert "planted send refused: boundary violation: L4_SHUFFLER may not send surge.v1.FilterRules to L4_FILTER" in out


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge-audit")
    up = cli(home, "up", "--workers", "1", timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield home
    finally:
        down_and_reap(home, cli)


def test_surgectl_audit_shows_the_routes_a_running_stack_used(small_stack: Path):
    r = cli(small_stack, "audit", "-o", "json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["processes"] == ["control", "data", "store", "worker-0"]
    used = {(x["sender"], x["message"], x["receiver"]): x for x in v["routes"]}
    registration = used[("EXT_HARDWARE", "surge.v1.WorkerRegistration", "L1_RESOURCE_ALLOCATOR")]
    assert registration["count"] >= 1 and registration["by_process"]["control"] >= 1
    assert v["violations"] == [] and v["notes"] == []
    unused = {(x["sender"], x["message"], x["receiver"]) for x in v["unused"]}
    assert ("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT") in unused

    table = cli(small_stack, "audit", "--no-unused")
    assert table.returncode == 0, table.stderr
    assert "WorkerRegistration" in table.stdout and "no violations" in table.stdout


def test_every_service_of_the_stack_serves_its_own_metrics(small_stack: Path):
    info = stack_info(small_stack)
    assert set(info) == {"control", "data", "store", "worker-0"}
    for name, s in info.items():
        assert s["metrics_port"] > 0, name
        text = urllib.request.urlopen(f"http://127.0.0.1:{s['metrics_port']}/metrics", timeout=10).read().decode()
        assert "# TYPE surge_boundary_violations_total counter" in text, name
        assert "# TYPE surge_bus_messages_total counter" in text, name
    control = scrape(info["control"]["metrics_port"])
    key = (
        "surge_bus_messages_total",
        (("message", "surge.v1.WorkerRegistration"), ("receiver", "L1_RESOURCE_ALLOCATOR"), ("sender", "EXT_HARDWARE")),
    )
    assert control.get(key, 0) >= 1
