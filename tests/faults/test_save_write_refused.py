"""A save the filesystem refuses is a typed cause, not a hang (issue 29, item 8), on the real stack.

One stack (control, store, data, two workers; ranks as real processes) whose store root is a
small tmpfs mounted before `surgectl up` (as root, where mounting works): filled while a dp 2
job trains, every save's write fails with ENOSPC; freed, the next save commits; filled again,
`stop` ends the job although its stop checkpoint cannot be written. Where mounting cannot be
done (not root) the job's checkpoint directories are made read-only instead (EACCES); as root
without mounting, nothing can refuse a write and the module is skipped, saying so.

Before the fix both ranks failed their loop on the refused write and waited for a release that
never came: the job stayed RUNNING at a frozen step and `stop` did nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from tests.faults.test_compound import committed_versions, events_so_far, services, wait_for
from tests.faults.test_recovery import JobOutcome, JobState, cli, of_type, running_stack, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STORE_BYTES = 32 << 20  # the tmpfs under the store: a few dozen of the job's 1.5 MB versions
EVERY = 10  # checkpoint interval (steps)


def _mount_tmpfs(where: Path) -> bool:
    """A ``STORE_BYTES`` tmpfs at ``where`` (root only); False where it cannot be mounted."""
    if os.geteuid() != 0:
        return False
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={STORE_BYTES}", "tmpfs", str(where)], capture_output=True, check=False
    )
    return done.returncode == 0


class Refuser:
    """Makes the store's filesystem refuse writes, and lets it take them again."""

    def __init__(self, store: Path, tmpfs: bool):
        self.store, self.tmpfs = store, tmpfs
        self.cause = "no_space" if tmpfs else "permission"
        self._filler = store / "filler"
        self._locked: list[Path] = []

    def refuse(self, job: str) -> None:
        if self.tmpfs:  # fill it: every write after this one fails with ENOSPC
            with open(self._filler, "ab") as f:
                block = b"\0" * (1 << 20)
                with contextlib.suppress(OSError):
                    while True:
                        f.write(block)
                        f.flush()
            return
        root = self.store / "checkpoints" / job  # not root: mode bits hold (EACCES)
        self._locked = [root, *(p for p in root.rglob("*") if p.is_dir())]
        for d in reversed(self._locked):
            d.chmod(0o555)

    def allow(self) -> None:
        if self.tmpfs:
            self._filler.unlink(missing_ok=True)
            return
        for d in self._locked:
            d.chmod(0o755)
        self._locked = []


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge-save-refused")
    store = home / "store"
    tmpfs = _mount_tmpfs(store)
    if not tmpfs and os.geteuid() == 0:
        pytest.skip("running as root (mode bits do not refuse root) and a tmpfs cannot be mounted here")
    try:
        with running_stack(home, ("json",), ("srefused",)) as s:
            yield s, Refuser(store, tmpfs)
    finally:
        if tmpfs:
            subprocess.run(["umount", "-l", str(store)], capture_output=True, check=False)


def _write_failures(events) -> list[str]:
    return [m for m in of_type(events, "fault") if m.startswith("MEDIUM checkpoint_write_failed")]


def _refused_and_decided(s, job: str):
    events = events_so_far(s, job)
    decided = [m for m in of_type(events, "decision") if "checkpoint_write_failed" in m]
    return events if _write_failures(events) and decided else None


def test_a_refused_save_is_typed_training_goes_on_the_next_save_commits_and_stop_ends_the_job(stack):
    s, refuser = stack
    job = s.submit(spec("srefused", steps=1_000_000, every=EVERY))
    wait_for(lambda: committed_versions(events_so_far(s, job)), 120, "a first committed version")
    refuser.refuse(job)
    try:
        # Typed: the store's cause, which refusal (from the errno), and L1-1's decision by policy.
        events = wait_for(lambda: _refused_and_decided(s, job), 60, "the refused save's fault and decision")
        refused_at = s.status(job).step
        latest = committed_versions(events)[-1]
        checkpoint = [m for m in of_type(events, "checkpoint") if "write_refused" in m]
        assert checkpoint and f"write_refused, {refuser.cause}" in checkpoint[0], of_type(events, "checkpoint")
        assert "older versions are intact" in checkpoint[0]
        decisions = [m for m in of_type(events, "decision") if "checkpoint_write_failed" in m]
        assert decisions[0].startswith("skip the save of step "), decisions
        assert "training continues, the next interval tries again" in decisions[0]
        # The ranks go on: three more intervals of steps, every one of them refused, none failed.
        s.wait_step(job, refused_at + 3 * EVERY, timeout=120)
        events = events_so_far(s, job)
        assert s.status(job).state == JobState.RUNNING
        assert [m for m in of_type(events, "rank") if " failed at step " in m] == []
        assert len(_write_failures(events)) >= 2, _write_failures(events)  # the next intervals tried again
        assert committed_versions(events)[-1] == latest  # latest unchanged while the disk refuses
        assert s.status(job).checkpoint_version == latest[1]
    finally:
        refuser.allow()
    freed_at = s.status(job).step
    wait_for(
        lambda: [v for v in committed_versions(events_so_far(s, job)) if v[0] > freed_at], 120, "a save after freeing"
    )
    verify = cli(s.home, "checkpoints", job, "--verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr  # every version kept is intact
    # Refused again, then stopped: the stop's own checkpoint cannot be written, the stop goes on.
    refuser.refuse(job)
    try:
        t0 = time.monotonic()
        s.stub.StopJob(control_pb2.StopJobRequest(job_id=job))
        events = s.events(job, timeout=120)
        print(f"stopped {time.monotonic() - t0:.1f} s after the request, with the disk refusing")
    finally:
        refuser.allow()
    assert events[-1].status.outcome == JobOutcome.STOPPED, events[-1].message
    assert events[-1].status.checkpoint_step < events[-1].status.step  # its stop checkpoint was refused


def _every_service_alive(home: Path) -> bool:
    for svc in services(home).values():
        try:
            os.kill(svc["pid"], 0)
        except ProcessLookupError:
            return False
    return True


def _paused(s, job: str):
    status = s.status(job)
    return status if status.state == JobState.PAUSED else None


def test_down_with_the_disk_full_refuses_again_and_again_then_drains_once_space_is_freed(stack):
    """`surgectl down` with every save refused (the disk full): refused, exit 1, the stack left
    running; `down` again with the disk still full: the paused ranks' save in place is refused
    again, so `down` refuses again, saying the store refused the write for no space (not "once
    the store answers"), and nothing is lost. Was: the second `down` took the job for drained,
    exited 0 and stopped the stack; `up` resumed 150 steps back (a fresh SRE's trial, F1).
    `status` names the refused saves in one line meanwhile (F7). Space freed, the drain
    checkpoints the step the ranks paused at."""
    s, refuser = stack
    if not refuser.tmpfs:
        pytest.skip("needs the store on a tmpfs it can fill (root, mount)")
    job = s.submit(spec("srefused", steps=1_000_000, every=EVERY))
    wait_for(lambda: committed_versions(events_so_far(s, job)), 120, "a first committed version")
    refuser.refuse(job)
    try:
        wait_for(lambda: _refused_and_decided(s, job), 60, "the refused save's fault and decision")
        shown = cli(s.home, "status", env={"COLUMNS": "1000"})  # (the line unwrapped)
        assert shown.returncode == 0, shown.stderr
        line = next((x for x in shown.stdout.splitlines() if x.startswith("checkpoint saves failing: ")), "")
        assert f"{job}: " in line and "refused the write: no space at " in line, shown.stdout
        for attempt in (1, 2):
            r = cli(s.home, "down", timeout=180)
            assert r.returncode == 1, f"down #{attempt} exited {r.returncode}: {r.stdout}{r.stderr}"
            said = r.stderr.strip().splitlines()[-1]
            assert said.startswith(f"error: not drained: {job} (paused at step "), said
            assert "; its save failed: the store answered but refused the write: no space at " in said, said
            assert "(`surgectl down` again once you free space at " in said and "once the store answers" not in said
            status = wait_for(lambda: _paused(s, job), 30, "the job paused")
            assert (status.drained, status.checkpoint_step < status.step) == (False, True), status
            assert _every_service_alive(s.home), "down stopped a service although it refused"
        events = events_so_far(s, job)
        assert not any("drained: `surgectl up` resumes it" in m for m in of_type(events, "state"))
        skipped = [m for m in of_type(events, "decision") if m.startswith("skip the save of step ")]
        assert any("the drain's pause goes on without it: not drained" in m for m in skipped), skipped
    finally:
        refuser.allow()
    paused_at = s.status(job).step
    s.stub.PauseJob(control_pb2.PauseJobRequest(job_id=job, drain=True))  # `down` again: what its drain asks
    status = wait_for(lambda: (st := _paused(s, job)) and st.drained and st, 120, "the drain with space freed")
    assert (status.step, status.checkpoint_step) == (paused_at, paused_at), status  # the paused step, saved
    assert not status.HasField("save_failing")
    s.stub.StopJob(control_pb2.StopJobRequest(job_id=job))
    assert s.events(job, timeout=120)[-1].status.state == JobState.TERMINATED
