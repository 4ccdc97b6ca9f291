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
    assert cells == [["version"], ["parent"], ["step"], ["kind"], ["size"], ["written"], ["fmt"], ["sha256"]]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in lines if JOB in line}
    assert rows[f"{JOB}:1"] == ["—", "40", "baseline", "1.5 MB", "1.5 MB", "1", "abababababab"]
    assert rows[f"{JOB}:2"] == ["1", "80", "delta", "1.5 MB", "123 KB", "1", "abababababab"]
    assert rows[f"{JOB}:3"] == ["2", "120", "full", "26 MB", "26 MB", "1", "abababababab"]
    # At 80 columns nothing is cut: the version stays whole (it is what `resume --from` takes).
    narrow = rendered(infos, width=80)
    assert any(f"{JOB}:2" in line for line in narrow), "\n".join(narrow)


def test_the_table_and_the_checkpoint_event_say_a_versions_sizes_in_one_unit(tmp_path):
    """One committed delta (the real store manager and chunk writer): the table's size and
    written cells are the very words of control's checkpoint event, and it writes less than
    its whole."""
    from services.control.orchestrator import checkpoint_text
    from services.store.checkpoint_manager import CheckpointManager
    from tests.store.test_chunked_versions import save

    manager = CheckpointManager(tmp_path)
    save(manager, "j", 1, every=3)
    _, done = save(manager, "j", 2, every=3)
    [listed] = [c for c in manager.checkpoint_query(store_pb2.CheckpointQuery(job_id="j")).checkpoints if c.step == 2]
    event = checkpoint_text(done)
    console = Console(width=200, record=True, color_system=None)
    console.print(checkpoints_table([listed]))
    row = next(line for line in console.export_text().splitlines() if "j:2" in line)
    size, written = (c.strip() for c in row.split("│")[5:7])
    assert 0 < done.written_bytes < done.bytes
    assert f"({size} total, {written} written (" in event and "% new), delta;" in event, (event, row)
