"""Rank log tails of node agents that share one run dir (the local stack): a rank that
moved from one agent to the other appends to the same file, and each agent sends only the
spans its own launches wrote, so `surgectl logs` prints every line once. Spans name their
file by inode, so a tail reads across a rotation (``rank_logs.py``)."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import pytest
import structlog

from services.contract import control_pb2
from services.worker.log_tail import LogTailer

pytestmark = pytest.mark.timeout(30)


class Agent:
    """One node agent's tailer over the shared ``logs`` dir, with the spans it launched."""

    def __init__(self, logs, name: str, out: queue.Queue):
        self.name = name
        self.spans: dict[int, list[tuple[int, int, int | None]]] = {}
        self.running: set[int] = set()
        self.lock = threading.Lock()
        self.tailer = LogTailer(
            logs, lambda ev: out.put((name, ev.rank_log_lines)), structlog.get_logger(), self._spans, self._alive
        )

    def _spans(self, job_id: str) -> dict[int, list[tuple[int, int, int | None]]]:
        with self.lock:
            return {r: list(s) for r, s in self.spans.items()}

    def _alive(self, job_id: str, rank: int) -> bool:
        with self.lock:
            return rank in self.running


def ino(path: Path) -> int:
    return os.stat(path).st_ino


def answers(out: queue.Queue, agents: int) -> dict[str, list[str]]:
    """Lines each agent sent until all of them said done."""
    got: dict[str, list[str]] = {}
    done = 0
    while done < agents:
        name, batch = out.get(timeout=10)
        got.setdefault(name, [])
        if batch.done:
            done += 1
        else:
            got[name].extend(batch.lines)
    return got


def test_a_rank_that_moved_between_agents_sharing_a_dir_is_sent_once(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "j.rank0.log"
    out: queue.Queue = queue.Queue()
    a, b = Agent(logs, "a", out), Agent(logs, "b", out)
    log.write_text("a1\na2\n")  # rank 0 ran on agent a, then was lost
    a.spans[0] = [(ino(log), 0, log.stat().st_size)]
    with open(log, "a") as f:  # relaunched on agent b: appends to the same file
        f.write("b1\nb2\n")
    b.spans[0] = [(ino(log), len("a1\na2\n"), None)]
    b.running.add(0)
    for agent in (a, b):
        agent.tailer.tail(control_pb2.TailRankLogs(request_id="r1", job_id="j", follow=False, rank=-1))
    got = answers(out, 2)
    assert got == {"a": ["a1", "a2"], "b": ["b1", "b2"]}


def test_a_followed_tail_reads_its_spans_around_another_agents_and_ends_with_its_rank(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "j.rank0.log"
    out: queue.Queue = queue.Queue()
    a = Agent(logs, "a", out)
    log.write_text("a1\n")
    a.spans[0] = [(ino(log), 0, 3)]
    with open(log, "a") as f:
        f.write("other1\nother2\n")  # another agent's process of rank 0
    a.spans[0].append((ino(log), log.stat().st_size, None))  # back on agent a
    a.running.add(0)
    a.tailer.tail(control_pb2.TailRankLogs(request_id="r2", job_id="j", follow=True, rank=0))
    with open(log, "a") as f:
        f.write("a2\na3 without newline")
    end = log.stat().st_size
    with a.lock:  # the rank exits: its span ends, then it is no longer alive
        a.spans[0][-1] = (*a.spans[0][-1][:2], end)
        a.running.clear()
    assert answers(out, 1) == {"a": ["a1", "a2", "a3 without newline"]}
