"""Surge on many hosts: the README's many-machine recipe run in network namespaces
(tests/multihost/netns.py), one host for the head services and one per node agent, each with
its own address, its own SURGE_HOME and nothing shared with another but the network.

One job runs through what a cluster does to it: two ranks on two hosts, `surgectl logs
--follow` from the operator's machine, a rank SIGKILLed (rebuilt in place: the survivor
keeps its process, the replacement heals from its memory across hosts), control killed and
started again (the job re-attached), then a node lost with every process on it (its rank
replaced on the third host, the survivor's node agent then probing the replacement's host and
not the lost one: counted on the wire with tc), and the job finishes.

Needs root and iproute2 (ip, tc): skipped, saying why, elsewhere, unless SURGE_REQUIRE_NETNS=1 (CI
sets it), which makes a missing capability a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from services.contract import control_pb2
from tests.multihost.cluster import Cluster, recipe_cluster
from tests.multihost.netns import available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
NODES = ("node-1", "node-2", "node-3")

JOB = """\
name: {name}
steps: 1000000
seed: 0
model: {{n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}}
data:
  dataset: stdlib@v1
  seq_len: 64
  micro_batch_size: 4
parallel: {{dp: 2}}
optimizer: {{lr: 3.0e-3, warmup_steps: 4}}
checkpoint: {{every_steps: 20, keep_last: 2}}
eval: {{every_steps: 0, batches: 2, at_end: false}}
liveness: {{heartbeat_interval_seconds: 0.5, heartbeat_timeout_seconds: 6.0, stall_min_seconds: 60}}
fault_policy: {{actions: {{rank_exit: rebuild, rank_silent: rebuild, worker_lost: {node_lost}, comm_error: rebuild}}, max_restarts: 20}}
"""


def _skip_or_fail(why: str) -> None:
    if os.environ.get("SURGE_REQUIRE_NETNS") == "1":
        pytest.fail(f"SURGE_REQUIRE_NETNS=1 but the namespace test bed cannot run: {why}")
    pytest.skip(f"namespace test bed: {why}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Cluster:
    why = available() or ("" if shutil.which("tc") else "needs iproute2's `tc` (the link probes are counted with it)")
    if why:
        _skip_or_fail(why)
    with recipe_cluster(tmp_path_factory.mktemp("netns-bed"), NODES) as cluster:
        yield cluster


def _tc(cluster: Cluster, host: str, *args: str) -> str:
    ns = cluster.bed.hosts[host].ns
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"tc {' '.join(args)}: {done.stderr}"
    return done.stdout


def _udp_sent(cluster: Cluster, pairs: dict[str, tuple[str, ...]], seconds: float) -> dict[tuple[str, str], int]:
    """How many UDP packets (the node agents' link probes: nothing else between the node hosts
    is UDP) each host of ``pairs`` sent to each host it names, in ``seconds``: an htb class per
    destination on the sender's eth0 (full rate: nothing is slowed), a u32 filter by destination
    address and protocol, the class's packet count read before and after."""
    hosts = cluster.bed.hosts
    for host, peers in pairs.items():
        _tc(cluster, host, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        _tc(cluster, host, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
        for i, peer in enumerate(peers, start=2):
            _tc(cluster, host, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{i}", "htb", "rate",
                "10gbit")  # fmt: skip
            _tc(cluster, host, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "dst", f"{hosts[peer].ip}/32", "match", "ip", "protocol", "17", "0xff",
                "flowid", f"1:{i}")  # fmt: skip

    def counts() -> dict[tuple[str, str], int]:
        out = {}
        for host, peers in pairs.items():
            text = _tc(cluster, host, "-s", "class", "show", "dev", "eth0")
            for i, peer in enumerate(peers, start=2):
                found = re.search(rf"class htb 1:{i} .*?Sent \d+ bytes (\d+) pkt", text, re.S)
                assert found, text
                out[host, peer] = int(found.group(1))
        return out

    try:
        before = counts()
        time.sleep(seconds)
        after = counts()
    finally:
        for host in pairs:
            subprocess.run(["ip", "netns", "exec", hosts[host].ns, "tc", "qdisc", "del", "dev", "eth0", "root"])
    return {k: after[k] - before[k] for k in after}


def test_the_readme_recipe_trains_across_hosts_through_a_rank_kill_a_control_restart_and_a_node_loss(bed):
    job = bed.submit(JOB.format(name="bed", node_lost="rebuild"), "bed")  # until the operator stops it
    bed.wait_step(job, 10)

    # Two ranks, two hosts, and nothing of either on the head.
    (host0, pid0), (host1, pid1) = bed.rank_host(job, 0), bed.rank_host(job, 1)
    assert host0 != host1
    assert not bed.bed.pids_of("head", f"--job {job}")

    # Logs from the operator's machine, followed: both hosts' ranks' lines arrive.
    follow = subprocess.Popen(
        [sys.executable, "-m", "services.cli.surgectl", "logs", job, "--follow"],
        env={**bed.operator_env, "SURGE_HOME": str(bed.operator_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen: set[str] = set()
        t0 = time.monotonic()
        while seen != {"rank 0", "rank 1"} and time.monotonic() - t0 < 60:
            line = follow.stdout.readline()
            seen |= {r for r in ("rank 0", "rank 1") if re.search(rf"\b{r}\b", line)}
        assert seen == {"rank 0", "rank 1"}, seen
    finally:
        follow.kill()
        follow.wait()

    # A rank SIGKILLed: rebuilt in place; the survivor keeps its process, the replacement
    # (on the same host: its slot is free again) heals from the survivor across hosts.
    step = bed.status(job).step
    os.kill(pid1, 9)
    bed.wait_step(job, step + 20)
    assert bed.rank_host(job, 0) == (host0, pid0), bed.events_text(job)
    assert bed.rank_host(job, 1)[1] != pid1

    # Control killed and started again with the recipe's own line: the job re-attaches.
    bed.restart_control()
    bed.wait_step(job, bed.status_when_back(job).step + 20)
    assert bed.rank_host(job, 0) == (host0, pid0), bed.events_text(job)
    bed.wait_registered()  # (the spare host runs no rank: its agent's return is not in the steps)

    # A node lost with everything on it: rank 1's host. Its rank is replaced on the spare
    # host; rank 0 keeps its process.
    lost, _ = bed.rank_host(job, 1)
    step = bed.status(job).step
    bed.bed.kill_all(lost)
    bed.wait_step(job, step + 20)
    spare, _ = bed.rank_host(job, 1)
    assert spare not in (lost, host0)
    assert bed.rank_host(job, 0) == (host0, pid0), bed.events_text(job)

    # The survivor's node agent probes the replacement's node at its address, and the lost node
    # no more (the rebuild told it its new probe peers); the replacement's agent probes it back.
    # Counted on the wire: the UDP packets each host sends to each other host, over 4 probe periods.
    sent = _udp_sent(bed, {host0: (spare, lost), spare: (host0,)}, seconds=4.0)
    print(f"UDP packets in 4 s after the node loss, (from, to): {sent}")
    assert sent[host0, spare] >= 2 and sent[spare, host0] >= 2, sent
    assert sent[host0, lost] == 0, sent

    # The operator stops it; the boundary's checkpoint streams to the store.
    stopped = bed.cli("stop", job)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    done = bed.until_ended(job)
    final = done[-1].status
    assert (final.state, final.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED), bed.events_text(job)
    decisions = [e.message for e in done if e.type == "decision"]
    assert sum(m.startswith("rebuild after rank_exit") for m in decisions) == 1, decisions
    assert sum(m.startswith("rebuild after worker_lost") for m in decisions) == 1, decisions
    saved = [e.message for e in done if e.type == "checkpoint"]
    # A save in flight when a rank or its node died is lost with it (recorded as that fault's
    # consequence: a CI run's kill fell inside one); no save failed for a reason of its own.
    assert saved and not [m for m in saved if "failed" in m and "(consequence of rank" not in m], saved
    # The ranks' hosts cannot see the store's files: every version came by stream.
    assert "checkpoint_files_received" in (bed.root / "head.log").read_text()


def test_a_node_lost_under_exclude_node_relaunches_every_rank_elsewhere_from_a_streamed_checkpoint(bed):
    # The host lost in the test above comes back (its agent started again by the recipe).
    down = [n for n in NODES if not bed.bed.pids_of(n, "services.worker")]
    for n in down:
        bed.start_node(n)
    job = bed.submit(JOB.format(name="bedx", node_lost="exclude_node"), "bedx")
    bed.wait_step(job, 45)  # versions of steps 20 and 40 committed, streamed from both hosts
    lost, _ = bed.rank_host(job, 1)
    bed.bed.kill_all(lost)
    t0 = time.monotonic()
    while not any(e.type == "recovery" and "first step" in e.message for e in bed.events(job)):
        assert time.monotonic() - t0 < 120, bed.events_text(job)
        time.sleep(0.2)
    step = bed.status(job).step
    bed.wait_step(job, step + 20)
    hosts = {bed.rank_host(job, r)[0] for r in (0, 1)}
    assert lost not in hosts and len(hosts) == 2, (lost, hosts)
    stopped = bed.cli("stop", job)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    done = bed.until_ended(job)
    decisions = [e.message for e in done if e.type == "decision"]
    assert any(m.startswith("exclude_node after worker_lost") and "excluding gpu-" in m for m in decisions), decisions
    resumed = [e.message for e in done if e.type == "recovery" and "resume from" in e.message]
    assert resumed and f"{job}:" in resumed[0], [e.message for e in done if e.type == "recovery"]
    final = done[-1].status
    assert (final.state, final.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED), bed.events_text(job)
