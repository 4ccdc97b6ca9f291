"""Resize in place (issue 16): a running job changes its data-parallel size without restarting
the ranks that stay. Shrink on a lost rank (L1-2's rendezvous names the smaller layout),
scale up and down by command (pause, ``ResumeTraining(rebuild=True)``); the kept ranks keep
their processes, new ranks heal from a live peer, and the job reads the same global sample
sequence as a run nobody resized: every step's 12 rows, none repeated or skipped.

Real gloo processes wired by the real rank composition root (tests/engine/resize_rank_main.py),
forked with torch and the rank's modules imported (tests/rank_forks.py); the test plays L1 (the
rendezvous, the launches, the kills).

Losses and weights are compared with the uninterrupted run at dp 3 within a tolerance, not
bit for bit: after the resize the same rows are summed in another order (another dp split,
another accumulation count, the bucket order of a fresh DDP wrapper), which moves float32
sums by a few ulps a step (the steps before it, at the uninterrupted run's layout, are
compared bit for bit). Measured here: final weights within 6e-7 (the scale-up run, at dp 2
for 4 steps), losses within 4e-8 relative; the bounds (weights 1e-5, losses 1e-5 relative)
leave a margin of 20x and more for other machines' summation orders. A repeated, skipped
or wrong row is caught by the row check, which is exact.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_fakes import GlobalRowData, corpus_bytes, free_port, tiny_spec
from rank_fakes import finish_processes as _finish

from tests.rank_forks import RankProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAIN = HERE / "resize_rank_main.py"
STEPS, KILL_AFTER, PAUSE_AT, ROWS_PER_STEP = 8, 4, 4, 12
WEIGHTS_TOL, LOSS_RTOL = 1e-5, 1e-5  # (module docstring)


def _start(scenario: str, role: str, rank: int, port: int, out: Path) -> RankProcess:
    """A rank process, forked with torch and the rank's modules imported (tests/rank_forks.py);
    its output goes to a file (a pipe nobody reads while it runs could fill)."""
    argv = [scenario, role, str(rank), str(port), str(out)]
    return RankProcess(MAIN, argv, out / f"{role}-{rank}.log", REPO, dict(os.environ))


def _wait_for(path: Path, procs: list[RankProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p.args[2:4] for p in procs if p.poll() is not None]  # (role, rank)
        assert not dead and time.monotonic() < deadline, f"no {path.name}; exited: {dead}"
        time.sleep(0.05)


def _rendezvous(out: Path, reason: str) -> int:
    """L1-2: the rendezvous of the resized group (rank 0 hosts it), to the ranks that stay."""
    port = free_port()
    (out / "rendezvous.json").write_text(json.dumps({"port": port, "reason": reason}))
    return port


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def _global_rows() -> list[np.ndarray]:
    """The input rows of each step of the job's one global order (what every layout reads)."""
    data = GlobalRowData(lambda *a: None, lambda *a: None, corpus_bytes(), train_batches=0)
    seed, T = tiny_spec().data.shuffle_seed, tiny_spec().data.seq_len
    return [
        np.stack([data.row(seed, 0, r, T)[:-1] for r in range(s * ROWS_PER_STEP, (s + 1) * ROWS_PER_STEP)])
        for s in range(STEPS)
    ]


def _assert_global_sequence(records: list[dict]) -> None:
    """Every step's rows, over the ranks that trained it, are that step's global batch: each
    row once, none of another step's."""
    expected = _global_rows()
    for step in range(1, STEPS + 1):
        got = [r["rows"][step] for r in records if step in r["rows"]]
        rows = sorted(bytes(row.numpy().astype(np.int64)) for part in got for row in part)
        want = sorted(bytes(row.astype(np.int64)) for row in expected[step - 1])
        assert rows == want, f"step {step}: {len(rows)} rows trained, {len(set(rows) & set(want))} of its 12"


def _assert_close_to(uninterrupted: dict, kept: dict, *, same_before: int) -> str:
    """Losses and final weights of ``kept`` against the uninterrupted run (module docstring);
    the first ``same_before`` steps ran at the same layout as it: bit for bit. Returns the
    largest differences, as a line."""
    assert kept["steps"] == list(range(1, STEPS + 1))
    assert kept["losses"][:same_before] == uninterrupted["losses"][:same_before]
    np.testing.assert_allclose(kept["losses"], uninterrupted["losses"], rtol=LOSS_RTOL, atol=0)
    expected = uninterrupted["state"]
    worst = max((kept["state"][k] - expected[k]).abs().max().item() for k in expected)
    assert worst < WEIGHTS_TOL, worst
    losses = np.abs(np.array(kept["losses"]) / np.array(uninterrupted["losses"]) - 1).max()
    return f"max |param - uninterrupted| {worst:.2e}, max relative loss difference {losses:.2e}"


def _figures(outputs: list[str]) -> list[str]:
    log = "\n".join(outputs)
    return re.findall(r"(?:group_rebuilt |state_healed|group_rebuilt_and_healed|layout_taken).*", log)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The ranks' records of the run nobody resizes (dp 3 x micro_batch_size 2 x grad_accum 2)."""
    out = tmp_path_factory.mktemp("plain")
    port = free_port()
    plain = [_start("shrink", "plain", r, port, out) for r in range(3)]
    outputs = _finish(plain, timeout=150)
    assert [p.returncode for p in plain] == [0] * 3, "\n".join(o[-2000:] for o in outputs)
    records = [_load(out, f"plain-{r}") for r in range(3)]
    _assert_global_sequence(records)  # (the fake's deal itself)
    return records


@pytest.mark.timeout(300)
def test_a_lost_rank_shrinks_the_job_to_dp_2_on_the_same_global_batches(uninterrupted, tmp_path):
    port = free_port()
    procs = [_start("shrink", "victim" if r == 2 else "survivor", r, port, tmp_path) for r in range(3)]
    try:
        procs[2].wait(timeout=150)
        assert procs[2].returncode == -9, _finish([procs[2]], 1)[0][-2000:]
        _rendezvous(tmp_path, "rank 2 lost, no replacement: shrink to dp 2")
        outputs = _finish(procs[:2], timeout=150)
    finally:
        _finish(procs, timeout=0)
    assert [p.returncode for p in procs[:2]] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    survivors = [_load(tmp_path, f"survivor-{r}") for r in range(2)]
    _assert_global_sequence([*survivors, _load(tmp_path, "victim-2")])
    worst = _assert_close_to(uninterrupted[0], survivors[0], same_before=KILL_AFTER)
    for r, s in enumerate(survivors):
        assert s["layout"] == (2, 2, 3) and s["world_sizes"] == [3] * KILL_AFTER + [2] * (STEPS - KILL_AFTER)
        (start, _, _, _, _), (restart, healed, source, generation, _) = s["started"]
        assert (start, restart, healed, source, generation) == (0, KILL_AFTER, True, 0, 1)
        assert s["topology_errors"] == 1  # a broken group: the fault is reported
        # The stream reopened at the global position after step 4 (4 x 12 rows), dealt at dp 2.
        assert s["opened"][-1] == ("train", KILL_AFTER * ROWS_PER_STEP, r, 2, 2)
        assert s["data_order"][4] == ROWS_PER_STEP  # a checkpoint now resumes at any layout
        assert s["state"].keys() == survivors[0]["state"].keys()
        assert all(torch.equal(s["state"][k], survivors[0]["state"][k]) for k in s["state"])
    print(f"shrink: {worst}", *_figures(outputs), sep="\n")


@pytest.mark.timeout(300)
def test_an_operator_scales_dp_2_to_3_and_the_new_rank_heals_from_a_live_peer(uninterrupted, tmp_path):
    port = free_port()
    kept = [_start("up", "kept", r, port, tmp_path) for r in range(2)]
    procs = list(kept)
    try:
        for r in range(2):
            _wait_for(tmp_path / f"paused-{r}", kept, timeout=150)
        pids = [p.pid for p in kept]
        t0 = time.monotonic()
        # L1: the new rank is launched at the new size on the new rendezvous, with the resized
        # spec and heal_from_peer; the kept ranks get the rendezvous and ResumeTraining(rebuild).
        new_port = _rendezvous(tmp_path, "scale by the operator: dp 2 -> 3")
        procs.append(_start("up", "new", 2, new_port, tmp_path))
        outputs = _finish(procs, timeout=150)
        scale_s = time.monotonic() - t0
    finally:
        _finish(procs, timeout=0)
    assert [p.returncode for p in procs] == [0] * 3, "\n".join(o[-3000:] for o in outputs)
    assert [p.pid for p in kept] == pids
    records = [_load(tmp_path, f"kept-{r}") for r in range(2)] + [_load(tmp_path, "new-2")]
    _assert_global_sequence(records)
    worst = _assert_close_to(uninterrupted[0], records[0], same_before=0)
    new = records[2]
    for r, rec in enumerate(records):
        assert rec["layout"] == (3, 2, 2)
        assert all(torch.equal(rec["state"][k], records[0]["state"][k]) for k in rec["state"]), f"rank {r}"
        assert rec["opened"][-1] == ("train", PAUSE_AT * ROWS_PER_STEP, r, 3, 2)
    for rec in records[:2]:
        assert rec["world_sizes"] == [2] * PAUSE_AT + [3] * (STEPS - PAUSE_AT)
        assert [m[:4] for m in rec["started"]] == [(0, False, 0, 0), (PAUSE_AT, True, 0, 1)]
        assert rec["topology_errors"] == 0  # a commanded resize is no fault
        # A survivor keeps its own RNG streams through the rebuild and the heal.
        assert _differing(rec["rng_paused"], rec["rng_restarted"]) == []
    # The new rank: healed from rank 0 at step 4; its RNG streams are a fresh rank 2's, those
    # the uninterrupted run's rank 2 had when it started (seeded from (job seed, rank 2), then
    # the model's construction draws), not its source's.
    assert [m[:3] for m in new["started"]] == [(PAUSE_AT, True, 0)]
    assert new["steps"] == list(range(PAUSE_AT + 1, STEPS + 1)) and new["losses"] == records[0]["losses"][PAUSE_AT:]
    assert _differing(new["rng_restarted"], uninterrupted[2]["rng_restarted"]) == []
    assert _differing(new["rng_restarted"], records[0]["rng_restarted"]) != []
    print(
        f"scale up: {worst}; {scale_s:.1f} s from the rendezvous to the end",
        *_figures(outputs),
        sep="\n",
    )


@pytest.mark.timeout(300)
def test_an_operator_scales_dp_3_to_2_and_the_kept_ranks_keep_their_processes(uninterrupted, tmp_path):
    port = free_port()
    procs = [_start("down", "kept", r, port, tmp_path) for r in range(3)]
    try:
        for r in range(3):
            _wait_for(tmp_path / f"paused-{r}", procs, timeout=150)
        # L1: rank 2 (>= the new size) is released, the others rebuild at dp 2.
        procs[2].kill()
        procs[2].wait()
        _rendezvous(tmp_path, "scale by the operator: dp 3 -> 2")
        outputs = _finish(procs[:2], timeout=150)
    finally:
        _finish(procs, timeout=0)
    assert [p.returncode for p in procs[:2]] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    records = [_load(tmp_path, f"kept-{r}") for r in range(2)]
    released = _load(tmp_path, "kept-2")
    assert released["steps"] == list(range(1, PAUSE_AT + 1))
    _assert_global_sequence([*records, released])
    worst = _assert_close_to(uninterrupted[0], records[0], same_before=PAUSE_AT)
    for r, rec in enumerate(records):
        assert rec["layout"] == (2, 3, 2) and rec["world_sizes"] == [3] * PAUSE_AT + [2] * (STEPS - PAUSE_AT)
        assert [m[:4] for m in rec["started"]] == [(0, False, 0, 0), (PAUSE_AT, True, 0, 1)]
        assert rec["topology_errors"] == 0
        assert rec["opened"][-1] == ("train", PAUSE_AT * ROWS_PER_STEP, r, 2, 3)
        assert _differing(rec["rng_paused"], rec["rng_restarted"]) == []
        assert all(torch.equal(rec["state"][k], records[0]["state"][k]) for k in rec["state"])
    print(f"scale down: {worst}", *_figures(outputs), sep="\n")


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The RNG streams (capture keys) in which ``a`` and ``b`` differ."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
