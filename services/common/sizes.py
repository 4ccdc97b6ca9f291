"""Byte counts as people read them (events, tables): decimal units, two significant places."""

from __future__ import annotations

_UNITS = ("KB", "MB", "GB", "TB", "PB")


def size_text(n: int | float) -> str:
    """``n`` bytes as "512 B", "120 KB", "1.4 MB", "23 GB" (powers of 1000; one decimal
    below 10 of a unit)."""
    n = float(n)
    if n < 1000:
        return f"{int(n)} B"
    for unit in _UNITS:
        n /= 1000
        if n < 999.5 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}" if n < 9.95 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def human_bytes(n: float) -> str:
    """E.g. "512 B", "1.5 MiB": binary units, one decimal (memory and free space)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
