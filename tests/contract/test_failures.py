"""A failure's cause is read from the exception's type, never its text; the bus turns a
handler's exception into the module's failure event (services/contract/failures.py, bus.py)."""

from __future__ import annotations

import errno
import sys

import grpc
import pytest
import torch
import torch.distributed as dist

from services.contract import Module, data_pb2, engine_pb2, route_pb2
from services.contract import failures as fl
from services.contract.bus import BoundaryViolation, Bus

FailureCause = route_pb2.FailureCause


class _Rpc(grpc.RpcError):
    def __init__(self, code, metadata=()):
        self._code, self._metadata = code, metadata

    def code(self):
        return self._code

    def trailing_metadata(self):
        return self._metadata


@pytest.fixture(autouse=True)
def _healthy_communicator():
    fl.communicator_reset()
    yield
    fl.communicator_reset()
    fl.set_collective_probe(None)


@pytest.mark.parametrize(
    "error, cause",
    [
        (torch.OutOfMemoryError("CUDA out of memory"), FailureCause.FAILURE_OUT_OF_MEMORY),
        (dist.DistStoreError("timed out"), FailureCause.FAILURE_RENDEZVOUS),
        (dist.DistNetworkError("connection reset"), FailureCause.FAILURE_COMMUNICATION),
        (dist.DistBackendError("NCCL error"), FailureCause.FAILURE_COMMUNICATION),
        (MemoryError(), FailureCause.FAILURE_OUT_OF_MEMORY),
        (TimeoutError("deadline"), FailureCause.FAILURE_TIMEOUT),
        (ConnectionRefusedError(), FailureCause.FAILURE_UNAVAILABLE),
        (OSError(errno.EADDRINUSE, "in use"), FailureCause.FAILURE_RENDEZVOUS),
        (OSError(errno.ENOSPC, "disk full"), FailureCause.FAILURE_IO),
        (NotImplementedError(), FailureCause.FAILURE_UNSUPPORTED),
        (ValueError("seq_len: must be > 0"), FailureCause.FAILURE_INVALID_INPUT),
        (KeyError("model"), FailureCause.FAILURE_INVALID_INPUT),
        (RuntimeError("gloo: Connection closed by peer"), FailureCause.FAILURE_INTERNAL),  # words make nothing
        (_Rpc(grpc.StatusCode.UNAVAILABLE), FailureCause.FAILURE_UNAVAILABLE),
        (_Rpc(grpc.StatusCode.DEADLINE_EXCEEDED), FailureCause.FAILURE_TIMEOUT),
        (
            _Rpc(grpc.StatusCode.INTERNAL, ((fl.CAUSE_METADATA, "FAILURE_DATA_CORRUPT"),)),
            FailureCause.FAILURE_DATA_CORRUPT,
        ),
    ],
)
def test_the_cause_is_the_exception_type_s(error, cause):
    assert fl.cause_of(error) == cause


def test_a_wrapper_of_no_cause_of_its_own_takes_its_explicit_cause():
    try:
        try:
            raise OSError(errno.EIO, "read failed")
        except OSError as e:
            raise RuntimeError("could not load") from e
    except RuntimeError as wrapped:
        assert fl.cause_of(wrapped) == FailureCause.FAILURE_IO


def test_a_collective_that_raised_breaks_the_communicator_and_what_follows_is_its_consequence():
    with pytest.raises(fl.CommunicationFailed) as failed, fl.collective():
        raise RuntimeError("[gloo] Connection closed by peer")
    assert fl.cause_of(failed.value) == FailureCause.FAILURE_COMMUNICATION and fl.communicator_broken()
    assert (
        fl.cause_of(RuntimeError("Expected all tensors to be on the same device")) == FailureCause.FAILURE_COMMUNICATION
    )


def test_a_group_that_could_not_be_formed_is_a_rendezvous_failure_and_breaks_no_communicator():
    failed = fl.communication_failed("init_process_group", dist.DistNetworkError("connect failed"))
    assert isinstance(failed, fl.RendezvousFailed) and not failed.port_in_use
    assert fl.cause_of(failed) == FailureCause.FAILURE_RENDEZVOUS and not fl.communicator_broken()
    assert isinstance(fl.communication_failed("all_reduce", RuntimeError("x")), fl.CommunicationFailed)
    assert fl.communicator_broken()


def test_a_failure_while_the_process_waits_in_a_collective_is_a_communication_failure():
    waiting = [True]
    fl.set_collective_probe(lambda: waiting[0])
    assert fl.cause_of(RuntimeError("anything")) == FailureCause.FAILURE_COMMUNICATION
    fl.communicator_reset()
    waiting[0] = False
    assert fl.cause_of(RuntimeError("anything")) == FailureCause.FAILURE_INTERNAL


def test_a_handler_exception_is_the_module_s_failure_event_and_the_commander_gets_module_failed():
    bus, seen = Bus(), []
    bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.ForwardFailed, lambda m, p=None: seen.append(m))

    def forward(msg, payload=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.RunForward, forward)
    fl.set_origin("j", 3)
    try:
        with pytest.raises(fl.ModuleFailed) as failed:
            bus.command(Module.L2_TRAINING_LOOP, Module.L3_FORWARD_UNIT, engine_pb2.RunForward())
    finally:
        fl.set_origin()
    event = failed.value.event
    assert isinstance(event, engine_pb2.ForwardFailed) and seen == [event]
    f = event.failure
    assert (f.cause, f.module, f.operation, f.job_id, f.rank) == (
        FailureCause.FAILURE_OUT_OF_MEMORY,
        Module.L3_FORWARD_UNIT,
        "surge.v1.RunForward",
        "j",
        3,
    )
    assert f.exception == "torch.OutOfMemoryError" and event.detail == f.detail
    assert isinstance(failed.value.error, torch.OutOfMemoryError)


def test_a_receiver_failing_on_data_stops_its_publisher_after_the_other_receivers_got_it():
    # An event's publisher gets nothing back from a failed receiver; data's does (a stage of
    # a stream that broke), once every receiver had the item.
    bus, got, failed_events = Bus(), [], []
    bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.TrainingLoopFailed, lambda m, p=None: failed_events.append(m))

    def take(msg, payload=None):
        raise RuntimeError("cannot take the batch")

    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.MicroBatch, take)
    bus.subscribe(Module.L3_FORWARD_UNIT, data_pb2.MicroBatch, lambda m, p=None: got.append(m))
    with pytest.raises(fl.ModuleFailed) as failed:
        bus.publish(Module.L4_BATCH_PACKER, data_pb2.MicroBatch(batch_size=2))
    assert failed_events == [failed.value.event]
    assert failed.value.failure.operation == "surge.v1.MicroBatch" and [m.batch_size for m in got] == [2]
    # The same receiver failing on an event: published, and the publisher gets nothing.
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DataExhausted, take)
    assert bus.publish(Module.L4_BATCH_PACKER, data_pb2.DataExhausted(split="train")) == 1
    assert len(failed_events) == 2


def test_refusals_unwinds_and_boundary_violations_pass_through_as_raised():
    class Unknown(LookupError, fl.Refusal):
        pass

    seen = []
    for error in (Unknown("no such job"), BoundaryViolation(Module.L3_FORWARD_UNIT, "x", None)):

        def forward(msg, payload=None, error=error):
            raise error

        bus = Bus()
        bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.ForwardFailed, lambda m, p=None: seen.append(m))
        bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.RunForward, forward)
        with pytest.raises(type(error)):
            bus.command(Module.L2_TRAINING_LOOP, Module.L3_FORWARD_UNIT, engine_pb2.RunForward())
    assert seen == []


def test_a_failing_handler_of_its_own_failure_event_does_not_loop():
    bus, calls = Bus(), []

    def grade(msg, payload=None):
        calls.append(msg)
        raise RuntimeError("the detector is broken")

    bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.ForwardFailed, grade)
    bus.subscribe(Module.L1_FAULT_DETECTOR, fl.message_class("surge.v1.FaultDetectorFailed"), grade)
    bus.publish(Module.L3_FORWARD_UNIT, engine_pb2.ForwardFailed(detail="x"))
    # ForwardFailed -> the detector fails -> FaultDetectorFailed (to itself) -> fails again: logged, no third
    assert [type(m).__name__ for m in calls] == ["ForwardFailed", "FaultDetectorFailed"]


def test_an_injection_rule_scoped_to_another_process_main_module_is_not_armed_here():
    from services.contract import injection

    main = sys.modules["__main__"].__spec__
    here = main.name.split(".")[0] if main is not None else ""
    try:
        injection.configure("handler:L3_FORWARD_UNIT:RunForward:in=services.store")
        injection.check(Module.L3_FORWARD_UNIT, "surge.v1.RunForward")  # (not armed: nothing raised)
        if here:
            injection.configure(f"handler:L3_FORWARD_UNIT:RunForward:in={here}")
            with pytest.raises(injection.InjectedFault):
                injection.check(Module.L3_FORWARD_UNIT, "surge.v1.RunForward")
        with pytest.raises(ValueError, match="bad option"):
            injection.configure("handler:L3_FORWARD_UNIT:RunForward:in=services.store:times=x")
    finally:
        injection.configure("")


def test_a_grpc_error_reads_as_its_status_and_details_in_one_line_not_its_repr():
    """A stream's error (_MultiThreadedRendezvous) prints as a multi-line repr; the failure
    event's detail is its status code and details, on one line (from a real loopback call)."""
    from concurrent import futures

    def fail(request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "dataset x@v1: no document\npasses the filter")
        yield b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_stream_rpc_method_handler(fail)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                list(channel.unary_stream("/t.T/M")(b"", timeout=10))
    finally:
        server.stop(None)
    assert "\n" in str(caught.value)  # the repr a user would have seen
    assert fl.one_line(caught.value) == "FAILED_PRECONDITION: dataset x@v1: no document passes the filter"
    assert fl.one_line(ValueError("a\nb")) == "ValueError: a"


# ---------------------------------------------------------------- a refused write (issue 29 item 8)

WRITE_ERRORS = [
    (errno.ENOSPC, route_pb2.WRITE_NO_SPACE),
    (errno.EDQUOT, route_pb2.WRITE_QUOTA),
    (errno.EACCES, route_pb2.WRITE_PERMISSION),
    (errno.EPERM, route_pb2.WRITE_PERMISSION),
    (errno.EROFS, route_pb2.WRITE_READ_ONLY),
    (errno.EIO, route_pb2.WRITE_IO),
]


@pytest.mark.parametrize(("code", "kind"), WRITE_ERRORS)
def test_a_refused_write_is_typed_from_its_errno(code, kind):
    refused = fl.write_refused(OSError(code, "whatever the libc says", "/store/job/.staging/x"))
    assert refused is not None
    assert (refused.write_error, refused.path, refused.errno) == (kind, "/store/job/.staging/x", code)
    assert fl.cause_of(refused) == route_pb2.FAILURE_WRITE_REFUSED


def test_an_errno_no_write_refusal_raises_is_none_whatever_its_text_says():
    assert fl.write_refused(OSError(errno.ENOENT, "No space left on device", "/x")) is None
    assert fl.write_refused(RuntimeError("[Errno 28] No space left on device")) is None
    # Outside a write site an OSError keeps its plain I/O cause (EACCES on a read says something else).
    assert fl.cause_of(OSError(errno.ENOSPC, "full")) == route_pb2.FAILURE_IO


def test_a_refused_write_is_found_behind_a_wrapper_and_in_another_ranks_gathered_error():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.EROFS, "Read-only file system", "/store/j/chunks/1/ab")
    except OSError as e:
        gathered = CheckpointException("write", {0: _wrap_exception(ValueError("other")), 1: _wrap_exception(e)})
    refused = fl.write_refused(gathered)
    assert refused is not None and refused.write_error == route_pb2.WRITE_READ_ONLY
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as outer:
        assert fl.write_refused(outer).write_error == route_pb2.WRITE_QUOTA


def test_a_refused_write_survives_the_pickling_dcp_gathers_it_with():
    import pickle

    refused = fl.write_refused(OSError(errno.ENOSPC, "No space left on device", "/s/x"))
    back = pickle.loads(pickle.dumps(refused))
    assert (type(back), back.errno, back.write_error, back.path) == (fl.WriteRefused, errno.ENOSPC, 1, "/s/x")


def test_writing_names_the_path_and_leaves_other_errors_as_they_are(tmp_path):
    with pytest.raises(fl.WriteRefused) as e, fl.writing(tmp_path / "manifest.json"):
        raise OSError(errno.ENOSPC, "No space left on device")  # (a write() names no file)
    assert (e.value.path, e.value.write_error) == (str(tmp_path / "manifest.json"), route_pb2.WRITE_NO_SPACE)
    with pytest.raises(FileNotFoundError), fl.writing(tmp_path / "x"):
        open(tmp_path / "missing" / "x", "rb")  # noqa: SIM115 - an error that is no refused write


def test_a_servers_refused_write_reaches_the_caller_typed_with_which_and_where():
    class Refused(grpc.RpcError):
        def __init__(self, metadata):
            self._metadata = metadata

        def trailing_metadata(self):
            return self._metadata

        def code(self):
            return grpc.StatusCode.INTERNAL

    error = fl.WriteRefused(errno.EROFS, "Read-only file system", "/store/catalog.json", route_pb2.WRITE_READ_ONLY)
    metadata = fl.cause_metadata(error)
    assert dict(metadata) == {
        fl.CAUSE_METADATA: "FAILURE_WRITE_REFUSED",
        fl.WRITE_ERROR_METADATA: "WRITE_READ_ONLY",
        fl.WRITE_PATH_METADATA: "/store/catalog.json",
    }
    assert fl.cause_of(Refused(metadata)) == route_pb2.FAILURE_WRITE_REFUSED
    assert fl.write_refused_from_rpc(Refused(metadata)) == (route_pb2.WRITE_READ_ONLY, "/store/catalog.json")
    assert fl.cause_metadata(OSError(errno.ENOSPC, "full")) == ((fl.CAUSE_METADATA, "FAILURE_IO"),)


def test_a_refusal_typed_in_another_process_is_found_by_its_kind_not_its_text():
    class Carried(RuntimeError):  # e.g. a relay's error for a stream the store refused
        failure_cause = route_pb2.FAILURE_WRITE_REFUSED
        write_error = route_pb2.WRITE_QUOTA
        path = "/store/j/.staging/step-4/x"

    refused = fl.write_refused(Carried("PutCheckpointFiles: INTERNAL: whatever"))
    assert (refused.errno, refused.write_error, refused.path) == (errno.EDQUOT, route_pb2.WRITE_QUOTA, Carried.path)
    untyped = Carried("the same text")
    untyped.failure_cause = route_pb2.FAILURE_IO
    assert fl.write_refused(untyped) is None
