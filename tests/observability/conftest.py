"""One small real stack for the observability tests: `surgectl up` (2 workers, control
requiring a bearer token), a real Prometheus scraping every service, one short DP=2 job
with evaluations and checkpoints. Every process started here is stopped by PID at the end
(`down_and_reap` for the stack, the Prometheus child by its own PID).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, down_and_reap
from tests.ports import free_port  # noqa: F401 (test_grpc imports it from here)

SURGECTL = [sys.executable, "-m", "services.cli.surgectl"]
TOKEN = "obs-test-token"
ADDRESS_VARS = ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS")
SECURITY_VARS = ("SURGE_AUTH_TOKEN", "SURGE_TLS_CERT", "SURGE_TLS_KEY", "SURGE_TLS_CA", "SURGE_TLS_SERVER_NAME")

# A profile whose export holds rank 1's interpreter lock for 14 s (what torch.profiler's
# post-processing of a long trace did on a loaded host), for the job named SLOW_EXPORT_JOB:
# 6 s past its running heartbeat deadline (SLOW_EXPORT_RUNNING_TIMEOUT, 8 s as test_fencing's,
# set by test_profile.py on that job; it was 20 s against the default 15 s: a test 6 s longer
# for a smaller margin).
INJECT = "SURGE_FAULT_INJECT"
SLOW_EXPORT_JOB = "obs-slow-export"
SLOW_EXPORT_SECONDS = 14
SLOW_EXPORT_RUNNING_TIMEOUT = 8
SLOW_EXPORT = f"{SLOW_EXPORT_JOB}:slow_profile_export@1:rank=1:seconds={SLOW_EXPORT_SECONDS}"

JOB = """\
name: obs
steps: 10
seed: 0
model: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
data:
  dataset: tiny@v1
  seq_len: 32
  micro_batch_size: 2
parallel: {dp: 2}
optimizer: {lr: 3.0e-3, warmup_steps: 2}
checkpoint: {every_steps: 5, keep_last: 2}
eval: {every_steps: 5, batches: 1}
"""


def cli(
    home: Path, *args: str, env: dict | None = None, token: str | None = TOKEN, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run surgectl against the stack under ``home`` (with the stack's token unless
    ``token`` is None)."""
    full = {**os.environ, "SURGE_HOME": str(home), "COLUMNS": "200", "PROMETHEUS_DISABLE_CREATED_SERIES": "true"}
    for var in (*ADDRESS_VARS, *SECURITY_VARS):
        full.pop(var, None)
    if token:
        full["SURGE_AUTH_TOKEN"] = token
    full.update(env or {})
    return subprocess.run([*SURGECTL, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def require_tool(binary: str, package: str) -> str:
    """The path of ``binary``; installs Debian's ``package`` with apt-get where it is missing
    (as root); skips the test, saying why, only when that is impossible."""
    found = shutil.which(binary)
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip(f"{binary} not found and there is no apt-get to install Debian's {package} package")
    if os.geteuid() != 0:
        pytest.skip(f"{binary} not found; `make tools` (apt-get install {package}) needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    problem = ""
    for attempt in ([], ["update"]):
        if attempt:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        r = subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = shutil.which(binary)
        if found:
            return found
        problem = (r.stderr.strip().splitlines() or ["no output"])[-1]
    pytest.skip(f"{binary} not found and `apt-get install {package}` failed: {problem}")


def venv_tool(name: str) -> str | None:
    """A console script of this Python's environment (e.g. grpcurl from the dev extras)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else shutil.which(name)


@dataclass
class ObsStack:
    home: Path
    services: dict  # stack.json's services: name -> {pid, port, metrics_port, log, ...}
    job_id: str
    status: dict  # `surgectl status JOB -o json` after the job
    prometheus: str | None  # http://127.0.0.1:PORT of the Prometheus scraping the stack
    prometheus_skip: str  # why there is none

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.services[service]['port']}"


def prometheus_config(services: dict, interval: str = "1s") -> str:
    """A Prometheus config scraping every service of the local stack (as deploy/prometheus.yml
    does for compose: honor_labels keeps Surge's `job` label)."""
    lines = [
        f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}",
        "scrape_configs:",
        "  - job_name: surge",
        "    honor_labels: true",
        "    static_configs:",
    ]
    for name, s in services.items():
        if s.get("metrics_port"):
            lines.append(f'      - {{targets: ["127.0.0.1:{s["metrics_port"]}"], labels: {{service: {name}}}}}')
    return "\n".join(lines) + "\n"


def start_prometheus(binary: str, workdir: Path, services: dict) -> tuple[subprocess.Popen, str]:
    config = workdir / "prometheus.yml"
    config.write_text(prometheus_config(services))
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"prometheus exited {proc.returncode}: {(workdir / 'prometheus.log').read_text()[-2000:]}"
            )
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError("prometheus did not become ready within 60 s")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the process group of a child started with start_new_session."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass


def _prometheus_binary() -> tuple[str | None, str]:
    try:
        return require_tool("prometheus", "prometheus"), ""
    except pytest.skip.Exception as e:
        return None, str(e)


@pytest.fixture(scope="package")
def obs_stack(tmp_path_factory) -> ObsStack:
    home = tmp_path_factory.mktemp("obs")
    src = home / "corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in ("json", "email"):
        shutil.copytree(stdlib / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    prep = cli(
        home, "dataset", "prepare", "--name", "tiny", "--version", "v1", "--source", str(src), "--val-fraction", "0.2"
    )
    assert prep.returncode == 0, prep.stderr
    prom_proc = None
    # The finished job's series stay for the whole package (the tests read them after it ended).
    # (the injection names one job, test_profile.py's: inert for every other job here)
    up = cli(
        home,
        "up",
        "--workers",
        "2",
        env={"SURGE_STORE_SERIES_LINGER_SECONDS": "3600", INJECT: SLOW_EXPORT},
        timeout=120,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        services = json.loads((home / "run" / "stack.json").read_text())["services"]
        binary, prom_skip = _prometheus_binary()
        prom_url = None
        if binary:
            prom_dir = home / "prometheus"
            prom_dir.mkdir()
            prom_proc, prom_url = start_prometheus(binary, prom_dir, services)
        spec = home / "obs.yaml"
        spec.write_text(JOB)
        run = cli(home, "submit", str(spec), "--follow")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr
        job_id = run.stdout.split("submitted ", 1)[1].split()[0]
        shown = cli(home, "status", job_id, "-o", "json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)[0]
        assert status["outcome"] == "FINISHED", status
        yield ObsStack(home, services, job_id, status, prom_url, prom_skip)
    finally:
        if prom_proc is not None:
            stop_process(prom_proc)
        down_and_reap(home, cli)
