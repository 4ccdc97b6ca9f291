"""The static half of the law: import-linter contracts (`make lint`) hold for the tree, and
a deliberately planted upward import makes them fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT, "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=150,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "services", tmp_path / "services", ignore=shutil.ignore_patterns("__pycache__", "gen"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_import_contract(tree_copy: Path):
    r = _lint(tree_copy)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "BROKEN" not in r.stdout


def test_a_planted_upward_import_from_compute_into_control_fails_lint(tree_copy: Path):
    (tree_copy / "services" / "compute" / "planted.py").write_text("import services.control.orchestrator\n")
    r = _lint(tree_copy)
    assert r.returncode != 0
    assert "L1 control above L2 engine above L3 compute BROKEN" in r.stdout
    assert "services.compute.planted -> services.control.orchestrator" in r.stdout


def test_a_planted_import_of_the_data_service_from_the_engine_fails_lint(tree_copy: Path):
    (tree_copy / "services" / "engine" / "planted.py").write_text("from services.data import shuffler\n")
    r = _lint(tree_copy)
    assert r.returncode != 0
    assert "L4 data and L5 store are reached only through the contract BROKEN" in r.stdout
