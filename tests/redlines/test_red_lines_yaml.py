"""services/contract/red_lines.yaml covers every red line of all 20 modules (Issue 3, part 6).

Each ❌ item of the seed's section 6 maps to a test that exists or to a structural reason.
Against the seed itself when it is beside the repository (``../shared/seeds``, as the README
says); otherwise against the per-module counts transcribed below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from services.contract import Module

from .wiring import MODULES, REPO

RED_LINES = REPO / "services" / "contract" / "red_lines.yaml"
SEEDS = REPO.parent / "shared" / "seeds"
SEED_TEXT = SEEDS / "000_82d85e39cfc38fe1.txt"
SEED_ROUTES = SEEDS / "seed_routes.yaml"

# ❌ items per module in seed 000 section 6 (used when the seed is not beside the repo).
COUNTS = {
    "L1-1": 5,
    "L1-2": 5,
    "L1-3": 5,
    "L1-4": 4,
    "L2-1": 4,
    "L2-2": 3,
    "L2-3": 3,
    "L2-4": 6,
    "L3-1": 6,
    "L3-2": 6,
    "L3-3": 6,
    "L3-4": 6,
    "L3-5": 6,
    "L4-1": 6,
    "L4-2": 6,
    "L4-3": 6,
    "L4-4": 6,
    "L4-5": 5,
    "L5-1": 5,
    "L5-2": 5,
}
KEYS = {"text", "text_zh", "seed_line", "test", "structural", "note"}


def module_of(seed_id: str) -> int:
    """``"L2-3"`` -> ``Module.L2_OPTIMIZER`` (23)."""
    layer, index = seed_id[1:].split("-")
    return int(layer) * 10 + int(index)


@pytest.fixture(scope="module")
def table() -> dict:
    return yaml.safe_load(RED_LINES.read_text())


def entries(table):
    for seed_id, module in table.items():
        for i, line in enumerate(module["red_lines"]):
            yield seed_id, i, line


def test_every_module_of_the_seed_is_listed_with_every_red_line(table):
    assert list(table) == list(COUNTS)
    assert {seed_id: len(m["red_lines"]) for seed_id, m in table.items()} == COUNTS
    for seed_id, m in table.items():
        assert Path(MODULES[module_of(seed_id)][1]).stem == m["name"], seed_id


def test_every_red_line_maps_to_exactly_one_test_or_structural_reason(table):
    for seed_id, i, line in entries(table):
        where = f"{seed_id} red line {i + 1}"
        assert set(line) <= KEYS, where
        assert {"text", "text_zh", "seed_line"} <= set(line), where
        assert ("test" in line) != ("structural" in line), where
        reason = line.get("test") or line.get("structural")
        assert isinstance(reason, str) and len(reason.strip()) > 10, where


def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_cited_test_exists(table):
    missing = []
    for seed_id, i, line in entries(table):
        if "test" not in line:
            continue
        file, _, name = line["test"].partition("::")
        path = REPO / file
        if not path.is_file() or name not in _defined_tests(path) or not name.startswith("test_"):
            missing.append(f"{seed_id}#{i + 1}: {line['test']}")
    assert missing == []


def test_seed_lines_rise_through_the_seed_in_order(table):
    lines = [line["seed_line"] for _, _, line in entries(table)]
    assert lines == sorted(lines) and len(set(lines)) == len(lines) == sum(COUNTS.values())


@pytest.mark.skipif(not SEED_TEXT.is_file(), reason="the seed is not beside the repository")
def test_every_seed_line_is_its_red_line_in_the_seed(table):
    seed = SEED_TEXT.read_text().splitlines()
    crosses = [i + 1 for i, text in enumerate(seed) if text.startswith("❌")]
    assert [line["seed_line"] for _, _, line in entries(table)] == crosses
    for seed_id, i, line in entries(table):
        assert seed[line["seed_line"] - 1][1:].strip() == line["text_zh"].strip(), f"{seed_id}#{i + 1}"


@pytest.mark.skipif(not SEED_ROUTES.is_file(), reason="the seed transcription is not beside the repository")
def test_every_text_is_the_transcriptions_red_line(table):
    routes = yaml.safe_load(SEED_ROUTES.read_text())
    for seed_id, m in table.items():
        assert [line["text"] for line in m["red_lines"]] == routes[seed_id]["red_lines"], seed_id
        assert [line["text_zh"] for line in m["red_lines"]] == routes[seed_id]["red_lines_zh"], seed_id
        assert m["name"] == routes[seed_id]["name_en"], seed_id


def test_the_red_line_table_names_each_module_the_route_table_knows(table):
    assert {module_of(s) for s in table} == set(MODULES) == {v for v in Module.values() if 10 < v < 60}
