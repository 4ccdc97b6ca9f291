"""The four learning-rate schedules (services/engine/lr_schedule.py): values at the
boundaries of each phase, from the formulas in its docstring."""

from __future__ import annotations

import math

import pytest

from services.engine.lr_schedule import learning_rate, schedule_for
from services.jobspec import JobSpecError, OptimizerSpec, parse_job_spec


def lr(step, schedule, **kw):
    return learning_rate(step, lr=1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "wsd"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    assert [lr(s, schedule) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])


def test_constant_holds_the_peak_to_the_end_and_beyond():
    assert [lr(s, "constant") for s in (11, 60, 110, 500)] == [1.0] * 4


def test_linear_falls_in_a_straight_line_to_the_floor_at_the_last_step():
    assert lr(11, "linear") == pytest.approx(1.0 - 0.9 / 100)
    assert lr(60, "linear") == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr(85, "linear") == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr(110, "linear") == pytest.approx(0.1)
    assert lr(111, "linear") == pytest.approx(0.1)
    values = [lr(s, "linear") for s in range(10, 111)]
    steps = [a - b for a, b in zip(values, values[1:])]
    assert steps == pytest.approx([0.009] * 100)  # the same drop every step


def test_cosine_is_unchanged():
    assert lr(60, "cosine") == pytest.approx(0.55)
    assert lr(35, "cosine") == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr(110, "cosine") == pytest.approx(0.1)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_is_stable_until_the_last_share_of_steps_then_decays_to_the_floor(shape):
    # 110 steps, decay_ratio 0.2: the last round(22) steps decay, i.e. steps 89..110.
    f = lambda s: lr(s, "wsd", decay_ratio=0.2, decay_shape=shape)  # noqa: E731
    assert [f(s) for s in (11, 50, 88)] == [1.0, 1.0, 1.0]
    assert f(110) == pytest.approx(0.1) and f(200) == pytest.approx(0.1)
    half = 0.5 if shape == "linear" else 1 - math.sqrt(0.5)
    assert f(99) == pytest.approx(0.1 + 0.9 * half)  # 11 of 22 decay steps done
    first = 1 / 22 if shape == "linear" else math.sqrt(1 / 22)
    assert f(89) == pytest.approx(0.1 + 0.9 * (1 - first))
    values = [f(s) for s in range(88, 111)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_wsd_1_sqrt_drops_faster_early_than_linear():
    assert lr(95, "wsd", decay_shape="1-sqrt") < lr(95, "wsd", decay_shape="linear")


def test_wsd_decay_never_reaches_into_the_warmup():
    # decay_ratio 1 over 20 steps with 10 of warmup: the decay starts after the warmup.
    f = lambda s: learning_rate(s, lr=1.0, total_steps=20, warmup_steps=10, schedule="wsd", decay_ratio=1.0)  # noqa: E731
    assert f(10) == 1.0
    assert f(15) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(20) == pytest.approx(0.1)
    # A tiny ratio still decays over one step: the last.
    g = lambda s: learning_rate(s, lr=1.0, total_steps=20, schedule="wsd", decay_ratio=0.01)  # noqa: E731
    assert g(19) == 1.0 and g(20) == pytest.approx(0.1)


def test_schedule_for_takes_every_field_from_the_spec():
    spec = OptimizerSpec(
        lr=0.5, warmup_steps=0, min_lr_ratio=0.0, schedule="wsd", decay_ratio=0.5, decay_shape="1-sqrt"
    )
    f = schedule_for(spec, 8)
    assert [f(s) for s in (1, 4)] == [0.5, 0.5]
    assert f(6) == pytest.approx(0.5 * (1 - math.sqrt(0.5)))
    assert f(8) == 0.0


def test_bad_schedule_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="schedule must be one of"):
        learning_rate(1, lr=1.0, total_steps=5, schedule="step")
    with pytest.raises(ValueError, match="decay_shape"):
        learning_rate(5, lr=1.0, total_steps=5, schedule="wsd", decay_shape="cosine")
    with pytest.raises(ValueError, match="decay_ratio"):
        learning_rate(5, lr=1.0, total_steps=5, schedule="wsd", decay_ratio=0.0)


BASE = "name: j\nsteps: 10\ndata: {dataset: tiny@v1}\noptimizer: {%s}\n"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("schedule: step", "optimizer.schedule"),
        ("schedule: wsd, decay_ratio: 0", "optimizer.decay_ratio"),
        ("schedule: wsd, decay_ratio: 1.5", "optimizer.decay_ratio"),
        ("decay_shape: sqrt", "optimizer.decay_shape"),
        ("max_grad_norm: -1", "optimizer.max_grad_norm"),
    ],
)
def test_the_spec_refuses_bad_schedule_and_clipping_fields_naming_them(body, field):
    with pytest.raises(JobSpecError, match=field.replace(".", r"\.")):
        parse_job_spec(BASE % body)


def test_the_spec_accepts_each_schedule_and_clipping():
    for schedule in ("constant", "linear", "cosine", "wsd"):
        spec = parse_job_spec(BASE % f"schedule: {schedule}, max_grad_norm: 1.0")
        assert spec.optimizer.schedule == schedule and spec.optimizer.max_grad_norm == 1.0
    assert parse_job_spec(BASE % "").optimizer.max_grad_norm == 0.0  # off by default
