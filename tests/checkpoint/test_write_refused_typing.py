"""The rank's checkpoint relay types a save whose write was refused from its errno (issue 29,
item 8): what DCP gathers from every rank, and what a stream to the store carries back. The
real-stack behaviour: tests/faults/test_save_write_refused.py."""

from __future__ import annotations

import errno
import pickle

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from services.contract import route_pb2, store_pb2
from services.rank.checkpoint_errors import CheckpointWriteRefused, _write_failed
from services.rank.checkpoint_transfer import TransferFailed


def _gathered(*errors: BaseException) -> CheckpointException:
    """What every rank's dcp.save raises when ranks' writes failed (rank -> wrapped error)."""
    wrapped = {}
    for rank, error in enumerate(errors):
        try:
            raise error
        except BaseException as e:  # noqa: BLE001 - wrapped with its traceback, as DCP does
            wrapped[rank] = _wrap_exception(e)
    return pickle.loads(pickle.dumps(CheckpointException("write", wrapped)))  # (gathered: pickled)


def test_another_ranks_full_disk_is_a_refused_write_of_this_save_naming_the_file():
    e = _gathered(OSError(errno.ENOSPC, "No space left on device", "/store/j/chunks/2/ab/.ab12.tmp"))
    refused = _write_failed(e, step=40)
    assert isinstance(refused, CheckpointWriteRefused)
    assert (refused.write_error, refused.path, refused.step) == (
        route_pb2.WRITE_NO_SPACE,
        "/store/j/chunks/2/ab/.ab12.tmp",
        40,
    )
    assert (refused.cause, refused.failure_cause, refused.fault_class) == (
        store_pb2.WRITE_REFUSED,
        route_pb2.FAILURE_WRITE_REFUSED,
        "checkpoint_write_failed",
    )
    assert str(refused) == ("checkpoint write refused: No space left on device (/store/j/chunks/2/ab/.ab12.tmp)")


def test_a_write_failure_of_no_refusing_errno_stays_a_plain_checkpoint_error():
    failed = _write_failed(_gathered(OSError(errno.ENOENT, "No such file or directory", "/x")), step=40)
    assert not isinstance(failed, CheckpointWriteRefused) and failed.failure_cause == route_pb2.FAILURE_IO


def test_a_stream_the_store_refused_for_its_own_write_is_typed_after_crossing_ranks():
    carried = TransferFailed(
        "PutCheckpointFiles: INTERNAL: store: PutCheckpointFiles: ...",
        route_pb2.FAILURE_WRITE_REFUSED,
        None,
        route_pb2.WRITE_READ_ONLY,
        "/store/j/.staging/step-40-ab",
    )
    refused = _write_failed(_gathered(ValueError("rank 0 fine"), carried), step=40)
    assert isinstance(refused, CheckpointWriteRefused)
    assert (refused.write_error, refused.path) == (route_pb2.WRITE_READ_ONLY, "/store/j/.staging/step-40-ab")


def test_a_save_dropped_with_its_replaced_group_is_a_consequence_unless_storage_failed():
    """A write still running when a rebuild destroyed its group raises whatever the dead group
    makes it raise (a ValueError of an unregistered group: by type, invalid input); dropped,
    it is typed communication, so that L1 records it as the consequence of the fault that
    broke the group. A storage failure (a full disk) keeps its own type."""
    from services.contract.failures import cause_of
    from services.rank.checkpoint_errors import _dropped

    artifact = ValueError("Group <ProcessGroup> is not registered, please create group with new_group API")
    assert cause_of(artifact) == route_pb2.FAILURE_INVALID_INPUT
    dropped = _dropped(_write_failed(artifact, step=40), cause_of(artifact))
    assert dropped.failure_cause == route_pb2.FAILURE_COMMUNICATION

    full = OSError(errno.ENOSPC, "No space left on device", "/store/j/x.tmp")
    kept = _dropped(_write_failed(full, step=40), route_pb2.FAILURE_WRITE_REFUSED)
    assert kept.failure_cause == route_pb2.FAILURE_WRITE_REFUSED
