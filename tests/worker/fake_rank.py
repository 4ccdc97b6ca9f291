"""A stand-in rank process for the node agent's tests; speaks the real RankSession protocol.

Run by the agent as ``python -m tests.worker.fake_rank --session H:P --job J --rank R``
(the tests set SURGE_RANK_MODULE). What it does is chosen by the pushed InitJob's
``spec_json``: ``{"fake": MODE}`` or ``{"fake": [MODE_OF_RANK_0, MODE_OF_RANK_1, ...]}``.

* ``train``: hello -> receives init, assignment -> TrainingLoopStarted -> waits for
  StartTraining -> StepCompleted(step 1), TrainingLoopFinished -> closes its stream, exit 0.
* ``train3``: like ``train`` with three steps (StepCompleted 1, 2, 3).
* ``sleep``: hello -> init, assignment -> TrainingLoopStarted -> sleeps (SIGTERM kills it).
* ``stubborn``: like ``sleep`` but ignores SIGTERM.
* ``family``: like ``sleep`` after starting a ``sleep`` grandchild (its pid is printed).
* ``beat``: like ``sleep`` (300 s), but beats (RankHeartbeat) every second on its node's beat
  grid, as a real rank does (services/common/beat_grid.py).
* ``audited``: like ``sleep``, but answers every ``audit`` question with one route count:
  L2_TRAINING_LOOP -> RunForward -> L3_FORWARD_UNIT, ``5 + rank`` messages.

It prints what it received to stdout (its log file) and exits 3 when the first two
commands are not init then assignment.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import time

from services.common.beat_grid import phase_from, seconds_to_next_beat
from services.common.grpc_server import channel as grpc_channel
from services.contract import Module, audit_pb2, engine_pb2, worker_pb2, worker_pb2_grpc
from services.contract.relay import pack, unpack


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--session", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args()
    job, rank = args.job, args.rank

    outgoing: queue.Queue = queue.Queue()

    def send(**event) -> None:
        outgoing.put(worker_pb2.RankEvent(job_id=job, rank=rank, **event))

    def send_up(msg) -> None:  # a routed event, by its name, as the rank's session sends it
        send(routed=pack(msg, Module.L2_TRAINING_LOOP))

    def requests():
        while (event := outgoing.get()) is not None:
            yield event

    send(hello=worker_pb2.RankHello(job_id=job, rank=rank, pid=os.getpid()))
    channel = grpc_channel(args.session, module=Module.L2_TRAINING_LOOP)  # a rank speaks as its loop
    commands = iter(worker_pb2_grpc.WorkerServiceStub(channel).RankSession(requests()))
    first, second = next(commands), next(commands)
    if first.WhichOneof("command") != "init" or second.WhichOneof("command") != "assignment":
        print(f"protocol violation: got {first.WhichOneof('command')}, {second.WhichOneof('command')}", flush=True)
        return 3
    init, assignment = first.init, second.assignment
    fake = json.loads(init.spec_json or "{}").get("fake", "train")
    mode = fake if isinstance(fake, str) else fake[rank]
    env = {
        k: os.environ.get(k, "-")
        for k in (
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "SURGE_CPU_AFFINITY",
            "SURGE_NUMA_NODE",
        )
    }
    print(f"init job={init.job_id} data={init.data_address} mode={mode}", flush=True)
    print(
        f"assignment rank={assignment.rank} world={assignment.world_size} device={assignment.device} "
        + " ".join(f"{k}={v}" for k, v in env.items()),
        flush=True,
    )

    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "family":
        child = subprocess.Popen(["sleep", "300"])
        print(f"grandchild {child.pid}", flush=True)
    send_up(engine_pb2.TrainingLoopStarted(job_id=job, rank=rank, start_step=0, num_parameters=42))
    if mode == "audited":
        for cmd in commands:
            if cmd.WhichOneof("command") == "audit":
                report = audit_pb2.AuditReport(process=f"rank {rank} of job {job}", id=cmd.audit.id)
                report.routes.add(
                    sender=Module.L2_TRAINING_LOOP,
                    message="surge.v1.RunForward",
                    receiver=Module.L3_FORWARD_UNIT,
                    count=5 + rank,
                )
                send(audit=report)
        return 0
    if mode == "beat":
        phase, ends = phase_from(), time.monotonic() + 300  # (as long as `sleep` lives: a test's leftover ends)
        while time.monotonic() < ends:
            time.sleep(seconds_to_next_beat(time.time(), 1.0, phase))
            send(heartbeat=worker_pb2.RankHeartbeat(job_id=job, rank=rank, step=0, stepping=False))
        return 0
    if mode not in ("train", "train3"):
        time.sleep(300)
        return 0

    for cmd in commands:
        if cmd.WhichOneof("command") == "start":
            print(f"start job={cmd.start.job_id}", flush=True)
            break
        if cmd.WhichOneof("command") == "routed" and cmd.routed.type == "surge.v1.StartTraining":
            start = unpack(cmd.routed)  # a real rank puts it on its bus (services/contract/relay.py)
            print(f"start job={start.job_id} from={Module.Name(cmd.routed.sender)}", flush=True)
            break
    steps = 3 if mode == "train3" else 1
    for step in range(1, steps + 1):
        send_up(
            engine_pb2.StepCompleted(
                job_id=job, rank=rank, step=step, loss=5.5, tokens=64, world_size=assignment.world_size
            )
        )
    send_up(engine_pb2.TrainingLoopFinished(job_id=job, rank=rank, step=steps))
    outgoing.put(None)  # half-close: the agent then ends our command stream
    for _ in commands:
        pass
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
