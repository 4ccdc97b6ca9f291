"""surgectl: --help of every command has an example; `plot` writes the curves; errors are one
line with a non-zero exit; the mutating commands need the stack's bearer token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import typer
from typer.testing import CliRunner

from services.cli.surgectl import app
from tests.observability.conftest import ADDRESS_VARS, REPO, SECURITY_VARS, SURGECTL, cli


def _commands(group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [path]
    for name, sub in (getattr(group, "commands", None) or {}).items():
        if not sub.hidden:  # hidden aliases (jobs, ls, ps) only print a hint to use `status`
            out += _commands(sub, (*path, name))
    return out


def test_every_command_has_help_with_an_example():
    root = typer.main.get_command(app)
    paths = _commands(root)
    assert ("logs",) in paths and ("plot",) in paths and ("dataset", "prepare") in paths
    runner = CliRunner()
    missing = []
    for path in paths:
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (path, r.output)
        if "Example: surgectl" not in r.output:
            missing.append(" ".join(path) or "(root)")
    assert missing == []


def test_the_demo_runs_without_importing_surgectl():
    # demo and surgectl share services/cli/jobs.py; neither imports the other at load time.
    code = "import sys, services.cli.demo; print(sorted(m for m in sys.modules if m.startswith('services.cli.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "services.cli.surgectl" not in out and "services.cli.jobs" in out


@pytest.mark.integration
def test_plot_writes_a_png_of_every_step(obs_stack, tmp_path):
    out = tmp_path / "curves.png"
    r = cli(obs_stack.home, "plot", obs_stack.job_id, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "10 steps" in r.stdout and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    default = obs_stack.home / f"{obs_stack.job_id}-loss.png"
    r = cli(obs_stack.home, "plot", obs_stack.job_id, "--rank", "1")
    assert r.returncode == 0 and default.stat().st_size > 10_000, r.stderr


@pytest.mark.integration
def test_plot_falls_back_to_controls_history_without_the_metrics_file(obs_stack, tmp_path):
    import socket

    out = tmp_path / "coarse.png"
    with socket.socket() as closed:  # bound, not listening: the store unreachable from here
        closed.bind(("127.0.0.1", 0))
        store = f"127.0.0.1:{closed.getsockname()[1]}"
        r = cli(
            obs_stack.home,
            "plot",
            obs_stack.job_id,
            "--out",
            str(out),
            # (neither the store nor a local copy of its files: control's history is what is left)
            env={"SURGE_STORE_ADDRESS": store, "SURGE_STORE_ROOT": str(tmp_path / "elsewhere")},
        )
    assert r.returncode == 0, r.stderr
    assert "control's event history" in r.stdout and out.exists()


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, words",
    [
        (("plot", "no-such-job"), "no-such-job"),
        (("plot", "JOB", "--metrics", "/nonexistent.jsonl"), "--metrics /nonexistent.jsonl: no such file"),
        (("plot", "JOB", "--rank", "5"), "no step records of rank 5"),
    ],
)
def test_plot_errors_are_one_line(obs_stack, args, words):
    r = cli(obs_stack.home, *[obs_stack.job_id if a == "JOB" else a for a in args])
    assert r.returncode != 0 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.integration
def test_mutating_commands_need_the_token_and_reading_ones_do_not(obs_stack):
    job = obs_stack.job_id
    refused = cli(obs_stack.home, "stop", job, token=None)
    assert refused.returncode == 1, refused.stdout
    assert "SURGE_AUTH_TOKEN" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    wrong = cli(obs_stack.home, "pause", job, token="not-the-token")
    assert wrong.returncode == 1 and "SURGE_AUTH_TOKEN" in wrong.stderr, wrong.stderr

    read = cli(obs_stack.home, "status", job, "-o", "json", token=None)
    assert read.returncode == 0 and json.loads(read.stdout)[0]["job_id"] == job, read.stderr

    accepted = cli(obs_stack.home, "stop", job)  # the job has ended: whatever control says, not a refusal
    assert "SURGE_AUTH_TOKEN" not in accepted.stderr, accepted.stderr


@pytest.mark.integration
def test_events_filtered_by_type_and_tailed_and_a_bad_type_refused(obs_stack):
    job = obs_stack.job_id
    every = cli(obs_stack.home, "events", job, "-o", "json")
    assert every.returncode == 0, every.stderr
    events = [json.loads(line) for line in every.stdout.splitlines()]
    states = [e for e in events if e["type"] == "state"]
    assert len(states) >= 3 and len(events) > len(states)

    last = cli(obs_stack.home, "events", job, "--type", "state", "--tail", "2", "-o", "json")
    assert last.returncode == 0, last.stderr
    assert [json.loads(line)["seq"] for line in last.stdout.splitlines()] == [e["seq"] for e in states[-2:]]
    # Two types, comma-separated; followed: the history's tail, then (the job has ended) nothing more.
    both = cli(obs_stack.home, "events", job, "-t", "state,checkpoint", "-n", "1", "--follow", "-o", "json")
    assert both.returncode == 0, both.stderr
    (only,) = [json.loads(line) for line in both.stdout.splitlines()]
    assert only["seq"] == max(e["seq"] for e in events if e["type"] in ("state", "checkpoint"))

    bad = cli(obs_stack.home, "events", job, "--type", "faults")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --type: unknown event type faults"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_status_watch_redraws_until_interrupted(obs_stack):
    env = {k: v for k, v in os.environ.items() if k not in (*ADDRESS_VARS, *SECURITY_VARS)}
    env.update(SURGE_HOME=str(obs_stack.home), COLUMNS="200")
    proc = subprocess.Popen(
        [*SURGECTL, "status", "--watch", "--interval", "0.3"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while sum(line.startswith("-- ") for line in lines) < 3:  # a third view: the loop is running
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)  # the operator's Ctrl-C
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "".join(lines).count(obs_stack.job_id) >= 2, lines  # one view after another, each with the job


@pytest.mark.integration
def test_a_sweep_submits_its_grid_through_the_queue_ranks_it_and_compare_shows_the_difference(obs_stack, tmp_path):
    spec = obs_stack.home / "obs.yaml"
    r = cli(
        obs_stack.home,
        "sweep",
        str(spec),
        "--grid",
        "optimizer.lr=1e-5,3e-3",
        "--set",
        "steps=6",
        "--metric",
        "train_loss",
        "--poll-seconds",
        "0.5",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    ids = [line.split()[1].rstrip(":") for line in r.stdout.splitlines() if line.startswith("submitted ")]
    assert len(ids) == 2, r.stdout
    # lr 3e-3 learns in 6 steps, 1e-5 barely moves: the ranking's first row is the 3e-3 trial.
    first = next(line for line in r.stdout.splitlines() if line.strip().startswith("│ 1 "))
    assert ids[1] in first and "optimizer.lr=3e-3" in first, r.stdout
    record = json.loads(next((obs_stack.home / "sweeps").glob("*.json")).read_text())
    assert [t["job_id"] for t in record["trials"]] == ids

    out = tmp_path / "both.png"
    c = cli(obs_stack.home, "compare", *ids, obs_stack.job_id, "--out", str(out), "-o", "json")
    assert c.returncode == 0, c.stderr
    shown = json.loads(c.stdout)
    assert shown["spec_differences"]["optimizer.lr"] == {ids[0]: "1e-05", ids[1]: "0.003", obs_stack.job_id: "0.003"}
    assert shown["spec_differences"]["steps"][obs_stack.job_id] == "10"
    by_id = {j["job_id"]: j for j in shown["jobs"]}
    assert by_id[ids[0]]["steps"] == 6 and by_id[ids[1]]["final_train"] < by_id[ids[0]]["final_train"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert by_id[ids[1]]["tags"] == {"sweep": record["sweep"], "optimizer.lr": "3e-3"}

    tagged = cli(obs_stack.home, "tag", ids[0], "verdict=too-slow", "--remove", "optimizer.lr")
    noted = cli(obs_stack.home, "note", ids[0], "lr 1e-5 barely moves")
    assert tagged.returncode == 0 and noted.returncode == 0, tagged.stderr + noted.stderr
    assert f"{ids[0]}: tags sweep={record['sweep']}, verdict=too-slow" in tagged.stdout
    ev = cli(obs_stack.home, "events", ids[0], "--type", "note")
    assert ev.returncode == 0 and "lr 1e-5 barely moves" in ev.stdout, ev.stdout + ev.stderr
    bad = cli(obs_stack.home, "tag", ids[0], "bad key=1")
    assert bad.returncode == 2 and "tag 'bad key'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    # MFU's peak on a CPU rank is measured and said (services/common/device_peaks.py).
    assert obs_stack.status["peak_tflops"] > 0 and obs_stack.status["peak_source"].startswith("measured: cpu")
    assert 0 < obs_stack.status["mfu"] < 1.5, obs_stack.status
    one = cli(obs_stack.home, "compare", ids[0])
    assert one.returncode == 2 and "at least two jobs" in one.stderr and len(one.stderr.strip().splitlines()) == 1
