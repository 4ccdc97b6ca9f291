"""How many node agents one `control` holds: simulated workers against the real service.

    .venv/bin/python bench/control_scale.py --workers 1000 [--seconds 45] [--procs 4] [--json]
        [--profile control.svg]   # py-spy flame graph of control over the steady window

Starts control, store and data (``surgectl up`` with no worker), then ``--workers``
simulated node agents (asyncio gRPC clients on loopback, spread over ``--procs``
processes). Each speaks the node agent's side of ``ControlService.WorkerSession``
(proto/surge/v1/control.proto, as services/worker/control_link.py does): registers with one
slot, answers ``LaunchRanks`` with its rank's ``TrainingLoopStarted``, and once
``StartTraining`` comes down sends, every second, the rank's ``RankHeartbeat`` and
``StepCompleted`` (each worker on its own phase within the second, as independent nodes
would). One job spans every worker (``parallel.dp`` = workers). After ``--seconds`` of
steady traffic one worker (rank ``N // 2``) goes silent (stream open, nothing sent), the
way a SIGSTOPped node agent looks.

Measured:
- registration: how many workers control acknowledged (``surge-registered`` header) within
  ``--register-timeout`` (60 s), and the latency of that acknowledgement (p50/p99);
- event-handling latency: where the control API acknowledges events (``WorkerEvent.seq`` /
  ``WorkerCommand.ack``), send -> ack of every event (control started with
  ``SURGE_CONTROL_ACK_S=0``: every commit acked at once, not paced); otherwise rank 0's StepCompleted ->
  the orchestrator's "step" job event (``JobEvent.unix_time`` - ``StepCompleted.unix_time``);
- CPU of the control process (utime + stime from /proc, % of one core) over the steady window,
  and of the simulated agents' processes together (they share the machine's cores), and
  control's thread count;
- time from the silenced worker's last message to the orchestrator's ``fault`` event.

If registration stalls, the figures say at how many workers, and the job part is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


# ------------------------------------------------------------------ simulated node agents


def sim_process(address: str, ids: list[int], total: int, registered, silence_rank, stop, out_q) -> None:
    """One process of simulated node agents (runs ``asyncio``)."""
    asyncio.run(_sim(address, ids, total, registered, silence_rank, stop, out_q))


async def _sim(address, ids, total, registered, silence_rank, stop, out_q) -> None:
    import grpc

    from services.contract import Module, control_pb2, control_pb2_grpc, engine_pb2, worker_pb2
    from services.contract.relay import pack

    sequenced = "seq" in control_pb2.WorkerEvent.DESCRIPTOR.fields_by_name
    # A few HTTP/2 connections per process, as many node agents would each have their own.
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, len(ids) // 100))
    ]
    reg_lat, ack_lat, step_sent = [], [], {}
    ack_by_kind: dict[str, list[float]] = {}
    last_sent: dict[int, float] = {}
    errors: list[str] = []

    async def worker(i: int) -> None:
        stub = control_pb2_grpc.ControlServiceStub(channels[i % len(channels)])
        # Requests from a queue, as the node agent feeds its stream (an iterator): with
        # thousands of streams, grpc.aio's call.write() before the response headers failed
        # with "INTERNAL: Internal error from Core" for some (against either server).
        outgoing: asyncio.Queue = asyncio.Queue()

        async def requests():
            while True:
                yield await outgoing.get()

        call = stub.WorkerSession(requests(), metadata=(("x-surge-module", "EXT_HARDWARE"),))  # as a node agent
        seq, pending = 0, {}
        state = {"job": "", "ranks": [], "stepping": False, "step": 0}

        async def send(**event) -> None:
            nonlocal seq
            ev = control_pb2.WorkerEvent(**event)
            if sequenced:
                seq += 1
                ev.seq = seq
                kind = (
                    ev.rank_event.WhichOneof("event")
                    if ev.WhichOneof("event") == "rank_event"
                    else ev.WhichOneof("event")
                )
                pending[seq] = (time.time(), f"{kind}{'0' if kind == 'step' and ev.rank_event.rank == 0 else ''}")
            outgoing.put_nowait(ev)

        reg = control_pb2.WorkerRegistration(
            worker_id=f"sim-{i}",
            host="127.0.0.1",
            address=f"127.0.0.1:{1 + i}",
            slots=1,
            cpu_count=1,
            memory_bytes=1 << 30,
        )
        if sequenced:
            reg.incarnation = f"sim-{i}-{os.getpid()}"
        t0 = time.time()
        try:
            outgoing.put_nowait(control_pb2.WorkerEvent(register=reg))
            if "surge-registered" not in dict(await call.initial_metadata()):  # the call ended
                errors.append(f"register: {await call.code()}: {await call.details()}")
                return
        except grpc.aio.AioRpcError as e:
            errors.append(f"register: {e.code().name}: {e.details()}")
            return
        reg_lat.append(time.time() - t0)
        with registered.get_lock():
            registered.value += 1

        async def reader() -> None:
            async for cmd in call:
                kind = cmd.WhichOneof("command")
                if kind == "launch":
                    state["job"] = cmd.launch.job_id
                    state["ranks"] = [r.rank for r in cmd.launch.ranks]
                    for r in state["ranks"]:
                        await send(
                            rank_event=worker_pb2.RankEvent(
                                job_id=state["job"],
                                rank=r,
                                routed=pack(
                                    engine_pb2.TrainingLoopStarted(
                                        job_id=state["job"], rank=r, start_step=0, num_parameters=1, startup_seconds=0.1
                                    ),
                                    Module.L2_TRAINING_LOOP,
                                ),
                            )
                        )
                elif kind == "routed" and cmd.routed.type == "surge.v1.StartTraining":  # to the job's ranks
                    state["stepping"] = True
                elif kind == "release":
                    state["stepping"] = False
                elif kind == "ack":
                    now = time.time()
                    for s in [s for s in pending if s <= cmd.ack.seq]:
                        sent, kind = pending.pop(s)
                        ack_lat.append(now - sent)
                        ack_by_kind.setdefault(kind, []).append(now - sent)

        read_task = asyncio.create_task(reader())
        phase = i / total  # this worker's offset within each second
        try:
            while not stop.is_set():
                now = time.time()
                await asyncio.sleep(1.0 - ((now - phase) % 1.0))
                if not state["stepping"] or not state["ranks"]:
                    continue
                if silence_rank.value >= 0 and silence_rank.value in state["ranks"]:
                    continue  # silent: the stream stays open, nothing is sent
                state["step"] += 1
                t = time.time()
                for r in state["ranks"]:
                    await send(
                        rank_event=worker_pb2.RankEvent(
                            job_id=state["job"],
                            rank=r,
                            heartbeat=worker_pb2.RankHeartbeat(
                                job_id=state["job"],
                                rank=r,
                                step=state["step"],
                                stepping=True,
                                step_seconds=1.0,
                                unix_time=t,
                            ),
                        )
                    )
                    await send(
                        rank_event=worker_pb2.RankEvent(
                            job_id=state["job"],
                            rank=r,
                            routed=pack(
                                engine_pb2.StepCompleted(
                                    job_id=state["job"],
                                    rank=r,
                                    step=state["step"],
                                    loss=2.0,
                                    tokens=4096 * total,
                                    tokens_per_second=4096.0 * total,
                                    step_seconds=1.0,
                                    unix_time=t,
                                    world_size=total,
                                ),
                                Module.L2_TRAINING_LOOP,
                            ),
                        )
                    )
                    last_sent[r] = t
                    if r == 0:
                        step_sent[state["step"]] = t
        except grpc.aio.AioRpcError as e:
            errors.append(f"stream: {e.code().name}: {e.details()}")
        finally:
            read_task.cancel()
            call.cancel()

    tasks = [asyncio.create_task(worker(i)) for i in ids]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    for t in tasks:
        t.cancel()
    out_q.put(
        {
            "reg_latency": reg_lat,
            "ack_latency": ack_lat,
            "ack_by_kind": ack_by_kind,
            "step_sent": step_sent,
            "errors": errors[:20],
            "n_errors": len(errors),
            "last_sent": last_sent,
            "sequenced": sequenced,
        }
    )
    for ch in channels:
        await ch.close()


# ------------------------------------------------------------------ driver


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(n: int, seconds: float, procs: int, register_timeout_s: float = 60.0, profile: str | None = None) -> dict:

    c.setup_env()
    # Latency is read as send -> ack: control acks every commit at once here. Paced (at most
    # one ack per session per second, services/control/ack_pacer.py: the default), an ack
    # says only that a second passed, not when the event was decided.
    os.environ["SURGE_CONTROL_ACK_S"] = "0"
    out: dict = {"workers": n, "seconds": seconds}
    with c.Stack(workers=0) as stack:
        control_pid = stack.pid("control")
        address = stack.procs["control"].address
        ctx = mp.get_context("spawn")
        registered, silence_rank, stop = ctx.Value("i", 0), ctx.Value("i", -1), ctx.Event()
        out_q = ctx.Queue()
        nproc = max(1, min(procs, (n + 249) // 250))
        ps = [
            ctx.Process(
                target=sim_process,
                args=(address, list(range(k, n, nproc)), n, registered, silence_rank, stop, out_q),
                daemon=True,
            )
            for k in range(nproc)
        ]
        cpu0, t0 = cpu_seconds(control_pid), time.time()
        for p in ps:
            p.start()
        while registered.value < n and time.time() - t0 < register_timeout_s:
            time.sleep(0.2)
        out["registered"] = registered.value
        out["register_wall_s"] = time.time() - t0
        out["control_cpu_percent_registration"] = 100 * (cpu_seconds(control_pid) - cpu0) / (time.time() - t0)
        events: list = []
        if registered.value == n:
            spec = c.write_spec(
                c.REPO / "bench/jobs/throughput.yaml",
                f"scale{n}",
                steps=1_000_000,
                parallel={"dp": n, "backend": "auto", "threads_per_rank": 1},
                liveness={"heartbeat_interval_seconds": 1.0, "heartbeat_timeout_seconds": 3.0},
            )
            job, t_submit = c.submit(spec)
            watcher = threading.Thread(target=_watch, args=(job, events), daemon=True)
            watcher.start()
            while time.time() - t_submit < 60 and not any("training started" in e.message for e in list(events)):
                time.sleep(0.2)
            out["submit_to_running_s"] = time.time() - t_submit
            time.sleep(3.0)  # let the traffic settle
            cpu1, t1 = cpu_seconds(control_pid), time.time()
            sim1 = sum(cpu_seconds(p.pid) for p in ps)
            spy = None
            if profile:  # py-spy samples from outside: a share of a core, not of control's
                spy = subprocess.Popen(
                    [
                        str(c.REPO / ".venv/bin/py-spy"),
                        "record",
                        "-o",
                        profile,
                        "--pid",
                        str(control_pid),
                        "--duration",
                        str(int(seconds)),
                        "--rate",
                        "50",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            time.sleep(seconds)
            if spy is not None:
                spy.wait(timeout=60)
            out["control_cpu_percent"] = 100 * (cpu_seconds(control_pid) - cpu1) / (time.time() - t1)
            out["clients_cpu_percent"] = 100 * (sum(cpu_seconds(p.pid) for p in ps) - sim1) / (time.time() - t1)
            out["control_threads"] = len(os.listdir(f"/proc/{control_pid}/task"))
            silenced = n // 2
            silence_rank.value = silenced
            t_silence = out["t_silence"] = time.time()
            while time.time() - t_silence < 30 and not [e for e in list(events) if e.type == "fault"]:
                time.sleep(0.1)
            faults = [e for e in list(events) if e.type == "fault"]
            out["fault_event"] = faults[0].message if faults else None
            out["t_fault_minus_silence_s"] = (faults[0].unix_time - t_silence) if faults else None
        else:
            out["control_cpu_percent"] = out["control_cpu_percent_registration"]
        stop.set()
        results = []
        for _ in ps:
            try:
                results.append(out_q.get(timeout=30))
            except Exception:  # noqa: BLE001 - a process that hung: its figures are missing
                pass
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    reg = [x for r in results for x in r["reg_latency"]]
    ack = [x for r in results for x in r["ack_latency"]]
    sent = {int(k): v for r in results for k, v in r["step_sent"].items()}
    last = {int(k): v for r in results for k, v in r["last_sent"].items()}
    out["register_latency_ms"] = {"p50": 1e3 * _pct(reg, 0.5), "p99": 1e3 * _pct(reg, 0.99), "n": len(reg)}
    out["sequenced_api"] = bool(results and results[0]["sequenced"])
    if ack:
        kinds: dict[str, list[float]] = {}
        for r in results:
            for k, v in r["ack_by_kind"].items():
                kinds.setdefault(k, []).extend(v)
        out["latency_ms_by_event"] = {
            k: {"p50": 1e3 * _pct(v, 0.5), "p99": 1e3 * _pct(v, 0.99), "n": len(v)} for k, v in kinds.items()
        }  # step0: rank 0's step (journaled in SQLite)
        out["latency_source"] = "send -> ack of every WorkerEvent"
        lat = ack
    else:
        out["latency_source"] = "rank 0 StepCompleted -> orchestrator step job event"
        lat = []
        for e in events:
            if e.type == "step":
                try:
                    k = int(e.message.split()[1].split("/")[0])
                except (IndexError, ValueError):
                    continue
                if k in sent:
                    lat.append(e.unix_time - sent[k])
    out["latency_ms"] = {"p50": 1e3 * _pct(lat, 0.5), "p99": 1e3 * _pct(lat, 0.99), "n": len(lat)}
    t_silence = out.get("t_silence", 0.0)
    if out.get("t_fault_minus_silence_s") is not None:
        out["silenced_declared_s"] = round(out["t_fault_minus_silence_s"], 2)
        if last.get(n // 2):  # from its last heartbeat (the deadline's start)
            out["silenced_declared_after_last_beat_s"] = round(
                out["t_fault_minus_silence_s"] + t_silence - last[n // 2], 2
            )
    else:
        out["silenced_declared_s"] = None
    out["client_errors"] = sum(r["n_errors"] for r in results)
    out["client_error_samples"] = [e for r in results for e in r["errors"]][:5]
    return out


def _watch(job: str, events: list) -> None:
    from services.cli import clients
    from services.contract import control_pb2

    try:
        with clients.stub("control") as s:
            for ev in s.WatchJob(control_pb2.JobQuery(job_id=job, follow=True)):
                events.append(ev)
    except Exception:  # noqa: BLE001 - the stack went down at the end
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--register-timeout", type=float, default=60.0, help="seconds to wait for every registration")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", help="write a py-spy flame graph (SVG) of control over the steady window here")
    args = ap.parse_args()
    if args.workers < 2:
        sys.exit("--workers: must be >= 2")
    res = run(args.workers, args.seconds, args.procs, args.register_timeout, args.profile)
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
