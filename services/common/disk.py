"""Durability helpers shared by the rank's chunk writer (services/state/chunk_store.py) and
the store's checkpoint manager."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def syncfs(path: Path) -> bool:
    """``syncfs(2)`` of the filesystem holding ``path``: every dirty page and inode on it
    reaches the disk. False where the C library has no syncfs (then the caller fsyncs)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return fn(fd) == 0
    finally:
        os.close(fd)
