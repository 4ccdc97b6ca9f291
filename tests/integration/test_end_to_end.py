"""The real four services as processes: a short DP=2 job end to end, and the CLI's errors.

One stack serves the whole module (starting it costs seconds on 2 cores); every process
it started is killed by PID at the end, and the test checks that none is left.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, down_and_reap, processes_with
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SURGECTL = [sys.executable, "-m", "services.cli.surgectl"]

JOB = """\
name: e2e
steps: 24
seed: 0
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data:
  dataset: tiny@v1
  seq_len: 64
  micro_batch_size: 4
  filter: {min_tokens: 16, banned_bytes: "\\0"}
parallel: {dp: 2}
optimizer: {lr: 3.0e-3, warmup_steps: 4}
checkpoint: {every_steps: 0, keep_last: 2}
eval: {every_steps: 0, batches: 2}
metrics: {tensorboard: true, log_every: 10}
"""


def cli(home: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "SURGE_HOME": str(home), "COLUMNS": "200", **(env or {})}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        if var not in (env or {}):
            full_env.pop(var, None)
    return subprocess.run([*SURGECTL, *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def running_stack(
    tmp_path_factory, packages: tuple[str, ...] = ("json", "email", "logging"), env: dict | None = None
) -> Iterator[Path]:
    """Body of a module-scoped ``stack`` fixture: yields a SURGE_HOME whose dataset ``tiny@v1``
    is prepared from the standard library's ``packages`` (20 % held out) and whose stack
    (`surgectl up --workers 2`, with ``env``) runs; brings it down and reaps it afterwards."""
    home = tmp_path_factory.mktemp("surge")
    src = home / "corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in packages:
        shutil.copytree(stdlib / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    prep = cli(
        home, "dataset", "prepare", "--name", "tiny", "--version", "v1", "--source", str(src), "--val-fraction", "0.2"
    )
    assert prep.returncode == 0, prep.stderr
    up = cli(home, "up", "--workers", "2", env=env, timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield home
    finally:
        down_and_reap(home, cli)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory, ("json", "email", "logging", "asyncio"))


def stack_info(home: Path) -> dict:
    return json.loads((home / "run" / "stack.json").read_text())["services"]


@pytest.fixture(scope="module")
def finished_job(stack, tmp_path_factory) -> str:
    """The module's DP=2 job, run to its end once (its id), for every test that reads what it left."""
    spec = tmp_path_factory.mktemp("e2e") / "e2e.yaml"
    spec.write_text(JOB)
    run = cli(stack, "submit", str(spec), "--follow")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    return run.stdout.split("submitted ", 1)[1].split()[0]


def test_a_short_dp2_job_trains_checkpoints_and_reports(stack, finished_job):
    home, job_id = stack, finished_job
    status = json.loads(cli(home, "status", job_id, "-o", "json").stdout)[0]
    assert status["state"] == "TERMINATED" and status["outcome"] == "FINISHED"
    assert int(status["step"]) == 24

    # The loss decreases (raw per-step records persisted by the metrics logger).
    records = [json.loads(line) for line in (home / "store" / "metrics" / f"{job_id}.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("type") == "step" and int(r.get("rank", 0)) == 0]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    # The same raw values in the job's TensorBoard event files (metrics.tensorboard), and a
    # step line in rank 0's log every metrics.log_every steps and at the last.
    from tests.sink_readers import tensorboard_points

    tb = tensorboard_points(home / "store" / "metrics" / job_id / "tensorboard", "train/loss", len(losses))
    assert tb == list(enumerate(losses, start=1))
    rank_log = [json.loads(x) for x in (home / "run" / "logs" / f"{job_id}.rank0.log").read_text().splitlines()]
    lines = [e["event"] for e in rank_log if e.get("event", "").startswith("step ")]
    assert [int(x.split()[1]) for x in lines] == [10, 20, 24] and f"loss {losses[9]:.4f}" in lines[0], lines

    # A checkpoint version was committed with a verified manifest.
    cks = json.loads(cli(home, "checkpoints", job_id, "-o", "json").stdout)
    assert [c["version"] for c in cks] == [f"{job_id}:1"]
    gen = cli(home, "generate", "--checkpoint", f"{job_id}:1", "--prompt", "def ", "--max-new-tokens", "20")
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
    # The job's final held-out loss, reproduced from the checkpoint in one process that asks
    # no service (the same rows: eval.batches x dp micro-batches from the split's start).
    final_eval = [r for r in records if r.get("type") == "eval" and int(r.get("rank", 0)) == 0][-1]
    offline = cli(home, "eval", f"{job_id}:1", "-o", "json", env={"SURGE_DATA_ADDRESS": "127.0.0.1:9"})
    assert offline.returncode == 0, offline.stderr
    got = json.loads(offline.stdout)
    assert got["tokens"] == int(final_eval["tokens"]) and got["batches"] == 2 * 2
    assert abs(got["loss"] - final_eval["loss"]) <= 1e-5 * final_eval["loss"], (got, final_eval)

    # The store's /metrics serves the training loss of this job.
    mport = stack_info(home)["store"]["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    loss_lines = [line for line in text.splitlines() if line.startswith("surge_train_loss{") and job_id in line]
    assert loss_lines and abs(float(loss_lines[0].split()[-1]) - losses[-1]) < 1e-6

    # No rank process of the job is left behind.
    assert processes_with(f"--job {job_id}") == []


def test_the_audit_after_the_job_shows_the_routes_every_process_used_and_no_violation(stack, finished_job):
    # The job's ranks have ended: their final counts stay with their node agents.
    r = cli(stack, "audit", "-o", "json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    used = {(x["sender"], x["message"], x["receiver"]): x["by_process"] for x in v["routes"]}
    forward = used[("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT")]
    assert forward.keys() == {"worker-0", "worker-1"} and min(forward.values()) >= 24, v  # one rank per worker
    # Rank 0 reports every step to control; rank 1 only its session's first (the rest only
    # marks it heard from, which its node agent's beats already do).
    to_control = used[("L2_TRAINING_LOOP", "surge.v1.StepCompleted", "L1_ORCHESTRATOR")]["control"]
    assert 24 + 1 <= to_control < 2 * 24, v
    assert used[("L2_TRAINING_LOOP", "surge.v1.ShufflePlan", "L4_SHUFFLER")]["data"] >= 2
    assert used[("L2_TRAINING_LOOP", "surge.v1.StepCompleted", "L5_METRICS_LOGGER")]["store"] >= 2 * 24
    assert v["violations"] == []


def test_a_job_evaluating_on_a_dataset_without_held_out_split_is_refused(stack, tmp_path):
    src = tmp_path / "one"
    src.mkdir()
    (src / "only.txt").write_text("a corpus of one file has no held-out split\n" * 50)
    prep = cli(stack, "dataset", "prepare", "--name", "one", "--version", "v1", "--source", str(src))
    assert prep.returncode == 0 and prep.stderr.startswith("warning: one@v1: no held-out split"), prep.stderr
    spec = tmp_path / "one.yaml"
    spec.write_text(JOB.replace("tiny@v1", "one@v1"))
    before = json.loads(cli(stack, "status", "-o", "json").stdout)
    r = cli(stack, "submit", str(spec))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "eval: dataset one@v1 has no held-out split" in r.stderr
    assert json.loads(cli(stack, "status", "-o", "json").stdout) == before


def submitted(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    return run.stdout.split("submitted ", 1)[1].split()[0]


def test_dp_larger_than_the_registered_ranks_waits_in_the_queue_saying_so_until_cancelled(stack, tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(JOB.replace("dp: 2", "dp: 3"))
    r = cli(stack, "submit", str(spec))
    job_id = submitted(r)
    assert "(STANDBY (queued #1))" in r.stdout
    (status,) = json.loads(cli(stack, "status", job_id, "-o", "json").stdout)
    assert status["message"] == (
        "queued: needs 3 ranks (parallel.dp=3), more than the 2 registered: can never run as things stand; waits for workers to join"
    )
    assert cli(stack, "cancel", job_id).returncode == 0  # (else it would hold the queue for the tests after it)
    (status,) = json.loads(cli(stack, "status", job_id, "-o", "json").stdout)
    assert (status["state"], status["outcome"], status.get("queue_position", 0)) == ("TERMINATED", "STOPPED", 0)
    assert processes_with(f"--job {job_id}") == []


def test_a_job_submitted_while_another_holds_the_ranks_is_queued_and_runs_once_they_free_up(stack, tmp_path):
    small = JOB.replace("d_model: 64", "d_model: 32")
    first, second = tmp_path / "qa.yaml", tmp_path / "qb.yaml"
    # a trains until it is stopped: a job that ends by itself can end before b's submit
    # (a loaded machine takes seconds to start a CLI), and b then finds the ranks free.
    first.write_text(small.replace("name: e2e", "name: qa").replace("steps: 24", "steps: 1000000"))
    second.write_text(small.replace("name: e2e", "name: qb").replace("steps: 24", "steps: 3"))
    a = submitted(cli(stack, "submit", str(first)))
    queued = cli(stack, "submit", str(second))
    b = submitted(queued)
    assert "(STANDBY (queued #1))" in queued.stdout.splitlines()[0], queued.stdout[:500]
    assert cli(stack, "stop", a).returncode == 0  # a's ranks free up at its next step boundary
    run = cli(stack, "events", b, "--follow")  # until b ends
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr

    def log(job: str) -> list[dict]:
        r = cli(stack, "events", job, "-o", "json")
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]

    ended = [e for e in log(a) if e["type"] == "state" and "-> TERMINATED" in e["message"]]
    assert len(ended) == 1 and ended[0]["status"]["outcome"] == "STOPPED", log(a)[-3:]
    events = log(b)
    assert events[0]["type"] == "queue" and events[0]["message"].startswith("queued at position 1 of 1, priority 0")
    (left,) = [e for e in events if e["type"] == "state" and "STANDBY -> WARMING_UP: left the queue" in e["message"]]
    assert left["unix_time"] >= ended[0]["unix_time"]  # started once a's ranks were released
    assert events[-1]["status"]["state"] == "TERMINATED" and events[-1]["status"]["outcome"] == "FINISHED"
    assert int(events[-1]["status"]["step"]) == 3


def test_unknown_dataset_or_version_is_a_one_line_error(stack, tmp_path):
    for ds, words in (("nope@v1", "nope@v1"), ("tiny@v9", "tiny@v9")):
        spec = tmp_path / "ds.yaml"
        spec.write_text(JOB.replace("tiny@v1", ds))
        r = cli(stack, "submit", str(spec))
        assert r.returncode == 2 and words in r.stderr and "not found" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_a_dataset_whose_files_no_longer_match_its_manifest_is_refused(stack, tmp_path):
    root = stack / "datasets" / "tiny"
    shutil.copytree(root / "v1", root / "v2")
    manifest = json.loads((root / "v2" / "manifest.json").read_text())
    manifest["version"] = "v2"
    victim = root / "v2" / next(f for f in _manifest_files(manifest) if f.startswith("train"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    spec = tmp_path / "bad.yaml"
    spec.write_text(JOB.replace("tiny@v1", "tiny@v2"))
    r = cli(stack, "submit", str(spec))
    assert r.returncode != 0 and "sha256 mismatch" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _manifest_files(manifest: dict) -> list[str]:
    files = manifest["files"]
    return list(files) if isinstance(files, dict) else [f["path"] if "path" in f else f["name"] for f in files]


def test_malformed_yaml_and_unknown_keys_exit_2_with_the_file_and_field(stack, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [e2e\n")
    r = cli(stack, "submit", str(bad))
    assert r.returncode == 2 and f"{bad}: line 2: malformed YAML" in r.stderr
    bad.write_text(JOB.replace("seq_len: 64", "seq_length: 64"))
    r = cli(stack, "submit", str(bad))
    assert r.returncode == 2 and "data.seq_length: unknown key" in r.stderr


def test_a_second_up_while_the_stack_runs_says_so_and_starts_nothing(stack):
    # (idempotent, issue 28 item 6: was refused, exit 1; a stack partly down is started again)
    before = json.loads((stack / "run" / "stack.json").read_text())["services"]
    r = cli(stack, "up")
    assert r.returncode == 0 and "the stack is already up" in r.stdout, r.stdout + r.stderr
    after = json.loads((stack / "run" / "stack.json").read_text())["services"]
    assert {n: s["pid"] for n, s in after.items()} == {n: s["pid"] for n, s in before.items()}


def test_a_service_port_already_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.control",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--db",
                str(tmp_path / "c.db"),
                "--data",
                "127.0.0.1:1",
                "--store",
                "127.0.0.1:1",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode != 0
    assert str(port) in r.stderr and "in use" in r.stderr


def test_control_unreachable_is_a_one_line_error(tmp_path):
    port = free_port()  # nothing listens here
    r = cli(tmp_path, "status", env={"SURGE_CONTROL_ADDRESS": f"127.0.0.1:{port}"}, timeout=60)
    assert r.returncode == 1
    assert f"control unreachable at 127.0.0.1:{port}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_short_job_on_a_weighted_mixture_trains_to_its_end_and_logs_each_datasets_position(stack, tmp_path):
    home = stack
    prep = cli(
        home, "dataset", "prepare", "--name", "mixb", "--version", "v1", "--source", str(home / "corpus" / "json"),
        "--val-fraction", "0.2",
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    mixed = JOB.replace("name: e2e", "name: mix").replace("steps: 24", "steps: 6")
    mixed = mixed.replace("dataset: tiny@v1", "mixture: [{dataset: tiny@v1, weight: 3}, {dataset: mixb@v1, weight: 1}]")
    mixed = mixed.replace("log_every: 10", "log_every: 3")
    spec = tmp_path / "mix.yaml"
    spec.write_text(mixed.replace("mixb@v1, weight: 1", "mixb@v9, weight: 1"))
    r = cli(home, "submit", str(spec))  # an unknown version of a component: one line, exit 2
    assert r.returncode == 2 and "mixb@v9" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    spec.write_text(mixed)
    run = cli(home, "submit", str(spec), "--follow")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    job_id = run.stdout.split("submitted ", 1)[1].split()[0]
    status = json.loads(cli(home, "status", job_id, "-o", "json").stdout)[0]
    assert status["state"] == "TERMINATED" and status["outcome"] == "FINISHED" and int(status["step"]) == 6
    rank_log = [json.loads(x) for x in (home / "run" / "logs" / f"{job_id}.rank0.log").read_text().splitlines()]
    lines = [e["event"] for e in rank_log if "data mixture:" in e.get("event", "")]
    # 6 steps x 2 ranks x 4 rows = 48 blended rows at weights 3:1: 36 from tiny, 12 from mixb.
    assert lines[-1].startswith("step 6 data mixture: tiny@v1 rows 36 at 0/") and "mixb@v1 rows 12 at " in lines[-1], (
        lines
    )
    assert processes_with(f"--job {job_id}") == []
