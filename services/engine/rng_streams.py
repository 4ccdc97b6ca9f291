"""A process's random streams as plain tensors, for the training loop's checkpoint state.

Python ``random``, NumPy's global generator, torch's CPU generator and (when CUDA is in
use) the current CUDA device's. Every value is a tensor, so a checkpoint that holds them
loads with ``weights_only=True``: nothing is pickled. Layout of :func:`capture`:

    torch         uint8 [N]   torch.get_rng_state()
    cuda          uint8 [M]   torch.cuda.get_rng_state() (only when CUDA is initialised)
    numpy_words   int64 [624] MT19937 key (uint32 values)
    numpy_pos     int64 [2]   position, has_gauss
    numpy_gauss   float64 [1] cached gaussian
    python_words  int64 [625] random.getstate()[1] (624 words + index)
    python_gauss  float64 [2] has a cached gaussian, its value

Helper of the training loop (L2-1), like ``lr_schedule.py``: no module of its own.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed(job_seed: int, rank: int) -> None:
    """Seed every stream from (job seed, rank): each rank draws its own stream, and a rerun
    of the job draws the same one."""
    s = int(np.random.SeedSequence([job_seed, rank]).generate_state(1, np.uint32)[0])
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)  # CPU and every CUDA device


def capture() -> dict[str, torch.Tensor]:
    """The streams now (see the module docstring for the layout)."""
    version, words, gauss = random.getstate()
    assert version == 3, f"random.getstate() version {version}"
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    assert kind == "MT19937", kind
    state = {
        "torch": torch.get_rng_state(),
        "numpy_words": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "python_words": torch.tensor(words, dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`capture` took (tensors as loaded from a checkpoint)."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))
    pos, has_gauss = (int(v) for v in state["numpy_pos"].tolist())
    words = state["numpy_words"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", words, pos, has_gauss, float(state["numpy_gauss"][0])))
    has, value = state["python_gauss"].tolist()
    random.setstate((3, tuple(int(w) for w in state["python_words"].tolist()), value if has else None))
