"""The README's many-machine recipe brought up on a namespace test bed (tests/multihost/
netns.py): a head host and node hosts, each running its part of the recipe, the operator's
CLI in the test's own namespace. Used by tests/multihost/test_netns_bed.py and
bench/multihost.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from services.common.grpc_server import channel
from services.contract import Module, control_pb2, control_pb2_grpc
from tests.multihost import readme_recipe
from tests.multihost.netns import Bed

TOKEN = "bed-token"  # SURGE_AUTH_TOKEN on every host and the operator's machine


class Cluster:
    def __init__(self, bed: Bed, nodes: tuple[str, ...], root: Path):
        self.bed, self.nodes, self.root = bed, nodes, root
        self.corpus = bed.hosts["head"].home / "corpus"  # the head's own files: datasets are prepared there
        self.operator_home = root / "operator"  # the CLI's machine (the test's namespace)
        self.recipe = readme_recipe.read()
        self.head_script = readme_recipe.script(self.recipe.every + self.recipe.head, self.names("head"))
        self.operator_env: dict[str, str] = {}
        self._channel = None
        self.stub: control_pb2_grpc.ControlServiceStub | None = None

    # ------------------------------------------------------------------ the recipe

    def names(self, host: str) -> dict[str, str]:
        """The README's names -> this bed's, for ``host`` ("cli": the operator's machine)."""
        hosts = self.bed.hosts
        out = {
            "head.example": hosts["head"].ip,
            "/srv/surge": str(hosts[host].home if host in hosts else self.operator_home),
            "--name stdlib --version v1": f"--name stdlib --version v1 --source {self.corpus} --val-fraction 0.2",
        }
        if host.startswith("node-"):
            n = host.split("-")[1]
            out |= {"gpu-N.example": hosts[host].ip, "gpu-N": f"gpu-{n}"}
        return out

    def host_env(self) -> dict[str, str]:
        """What every host starts with: the machine's PATH with this Python's scripts first
        (the recipe's `python` and `surgectl`), and the token the recipe's optional line sets."""
        bindir = str(Path(sys.executable).parent)
        return {
            "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "SURGE_AUTH_TOKEN": TOKEN,
            "PYTHONUNBUFFERED": "1",
            "SURGE_LOG_FORMAT": "json",
            "HOME": os.environ.get("HOME", "/root"),
            # The code under test, where it is not the installed one (a worktree beside an
            # editable install): every host runs what the test imports.
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
            # Control's opt-in liveness datagrams, where the run asks for them (hb37: the beds with them on)
            **{k: os.environ[k] for k in ("SURGE_CONTROL_LIVENESS_DATAGRAMS",) if k in os.environ},
        }

    def start(self) -> None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for pkg in ("json", "email", "logging"):
            shutil.copytree(stdlib / pkg, self.corpus / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        self.bed.start("head", self.head_script, self.host_env(), self.root / "head.log")
        for n in self.nodes:
            self.start_node(n)
        self.operator_env = self._operator_env()
        self._channel = channel(self.operator_env["SURGE_CONTROL_ADDRESS"], module=Module.EXT_USER)
        self.stub = control_pb2_grpc.ControlServiceStub(self._channel)

    def start_node(self, node: str) -> None:
        """Run the recipe's node part on ``node`` (again, after it was lost)."""
        script = readme_recipe.script(self.recipe.every + self.recipe.node, self.names(node))
        self.bed.start(node, script, self.host_env(), self.root / f"{node}.log")

    def _operator_env(self) -> dict[str, str]:
        """The CLI section's exports, run in a shell here and read back."""
        exports = [line for line in self.recipe.cli if line.startswith("export ")]
        script = readme_recipe.script(exports, self.names("cli")) + "env -0\n"
        out = subprocess.run(["bash", "-c", script], env=self.host_env(), capture_output=True, check=True).stdout
        return dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)

    def restart_control(self) -> None:
        """SIGKILL control and start it again with the recipe's own line."""
        (control,) = self.bed.pids_of("head", "services.control")
        os.kill(control, 9)
        self._restarted_at = (self.root / "head.log").stat().st_size  # (the new control's lines come after)
        lines = self.head_script.splitlines()
        script = [line for line in lines if line.startswith("export ") or "services.control" in line]
        self.bed.start("head", "\n".join(script) + "\n", self.host_env(), self.root / "head.log")

    def wait_registered(self, timeout: float = 60) -> None:
        """Until every node agent registered with the control restart_control started (its
        log lines): a node lost before the spare host is back has no slot to move to."""
        want = {f"gpu-{n.split('-')[1]}" for n in self.nodes}
        t0, seen = time.monotonic(), set()
        while seen != want:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"node agents not registered again {timeout:.0f} s after the restart: {want - seen}")
            time.sleep(0.2)
            with open(self.root / "head.log", "rb") as f:
                f.seek(self._restarted_at)
                lines = [line for line in f.read().decode(errors="replace").splitlines() if "worker registered" in line]
            seen = {w for w in want if any(f'"worker_id": "{w}"' in line for line in lines)}

    def wait_ready(self, timeout: float = 120) -> None:
        """Until control answers the operator and the head prepared the dataset (a job then
        waits in the queue for node agents, if they have not registered yet).
        Raises TimeoutError with every host's log tail."""
        t0, last = time.monotonic(), ""
        while time.monotonic() - t0 < timeout:
            r = self.cli("status")
            last = r.stdout + r.stderr
            if r.returncode == 0 and (self.bed.hosts["head"].home / "datasets" / "stdlib" / "v1").is_dir():
                return
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))
        raise TimeoutError(f"the bed did not come up in {timeout:.0f} s: {last[-500:]}\n{logs}")

    # ------------------------------------------------------------------ the operator's side

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """surgectl on the operator's machine, configured as the README's CLI section says."""
        return subprocess.run(
            [sys.executable, "-m", "services.cli.surgectl", *args],
            env={**self.operator_env, "SURGE_HOME": str(self.operator_home)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(self, spec_text: str, name: str) -> str:
        path = self.root / f"{name}.yaml"
        path.write_text(spec_text)
        done = self.cli("submit", str(path))
        if done.returncode != 0:
            raise RuntimeError(f"surgectl submit: {done.stdout}{done.stderr}")
        return next(w for w in done.stdout.split() if w.startswith(f"{name}-"))

    def status(self, job: str) -> control_pb2.JobStatus:
        return self.stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=10, metadata=_auth())

    def events(self, job: str, follow: bool = False, timeout: float = 240) -> list[control_pb2.JobEvent]:
        query = control_pb2.JobQuery(job_id=job, follow=follow)
        return list(self.stub.WatchJob(query, timeout=timeout, metadata=_auth()))

    def until_ended(self, job: str, timeout: float = 180) -> list[control_pb2.JobEvent]:
        """The job's events, followed until it is TERMINATED. If it is not within ``timeout``,
        raises AssertionError with a diagnosis (``diagnosis``): a hang on this bed is seen once
        in hundreds of runs, and its files are gone with the test's tmp dir."""
        try:
            return self.events(job, follow=True, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        raise AssertionError(f"{job} not TERMINATED in {timeout:.0f} s\n{self.diagnosis(job)}")

    def diagnosis(self, job: str, lines: int = 25) -> str:
        """What a hung job's state is, for a failure's message: its status and last events,
        every rank's stacks (SIGUSR2: services/common/stack_dump.py) and log tail, and each
        host log's last warnings."""
        out = [f"--- status: {self.status(job)}", f"--- events: {self.events_text(job)}"]
        ranks = [pid for n in self.nodes for pid in self.bed.pids_of(n, f"--job {job} --rank ")]
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR2)
        time.sleep(1.5)  # (the dumps reach the rank logs through the agent's pump)
        for path in sorted(self.root.glob(f"*/run/logs/{job}.rank*.log")):
            text = path.read_text()
            logged = [ln[:300] for ln in text.splitlines() if ln.startswith("{")][-lines:]
            out.append(f"--- {path.name}: stacks (ranks {ranks} dumped)\n{_stacks(text)}")
            out.append(f"--- {path.name}: last lines\n" + "\n".join(logged))
        for path in sorted(self.root.glob("*.log")):
            noted = [ln for ln in path.read_text().splitlines() if '"warning"' in ln or '"error"' in ln]
            out.append(f"--- {path.name}: last warnings\n" + "\n".join(ln[:400] for ln in noted[-lines:]))
        return "\n".join(out)

    def events_text(self, job: str) -> str:
        try:
            return " | ".join(f"{e.type}: {e.message[:160]}" for e in self.events(job)[-12:])
        except Exception as e:  # noqa: BLE001 - for a failure's message only
            return f"(events unavailable: {e})"

    def wait_step(self, job: str, step: int, timeout: float = 120) -> None:
        """Until rank 0 reported ``step`` (control may be restarting meanwhile).
        Raises TimeoutError with the job's last events."""
        t0 = time.monotonic()
        while True:
            with contextlib.suppress(Exception):  # control restarting: keep asking
                if self.status(job).step >= step:
                    return
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{job} did not reach step {step} in {timeout:.0f} s: {self.events_text(job)}")
            time.sleep(0.1)

    def status_when_back(self, job: str, timeout: float = 60) -> control_pb2.JobStatus:
        """The job's status once control answers again (after a restart)."""
        t0 = time.monotonic()
        while True:
            try:
                return self.status(job)
            except Exception:  # noqa: BLE001 - control still starting
                if time.monotonic() - t0 > timeout:
                    raise
                time.sleep(0.2)

    def rank_host(self, job: str, rank: int) -> tuple[str, int]:
        """The host running ``rank`` of ``job`` and its pid (exactly one process)."""
        found = [(n, pid) for n in self.nodes for pid in self.bed.pids_of(n, f"--job {job} --rank {rank}")]
        if len(found) != 1:
            raise AssertionError(f"rank {rank} of {job}: {found}")
        return found[0]

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def _stacks(log: str) -> str:
    """The last stack dump in a rank's log, short: each thread's innermost frame and its
    frames in services/ (a thread with none, gRPC's own say, is left out)."""
    end = log.rfind("Current thread 0x")
    if end < 0:
        return "(no stack dump in the log)"
    start = end
    while (prev := log.rfind("\nThread 0x", 0, start)) >= 0 and "\n{" not in log[prev:start]:
        start = prev + 1  # (back to the dump's first thread: no log line between them)
    kept = []
    for block in log[start:].split("\n\n"):
        frames = [f for f in block.strip().splitlines() if not f.startswith("{")]
        ours = [f for f in frames[2:] if "/services/" in f]
        if len(frames) > 1 and (ours or "/services/" in frames[1]):
            kept.append("\n".join([frames[0], frames[1], *ours]))
    return "\n".join(kept)


def _auth():
    return (("authorization", f"Bearer {TOKEN}"),)


@contextlib.contextmanager
def recipe_cluster(root: Path, nodes: tuple[str, ...]) -> Iterator[Cluster]:
    """The bed with the recipe running on it, ready for a job; everything torn down on exit."""
    with Bed(root, ["head", *nodes]) as bed:
        cluster = Cluster(bed, nodes, root)
        try:
            cluster.start()
            cluster.wait_ready()
            yield cluster
        finally:
            cluster.close()
