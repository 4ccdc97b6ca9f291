"""`surgectl profile` on the real stack (issue 31 item 3): a running dp-2 job's ranks record a
torch.profiler trace of the same steps from the boundary they agree on, the store keeps each
rank's file beside the job's metrics, the job's status and events name them, and the job
trains on; refusals are one line."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from tests.observability.conftest import cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _state(home, job_id: str) -> dict:
    shown = cli(home, "status", job_id, "-o", "json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)[0]


def test_a_running_jobs_ranks_each_record_a_trace_of_the_same_steps(obs_stack):
    home = obs_stack.home
    spec = home / "obs.yaml"
    sub = cli(home, "submit", str(spec), "--set", "steps=400", "--set", "checkpoint.every_steps=0")
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.split("submitted ", 1)[1].split()[0]
    try:
        deadline = time.monotonic() + 120
        while _state(home, job_id)["state"] != "RUNNING":
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.5)
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
