"""A bucket's gradient all-reduce that fails records the communicator broken before DDP sees
it (services/compute/gradient_reduction.py ``broken_on_failure``): gloo's plain RuntimeError
from a dead peer, in an early bucket during the backward, was typed internal_error and the
survivor stopped instead of rebuilt (CI, test_rebuild_in_place)."""

from __future__ import annotations

import pytest
import torch

from services.compute.gradient_reduction import broken_on_failure
from services.contract import route_pb2
from services.contract.failures import cause_of, communicator_broken, communicator_reset


def test_a_failed_bucket_all_reduce_marks_the_communicator_broken_and_types_the_error_as_communication():
    communicator_reset()
    try:
        fut: torch.futures.Future = torch.futures.Future()
        chained = broken_on_failure(fut)
        fut.set_exception(RuntimeError("[gloo] Connection closed by peer"))
        with pytest.raises(RuntimeError) as e:
            chained.wait()
        assert communicator_broken()
        assert cause_of(e.value) == route_pb2.FAILURE_COMMUNICATION
    finally:
        communicator_reset()


def test_a_bucket_that_succeeds_passes_its_tensor_on_and_breaks_nothing():
    communicator_reset()
    fut: torch.futures.Future = torch.futures.Future()
    chained = broken_on_failure(fut)
    fut.set_result(torch.ones(3))
    assert torch.equal(chained.wait(), torch.ones(3)) and not communicator_broken()
