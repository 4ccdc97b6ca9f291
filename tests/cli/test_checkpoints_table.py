"""`surgectl checkpoints JOB`'s table: each version's kind (baseline, delta, or full: plain
files) and what its save wrote next to its whole size, readable at 80-100 columns."""

from __future__ import annotations

import pytest
from rich.console import Console

from services.cli.render import checkpoints_table
from services.contract import store_pb2

pytestmark = pytest.mark.timeout(30)

JOB = "tiny-llm-3f2a1c"


def info(n: int, step: int, **kw) -> store_pb2.CheckpointInfo:
    return store_pb2.CheckpointInfo(
        version=f"{JOB}:{n}",
        job_id=JOB,
        parent=f"{JOB}:{n - 1}" if n > 1 else "",
        step=step,
        files=88,
        manifest_sha256="ab" * 32,
        **kw,
    )


def rendered(infos, width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(checkpoints_table(infos))
    return console.export_text().splitlines()


def test_each_version_shows_its_kind_and_the_bytes_its_save_wrote_within_90_columns():
    chunks = f"/store/{JOB}/chunks/1"
    infos = [
        info(1, 40, bytes=1_466_208, written_bytes=1_466_208, baseline=True, chunk_path=chunks),
        info(2, 80, bytes=1_466_208, written_bytes=122_880, chunk_path=chunks),
        info(3, 120, bytes=25 * 2**20),  # a version of plain files: all of it was written
    ]
    lines = rendered(infos, width=200)
    assert max(len(line) for line in lines) <= 90, "\n".join(lines)
    header = next(line for line in lines if "version" in line)
    cells = [c.split() for c in header.split("┃")[1:-1]]
    assert cells == [["version"], ["parent"], ["step"], ["kind"], ["MiB"], ["written", "MiB"], ["sha256"]]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in lines if JOB in line}
    assert rows[f"{JOB}:1"] == ["—", "40", "baseline", "1.40", "1.40", "abababababab"]
    assert rows[f"{JOB}:2"] == ["1", "80", "delta", "1.40", "0.12", "abababababab"]
    assert rows[f"{JOB}:3"] == ["2", "120", "full", "25.0", "25.0", "abababababab"]
    # At 80 columns nothing is cut: the version stays whole (it is what `resume --from` takes).
    narrow = rendered(infos, width=80)
    assert any(f"{JOB}:2" in line for line in narrow), "\n".join(narrow)
