"""`surgectl status`, `cancel` and `submit --priority` with control's job queue (issue 15
part 3), in this process: the real control plane (build()) served by its real servicer on
loopback gRPC, one registered worker (one slot), jobs submitted as the operator would."""

from __future__ import annotations

import json
import os
import re
import sys

import grpc
import pytest

from services.cli import cmd_jobs, surgectl
from services.contract import control_pb2, control_pb2_grpc
from tests.control.conftest import registration, served_control, spec_yaml

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def control(tmp_path, monkeypatch):
    """(the control plane, a submit function): wa (one slot) registered; SURGE_CONTROL_ADDRESS set."""
    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))

        def submit(name: str) -> str:
            req = control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name=name, dp=1), spec_path="job.yaml")
            return stub.SubmitJob(req, timeout=10).job_id

        yield submit


# What control's modules log in this process (structlog, on stdout): not surgectl's output.
SERVICE_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")


def run(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """``surgectl ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["surgectl", *argv])
    with pytest.raises(SystemExit) as done:
        surgectl.main()
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    out = "".join(line for line in out.splitlines(keepends=True) if not SERVICE_LOG.match(line))
    return done.value.code, out, err


def test_status_shows_the_queue_position_and_cancel_takes_a_queued_job_out(control, monkeypatch, capsys):
    running, first, second = control("a"), control("b"), control("c")
    code, out, _ = run(monkeypatch, capsys, "status", "-o", "json")
    rows = {j["job_id"]: j for j in json.loads(out)}
    assert code == 0 and (rows[first]["queue_position"], rows[second]["queue_position"]) == (1, 2)
    assert rows[second]["message"] == "queued: waits for the jobs queued ahead of it"
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run(monkeypatch, capsys, "status", first)
    assert code == 0 and "STANDBY (queued #1)" in out

    code, out, _ = run(monkeypatch, capsys, "cancel", first)
    assert code == 0 and out.strip() == f"{first}: taken out of the queue; now TERMINATED (STOPPED)"
    code, out, _ = run(monkeypatch, capsys, "status", second, "-o", "json")
    assert json.loads(out)[0]["queue_position"] == 1

    code, _, err = run(monkeypatch, capsys, "cancel", running)  # refused: not queued, left running
    assert code == 1 and err.strip() == (
        f"error: job {running} is WARMING_UP, not queued: `surgectl stop {running}` stops it"
    )
    code, out, _ = run(monkeypatch, capsys, "status", running, "-o", "json")
    assert json.loads(out)[0]["state"] == "WARMING_UP"


def test_a_priority_out_of_range_is_one_line_naming_the_option_and_exit_2(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_yaml(name="x", dp=1))
    code, out, err = run(monkeypatch, capsys, "submit", str(spec), "--priority", "1001")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "--priority" in lines[0], err


def test_submit_says_when_a_job_waits_for_workers_to_join(control, tmp_path, monkeypatch, capsys):
    """The data service's checks are left out (surgectl's submit_job sends the spec as is):
    what is printed for a job queued because it needs more ranks than are registered."""
    stub = control_pb2_grpc.ControlServiceStub(grpc.insecure_channel(os.environ["SURGE_CONTROL_ADDRESS"]))

    def submit_job(spec, overrides, priority):
        req = control_pb2.SubmitJobRequest(spec_yaml=spec.read_text(), spec_path=str(spec), priority=priority)
        return stub.SubmitJob(req, timeout=10)

    monkeypatch.setattr(cmd_jobs, "submit_job", submit_job)
    spec = tmp_path / "big.yaml"
    spec.write_text(spec_yaml(name="big", dp=2))
    code, out, err = run(monkeypatch, capsys, "submit", str(spec))
    first, second = out.strip().splitlines()
    assert code == 0 and first.startswith("submitted big-") and first.endswith("(STANDBY (queued #1))"), out
    assert (
        second
        == "queued: needs 2 ranks (parallel.dp=2), more than the 1 registered: can never run as things stand; waits for workers to join"
    )
    spec.write_text(spec_yaml(name="small", dp=1))  # behind it, yet it starts: one line
    code, out, err = run(monkeypatch, capsys, "submit", str(spec))
    assert code == 0 and out.strip().endswith("(WARMING_UP)") and len(out.strip().splitlines()) == 1, out


def test_status_lists_a_worker_cordoned_after_a_device_error_with_the_reason(tmp_path, monkeypatch, capsys):
    from services.contract import Module, engine_pb2
    from services.contract.relay import pack

    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        session = plane.sessions.open(registration("wa"))
        ecc = engine_pb2.HardwareError(worker_id="wa", device=3, error=engine_pb2.HardwareError.ECC_UNCORRECTABLE)
        ecc.detail = "uncorrectable ECC errors: 1 since the driver loaded"
        event = control_pb2.WorkerEvent(routed=pack(ecc, Module.EXT_HARDWARE))
        plane.sessions.on_worker_event(session, event)
        monkeypatch.setenv("COLUMNS", "300")
        code, out, _ = run(monkeypatch, capsys, "status")
        assert code == 0 and "unhealthy workers" in out
        (row,) = [line for line in out.splitlines() if "wa" in line and "ECC" in line]
        assert "device_error: device 3 of wa: uncorrectable ECC errors: 1 since the driver loaded" in row
        code, out, _ = run(monkeypatch, capsys, "status", "-o", "json")
        assert code == 0 and json.loads(out) == []  # (json: the jobs, as before)


def test_status_shows_a_quarantined_worker_and_uncordon_releases_it_or_refuses_an_unknown_one_in_a_line(
    tmp_path, monkeypatch, capsys
):
    from services.contract import Module

    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))
        alert = control_pb2.FaultBacklogAlert(worker_id="wa", reports=3, incidents=2, detail="3 rank faults on wa")
        plane.bus.publish(Module.L1_FAULT_DETECTOR, alert)  # (L1-3's alert: its rule is tested in tests/control)
        monkeypatch.setenv("COLUMNS", "300")
        code, out, _ = run(monkeypatch, capsys, "status")
        (row,) = [line for line in out.splitlines() if "quarantined" in line]
        assert (
            code == 0 and "wa" in row and "quarantined: 3 rank faults on wa" in row and "`surgectl uncordon wa`" in row
        )
        code, out, err = run(monkeypatch, capsys, "uncordon", "wz")
        assert (code, out) == (2, "")
        assert err.strip() == "error: uncordon: no such worker 'wz' (registered: wa)"  # (was: "is not cordoned")
        code, out, _ = run(monkeypatch, capsys, "uncordon", "wa")
        assert (code, out.strip()) == (0, "wa: uncordoned; ranks may be placed on it again")
        code, out, err = run(monkeypatch, capsys, "uncordon", "wa")  # a node, with no cordon now
        assert (code, err.strip()) == (2, "error: uncordon: worker 'wa' is not cordoned (no worker is cordoned)")
        code, out, _ = run(monkeypatch, capsys, "status")
        assert code == 0 and "unhealthy workers" not in out


def test_drain_cordons_a_node_in_a_line_and_refuses_an_unknown_node_or_a_bad_deadline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))
        code, out, err = run(monkeypatch, capsys, "drain", "wz", "--deadline", "60")
        assert (code, out, err.strip()) == (2, "", "error: drain: worker 'wz' is not registered (registered: wa)")
        for bad in ("0", "-3"):
            code, out, err = run(monkeypatch, capsys, "drain", "wa", "--deadline", bad)
            assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--deadline" in err, err
        code, out, _ = run(monkeypatch, capsys, "drain", "wa", "--deadline", "60")
        assert (code, out.strip()) == (
            0,
            "wa: draining, leaves within 60 s; nothing new is placed on it; no job's ranks on it",
        )
        monkeypatch.setenv("COLUMNS", "300")
        code, out, _ = run(monkeypatch, capsys, "status")
        assert code == 0 and "draining: leaves within 60 s (`surgectl drain`)" in out


def test_workers_lists_each_workers_slots_and_health_and_says_when_control_s_metrics_cannot_be_read(
    tmp_path, monkeypatch, capsys
):
    from prometheus_client import start_http_server

    from tests.ports import free_port

    monkeypatch.setenv("SURGE_HOME", str(tmp_path))  # (no local stack there: no stack file)
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))
        plane.sessions.open(registration("wb"))
        port = free_port()
        server, thread = start_http_server(port, addr="127.0.0.1")  # (this process's registry: control's census)
        try:
            metrics = f"http://127.0.0.1:{port}/metrics"
            code, out, _ = run(monkeypatch, capsys, "drain", "wb", "--deadline", "60")
            assert code == 0, out
            code, out, err = run(monkeypatch, capsys, "workers", "--metrics", metrics, "-o", "json")
            assert (code, err) == (0, "")
            rows = {w["worker_id"]: w for w in json.loads(out)}
            assert set(rows) == {"wa", "wb"}, rows
            assert (rows["wa"]["placeable"], rows["wa"]["health"], rows["wa"]["slots_used"]) == (True, [], 0)
            assert rows["wa"]["slots_free"] >= 1, rows["wa"]
            assert not rows["wb"]["placeable"] and rows["wb"]["health"] == [
                "cordoned: draining: leaves within 60 s (`surgectl drain`)"
            ]
            monkeypatch.setenv("COLUMNS", "300")
            code, out, err = run(monkeypatch, capsys, "workers", "--metrics", metrics)
            assert code == 0 and "workers registered; rank slots: 0 used," in out, out + err
            (row,) = [line for line in out.splitlines() if "wb" in line]
            assert "cordoned: draining" in row
            # Control's /metrics not known here (no local stack) or not answering: what control's job
            # list names is shown, and one line says the slots were not read, exit 1.
            code, out, err = run(monkeypatch, capsys, "workers", "-o", "json")
            assert code == 1 and [w["worker_id"] for w in json.loads(out)] == ["wb"], out
            assert json.loads(out)[0]["slots_used"] is None
            assert err.strip() == (
                "error: slots not read (no local stack here: pass --metrics URL); the workers control's job "
                'list names are shown, their slots as "?"'
            )
            code, out, err = run(monkeypatch, capsys, "workers", "--metrics", "http://127.0.0.1:1/metrics")
            assert (
                code == 1 and len(err.strip().splitlines()) == 1 and "http://127.0.0.1:1/metrics did not answer" in err
            )
            # No URL at all is bad input (was: "did not answer", exit 1).
            code, out, err = run(monkeypatch, capsys, "workers", "--metrics", "notaurl")
            assert (code, out) == (2, "") and err.strip() == (
                "error: --metrics: expected an http:// or https:// URL of control's /metrics, got 'notaurl'"
            )
        finally:
            server.shutdown()
            thread.join(5)
