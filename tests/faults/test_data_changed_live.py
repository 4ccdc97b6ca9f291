"""A dataset shard rewritten under a running job (issue 29 item 7), on the real stack.

The stack the group cli-two-workers shares (tests/conftest.py STACK_GROUPS, tests/shared_stacks.py:
control, store, data, two workers; ranks as real processes; ``tiny@v1`` from ``json``, as this
module's own stack had it): the byte is put back whatever happens (the group's next modules
train on the same dataset), and the job, left running, is stopped when the module hands the
stack on. A dp 2 job trains on ``tiny@v1``;
the test flips one byte of the version's ``train.bin`` in place (same size, so only the
digest can see it). The data service's next read of that shard finds its identity changed,
hashes it again and fails the read as data_corrupt; L1-1 pauses the job (not FAILED), its
message one line naming the version and the shard. Resumed with the byte still flipped, the
relaunched ranks' streams find it at open and the job pauses again; with the byte put back, a
resume trains on.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.test_compound import committed_versions, events_so_far, wait_for
from tests.faults.test_recovery import JobState, cli, of_type, spec

# (420 s, not 300: run alone, the test's setup and teardown start and end the group's stack)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
JOBS = ("dchanged",)


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its job: JOBS."""
    return shared_stack


@pytest.fixture
def shard(stack):
    """``tiny@v1``'s train.bin, put back as prepared when the test ends (flipped an odd number
    of times by a test that failed half-way, it is flipped once more)."""
    [path] = list((stack.home / "datasets").rglob("tiny/v1/train.bin"))
    prepared = path.read_bytes()[:1]
    yield path
    if path.read_bytes()[:1] != prepared:
        flip(path)


def test_a_shard_rewritten_under_a_running_job_pauses_it_naming_the_version_and_the_shard(stack, shard):
    s = stack
    # The rank's stream holds a few MB of batches read ahead (the gRPC windows), read from
    # the bytes as they were; the fault reaches the job once it has trained on those.
    # Batches of 128 rows, not 4: the 4 MB the streams hold are ~70 batches, not ~2,200 (the
    # tokens trained are the same whatever the rows; each step has its own cost on top). A
    # save every 20 steps: the first, to resume from, comes at step 20 (at 100 the job
    # trained 80 more steps before the change; 90 CPU-s -> see docs/LOG.md session 27).
    job = s.submit(spec("dchanged", steps=1_000_000, every=20).replace("micro_batch_size: 4", "micro_batch_size: 128"))
    wait_for(lambda: committed_versions(events_so_far(s, job)), 180, "a checkpoint to resume from")
    flip(shard)
    changed = time.monotonic()
    status = settled(s, job, 150)
    found_s = time.monotonic() - changed
    assert status.state == JobState.PAUSED, (JobState.Name(status.state), status.message)
    assert status.message.startswith("paused: data_corrupt: "), status.message
    assert "dataset tiny@v1: shard train.bin changed since it was prepared" in status.message
    assert status.message.endswith("continues it from its newest checkpoint") and "\n" not in status.message
    events = events_so_far(s, job)
    faults = [m for m in of_type(events, "fault") if "data_corrupt" in m]
    assert faults and faults[0].startswith("FATAL data_corrupt"), of_type(events, "fault")
    decisions = [m for m in of_type(events, "decision") if "data_corrupt" in m]
    assert decisions[0].startswith("pause after data_corrupt"), decisions
    assert not [m for m in of_type(events, "decision") if m.startswith(("restart", "rollback"))]
    print(f"found and paused {found_s:.1f} s after the change")

    # At resume: the relaunched ranks' streams open the shard, still changed.
    def pauses() -> int:
        return len([m for m in of_type(events_so_far(s, job), "decision") if m.startswith("pause after data_corrupt")])

    assert cli(s.home, "resume", job).returncode == 0
    # (by the events: on a loaded host the relaunch can be paused again between two polls of the state)
    wait_for(lambda: pauses() >= 2, 120, "the resumed ranks to find the shard changed again")
    assert any(m.startswith("PAUSED -> WARMING_UP") for m in of_type(events_so_far(s, job), "state"))
    again = settled(s, job)
    assert again.state == JobState.PAUSED and "shard train.bin changed" in again.message, again.message
    # Put back as prepared: the resume trains on.
    flip(shard)
    assert cli(s.home, "resume", job).returncode == 0
    wait_for(lambda: s.status(job).state == JobState.RUNNING, 60, "the job to run again")
    at = s.status(job).step
    s.wait_step(job, at + 2, timeout=60)
    assert s.status(job).state == JobState.RUNNING


def flip(path) -> None:
    """Flip the first byte of ``path`` in place (same inode, same size); twice restores it."""
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def settled(s, job: str, timeout: float = 60):
    """The job's status once it is PAUSED or TERMINATED (``timeout`` seconds at most)."""
    try:
        return wait_for(
            lambda: (st := s.status(job)).state in (JobState.PAUSED, JobState.TERMINATED) and st,
            timeout,
            "the job to settle",
        )
    except AssertionError:
        st = s.status(job)
        said = [f"{e.type}: {e.message}" for e in events_so_far(s, job)][-15:]
        raise AssertionError(
            f"not settled: {JobState.Name(st.state)} at step {st.step}: {st.message}\n" + "\n".join(said)
        ) from None
