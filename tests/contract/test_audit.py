"""The contract layer's reports: route counts for the audit, violations on their way up."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import structlog

from services.cli.audit import view
from services.common import grpc_server
from services.common.grpc_server import channel
from services.contract import Module, audit_pb2, audit_pb2_grpc, control_pb2, engine_pb2, worker_pb2
from services.contract.audit import (
    AuditServicer,
    ViolationReporter,
    abort_with_violation,
    merge_reports,
    report_of,
    violation_from_rpc,
)
from services.contract.bus import BoundaryViolation, Bus, Traffic
from services.contract.relay import pack
from services.control.session_hub import SessionHub

log = structlog.get_logger("test")


def _eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _counts(report: audit_pb2.AuditReport) -> dict[tuple[str, str, str], int]:
    return {(Module.Name(c.sender), c.message, Module.Name(c.receiver)): c.count for c in report.routes}


def test_a_report_lists_the_ledgers_routes_and_refusals_and_merging_sums_them():
    traffic = Traffic()
    traffic.delivered(Module.L2_TRAINING_LOOP, "surge.v1.RunForward", Module.L3_FORWARD_UNIT, 5)
    traffic.refused(Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER)
    one = report_of("rank 0 of job j", traffic, request_id=3)
    assert one.id == 3 and _counts(one) == {("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT"): 5}
    assert [(v.sender, v.message, v.receiver, v.count) for v in one.violations] == [
        (Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER, 1)
    ]

    other = audit_pb2.AuditReport(process="rank 1 of job j", notes=["late"])
    other.routes.add(
        sender=Module.L2_TRAINING_LOOP, message="surge.v1.RunForward", receiver=Module.L3_FORWARD_UNIT, count=2
    )
    merged = merge_reports("worker-0", [one, other], ["asked 2 ranks"])
    assert merged.process == "worker-0"
    assert _counts(merged) == {("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT"): 7}
    assert list(merged.notes) == ["late", "asked 2 ranks"]
    assert sum(v.count for v in merged.violations) == 1


def test_the_audit_view_lays_counts_over_the_table_marking_violations_and_unused_routes():
    control = audit_pb2.AuditReport(process="control")
    control.routes.add(
        sender=Module.EXT_HARDWARE,
        message="surge.v1.WorkerRegistration",
        receiver=Module.L1_RESOURCE_ALLOCATOR,
        count=2,
    )
    data = audit_pb2.AuditReport(process="data")
    data.violations.add(sender=Module.L4_SHUFFLER, message="surge.v1.FilterRules", receiver=Module.L4_FILTER, count=1)
    v = view([control, data], ["worker-1 at 127.0.0.1:9 did not answer"])
    assert v.processes == ["control", "data"]
    used = {(r.sender, r.message, r.receiver): (r.kind, r.count, r.by_process) for r in v.used}
    assert used == {
        ("EXT_HARDWARE", "surge.v1.WorkerRegistration", "L1_RESOURCE_ALLOCATOR"): ("EVENT", 2, {"control": 2})
    }
    assert [(r.sender, r.message, r.receiver, r.count) for r in v.violations] == [
        ("L4_SHUFFLER", "surge.v1.FilterRules", "L4_FILTER", 1)
    ]
    unused = {(r.sender, r.message, r.receiver) for r in v.unused}
    assert ("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT") in unused
    assert ("EXT_HARDWARE", "surge.v1.WorkerRegistration", "L1_RESOURCE_ALLOCATOR") not in unused
    assert v.notes == ["worker-1 at 127.0.0.1:9 did not answer"]


def test_a_reporter_delivers_off_the_violating_thread_and_never_reports_its_own_report():
    delivered: list[tuple[audit_pb2.BoundaryViolationReported, str]] = []
    done = threading.Event()

    def deliver(event):
        delivered.append((event, threading.current_thread().name))
        done.set()

    reporter = ViolationReporter("control", log, deliver=deliver)
    bus = Bus(on_violation=reporter, traffic=Traffic())
    with pytest.raises(BoundaryViolation):
        bus.publish(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted())
    assert done.wait(5)
    event, thread = delivered[0]
    assert thread == "violation-reporter"  # not this (the violating) thread
    assert (event.process, event.sender, event.message, event.receiver) == (
        "control",
        Module.L5_METRICS_LOGGER,
        "surge.v1.StepCompleted",
        Module.MODULE_UNSPECIFIED,
    )
    assert event.detail == "boundary violation: L5_METRICS_LOGGER may not send surge.v1.StepCompleted to any receiver"
    # A refused report is logged and counted, not reported again (that would loop).
    with pytest.raises(BoundaryViolation):
        bus.publish(Module.L5_METRICS_LOGGER, audit_pb2.BoundaryViolationReported())
    reporter(BoundaryViolation(Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER))  # a marker after it
    done.clear()
    assert done.wait(5)
    assert [e.message for e, _ in delivered] == ["surge.v1.StepCompleted", "surge.v1.FilterRules"]


def test_an_inline_reporter_stamps_the_rank_and_delivers_before_the_violation_is_raised():
    delivered = []
    reporter = ViolationReporter("rank 1 of job j", log, deliver=delivered.append, job_id="j", rank=1, inline=True)
    bus = Bus(on_violation=reporter, traffic=Traffic())
    with pytest.raises(BoundaryViolation):
        bus.command(Module.L3_FORWARD_UNIT, Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate())
    assert [(e.job_id, e.rank, e.sender, e.receiver) for e in delivered] == [
        ("j", 1, Module.L3_FORWARD_UNIT, Module.L2_OPTIMIZER)
    ]


class _Refusing(audit_pb2_grpc.AuditServiceServicer):
    """Answers like a service whose bus refused the request."""

    def Audit(self, request, context):  # noqa: N802
        if request.id == 1:
            abort_with_violation(
                context,
                BoundaryViolation(Module.L3_FORWARD_UNIT, "surge.v1.SaveCheckpoint", Module.L5_CHECKPOINT_MANAGER),
                "store",
            )
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "some other refusal")


@pytest.fixture
def refusing_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    audit_pb2_grpc.add_AuditServiceServicer_to_server(_Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_violation_returned_as_permission_denied_is_read_back_and_relayed_by_the_caller(refusing_server):
    relayed = []
    reporter = ViolationReporter("rank 0 of job j", log, deliver=relayed.append, job_id="j", rank=0, inline=True)
    with channel(refusing_server) as ch:
        stub = audit_pb2_grpc.AuditServiceStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Audit(audit_pb2.AuditRequest(id=1), timeout=10)
        with pytest.raises(grpc.RpcError) as other:
            stub.Audit(audit_pb2.AuditRequest(id=2), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == (
        "boundary violation: L3_FORWARD_UNIT may not send surge.v1.SaveCheckpoint to L5_CHECKPOINT_MANAGER"
    )
    event = violation_from_rpc(refused.value)
    assert (event.process, event.sender, event.receiver) == (
        "store",
        Module.L3_FORWARD_UNIT,
        Module.L5_CHECKPOINT_MANAGER,
    )
    assert violation_from_rpc(other.value) is None  # a refusal that carries no violation
    reporter.relay_rpc_error(refused.value)
    reporter.relay_rpc_error(other.value)
    assert [(e.process, e.job_id) for e in relayed] == [("store", "j")]  # stamped with the caller's job


def test_the_audit_servicer_answers_with_the_process_counts():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditServicer("data"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with channel(f"127.0.0.1:{port}") as ch:
            report = audit_pb2_grpc.AuditServiceStub(ch).Audit(audit_pb2.AuditRequest(id=9), timeout=10)
    finally:
        server.stop(0)
    assert report.process == "data" and report.id == 9


def test_the_session_relay_sends_a_ranks_violation_to_the_fault_detector_as_ext_contract():
    bus = Bus(traffic=Traffic())
    seen = []
    bus.subscribe(Module.L1_FAULT_DETECTOR, audit_pb2.BoundaryViolationReported, lambda m, p: seen.append(m))
    hub = SessionHub(bus, hardware=bus.emitter(Module.EXT_HARDWARE))
    bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, control_pb2.WorkerRegistration, lambda m, p: None)
    session = hub.open(control_pb2.WorkerRegistration(worker_id="w0", slots=1))
    violation = audit_pb2.BoundaryViolationReported(
        process="data", sender=Module.L4_SHUFFLER, message="surge.v1.FilterRules", receiver=Module.L4_FILTER
    )
    hub.on_worker_event(
        session,
        control_pb2.WorkerEvent(
            rank_event=worker_pb2.RankEvent(job_id="j", rank=1, routed=pack(violation, Module.EXT_CONTRACT))
        ),
    )
    hub.on_worker_event(
        session,
        control_pb2.WorkerEvent(  # a rank's audit stays with its agent
            rank_event=worker_pb2.RankEvent(job_id="j", rank=1, audit=audit_pb2.AuditReport(process="x"))
        ),
    )
    assert [(m.process, m.job_id, m.rank, m.sender) for m in seen] == [("data", "j", 1, Module.L4_SHUFFLER)]
    assert (
        bus.snapshot().sent[(Module.EXT_CONTRACT, "surge.v1.BoundaryViolationReported", Module.L1_FAULT_DETECTOR)] == 1
    )


def test_a_ranks_violation_relayed_to_control_is_graded_and_reported_to_the_orchestrator(tmp_path):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    journal = JobStore(str(tmp_path / "c.db"))
    try:
        control = build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)
        graded = (Module.L1_FAULT_DETECTOR, "surge.v1.FaultReport", Module.L1_ORCHESTRATOR)
        before = control.bus.snapshot().sent.get(graded, 0)
        control.bus.command(
            Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j")
        )
        # A rank's report, as its node agent relays it up the session.
        violation = audit_pb2.BoundaryViolationReported(
            process="rank 0 of job j",
            sender=Module.L4_SHUFFLER,
            message="surge.v1.FilterRules",
            receiver=Module.L4_FILTER,
        )
        session = control.sessions.open(control_pb2.WorkerRegistration(worker_id="w0", slots=1))
        control.sessions.on_worker_event(
            session,
            control_pb2.WorkerEvent(
                rank_event=worker_pb2.RankEvent(job_id="j", rank=0, routed=pack(violation, Module.EXT_CONTRACT))
            ),
        )
        assert control.bus.snapshot().sent.get(graded, 0) == before + 1
    finally:
        journal.close()


def test_a_send_refused_inside_control_goes_to_its_own_fault_detector(tmp_path):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    journal = JobStore(str(tmp_path / "c.db"))
    try:
        control = build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)
        reported = (Module.EXT_CONTRACT, "surge.v1.BoundaryViolationReported", Module.L1_FAULT_DETECTOR)
        before = control.bus.snapshot().sent.get(reported, 0)
        with pytest.raises(BoundaryViolation):  # the recovery controller cannot forge a grade
            control.bus.publish(Module.L1_RECOVERY_CONTROLLER, control_pb2.FaultReport(job_id="j"))
        assert _eventually(lambda: control.bus.snapshot().sent.get(reported, 0) == before + 1)  # reporter's thread
    finally:
        journal.close()


# ---------------------------------------------------------------- services without a channel up


def _serve(add, servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_data_service_returns_a_refused_send_to_its_caller_as_permission_denied():
    from services.contract import data_pb2, data_pb2_grpc
    from services.data.server import DataServicer

    def mount(msg, payload=None):  # as if L4-1's handling made a send the table refuses
        raise BoundaryViolation(Module.L4_DATASET_VERSIONS, "surge.v1.FilterRules", Module.L4_FILTER)

    work = futures.ThreadPoolExecutor(max_workers=2)
    servicer = DataServicer(mount=mount, list_datasets=mount, new_stream=None, log=log, executor=work)
    server = grpc_server.AioServiceServer("data", "127.0.0.1", 0)  # the data service serves on grpc.aio
    data_pb2_grpc.add_DataServiceServicer_to_server(servicer, server.server)
    server.start(["surge.v1.DataService"])
    try:
        with channel(f"127.0.0.1:{server.port}", module=Module.EXT_USER) as ch, pytest.raises(grpc.RpcError) as e:
            data_pb2_grpc.DataServiceStub(ch).Mount(data_pb2.MountDataset(name="tiny", version="v1"), timeout=10)
    finally:
        server.stop(0)
        work.shutdown()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    event = violation_from_rpc(e.value)
    assert (event.process, event.sender, event.message) == ("data", Module.L4_DATASET_VERSIONS, "surge.v1.FilterRules")


def test_the_store_counts_and_returns_a_request_from_a_sender_that_may_command_nobody_there():
    from services.contract import store_pb2, store_pb2_grpc
    from services.store.server import SENDER_METADATA, StoreRelay

    traffic = Traffic()
    reported = []
    bus = Bus(on_violation=reported.append, traffic=traffic)
    relay = StoreRelay({}, log, check=bus.check)
    server, address = _serve(store_pb2_grpc.add_StoreServiceServicer_to_server, relay)
    try:
        with channel(address) as ch, pytest.raises(grpc.RpcError) as e:
            store_pb2_grpc.StoreServiceStub(ch).BeginSave(
                store_pb2.SaveCheckpoint(job_id="j", step=1),
                metadata=((SENDER_METADATA, "L3_FORWARD_UNIT"),),
                timeout=10,
            )
    finally:
        server.stop(0)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert violation_from_rpc(e.value).sender == Module.L3_FORWARD_UNIT
    assert traffic.snapshot().refused == {
        (Module.L3_FORWARD_UNIT, "surge.v1.SaveCheckpoint", Module.L5_CHECKPOINT_MANAGER): 1
    }
    assert len(reported) == 1
