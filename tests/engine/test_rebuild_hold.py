"""A survivor held for inspection while it waits for its rebuild's rendezvous (issue 29 item 9,
``fault_policy.freeze_seconds`` holding a rebuild in place): the rendezvous's wait (minutes)
running out during the hold (up to days) is not a failure; the rank waits for L1-1's thaw and
then for the rendezvous again. Without a hold, the same timeout fails the rank as before.

``Recovery._recover`` driven on a stand-in loop: the rest of the rebuild (the group, the heal,
the data) is tests/engine/test_rebuild_in_place.py's, on real processes."""

from __future__ import annotations

import threading
import types

import pytest

from services.common.phase import NoPhase
from services.contract import engine_pb2
from services.contract.failures import RendezvousFailed
from services.engine.training_loop.recovery import Recovery

pytestmark = pytest.mark.timeout(30)


class _Parallel:
    """L2-2's RebuildParallelGroup: the first ``timeouts`` calls time out, the next joins."""

    def __init__(self, timeouts: int, while_waiting=lambda: None):
        self.calls, self._timeouts, self._while_waiting = 0, timeouts, while_waiting

    def __call__(self, msg):
        self.calls += 1
        if self.calls <= self._timeouts:
            self._while_waiting()  # (what comes while it waits: L1-1's FreezeTraining)
            raise RendezvousFailed("no rendezvous for generation 2 within 300 s")
        return types.SimpleNamespace(payload=engine_pb2.RebuildParallelGroup(generation=2))


def _survivor(parallel: _Parallel, frozen: bool):
    loop = types.SimpleNamespace(
        _phase="stepping", _mark=NoPhase(), _rng_at_step=None, _step=5, _generation=1, _world=2,
        _num_parameters=0, _peak=types.SimpleNamespace(tflops=0.0, source=""), _job_id="j",
        _p=types.SimpleNamespace(parallel=parallel), _await_ready=lambda: None, _take_layout=lambda layout: None,
        _heal=lambda has_state: engine_pb2.StateHealed(step=5, source_rank=0), _open_stream=lambda *a, **k: None,
        _emit=lambda msg: None, _layout_text=lambda: "dp 2", _await_start=lambda: True, _position=0, _rank=1,
        _frozen=engine_pb2.FreezeTraining(job_id="j") if frozen else None, _thawed=threading.Event(),
        _rebuilds=lambda e: False,  # (a rendezvous failure is not one a survivor rebuilds from)
    )  # fmt: skip
    for name in ("_await_thaw", "_report_taken_over"):
        setattr(loop, name, types.MethodType(getattr(Recovery, name), loop))
    return loop


def test_a_rendezvous_wait_that_runs_out_during_a_hold_is_waited_again_after_the_thaw():
    # The usual order: the survivor's collective broke and it waits for the rendezvous before
    # L1-1 has decided; the hold's FreezeTraining comes during that wait.
    def freeze():
        loop._frozen = engine_pb2.FreezeTraining(job_id="j")
        loop._thawed.clear()

    parallel = _Parallel(timeouts=1, while_waiting=freeze)
    loop = _survivor(parallel, frozen=False)
    done = []
    t = threading.Thread(target=lambda: done.append(Recovery._recover(loop, "peer lost", in_step=False)), daemon=True)
    t.start()
    t.join(1.0)
    assert (parallel.calls, done, t.is_alive()) == (1, [], True)  # timed out, held: waits for the thaw
    loop._frozen = None  # (FreezeTraining.thaw, as the loop's handler does it)
    loop._thawed.set()
    t.join(10)
    assert (parallel.calls, done) == (2, [True])  # the rendezvous again, joined, healed, started


def test_without_a_hold_the_rendezvous_timeout_fails_the_rank_as_before():
    loop = _survivor(_Parallel(timeouts=1), frozen=False)
    with pytest.raises(RendezvousFailed):
        Recovery._recover(loop, "peer lost", in_step=False)


def test_a_survivor_held_before_its_group_broke_asks_for_the_rendezvous_only_after_the_thaw():
    parallel = _Parallel(timeouts=0)
    loop = _survivor(parallel, frozen=True)
    t = threading.Thread(target=Recovery._recover, args=(loop, "peer lost", False), daemon=True)
    t.start()
    t.join(0.5)
    assert (parallel.calls, t.is_alive()) == (0, True)  # the rendezvous's clock not started
    loop._frozen = None
    loop._thawed.set()
    t.join(10)
    assert (parallel.calls, t.is_alive()) == (1, False)
