"""L1-2's memory quota enforced in the rank (services/engine/memory_quota.py), through a
stand-in at the torch.cuda boundary: no GPU here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.engine.memory_quota import apply_memory_quota

GIB = 1 << 30


class FakeCuda:
    """torch.cuda's two calls the quota makes: device properties, and the fraction set."""

    def __init__(self, total_bytes: int):
        self.total = total_bytes
        self.calls: list[tuple[float, int]] = []

    def get_device_properties(self, device: int):
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.calls.append((fraction, device))


@pytest.mark.parametrize(
    ("quota", "total", "fraction"),
    [
        (40 * GIB, 80 * GIB, 0.5),  # a quota below the device: half of it
        (141 * GIB, 141 * GIB, 1.0),  # the whole device (L1-2's quota on CUDA today)
        (81 * GIB, 80 * GIB, 1.0),  # registered a little larger than torch sees: never above 1
    ],
)
def test_the_quota_becomes_the_per_process_memory_fraction_of_the_device(quota, total, fraction):
    cuda = FakeCuda(total)
    assert apply_memory_quota(quota, 1, cuda=cuda) == pytest.approx(fraction)
    assert cuda.calls == [(pytest.approx(fraction), 1)]


def test_no_quota_sets_nothing():
    cuda = FakeCuda(80 * GIB)
    assert apply_memory_quota(0, 0, cuda=cuda) is None
    assert cuda.calls == []
