"""The store's chart reads resumed between calls (services/store/metric_scans.py): each answer
is the answer a fresh scan of the job's files gives, after appends (a partial last line, a
replay after a rollback), a rotation, and with a type filter; only the new bytes are read."""

from __future__ import annotations

import os

from services.common.metric_select import Selection, select
from services.common.rotated_files import rotated_paths
from services.store import metric_files
from services.store.metric_scans import ChartScans
from tests.store.test_metric_select import job_text, step_line


def fresh(files, sel: Selection) -> bytes:
    return b"".join(select(metric_files.lines(files, sel.record_type), sel))


def test_a_resumed_chart_read_answers_what_a_fresh_scan_answers_after_appends_replays_and_rotations(
    tmp_path, monkeypatch
):
    path = tmp_path / "j.jsonl"
    path.write_text(job_text(3000, 3))
    scans = ChartScans()
    sel = Selection(ranks=frozenset({0, 2}), points=200)
    assert b"".join(scans.read("j", rotated_paths(path), sel)) == fresh(rotated_paths(path), sel)

    read_from: list[int] = []
    monkeypatch.setattr("services.store.metric_scans._feed", _spy(read_from))
    with open(path, "a") as f:  # more steps, a replay from 2500, and a line still being written
        f.write("".join(step_line(r, s, loss=2.0) for s in range(3001, 3200) for r in range(3)))
        f.write("".join(step_line(r, s, loss=30.0 if s == 2550 else 1.5) for s in range(2500, 2600) for r in range(3)))
        f.write(step_line(0, 2600)[:40])
    size_before = os.path.getsize(path) - 40
    got = b"".join(scans.read("j", rotated_paths(path), sel))
    assert read_from and min(read_from) > 0  # resumed, not read from the start
    assert got == fresh(rotated_paths(path), sel)
    assert b'"step":2550,"loss":30.0' in got and b'"step":3100' not in got  # (the replay's spike; 3100 replayed away)
    with open(path, "a") as f:
        f.write(step_line(0, 2600)[40:])
    assert b"".join(scans.read("j", rotated_paths(path), sel)) == fresh(rotated_paths(path), sel)
    assert max(read_from) >= size_before

    os.rename(path, tmp_path / "j.jsonl.1")  # rotated: a new newest file
    path.write_text("".join(step_line(r, s) for s in range(2600, 2700) for r in range(3)))
    assert b"".join(scans.read("j", rotated_paths(path), sel)) == fresh(rotated_paths(path), sel)

    evals = Selection("eval", frozenset({1}), 200)
    assert b"".join(scans.read("j", rotated_paths(path), evals)) == fresh(rotated_paths(path), evals)
    assert fresh(rotated_paths(path), evals).count(b"\n") == 3  # (steps 1000, 2000, 3000 of rank 1)


def _spy(offsets: list[int]):
    from services.store import metric_scans

    real = metric_scans._feed

    def feed(selector, path, offset):
        if path.name == "j.jsonl":
            offsets.append(offset)
        return real(selector, path, offset)

    return feed
