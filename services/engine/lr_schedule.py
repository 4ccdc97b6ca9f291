"""Learning-rate schedule: a pure function of the step, owned by the training loop (L2-1).

Linear warmup from 0 to ``lr`` over ``warmup_steps`` updates, then half-cosine decay to
``min_lr_ratio * lr`` at the last step. Sources: warmup + cosine decay to 10% of the peak
as in GPT-3 (Brown et al. 2020, appendix B) and Chinchilla (Hoffmann et al. 2022); the
cosine shape from SGDR (Loshchilov & Hutter 2017) without restarts; same formula as
nanoGPT's ``get_lr``.

Steps are 1-based: step 1 is the first optimizer update, so the first update already
uses a non-zero rate (``lr / warmup_steps``) and step ``warmup_steps`` uses the peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from services.jobspec import OptimizerSpec


def learning_rate(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    schedule: str = "cosine",
) -> float:
    """The learning rate of optimizer update ``step`` (1-based).

    Raises:
        ValueError: step < 1, total_steps < 1, or an unknown schedule.
    """
    if step < 1:
        raise ValueError(f"learning_rate: step must be >= 1, got {step}")
    if total_steps < 1:
        raise ValueError(f"learning_rate: total_steps must be >= 1, got {total_steps}")
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"learning_rate: schedule must be 'cosine' or 'constant', got {schedule!r}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    min_lr = lr * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
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
        )

    return lr_at
