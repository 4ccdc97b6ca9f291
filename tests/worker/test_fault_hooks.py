"""The rank's fault hooks: test-only injections parse strictly, fire once per job and rank,
and reach only training backward passes (what a non-finite loss or gradient does is the
loop's decision: tests/engine/test_training_loop.py, tests/faults/test_nan_skip.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from services.contract import engine_pb2, store_pb2
from services.contract.bus import Reply
from services.rank.faults import FaultInjector, Injection, StepGuard, lift_pace, parse_injections

pytestmark = pytest.mark.timeout(30)


def test_injections_are_parsed_per_job_name_and_a_bad_entry_is_one_line():
    text = "a:nan_loss@7,b:hang@3:rank=1, a:hang@9:rank=2"
    assert parse_injections(text, "a") == [Injection("nan_loss", 7, 0), Injection("hang", 9, 2)]
    assert parse_injections(text, "c") == []
    kinds = (
        r"nan_loss\|inf_grad\|hang\|hang_forward\|slow_eval\|slow_save\|slow_heal\|slow_load\|slow_steps\|corrupt_weights"
        r"\|slow_compute\|slow_profile_export"
    )
    expected = rf"expected <job name>:<{kinds}>@<step>"
    with pytest.raises(ValueError, match=r"^SURGE_FAULT_INJECT: 'a:explode@1': " + expected):
        parse_injections("a:explode@1", "a")
    assert parse_injections("a:slow_eval@4:rank=1:seconds=2.5", "a") == [Injection("slow_eval", 4, 1, 2.5)]


def test_a_nan_injection_poisons_the_logits_of_its_step_once_across_relaunches(tmp_path):
    logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64)
    first = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 0, marker_dir=tmp_path)
    assert torch.equal(first.before_backward(6, (logits, labels))[0], logits)
    poisoned, same = first.before_backward(7, (logits, labels))
    assert torch.isnan(poisoned).all() and same is labels
    relaunched = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 0, marker_dir=tmp_path)
    assert torch.equal(relaunched.before_backward(7, (logits, labels))[0], logits)
    other_rank = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 1, marker_dir=tmp_path)
    assert torch.equal(other_rank.before_backward(7, (logits, labels))[0], logits)


def test_an_inf_grad_injection_keeps_the_loss_finite_and_makes_the_gradients_inf(tmp_path):
    weight = torch.ones(3, requires_grad=True)
    logits, labels = (torch.zeros(2, 3) + weight).unsqueeze(0), torch.zeros(1, 2, dtype=torch.int64)
    injector = FaultInjector([Injection("inf_grad", 4, 0)], "j-1", 0, marker_dir=tmp_path)
    poisoned, _ = injector.before_backward(4, (logits, labels))
    loss = torch.nn.functional.cross_entropy(poisoned.reshape(-1, 3), labels.reshape(-1))
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert not torch.isfinite(weight.grad).any()


def test_the_step_guard_injects_only_into_training_backward_passes_and_is_a_no_op_without_injections(tmp_path):
    seen = []
    port = lambda msg, payload: seen.append(payload) or Reply(engine_pb2.BackwardDone(loss_sum=1.0, tokens=1))  # noqa: E731
    assert StepGuard(lambda: 1).backward(port) is port
    injector = FaultInjector([Injection("nan_loss", 2, 0)], "j-1", 0, marker_dir=tmp_path)
    backward = StepGuard(lambda: 2, injector=injector).backward(port)
    logits = torch.zeros(1, 2, 3)
    backward(engine_pb2.RunBackward(backward=False), (logits, None))
    backward(engine_pb2.RunBackward(backward=True), (logits, None))
    assert not torch.isnan(seen[0][0]).any() and torch.isnan(seen[1][0]).all()


def test_slow_eval_slows_every_batch_of_the_evaluation_after_its_step_and_only_that_one(tmp_path):
    import time

    injector = FaultInjector([Injection("slow_eval", 4, 0, 0.2)], "j-1", 0, marker_dir=tmp_path)
    forward = StepGuard(lambda: 5, injector=injector).forward(lambda msg, payload=None: Reply(msg))
    forward(engine_pb2.ConfigureForward())  # the same port carries the forward unit's configuration
    t0 = time.monotonic()
    forward(engine_pb2.RunForward(training=True))  # step 5's training forward: untouched
    assert time.monotonic() - t0 < 0.1
    for _ in range(2):  # the evaluation after step 4 (the session's step is 4): each batch
        t0 = time.monotonic()
        forward(engine_pb2.RunForward(training=False))
        assert time.monotonic() - t0 >= 0.2
    relaunched = FaultInjector([Injection("slow_eval", 4, 0, 0.2)], "j-1", 0, marker_dir=tmp_path)
    t0 = time.monotonic()
    relaunched.before_forward(5, False)  # fired once per job and rank, across relaunches
    assert time.monotonic() - t0 < 0.1
    # Step 4's backward pass does not consume it (it once did: the marker fired there).
    other = FaultInjector([Injection("slow_eval", 4, 0, 0.2)], "j-2", 0, marker_dir=tmp_path)
    other.before_backward(4, (torch.zeros(1), None))
    t0 = time.monotonic()
    other.before_forward(5, False)
    assert time.monotonic() - t0 >= 0.2


def test_slow_steps_slows_each_training_step_from_its_step_once_on_every_incarnation(tmp_path):
    import time

    def took(injector: FaultInjector, step: int, training: bool = True) -> float:
        t0 = time.monotonic()
        injector.before_forward(step, training)
        return time.monotonic() - t0

    for _ in range(2):  # a relaunched rank is paced as well: no marker
        injector = FaultInjector([Injection("slow_steps", 3, 1, 0.2)], "j-1", 1, marker_dir=tmp_path)
        assert took(injector, 2) < 0.1  # before its step
        assert took(injector, 3) >= 0.2 and took(injector, 3) < 0.1  # once a step (its second micro-batch: not again)
        assert took(injector, 4, training=False) < 0.1  # an evaluation batch
        assert took(injector, 4) >= 0.2 and took(injector, 9) >= 0.2  # every later step
    assert not list(tmp_path.iterdir())
    assert took(FaultInjector([Injection("slow_steps", 3, 1, 0.2)], "j-1", 0, marker_dir=tmp_path), 5) < 0.1
    # Lifted mid-wait: the step goes on within a poll; later steps and incarnations unpaced.
    import threading

    injector = FaultInjector([Injection("slow_steps", 1, 1, 30.0)], "j-1", 1, marker_dir=tmp_path)
    threading.Timer(0.3, lift_pace, (tmp_path, "j-1")).start()
    assert 0.3 <= took(injector, 1) < 2.0
    assert took(injector, 2) < 0.1
    assert took(FaultInjector([Injection("slow_steps", 1, 1, 30.0)], "j-1", 1, marker_dir=tmp_path), 3) < 0.1
    assert took(FaultInjector([Injection("slow_steps", 1, 1, 0.2)], "j-2", 1, marker_dir=tmp_path), 3) >= 0.2


def test_hang_forward_is_due_only_at_its_steps_training_forward(tmp_path):
    injector = FaultInjector([Injection("hang_forward", 8, 1)], "j-1", 1, marker_dir=tmp_path)
    injector.before_forward(7, True)
    injector.before_forward(9, False)  # an evaluation: not a training forward
    assert not list(tmp_path.iterdir())  # not fired


def test_slow_save_delays_only_the_save_of_its_step_once(tmp_path):
    import time

    from services.contract import store_pb2

    injector = FaultInjector([Injection("slow_save", 4, 0, 0.2)], "j-1", 0, marker_dir=tmp_path)
    store = StepGuard(lambda: 5, injector=injector).store(lambda msg, payload=None: Reply(msg))
    for msg, slow in (
        (store_pb2.SaveCheckpoint(step=3), False),
        (store_pb2.CommitCheckpoint(step=4), False),
        (store_pb2.SaveCheckpoint(step=4), True),
        (store_pb2.SaveCheckpoint(step=4), False),
    ):
        t0 = time.monotonic()
        store(msg)
        assert (time.monotonic() - t0 >= 0.2) == slow, msg


def test_slow_compute_multiplies_the_training_forward_and_backward_time_from_its_step_on(tmp_path):
    import time

    text = "j:slow_compute@3:rank=1:factor=3"
    assert parse_injections(text, "j") == [Injection("slow_compute", 3, 1, factor=3.0)]
    with pytest.raises(ValueError, match="factor"):
        parse_injections("j:slow_compute@3:factor=0.5", "j")
    step = [2]
    guard = StepGuard(lambda: step[0], injector=FaultInjector(parse_injections(text, "j"), "j", 1, tmp_path))

    def work(msg, payload=None):
        time.sleep(0.02)
        return Reply(engine_pb2.ForwardDone())

    forward, backward = guard.forward(work), guard.backward(work)

    def timed(call, msg) -> float:
        t0 = time.perf_counter()
        call(msg)
        return time.perf_counter() - t0

    train, bwd = engine_pb2.RunForward(training=True), engine_pb2.RunBackward(backward=True)
    assert timed(forward, train) < 0.035 and timed(backward, bwd) < 0.035  # before its step: as it is
    step[0] = 3
    assert timed(forward, train) >= 0.06  # 3x its own time
    assert timed(backward, bwd) >= 0.06  # 3x the previous backward's
    assert timed(forward, engine_pb2.RunForward(training=False)) < 0.035  # an evaluation: not slowed
    assert timed(guard.optimizer(work), engine_pb2.ApplyUpdate(step=3)) >= 0.06  # the update too


def test_slow_profile_export_holds_the_interpreter_lock_so_no_other_thread_beats(tmp_path):
    """What torch.profiler's post-processing of a long trace does to a rank (step_profiler.py)."""
    import threading
    import time

    from services.rank.faults import FaultInjector, parse_injections

    injector = FaultInjector(parse_injections("j:slow_profile_export@3:seconds=1", "j"), "job", 0, tmp_path)
    ticks: list[float] = []
    stop = threading.Event()

    def beat():
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    time.sleep(0.1)
    injector.before_profile_export(2)  # (not due yet)
    t0 = time.monotonic()
    injector.before_profile_export(3)
    t1 = time.monotonic()
    injector.before_profile_export(4)  # (fired once)
    stop.set()
    t.join()
    assert t1 - t0 >= 1.0
    assert not [x for x in ticks if t0 + 0.05 < x < t1 - 0.05], "a thread ran while the lock was held"
    assert time.monotonic() - t1 < 0.5


def test_a_slow_load_waits_before_the_first_load_at_or_after_its_step_once_across_relaunches(tmp_path):
    asked = []

    def port(msg, payload):
        asked.append((type(msg).__name__, time.monotonic()))
        return Reply(store_pb2.CheckpointLoaded())

    step = [3]

    def guarded() -> object:
        injector = FaultInjector([Injection("slow_load", 4, 1, 0.3)], "j-1", 1, marker_dir=tmp_path)
        return StepGuard(lambda: step[0], injector=injector).store(port)

    load = guarded()
    t0 = time.monotonic()
    load(store_pb2.LoadCheckpoint(version="v1"), None)  # (session at step 3: not yet)
    assert asked[-1][1] - t0 < 0.2
    step[0] = 4
    t0 = time.monotonic()
    load(store_pb2.LoadCheckpoint(version="v1"), None)
    assert asked[-1][1] - t0 >= 0.3  # waited before the store was asked
    t0 = time.monotonic()
    guarded()(store_pb2.LoadCheckpoint(version="v1"), None)  # a relaunch of the rank: fired already
    assert asked[-1][1] - t0 < 0.2 and [a for a, _ in asked] == ["LoadCheckpoint"] * 3
