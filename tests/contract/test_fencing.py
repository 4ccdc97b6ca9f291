"""services/common/fencing.py: the newest generation per (job, rank), and the header a rank's
channels add to every call once it knows its incarnation."""

from __future__ import annotations

import pytest

from services.common import fencing
from services.common.fencing import GenerationFence, StaleGeneration
from services.common.grpc_server import _Headers
from services.contract import route_pb2
from services.contract.failures import cause_of

pytestmark = pytest.mark.timeout(30)


def test_an_older_generation_is_refused_a_newer_one_raises_the_fence_and_zero_is_unfenced():
    fence = GenerationFence()
    fence.admit("j", 1, 5)
    fence.admit("j", 1, 5)  # the same incarnation again
    with pytest.raises(StaleGeneration) as e:
        fence.admit("j", 1, 4)
    assert (e.value.generation, e.value.newest) == (4, 5)
    assert cause_of(e.value) == route_pb2.FailureCause.FAILURE_FENCED  # typed, not from its text
    fence.admit("j", 0, 1)  # another rank: its own fence
    fence.admit("j", 1, 0)  # no generation named: not fenced
    assert fence.tell("j", 1, 9) == 9 and fence.tell("j", 1, 7) == 9  # told of a newer one by its owner
    with pytest.raises(StaleGeneration):
        fence.admit("j", 1, 8)


def test_a_ranks_calls_name_its_incarnation_once_it_has_its_assignment():
    class Details:
        method, timeout, metadata, credentials = "/surge.v1.DataService/Stream", None, (), None

    headers = _Headers([("x-surge-module", "L2_TRAINING_LOOP")])
    try:
        assert fencing.GENERATION_METADATA not in dict(headers._details(Details()).metadata)
        fencing.set_identity("job-a/b", 3, 1700000000123)  # (a job id may hold a slash)
        value = dict(headers._details(Details()).metadata)[fencing.GENERATION_METADATA]
        assert fencing.parse(value) == ("job-a/b", 3, 1700000000123)
    finally:
        fencing.set_identity("", 0, 0)
    assert fencing.identity_header() is None
    assert fencing.parse("garbage") is None and fencing.parse(b"j/x/3") is None
