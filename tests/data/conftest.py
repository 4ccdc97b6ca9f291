"""Fixtures for the data service: a tiny source tree and its prepared dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.data.prepare import prepare_dataset

from .helpers import NUM_FILES, file_text


@pytest.fixture
def source(tmp_path) -> Path:
    """40 .py files in two packages, plus things prepare must skip."""
    src = tmp_path / "src"
    for i in range(NUM_FILES):
        path = src / f"pkg{i % 2}" / f"mod_{i:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(file_text(i))
    (src / "pkg0" / "has_nul.py").write_bytes(b"x = 1\n\0\n" * 10)  # dropped by a banned-bytes rule
    (src / "pkg0" / "empty.py").write_bytes(b"")  # skipped: no token
    (src / "site-packages" / "third").mkdir(parents=True)
    (src / "site-packages" / "third" / "vendored.py").write_bytes(b"import os\n")  # excluded
    (src / "pkg1" / "notes.txt").write_bytes(b"not python\n")  # not matched by the glob
    return src


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "datasets"


@pytest.fixture
def dataset(source, root):
    """``tiny@v1`` prepared with the bytes tokenizer and 10 % held out."""
    return prepare_dataset(source, "tiny", "v1", root, val_fraction=0.1)
