"""Learning-rate schedule: a pure function of the step, owned by the training loop (L2-1).

Every schedule starts with a linear warmup from 0 to ``lr`` over ``warmup_steps`` updates;
after it (``min_lr = min_lr_ratio * lr``):

    constant  ``lr`` to the end.
    linear    straight down from ``lr`` to ``min_lr`` at the last step.
    cosine    half-cosine from ``lr`` to ``min_lr`` at the last step (the default). Warmup +
              cosine to 10% of the peak as in GPT-3 (Brown et al. 2020, appendix B) and
              Chinchilla (Hoffmann et al. 2022); the cosine shape from SGDR (Loshchilov &
              Hutter 2017) without restarts; the same formula as nanoGPT's ``get_lr``.
    wsd       warmup-stable-decay: ``lr`` until the last ``decay_ratio`` share of all steps,
              which decays to ``min_lr`` at the last step, linearly (``decay_shape: linear``,
              MiniCPM, Hu et al. 2024) or as ``1 - sqrt`` of the decay's progress
              (``decay_shape: 1-sqrt``, Hägele et al. 2024, "Scaling Laws and Compute-Optimal
              Training Beyond Fixed Training Durations", who found 1-sqrt over a 20% cooldown
              to match cosine). The decay spans ``max(1, round(decay_ratio * total_steps))``
              steps; where it would reach back into the warmup, the warmup wins.

Steps are 1-based: step 1 is the first optimizer update, so the first update already
uses a non-zero rate (``lr / warmup_steps``) and step ``warmup_steps`` uses the peak. Past
the last step every decaying schedule stays at ``min_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from services.jobspec import OptimizerSpec

SCHEDULES = ("constant", "linear", "cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")


def learning_rate(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
    decay_shape: str = "linear",
) -> float:
    """The learning rate of optimizer update ``step`` (1-based).

    Raises:
        ValueError: step < 1, total_steps < 1, an unknown schedule or decay shape, or a
            decay_ratio outside (0, 1].
    """
    if step < 1:
        raise ValueError(f"learning_rate: step must be >= 1, got {step}")
    if total_steps < 1:
        raise ValueError(f"learning_rate: total_steps must be >= 1, got {total_steps}")
    if schedule not in SCHEDULES:
        raise ValueError(f"learning_rate: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    min_lr = lr * min_lr_ratio
    if schedule == "wsd":
        if decay_shape not in DECAY_SHAPES:
            raise ValueError(
                f"learning_rate: decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {decay_shape!r}"
            )
        if not 0.0 < decay_ratio <= 1.0:
            raise ValueError(f"learning_rate: decay_ratio must be in (0, 1], got {decay_ratio}")
        decay_start = max(warmup_steps, total_steps - max(1, round(decay_ratio * total_steps)))
        if step <= decay_start:
            return lr
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        remaining = 1.0 - (math.sqrt(progress) if decay_shape == "1-sqrt" else progress)
        return min_lr + (lr - min_lr) * remaining
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_for(spec: OptimizerSpec, total_steps: int) -> Callable[[int], float]:
    """``learning_rate`` bound to the job spec's optimizer section and step count."""

    def lr_at(step: int) -> float:
        return learning_rate(
            step,
            lr=spec.lr,
            total_steps=total_steps,
            warmup_steps=spec.warmup_steps,
            min_lr_ratio=spec.min_lr_ratio,
            schedule=spec.schedule,
            decay_ratio=spec.decay_ratio,
            decay_shape=spec.decay_shape,
        )

    return lr_at
