"""Metrics and step summaries: the model's FLOPs per token (MFU), a step's line and a
mixture's line in the rank log, and when interval work is due."""

from __future__ import annotations

from services.contract import engine_pb2
from services.jobspec import JobSpec


def model_flops_per_token(spec: JobSpec, num_parameters: int) -> float:
    """Training FLOPs per token: 6N (forward + backward of every weight) plus attention,
    12 * n_layers * d_model * seq_len (PaLM, Chowdhery et al. 2022, appendix B)."""
    m = spec.model
    return 6.0 * num_parameters + 12.0 * m.n_layers * m.d_model * spec.data.seq_len


def step_line(done: engine_pb2.StepCompleted) -> str:
    """A step's line in the rank log: ``step 120 loss 2.3141 lr 2.9e-03 grad_norm 0.84 tok/s 12345``
    (the StepCompleted's values, rounded for reading; the store keeps them exact)."""
    line = (
        f"step {done.step} loss {done.loss:.4f} lr {done.learning_rate:.1e} "
        f"grad_norm {done.grad_norm:.4g} tok/s {done.tokens_per_second:.0f}"
    )
    return f"{line} skipped ({done.skip_reason})" if done.skipped else line


def mixture_line(step: int, components) -> str:
    """Where each dataset of a mixture stands after ``step``: rows taken, its own epoch/row."""
    return f"step {step} data mixture: " + ", ".join(
        f"{c.dataset} rows {c.rows} at {c.position.epoch}/{c.position.row}" for c in components
    )


def _due(step: int, every: int, at_end: bool) -> bool:
    return (every > 0 and step % every == 0) or at_end
