"""Kernel cpulists ("0-3,8,10-11"): how sysfs writes a device's local CPUs and how the node
agent hands a rank its CPUs (``SURGE_CPU_AFFINITY``); both programs read and write them."""

from __future__ import annotations

CPU_AFFINITY_ENV = "SURGE_CPU_AFFINITY"  # a rank's CPUs, set by its node agent, applied by the rank


def parse_cpu_list(text: str) -> list[int]:
    """A kernel cpulist ("0-3,8,10-11") as sorted CPU numbers.

    Raises:
        ValueError: not a cpulist."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"not a cpulist: {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int] | tuple[int, ...]) -> str:
    """Sorted CPU numbers as a kernel cpulist ([0, 1, 2, 3, 8] -> "0-3,8")."""
    runs: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
