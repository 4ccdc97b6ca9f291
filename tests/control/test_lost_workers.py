"""A worker whose node agent is lost without notice (killed, its host gone) stays in the
cluster's view, marked lost, until an agent of it registers again; one that leaves with
notice (a departing registration) or is replaced by a new session is not lost. Through the
real servicer on loopback gRPC (the operator's ListJobs, what `surgectl status` and the
dashboard's cluster page read) and `surgectl status`'s table."""

from __future__ import annotations

from rich.console import Console

from services.cli.render import cordons_table
from services.contract import Module, control_pb2

from .conftest import registration, served_control


def _listed(stub) -> dict[str, control_pb2.WorkerCordoned]:
    return {c.worker_id: c for c in stub.ListJobs(control_pb2.JobQuery(), timeout=10).cordoned}


def test_a_node_agent_lost_without_notice_is_listed_lost_until_it_registers_again(tmp_path, monkeypatch):
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        hub = plane.sessions
        lost, leaving, replaced = (hub.open(registration(w)) for w in ("w-lost", "w-leaving", "w-replaced"))
        departing = control_pb2.WorkerRegistration(worker_id="w-leaving", departing=True)
        hub.on_worker_event(leaving, control_pb2.WorkerEvent(register=departing))
        hub.close(lost, reason="session closed")
        hub.close(leaving, reason="session closed")
        hub.open(registration("w-replaced"))  # (a new session of it: the old one is replaced, not lost)
        listed = _listed(stub)
        assert list(listed) == ["w-lost"], listed
        c = listed["w-lost"]
        assert c.lost and not c.quarantine and c.reason == "node agent lost: session closed without notice"
        console = Console(width=200, record=True, color_system=None)
        console.print(cordons_table(listed.values()))
        row = next(line for line in console.export_text().splitlines() if "w-lost" in line)
        assert "node agent lost" in row and "`surgectl up` starts what is down" in row, row
        del replaced
        hub.open(registration("w-lost"))  # its agent is back
        assert _listed(stub) == {}


def test_a_held_worker_is_listed_held_then_lost_if_its_session_ends_and_neither_once_it_registers(
    tmp_path, monkeypatch
):
    def agent_silent(cleared: bool) -> control_pb2.FaultReport:
        return control_pb2.FaultReport(
            grade=control_pb2.MEDIUM, fault_class="agent_silent", worker_id="w-held", cleared=cleared,
            detail="the node agent of w-held sent no AgentHeartbeat for 5.0 s",
        )  # fmt: skip

    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        session = plane.sessions.open(registration("w-held"))
        plane.bus.publish(Module.L1_FAULT_DETECTOR, agent_silent(cleared=False))
        (held,) = _listed(stub).values()
        assert held.held and not held.lost and held.reason.startswith("placement held: the node agent of w-held")
        plane.sessions.close(session, reason="session closed")  # (killed while stopped: its host gone)
        (lost,) = _listed(stub).values()
        assert lost.lost and not lost.held, lost
        plane.sessions.open(registration("w-held"))  # an agent of it is back: L1-3 reports it heard
        plane.bus.publish(Module.L1_FAULT_DETECTOR, agent_silent(cleared=True))
        assert _listed(stub) == {}


def test_a_held_worker_reads_held_until_its_agent_beats_in_the_workers_and_status_views():
    from services.cli.worker_slots import health_of

    held = control_pb2.WorkerCordoned(
        worker_id="wb", reason="placement held: the node agent of wb sent no AgentHeartbeat for 5.0 s", held=True
    )
    (wb,) = health_of(["wb"], [], [held])
    assert wb.cordoned and wb.findings == (
        "held: placement held: the node agent of wb sent no AgentHeartbeat for 5.0 s",
    )
    console = Console(width=240, record=True, color_system=None)
    console.print(cordons_table([held]))
    row = next(line for line in console.export_text().splitlines() if "wb" in line)
    assert "placement held" in row and "its node agent beats again" in row, row


def test_a_quarantined_worker_s_reason_is_said_once_in_the_workers_view():
    # A fresh user's trial: `workers` read "quarantined: quarantined: 3 rank faults ..." (the
    # quarantine's reason names itself, and the view prefixed the kind again).
    from services.cli.worker_slots import health_of

    reason = "quarantined: 3 rank faults on wa in 3 incidents within 600 s (rank_exit; jobs j-1)"
    quarantined = control_pb2.WorkerCordoned(worker_id="wa", reason=reason, quarantine=True)
    cordoned = control_pb2.WorkerCordoned(worker_id="wb", reason="by the operator", unix_time=1.0)
    wa, wb = health_of(["wa", "wb"], [], [quarantined, cordoned])
    assert wa.findings == (reason,) and wb.findings == ("cordoned: by the operator",)
