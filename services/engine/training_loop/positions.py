"""What a checkpoint's data position means: ``DATA_ORDER`` (what must not change for it to
resume exactly), its formats, a mixture's digest, and the position's fixed-width encoding
(package docstring, "Exact resume")."""

from __future__ import annotations

import hashlib

from services.jobspec import JobSpec

# What the checkpoint's data position depends on (LoopState ``data_order``), in this order:
# a resume that changes one of them would not continue the same global sample sequence. The
# dp size may change (the global batch split another way: batch_packer.py's deal).
DATA_ORDER = (
    "data.shuffle_seed",
    "data.shuffle",
    "data.seq_len",
    "data.pack",
    "global batch rows (data.micro_batch_size x data.grad_accum x parallel.dp)",
    "data position format",
    "data.mixture",  # (after the format: a checkpoint without it read a single dataset, 0)
)


# The format of ``data_position`` (the last value of ``data_order``; a checkpoint whose
# data_order has no such value is format 1).
DATA_FORMATS = {
    1: "[epoch, document, offset] of the epoch's document order",
    2: "[epoch, row] of the epoch's ordered packed rows",
}


DATA_FORMAT = 2


# A mixture's position format (services/data/blend.py FORMAT): [0, blended row].
MIXTURE_FORMAT = "mix-v1"


_FORMAT_AT = DATA_ORDER.index("data position format")


def mixture_id(spec: JobSpec) -> int:
    """0 for one dataset; for a mixture a 63-bit digest of its datasets and normalised
    weights (what its blended rows mean)."""
    d = spec.data
    if d.mixture is None:
        return 0
    total = sum(w for *_, w in d.datasets)
    text = ";".join(f"{n}@{v}={w / total!r}" for n, v, w in d.datasets)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def data_order(spec: JobSpec, dp_size: int) -> tuple[int, ...]:
    """The values of :data:`DATA_ORDER` for ``spec`` at ``dp_size`` (data.pack: 1 pack, 0 pad)."""
    d = spec.data
    rows = d.micro_batch_size * d.grad_accum * dp_size
    return d.shuffle_seed, int(d.shuffle), d.seq_len, int(d.pack == "pack"), rows, DATA_FORMAT, mixture_id(spec)


def data_format(loaded: tuple[int, ...] | None) -> int:
    """The data position format a checkpoint's ``data_order`` names (1 when it names none)."""
    return loaded[_FORMAT_AT] if loaded and len(loaded) > _FORMAT_AT else 1


def data_order_changes(loaded: tuple[int, ...] | None, now: tuple[int, ...]) -> str:
    """The empty string when a checkpoint's data order is this job's; else one line naming
    each field that changed, its value then and now."""
    loaded = tuple(loaded or ())[: len(now)]
    if len(loaded) == _FORMAT_AT + 1:  # written before data.mixture: one dataset
        loaded = (*loaded, 0)
    loaded = loaded + (None,) * (len(now) - len(loaded))
    return "; ".join(
        f"{name} {_shown(name, a)} (this job: {_shown(name, b)})"
        for name, a, b in zip(DATA_ORDER, loaded, now, strict=True)
        if a != b
    )


def _shown(name: str, value: int | None) -> object:
    if value is None:
        return "(none)"
    if name == "data.shuffle":
        return bool(value)
    if name == "data.pack":
        return "pack" if value else "pad"
    if name == "data.mixture":
        return f"mixture {value:016x}" if value else "one dataset"
    return value


POSITION_FORMAT_BYTES = 16  # room for a sample-sequence format's name in data_position


def _format_bytes(fmt: str) -> bytes:
    raw = fmt.encode("utf-8")
    if len(raw) > POSITION_FORMAT_BYTES:
        raise ValueError(f"data position format {fmt!r}: longer than {POSITION_FORMAT_BYTES} bytes")
    return raw.ljust(POSITION_FORMAT_BYTES, b"\0")
