"""docs/permissions.md is generated from the proto route options and kept in sync (CI)."""

from __future__ import annotations

import subprocess
import sys

from services.contract import Module, route_pb2
from services.contract.permissions_doc import DOC, NOT_MAPPED, REPO, label, load_red_lines, render
from services.contract.route_table import Route, RouteTable


def test_the_committed_permissions_page_is_what_make_contracts_generates():
    r = subprocess.run(
        [sys.executable, "-m", "services.contract.permissions_doc", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_a_stale_page_fails_the_check_with_one_line(tmp_path):
    stale = tmp_path / "permissions.md"
    stale.write_text(DOC.read_text().replace("| S |", "| R |", 1))
    r = subprocess.run(
        [sys.executable, "-m", "services.contract.permissions_doc", "--check", "--out", str(stale)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == f"{stale} is stale: run `make contracts` and commit it"


def test_every_route_of_the_table_is_a_matrix_row_with_its_senders_and_receivers():
    table = RouteTable(
        {
            "surge.v1.A": Route(
                "surge.v1.A",
                frozenset({Module.L2_TRAINING_LOOP}),
                frozenset({Module.L2_OPTIMIZER}),
                1,
                "L2-1 s5 529",
                status=route_pb2.IMPLEMENTED,
            ),
            "surge.v1.B": Route(
                "surge.v1.B",
                frozenset({Module.L2_OPTIMIZER}),
                frozenset({Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER}),
                2,
                "a | note",
                status=route_pb2.DEFERRED,
                reason="not built | yet",
            ),
        }
    )
    page = render(table, red_lines={})
    header = next(line for line in page.splitlines() if line.startswith("| message | kind |"))
    assert header == "| message | kind | status | L2-1 | L2-3 |"  # only the modules the table names
    assert "| `A` | command | implemented | S | R |" in page
    assert "| `B` | event | deferred | R | SR |" in page
    assert "| `B` | deferred | not built \\| yet |" in page  # the reason, in the not-implemented list
    assert "| `A` | implemented |" not in page
    assert "| `A` | L2-1 | command | L2-1 s5 529 |" in page  # L2-3 receives A from L2-1
    assert "| `B` | L2-1, L2-3 | event | a \\| note |" in page  # a pipe in a seed note is escaped
    assert page == render(table, red_lines={})  # deterministic


def test_red_lines_render_with_their_test_or_structural_reason_and_missing_ones_say_so(tmp_path):
    f = tmp_path / "red_lines.yaml"
    f.write_text(
        "L4-3:\n"
        "  - red_line: Must not filter samples.\n"
        "    test: tests/redlines/test_x.py::test_the_shuffler_only_permutes\n"
        "  - red_line: Must not read upper-layer state.\n"
        "    structural: holds no port to any upper module\n"
        "  - Must not pad.\n"
    )
    lines = load_red_lines(f)
    table = RouteTable(
        {"surge.v1.A": Route("surge.v1.A", frozenset({Module.L4_SHUFFLER}), frozenset({Module.L4_FILTER}), 3, "")}
    )
    page = render(table, red_lines=lines)
    assert "1. Must not filter samples. — test: `tests/redlines/test_x.py::test_the_shuffler_only_permutes`" in page
    assert "2. Must not read upper-layer state. — structural: holds no port to any upper module" in page
    assert f"3. Must not pad. — *{NOT_MAPPED}*" in page
    shuffler_and_after = page.split(f"### {label(Module.L4_SHUFFLER)}")[1]
    filter_section = shuffler_and_after.split(f"### {label(Module.L4_FILTER)}")[1]
    assert f"**Red lines**\n\n{NOT_MAPPED}" in filter_section


def test_the_page_lists_the_run_time_violation_report_route():
    page = DOC.read_text()
    assert "| `BoundaryViolationReported` | event | implemented |" in page
    assert "| contract | `EXT_CONTRACT` |" in page
