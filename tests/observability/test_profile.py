"""`surgectl profile` on the real stack (issue 31 item 3): a running dp-2 job's ranks record a
torch.profiler trace of the same steps from the boundary they agree on, the store keeps each
rank's file beside the job's metrics, the job's status and events name them, and the job
trains on; refusals are one line."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from tests.observability.conftest import SLOW_EXPORT_JOB, SLOW_EXPORT_RUNNING_TIMEOUT, SLOW_EXPORT_SECONDS, cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _state(home, job_id: str) -> dict:
    shown = cli(home, "status", job_id, "-o", "json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)[0]


def _running_job(home, *sets: str) -> str:
    """A job of the package's spec submitted with ``sets`` (that cannot end during a profile:
    100,000 steps, no checkpoints), once RUNNING; its id."""
    sub = cli(
        home, "submit", str(home / "obs.yaml"), "--set", "steps=100000", "--set", "checkpoint.every_steps=0", *sets
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.split("submitted ", 1)[1].split()[0]
    deadline = time.monotonic() + 120
    try:
        while _state(home, job_id)["state"] != "RUNNING":
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.5)
    except BaseException:
        cli(home, "stop", job_id, "--no-checkpoint")  # (not left on the package's stack)
        raise
    return job_id


def test_a_running_jobs_ranks_each_record_a_trace_of_the_same_steps(obs_stack):
    home = obs_stack.home
    job_id = _running_job(home)
    try:
        r = cli(home, "profile", job_id, "--steps", "2", "--wait-seconds", "120", "-o", "json")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        info = json.loads(r.stdout)
        assert info["steps"] == 2 and info["ranks"] == 2
        recorded = sorted(info["recorded"], key=lambda x: x["rank"])
        assert [x["rank"] for x in recorded] == [0, 1]
        assert not any(x.get("error") for x in recorded), recorded
        # The same steps on both ranks (the boundary is agreed), two of them.
        assert recorded[0]["first_step"] == recorded[1]["first_step"]
        assert int(recorded[0]["last_step"]) - int(recorded[0]["first_step"]) == 1
        for x in recorded:
            [path] = x["files"]
            assert path == f"metrics/{job_id}/profiles/cmd{info['seq']}/rank{x['rank']}.trace.json.gz"
            trace = json.loads(gzip.decompress((home / "store" / path).read_bytes()))
            assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
        ev = cli(home, "events", job_id, "--type", "profile")
        assert ev.returncode == 0 and f"profile #{info['seq']}" in ev.stdout and "rank 1:" in ev.stdout, ev.stdout
        assert _state(home, job_id)["state"] == "RUNNING"  # (it trains on)

        # Refusals: one line, non-zero, nothing sent.
        bad = cli(home, "profile", job_id, "--steps", "0")
        assert bad.returncode == 2 and "--steps" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
        done = cli(home, "profile", obs_stack.job_id, "--steps", "1")  # (the package's job: finished)
        assert done.returncode != 0 and "only a running job's steps can be profiled" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    finally:
        cli(home, "stop", job_id, "--no-checkpoint")


def test_an_export_that_silences_a_rank_past_its_heartbeat_deadline_is_no_fault(obs_stack):
    """Issue 28 (profile28): rank 1's export holds its interpreter lock for 14 s, 6 s past the
    job's running heartbeat deadline (8 s): the rank announced the export (PHASE_PROFILE_EXPORT), so
    control allows the silence within its budget; no rank_silent, no relaunch, the files kept."""
    home = obs_stack.home
    assert SLOW_EXPORT_SECONDS >= SLOW_EXPORT_RUNNING_TIMEOUT + 5  # (past it by more than the old 20 s past 15 s)
    deadline = f"liveness.heartbeat_timeout_running_seconds={SLOW_EXPORT_RUNNING_TIMEOUT}"
    job_id = _running_job(home, "--set", f"name={SLOW_EXPORT_JOB}", "--set", deadline)
    try:
        t0 = time.monotonic()
        r = cli(home, "profile", job_id, "--steps", "2", "--wait-seconds", "150", "-o", "json")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        assert time.monotonic() - t0 > SLOW_EXPORT_SECONDS
        # The injection fired (held rank 1's lock): it leaves its marker when it does.
        assert (home / "run" / "faults" / f"{job_id}.rank1.slow_profile_export@1").exists()
        info = json.loads(r.stdout)
        recorded = sorted(info["recorded"], key=lambda x: x["rank"])
        assert [x["rank"] for x in recorded] == [0, 1] and not any(x.get("error") for x in recorded), recorded
        for x in recorded:
            [path] = x["files"]
            assert (home / "store" / path).stat().st_size > 0
        ev = cli(home, "events", job_id)
        assert ev.returncode == 0, ev.stderr
        for fault in ("rank_silent", "rank_stalled", "comm_error", "relaunch"):
            assert fault not in ev.stdout, ev.stdout[-3000:]
        assert _state(home, job_id)["state"] == "RUNNING"
    finally:
        cli(home, "stop", job_id, "--no-checkpoint")
