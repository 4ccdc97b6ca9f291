"""Where Surge keeps its files. Everything lives under SURGE_HOME (default ./.surge)."""

from __future__ import annotations

import os
from pathlib import Path


def surge_home() -> Path:
    return Path(os.environ.get("SURGE_HOME", ".surge")).resolve()


def datasets_root() -> Path:
    return Path(os.environ.get("SURGE_DATA_ROOT", surge_home() / "datasets")).resolve()


def store_root() -> Path:
    return Path(os.environ.get("SURGE_STORE_ROOT", surge_home() / "store")).resolve()


def run_dir() -> Path:
    return surge_home() / "run"
