"""Recovery from the in-memory copies (issue 14, part 3) on the real stack: control, store,
data, three node agents, ranks as real processes.

Each node agent keeps its ranks' newest checkpoint chunks in memory and replicates them to
its peer (the next worker in registration order). A node agent SIGKILLed with its rank takes
its own copy with it; the rank is relaunched on the next worker, the node that holds the
replica, and reads its chunks from that memory instead of the store's files. The run then
ends bit-identical to an uninterrupted one (per-step losses, and the final version's model
and optimizer slot digests: SHA-256 over every chunk of the slot). With the peer's copy
corrupted (SURGE_MEMORY_COPY_CORRUPT: the agents flip a byte of every replica chunk they
store for that job), the reader's SHA-256 check refuses every chunk of it (counted in the
load's record, each one logged) and the store's files serve the load: the run still ends
bit-identical.

A dp 2 job whose rank is SIGKILLed restores both ranks from memory: the chunks DCP wrote on
the other rank's node come from that node, the peer, through the rank's own agent.

What served the load is read from the rank's ``checkpoint_loaded`` log record (JSON lines).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from tests.faults.test_recovery import finished, of_type, running_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SPEC = """\
name: {name}
steps: 16
seed: 0
model: {{n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}}
data:
  dataset: tiny@v1
  seq_len: 64
  micro_batch_size: 4
parallel: {{dp: {dp}}}
optimizer: {{lr: 3.0e-3, warmup_steps: 4}}
checkpoint: {{every_steps: 5, keep_last: 0}}
eval: {{every_steps: 0, batches: 2, at_end: false}}
liveness: {{heartbeat_interval_seconds: 0.5, heartbeat_timeout_seconds: 2.0}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(
        tmp_path_factory.mktemp("surge-memory"),
        ("json", "email"),
        ("mdp", "mref", "mpeer", "mcorrupt"),
        # The save at step 10 waits 60 s (once): the kill after step 5's version always
        # precedes the next version, however fast the steps run. Disarmed once the killed
        # rank's relaunch starts (disarm_slow_save): a relaunch that meets it waits for nothing.
        env={
            "SURGE_MEMORY_COPY_CORRUPT": "mcorrupt",
            "SURGE_FAULT_INJECT": "mdp:slow_save@10:seconds=60,mpeer:slow_save@10:seconds=60,"
            "mcorrupt:slow_save@10:seconds=60",
        },
        workers=3,
    ) as s:
        yield s


def records(path: Path, event: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("event") == event:
            out.append(r)
    return out


def placed_on(stack, job: str) -> str:
    first = next(iter(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job), timeout=30)))
    return first.message.split(" allocated on ")[1].split(";")[0]  # "1 ranks allocated on worker-N; ..."


def replicated(stack, job: str, step: int, timeout: float = 30.0, rank: int = 0) -> str:
    """The worker whose agent stored the replica of ``job``'s ``rank`` at ``step`` (its log)."""
    deadline = time.monotonic() + timeout
    logs = stack.home / "run" / "logs"
    while time.monotonic() < deadline:
        for path in sorted(logs.glob("worker-*.log")):
            for r in records(path, "memory_copy_stored"):
                if (
                    r.get("job") == job
                    and r.get("replica")
                    and (r.get("rank", 0), r.get("step")) == (rank, step)
                    and r.get("chunks", 0) > 0
                ):
                    return path.stem
        time.sleep(0.1)
    raise AssertionError(f"{job}: no replica of step {step} stored within {timeout:.0f} s")


def disarm_slow_save(stack, job: str, rank: int = 0, timeout: float = 120.0) -> None:
    """Mark ``job``'s ``slow_save@10`` of ``rank`` fired (its marker file) once the rank's
    relaunch has started (a second ``rank_composed`` in its log: on the same node the agent
    launches it only after the older process of that rank ended; on another node, the older
    one went with its killed agent). The injection holds step 10's version back
    only until the kill; a relaunch that had not fired it (a loaded host: the rank was not at
    step 10 when killed) would otherwise sit out its 60 s at step 10 for nothing. Written after
    the older incarnation is gone, it cannot let that one's version 10 through. If the
    relaunch is not seen within ``timeout``, the test goes on armed (only slower)."""
    log = stack.home / "run" / "logs" / f"{job}.rank{rank}.log"
    deadline = time.monotonic() + timeout
    while len(records(log, "rank_composed")) < 2:
        if time.monotonic() > deadline:
            print(f"{job}: rank {rank}'s relaunch not seen in {timeout:.0f} s; slow_save@10 left armed")
            return
        time.sleep(0.05)
    marker = stack.home / "run" / "faults" / f"{job}.rank{rank}.slow_save@10"  # (FaultInjector._fire's name)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def run_killing_its_worker(stack, name: str) -> tuple[str, dict, list[dict]]:
    """Submit ``name``; once step 5's version is committed and its replica stored, SIGKILL the
    node agent running the rank (the rank ends with it); follow the job to its end. Returns
    the job id, the load record of the relaunched rank and the job's events."""
    job = stack.submit(SPEC.format(name=name, dp=1))
    worker = placed_on(stack, job)
    stack.wait_step(job, 7)
    deadline = time.monotonic() + 60
    while stack.status(job).checkpoint_step < 5:
        assert time.monotonic() < deadline, f"{job}: step 5 not committed"
        time.sleep(0.05)
    holder = replicated(stack, job, 5)
    assert holder != worker
    services = json.loads((stack.home / "run" / "stack.json").read_text())["services"]
    os.kill(services[worker]["pid"], signal.SIGKILL)
    disarm_slow_save(stack, job)
    events = stack.events(job)
    finished(events)
    assert any(
        m.startswith(f"restart_ranks after worker_lost of rank 0 on {worker}") for m in of_type(events, "decision")
    )
    (loaded,) = records(stack.home / "run" / "logs" / f"{job}.rank0.log", "checkpoint_loaded")
    assert loaded["step"] == 5
    return job, loaded, events


def recovered_event(events) -> str:
    """The recovery's state event ("... ranks restored from checkpoint V, read from ..., at step N")."""
    (event,) = [m for m in of_type(events, "state") if "ranks restored from checkpoint " in m]
    return event


def final_slots(stack, job: str) -> dict[str, str]:
    """The slot digests of the job's last version (chunks.json)."""
    root = stack.home / "store" / "checkpoints" / job
    last = max((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return json.loads((last / "chunks.json").read_text())["slots"]


@pytest.fixture(scope="module")
def reference(stack):
    job = stack.submit(SPEC.format(name="mref", dp=1))
    finished(stack.events(job))
    return job


def same_run(stack, job: str, reference: str) -> None:
    la, lb = stack.losses(reference), stack.losses(job)
    assert sorted(la) == sorted(lb) == list(range(1, 17))
    assert [s for s in la if la[s] != lb[s]] == [], "per-step losses differ"
    sa, sb = final_slots(stack, reference), final_slots(stack, job)
    assert (sa["model"], sa["optim"]) == (sb["model"], sb["optim"]), "final model or optimizer state differs"


def test_a_killed_dp_2_rank_restores_from_its_nodes_memory_and_its_peers_through_its_agent(stack):
    # First in this module (it needs all three workers). Workers in registration order a, b,
    # c; peers a -> b -> c -> a; ranks 0 on a, 1 on b. DCP writes each replicated tensor on one
    # of the two ranks; after rank 1 is SIGKILLed both are relaunched where they were: rank 1
    # finds all it needs on b (its part, and rank 0's replica), rank 0 finds its part on a and
    # rank 1's on a's peer b, through a's agent. Those are read from both ends at once (the
    # peer's memory from the front, the store's files from the back: chunk_race.py), so the
    # store may serve part of them (a small part on a local disk's page cache: whichever
    # source gets there first); nothing of rank 0's own part, and nothing twice.
    job = stack.submit(SPEC.format(name="mdp", dp=2))
    stack.wait_step(job, 7)
    deadline = time.monotonic() + 60
    while stack.status(job).checkpoint_step < 5:
        assert time.monotonic() < deadline, f"{job}: step 5 not committed"
        time.sleep(0.05)
    replicated(stack, job, 5, rank=0)
    replicated(stack, job, 5, rank=1)
    for pid in stack.rank_pids(job, 1):
        os.kill(pid, signal.SIGKILL)
    disarm_slow_save(stack, job)
    events = stack.events(job)
    finished(events)
    assert any(m.startswith("restart_ranks after rank_exit of rank 1") for m in of_type(events, "decision"))
    logs = stack.home / "run" / "logs"
    (r0,) = records(logs / f"{job}.rank0.log", "checkpoint_loaded")
    (r1,) = records(logs / f"{job}.rank1.log", "checkpoint_loaded")
    assert r0["step"] == r1["step"] == 5
    assert r0["chunks_from"].get("memory", 0) > 0 and not r0["mismatches"], r0
    assert set(r0["chunks_from"]) - {"memory"} and set(r0["chunks_from"]) <= {"memory", "peer", "store"}, r0
    assert set(r1["chunks_from"]) == {"memory"} and not r1["mismatches"], r1
    # The recovery's event says so (the ranks' TrainingLoopStarted carry their bytes per source).
    recovered = recovered_event(events)
    assert ", read from memory (own node) " in recovered, recovered
    assert " + the peer's memory " in recovered or " + the store " in recovered, recovered
    print(f"dp 2: rank 0 {r0['bytes_from']}, rank 1 {r1['bytes_from']} (bytes)")


def relaunched_on(events) -> str:
    """The workers the recovery relaunched the ranks on (its "relaunched on W (rendezvous" event)."""
    (said,) = [m for m in of_type(events, "recovery") if "relaunched on " in m]
    return said.split("relaunched on ", 1)[1].split(" (rendezvous", 1)[0]


def test_a_rank_whose_node_died_is_recovered_from_the_peers_memory_copy_bit_identical(stack, reference):
    job, loaded, events = run_killing_its_worker(stack, "mpeer")
    holder, where = replicated(stack, job, 5), relaunched_on(events)
    if holder not in where:
        # L1-2 places a relaunch on the first placeable worker (registration order), not where
        # the copy is: on a loaded host (ci14) the holder was not it (held while its agent was
        # late, or the first placement moved the ring), and nothing of the copy is reachable from
        # there (its peer was the dead node). What holds then: the store serves it, bit identical.
        print(f"{job}: relaunched on {where}, not on {holder} holding the copy: the store's path checked instead")
        assert loaded["chunks_from"].get("memory", 0) == 0 and loaded["chunks_from"].get("store", 0) > 0, loaded
        same_run(stack, job, reference)
        return
    assert loaded["chunks_from"].get("memory", 0) > 0, loaded
    assert loaded["chunks_from"].get("store", 0) == 0 and not loaded["mismatches"], loaded
    # (Relaunched on the node that held the replica: its own node's memory.)
    assert ", read from memory (own node), at step 5 " in recovered_event(events), recovered_event(events)
    same_run(stack, job, reference)
    print(f"recovered from the peer's memory: {loaded['chunks_from']}, read in {loaded['read_verified_s']} s")


def test_a_corrupt_peer_copy_is_detected_and_the_store_serves_the_recovery(stack, reference):
    job, loaded, events = run_killing_its_worker(stack, "mcorrupt")
    refused = loaded["mismatches"].get("memory", 0)
    recovered = recovered_event(events)  # (the refused chunks were read from the store)
    assert ", read from " in recovered and "the store" in recovered.split(", read from ", 1)[1], recovered
    # Every corrupted chunk is refused and read from the store. (A chunk the agent also held
    # for another job, e.g. a small item equal to mpeer's, was not stored again, so not
    # corrupted: it is served from memory, verified.)
    assert refused > 0 and loaded["chunks_from"].get("store", 0) == refused, loaded
    logged = records(stack.home / "run" / "logs" / f"{job}.rank0.log", "chunk_digest_mismatch")
    assert len(logged) == refused and {r["source"] for r in logged} == {"memory"}
    same_run(stack, job, reference)
    print(f"corrupt peer copy: {refused} chunks refused, chunks from {loaded['chunks_from']}")
