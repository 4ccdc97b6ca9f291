"""Many hosts on one machine: a network namespace per host on a private bridge.

The bed (root, iproute2) makes a bridge in the test's own namespace, and per host a network
namespace joined to it by a veth pair, with its own address (10.<a>.<b>.<i>/24), its own
loopback and its own port space. Every process of a host runs in its namespace, started
through bash in a mount namespace of its own (``ip netns exec`` makes one) where the other
hosts' directories and the machine's ``/dev/shm`` are covered by empty tmpfs mounts: a host
sees its own ``SURGE_HOME`` and nothing another host wrote, so nothing is shared but the
network. The test itself (the bridge's side, address .254) plays the operator's machine:
the CLI reaches the head by its address, as from anywhere.

Everything is torn down by the bed: every process in each namespace (``ip netns pids``,
SIGKILL), the namespaces, the bridge. Names carry the test process's pid, so parallel test
processes (xdist) each get their own bed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_SLASH24 = 24


def available() -> str:
    """Why the bed cannot run here ("" when it can): it needs root and `ip netns`."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"sgprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


@dataclass
class Host:
    name: str  # "head", "node-1", ...
    ns: str  # the network namespace
    ip: str
    home: Path  # its SURGE_HOME; every file it writes lives under it


class Bed:
    """``hosts`` network namespaces on a bridge; a context manager (torn down on exit)."""

    def __init__(self, root: Path, names: list[str], *, isolate_files: bool = True):
        tag = os.getpid() % 100000
        self._bridge = f"sgbr{tag}"
        self._isolate = isolate_files
        # A /24 of its own per test process: 10.(200 + tag/256 % 50).(tag % 256).0
        a, b = 200 + (tag // 256) % 50, tag % 256
        self.operator_ip = f"10.{a}.{b}.254"
        self.hosts = {
            name: Host(name, f"sg{tag}-{i}", f"10.{a}.{b}.{i + 1}", root / name) for i, name in enumerate(names)
        }
        self._made: list[list[str]] = []  # teardown commands, run in reverse

    def __enter__(self) -> Bed:
        try:
            self._ip("link", "add", self._bridge, "type", "bridge")
            self._made.append(["ip", "link", "del", self._bridge])
            self._ip("addr", "add", f"{self.operator_ip}/{_SLASH24}", "dev", self._bridge)
            self._ip("link", "set", self._bridge, "up")
            for i, host in enumerate(self.hosts.values()):
                host.home.mkdir(parents=True, exist_ok=True)
                self._ip("netns", "add", host.ns)
                self._made.append(["ip", "netns", "del", host.ns])
                outer, inner = f"{self._bridge}v{i}", "eth0"
                self._ip("link", "add", outer, "type", "veth", "peer", "name", f"{self._bridge}p{i}")
                # Deleting this end deletes the pair, even where a process left in the namespace
                # keeps it alive past `ip netns del` (whose veth would block the next bed's name).
                self._made.append(["ip", "link", "del", outer])
                self._ip("link", "set", f"{self._bridge}p{i}", "netns", host.ns)
                self._ip("-n", host.ns, "link", "set", f"{self._bridge}p{i}", "name", inner)
                self._ip("link", "set", outer, "master", self._bridge)
                self._ip("link", "set", outer, "up")
                self._ip("-n", host.ns, "addr", "add", f"{host.ip}/{_SLASH24}", "dev", inner)
                self._ip("-n", host.ns, "link", "set", inner, "up")
                self._ip("-n", host.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts.values():
            self.kill_all(host)
        for cmd in reversed(self._made):
            subprocess.run(cmd, capture_output=True)
        self._made.clear()

    # ------------------------------------------------------------------ processes

    def start(self, host: str, script: str, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run bash ``script`` on ``host`` (its namespace, its view of the files), output
        appended to ``log``. Returns the bash process (its background jobs live on in the
        namespace; :meth:`kill_all` ends them)."""
        h = self.hosts[host]
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "bash", "-c", self._prelude(h) + script],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=h.home,
            )

    def run(self, host: str, script: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Run bash ``script`` on ``host`` to its end (output captured)."""
        h = self.hosts[host]
        return subprocess.run(
            ["ip", "netns", "exec", h.ns, "bash", "-c", self._prelude(h) + script],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=h.home,
        )

    def pids(self, host: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.hosts[host].ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def pids_of(self, host: str, needle: str) -> list[int]:
        """The processes on ``host`` whose command line contains ``needle``."""
        found = []
        for pid in self.pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmdline:
                found.append(pid)
        return found

    def kill_all(self, host: Host | str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Signal every process in the host's namespace and wait until none is left."""
        name = host.name if isinstance(host, Host) else host
        end = time.monotonic() + timeout
        while (left := self.pids(name)) and time.monotonic() < end:
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def _prelude(self, h: Host) -> str:
        """Cover what this host must not see: the other hosts' homes and /dev/shm."""
        if not self._isolate:
            return "set -e\n"
        covered = [str(o.home) for o in self.hosts.values() if o.name != h.name] + ["/dev/shm"]
        mounts = "".join(f"mount -t tmpfs -o size=64m tmpfs {p}\n" for p in covered)
        return "set -e\n" + mounts

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
