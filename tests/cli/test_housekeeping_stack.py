"""Housekeeping on a real stack (DP=1 jobs of a tiny model): a job looked up by name; `surgectl
delete` of a job, a checkpoint and a dataset through control, the store and the data service,
refused while in use; `surgectl logs` of a job of an earlier `up` after `down` and `up`.

The stack is the one the group cli-two-workers shares (tests/conftest.py STACK_GROUPS,
tests/shared_stacks.py), the last module on it: it deletes the dataset the others train on.
Every process is killed by PID when the group ends (running_stack)."""

from __future__ import annotations

import json
import time

import pytest

from services.contract import control_pb2
from tests.faults.test_recovery import cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
JobState = control_pb2.JobState

JOB = """\
name: {name}
steps: {steps}
seed: 0
model: {{n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}}
data: {{dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}}
parallel: {{dp: 1}}
optimizer: {{lr: 3.0e-3, warmup_steps: 1}}
checkpoint: {{every_steps: {every}, keep_last: 0}}
eval: {{every_steps: 0, batches: 1, at_end: false}}
"""


def one_line(r, code: int, *words: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its jobs:
    hkdone, hklive."""
    return shared_stack


def test_lookup_by_name_delete_refused_while_in_use_and_logs_of_an_earlier_session(stack):
    home = stack.home
    done = stack.submit(JOB.format(name="hkdone", steps=4, every=2))
    assert stack.events(done)[-1].status.outcome == control_pb2.FINISHED
    r = cli(home, "status", "hkdone", "-o", "json")  # by name
    assert r.returncode == 0 and done in r.stdout, r.stderr

    # A live job, paused (checkpointed at its boundary step): its newest version stays put.
    live = stack.submit(JOB.format(name="hklive", steps=100000, every=100000))
    stack.wait_step(live, 3)
    assert cli(home, "pause", "hklive").returncode == 0
    t0 = time.monotonic()
    while (s := stack.status(live)).state != JobState.PAUSED or not s.checkpoint_version:
        assert time.monotonic() - t0 < 60, f"{live} not paused with a checkpoint: {s}"
        time.sleep(0.1)
    newest = s.checkpoint_version
    one_line(cli(home, "delete", "job", "hklive"), 1, "PAUSED", "only an ended job")
    one_line(cli(home, "delete", "checkpoint", newest), 1, newest, "in use")
    one_line(cli(home, "delete", "dataset", "tiny@v1"), 1, "tiny@v1 is in use", live)
    assert cli(home, "stop", "hklive", "--no-checkpoint").returncode == 0
    assert stack.events(live)[-1].status.state == JobState.TERMINATED

    # The job ended: its newest version may go now; then the job's records.
    r = cli(home, "delete", "checkpoint", f"{done}:1")
    assert r.returncode == 0 and f"deleted checkpoint {done}:1" in r.stdout, r.stderr
    r = cli(home, "checkpoints", done, "-o", "json")
    assert r.returncode == 0 and [c["version"] for c in json.loads(r.stdout)] == [f"{done}:2"], r.stdout
    one_line(cli(home, "delete", "checkpoint", f"{done}:1"), 2, "not found")
    r = cli(home, "delete", "job", "hkdone")
    assert r.returncode == 0 and f"deleted job {done}" in r.stdout, r.stderr
    one_line(cli(home, "status", "hkdone"), 2, "no job 'hkdone'")

    # A new session: `logs` of the live job (its node agent is gone) prints its lines once.
    assert cli(home, "down").returncode == 0
    assert cli(home, "up", "--workers", str(stack.workers), env=stack.env).returncode == 0
    r = cli(home, "logs", "hklive", "-o", "json")
    assert r.returncode == 0, r.stderr
    on_disk = [line for line in (home / "run" / "logs" / f"{live}.rank0.log").read_text().splitlines() if line.strip()]
    assert on_disk and sorted(r.stdout.splitlines()) == sorted(on_disk)

    # No stream reads it any more and no live job names it: the dataset may go.
    r = cli(home, "delete", "dataset", "tiny@v1")
    assert r.returncode == 0 and "deleted dataset tiny@v1" in r.stdout, r.stderr
    assert not (home / "datasets" / "tiny" / "v1").exists()
