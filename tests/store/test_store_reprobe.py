"""The rank relay's store breaker (services/rank/store_liveness.py): its prober asks a store
that refused (nothing listening: killed, being restarted) again within REFUSED_RETRY_S, and one
that left a probe unanswered (stopped) a half window later. The health stub and the wait are
stand-ins: what is checked is how long the prober waits after each kind of answer."""

from __future__ import annotations

import threading

import grpc

from services.contract import store_pb2
from services.rank import store_liveness
from services.rank.store_liveness import REFUSED_RETRY_S, StoreLiveness


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Health:
    """Check fails with each of ``codes`` in turn, then answers."""

    def __init__(self, codes: list[grpc.StatusCode]):
        self.codes, self.calls = list(codes), 0

    def Check(self, request, timeout):  # noqa: N802 (gRPC's name)
        self.calls += 1
        if self.codes:
            raise _Failed(self.codes.pop(0))


class _Waits(threading.Event):
    """The relay's closing event, recording each wait of the prober (and waiting none)."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return False


def _prober_waits(codes: list[grpc.StatusCode]) -> tuple[list[float], StoreLiveness]:
    liveness = StoreLiveness(grpc.insecure_channel("127.0.0.1:1"), "127.0.0.1:1", silent_s=10.0)
    liveness._health, liveness._closed = _Health(codes), _Waits()
    liveness._open(store_pb2.UNREACHABLE, "refused")
    liveness._prober.join(timeout=10)
    return liveness._closed.waits, liveness


def test_a_refused_probe_is_asked_again_within_a_second_and_the_breaker_closes_on_the_answer():
    waits, liveness = _prober_waits([grpc.StatusCode.UNAVAILABLE] * 3)
    assert len(waits) == 3 and all(0 < w <= REFUSED_RETRY_S for w in waits), waits  # (was: 5 s each)
    assert liveness.silent_since is None and liveness._health.calls == 4


def test_an_unanswered_probe_waits_half_a_window_as_before():
    waits, liveness = _prober_waits([grpc.StatusCode.DEADLINE_EXCEEDED])
    assert len(waits) == 1 and REFUSED_RETRY_S < waits[0] <= store_liveness.PROBE_SHARE * 10.0, waits
    assert liveness.silent_since is None
