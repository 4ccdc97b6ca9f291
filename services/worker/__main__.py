"""Composition root of the node agent: ``python -m services.worker``.

    python -m services.worker --port P --control HOST:PORT [--host 127.0.0.1]
        [--advertise HOST] [--worker-id ID] [--slots N] [--host-share N] [--run-dir DIR]
        [--memory-check-seconds S] [--memory-pressure-fraction F] [--metrics-port M]

Environment defaults: SURGE_WORKER_PORT, SURGE_CONTROL_ADDRESS, SURGE_WORKER_ID
(default ``<hostname>-<port>``), SURGE_WORKER_SLOTS (default: number of CUDA devices,
else 1), SURGE_RANK_MODULE (module the rank processes run, default
``services.rank``), SURGE_WORKER_MEMORY_CHECK_SECONDS (default 2.0; 0 disables
the memory sampler), SURGE_WORKER_MEMORY_PRESSURE_FRACTION (default 0.10),
SURGE_WORKER_MEMINFO (file the host memory is read from, default /proc/meminfo),
SURGE_WORKER_HOST_SHARE (agents sharing this host's RAM: each registers RAM / N; default 1),
SURGE_WORKER_GPU_CHECK_SECONDS (default 5.0; 0 disables the GPU health sampler, which is off
anyway without NVML: services/worker/gpu_health.py), SURGE_WORKER_GPU_MEMORY_PRESSURE_FRACTION
(default 0.95 of a device's memory used),
SURGE_WORKER_METRICS_PORT (Prometheus ``/metrics``; default 0 = not served),
SURGE_WORKER_MEMORY_COPY_BYTES (bound on the in-memory checkpoint copies, default a quarter
of the host's memory; 0 = off), SURGE_WORKER_MEMORY_COPY_SHM (``off``: keep them in the
agent's process instead of /dev/shm), SURGE_WORKER_RANK_FORKSERVER (ranks forked from a process
with their imports done: ``lazy``, the default, started at the first launch; ``eager``, at the
agent's start, a spare node; ``off``, every rank a new interpreter:
services/worker/rank_forkserver.py). Port 0
takes a free port (the bound one is registered).

Serves ``surge.v1.WorkerService`` (RankSession), ``surge.v1.MemoryCopyService`` (the
in-memory checkpoint copies, ``memory_copies.py``), ``surge.v1.AuditService`` (the route
counts of this node's rank processes, asked over their sessions) plus health and
reflection. Rank processes serve no port of their own. SIGTERM or SIGUSR1 (Slurm's
`--signal=USR1@N`): a departure with notice (departure.py): control is told the deadline
(``--departure-seconds``, SURGE_WORKER_DEPARTURE_SECONDS, default 30) and the ranks run until
control released them (moved away after a checkpoint) or the deadline passed; then, as for
SIGINT at once: kill the rank process groups, close the session, stop the server, exit 0. A
port in use: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from services.common import grpc_waits, logs, paths, stack_dump, thread_names
from services.common.departure import DEFAULT_DEPARTURE_SECONDS, DEPARTURE_ENV
from services.common.grpc_server import AUTH_TOKEN_ENV, SMALL_AND_BULK, PortInUse, ServiceServer, serve_metrics
from services.common.service_args import (
    ServiceArgumentParser,
    address,
    env_option,
    host,
    listen_host,
    port,
    seconds,
)
from services.contract import Module, audit_pb2_grpc, control_pb2, worker_pb2_grpc
from services.contract.audit import AuditServicer, ViolationReporter, merge_reports, report_of
from services.contract.bus import Bus
from services.contract.injection import env_error
from services.contract.relay import pack
from services.contract.validation import ContractError, refuse, validate_table
from services.worker import rank_logs
from services.worker.control_link import ControlSession, Outbox
from services.worker.departure import NOTICE_SIGNALS, announcement, wait_for_release
from services.worker.gpu_health import GpuHealthSampler
from services.worker.hardware import (
    DEFAULT_MEMINFO,
    DEFAULT_SYSFS,
    GLOO_IFNAME,
    MEMINFO_ENV,
    SYSFS_ENV,
    detect_cuda_devices,
    gloo_interface,
    hardware_report,
)
from services.worker.link_probe import LinkProber, probe_key
from services.worker.memory_chunks import env_problem as memory_copies_env_problem
from services.worker.memory_chunks import limit_from_env, shm_from_env
from services.worker.memory_copies import MemoryCopies
from services.worker.memory_copy_service import MemoryCopyServicer
from services.worker.memory_pressure import MemorySampler
from services.worker.node_agent import DEFAULT_RANK_MODULE, RANK_MODULE_ENV, SHUTDOWN_GRACE_SECONDS, NodeAgent
from services.worker.rank_forkserver import RankForkServer, become_subreaper
from services.worker.rank_process import REPO_ROOT
from services.worker.rank_session import RankSessionServicer

SERVICE_NAME = "surge.v1.WorkerService"
MEMORY_SERVICE_NAME = "surge.v1.MemoryCopyService"
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    p = ServiceArgumentParser(prog="python -m services.worker", description="Surge node agent")
    env_option(p, "--port", "SURGE_WORKER_PORT", port, help="gRPC port (0: any free port)")
    env_option(p, "--control", "SURGE_CONTROL_ADDRESS", address, help="control host:port")
    env_option(p, "--host", "SURGE_WORKER_HOST", listen_host, "127.0.0.1", "address to listen on")
    env_option(
        p, "--advertise", "SURGE_WORKER_ADVERTISE", host,
        help="host other nodes reach this agent at (default: --host, or the host name when listening on all addresses)",
    )  # fmt: skip
    p.add_argument(
        "--worker-id",
        default=env.get("SURGE_WORKER_ID"),
        help="stable id (env SURGE_WORKER_ID; default <hostname>-<port>)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=env.get("SURGE_WORKER_SLOTS"),
        help="rank processes this node may run (env SURGE_WORKER_SLOTS; default: CUDA devices, else 1)",
    )
    p.add_argument(
        "--host-share",
        type=int,
        default=env.get("SURGE_WORKER_HOST_SHARE", 1),
        help="node agents sharing this host's RAM; each registers RAM / N as its memory "
        "(env SURGE_WORKER_HOST_SHARE; default 1; `surgectl up --workers N` passes N)",
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="rank logs go to <run-dir>/logs (default $SURGE_HOME/run)"
    )
    p.add_argument(
        "--memory-check-seconds",
        type=seconds("SURGE_WORKER_MEMORY_CHECK_SECONDS"),
        default=env.get("SURGE_WORKER_MEMORY_CHECK_SECONDS") or 2.0,
        help="seconds between host memory samples (env SURGE_WORKER_MEMORY_CHECK_SECONDS; 0 disables)",
    )
    p.add_argument(
        "--memory-pressure-fraction",
        type=float,
        default=env.get("SURGE_WORKER_MEMORY_PRESSURE_FRACTION") or 0.10,
        help="report memory pressure below this fraction of MemTotal available (env SURGE_WORKER_MEMORY_PRESSURE_FRACTION)",
    )
    p.add_argument(
        "--gpu-check-seconds",
        type=seconds("SURGE_WORKER_GPU_CHECK_SECONDS"),
        default=env.get("SURGE_WORKER_GPU_CHECK_SECONDS") or 5.0,
        help="seconds between GPU health samples through NVML (env SURGE_WORKER_GPU_CHECK_SECONDS; 0 disables)",
    )
    p.add_argument(
        "--gpu-memory-pressure-fraction",
        type=float,
        default=env.get("SURGE_WORKER_GPU_MEMORY_PRESSURE_FRACTION") or 0.95,
        help="report a device under memory pressure at this fraction of its memory used "
        "(env SURGE_WORKER_GPU_MEMORY_PRESSURE_FRACTION)",
    )
    env_option(p, "--metrics-port", "SURGE_WORKER_METRICS_PORT", port, "0", "Prometheus /metrics port (0: off)")
    p.add_argument(
        "--departure-seconds",
        type=seconds(DEPARTURE_ENV),
        default=env.get(DEPARTURE_ENV) or DEFAULT_DEPARTURE_SECONDS,
        help="on SIGTERM or SIGUSR1, keep the ranks this long while control moves them away after a "
        f"checkpoint (env {DEPARTURE_ENV}; default {DEFAULT_DEPARTURE_SECONDS:g}; 0: stop them at once)",
    )
    args = p.parse_args(argv)
    args.departure_seconds = float(args.departure_seconds)
    if args.port is None:
        p.error("--port (or SURGE_WORKER_PORT) is required")
    if not args.control:
        p.error("--control (or SURGE_CONTROL_ADDRESS) is required")
    if args.slots is not None and args.slots < 1:
        p.error(f"--slots: must be >= 1, got {args.slots}")
    if args.host_share < 1:
        p.error(f"--host-share: must be >= 1, got {args.host_share}")
    if os.environ.get(FORKSERVER_ENV, "lazy") not in FORKSERVER_MODES:
        p.error(f"{FORKSERVER_ENV}: one of {', '.join(FORKSERVER_MODES)}, got {os.environ[FORKSERVER_ENV]!r}")
    if problem := memory_copies_env_problem() or rank_logs.env_problem():
        p.error(problem)
    if not 0 < args.memory_pressure_fraction < 1:
        p.error(f"--memory-pressure-fraction: must be in (0, 1), got {args.memory_pressure_fraction}")
    if not 0 < args.gpu_memory_pressure_fraction < 1:
        p.error(f"--gpu-memory-pressure-fraction: must be in (0, 1), got {args.gpu_memory_pressure_fraction}")
    return args


def local_host(listen_host: str) -> str:
    """Where a rank on this node reaches the agent (loopback when listening everywhere)."""
    return "127.0.0.1" if listen_host in WILDCARD_HOSTS else listen_host


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        return 2
    thread_names.install()  # its threads seen by name from outside (bench/stack_cost.py)
    stack_dump.install()  # `kill -USR2 PID`: every thread's stack into its log (a hang's diagnosis)
    grpc_waits.install()  # its stream readers wait without gRPC's 0.1 s poll (grpc_waits.py)
    try:
        validate_table()  # the node agent relays the table's messages (it is EXT_HARDWARE)
    except ContractError as e:
        return refuse("worker", e)
    try:
        # one thread per rank session; no BDP probe per rank message (a fixed window instead: SMALL_AND_BULK)
        server = ServiceServer("worker", args.host, args.port, max_workers=64, options=SMALL_AND_BULK)
        http = serve_metrics("worker", args.host, args.metrics_port)
    except PortInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status  # EXIT_PORT_IN_USE when another holds it, else 2
    port = server.port
    worker_id = args.worker_id or f"{socket.gethostname()}-{port}"
    log = logs.configure("worker", worker_id=worker_id)
    advertise = args.advertise or (socket.gethostname() if args.host in WILDCARD_HOSTS else args.host)
    if not os.environ.get(GLOO_IFNAME) and (ifname := gloo_interface(advertise)):
        os.environ[GLOO_IFNAME] = ifname  # every rank and the fork server start with this environment
    cuda = detect_cuda_devices(os.environ.get(SYSFS_ENV) or DEFAULT_SYSFS)
    meminfo = os.environ.get(MEMINFO_ENV) or DEFAULT_MEMINFO
    registration = hardware_report(
        worker_id, f"{advertise}:{port}", args.slots or len(cuda) or 1, cuda, meminfo, args.host_share
    )
    # This process's event sequence (WorkerEvent.seq) is new: a restarted agent is a new
    # incarnation to control, which then expects seq 1 again.
    registration.incarnation = uuid.uuid4().hex

    outbox = Outbox()
    # A command from control this agent refuses (its sender may not send it here) goes up as
    # the contract layer's report, like a rank's.
    violations = ViolationReporter(
        worker_id,
        log,
        deliver=lambda event: outbox.put(control_pb2.WorkerEvent(routed=pack(event, Module.EXT_CONTRACT))),
    )
    # In-memory copies of the local ranks' newest checkpoint (0 bytes: off; the ranks then
    # find no MemoryCopyService here and read the store only).
    memory_limit = limit_from_env(registration.memory_bytes)
    # A peer's heal reads them on a bulk lane beside this server (plaintext: none under TLS).
    lane_host = None if server.tls else args.host
    memory = (
        MemoryCopies(worker_id, log, memory_limit, shm_from_env(worker_id), lane_host=lane_host)
        if memory_limit > 0
        else None
    )
    rank_module = os.environ.get(RANK_MODULE_ENV) or DEFAULT_RANK_MODULE
    run_dir = args.run_dir or paths.run_dir()
    log_settings = rank_logs.settings_from_env()
    pump = rank_logs.LogPump(log)
    forkserver = forkserver_from_env(worker_id, Path(run_dir), rank_module, pump, log_settings)
    # Data-plane link probes (UDP on this agent's own address and port number): off, said in
    # one line, where the port cannot be bound for UDP.
    try:
        links = LinkProber(worker_id, args.host, port, outbox.put, log, key=probe_key(os.environ.get(AUTH_TOKEN_ENV)))
    except OSError as e:
        log.warning("link probes off: UDP port unavailable", port=port, error=str(e))
        links = None
    agent = NodeAgent(
        worker_id,
        session_address=f"{local_host(args.host)}:{port}",
        run_dir=run_dir,
        emit=outbox.put,
        log=log,
        rank_module=rank_module,
        cwd=Path.cwd(),
        bus=Bus(on_violation=violations),
        memory=memory,
        forkserver=forkserver,
        devices=registration.devices,
        log_settings=log_settings,
        pump=pump,
        links=links,
        together=outbox.together,  # (a rank's message: one message up)
    )
    if forkserver is not None and os.environ.get(FORKSERVER_ENV) == "eager":
        forkserver.start()  # a spare node: its imports done before any rank is lost
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(RankSessionServicer(agent, log), server.server)
    if memory is not None:
        worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(memory), server.server)
    audit_pb2_grpc.add_AuditServiceServicer_to_server(
        AuditServicer(
            worker_id, report=lambda request: merge_reports(worker_id, [report_of(worker_id), agent.audit()])
        ),
        server.server,
    )

    def current_registration():
        # Every (re-)registration declares the ranks still running here (re-attach).
        reg = type(registration)()
        reg.CopyFrom(registration)
        reg.running.extend(agent.running())
        # ...and what it knows of their processes (stopped or running), after the registration:
        # a control that restarted has not heard it.
        agent.restate_processes()
        if links is not None:
            links.restate()  # (control forgot this agent's link views when it registered)
        agent.steps.new_session()  # (a restarted control hears each rank's step once)
        return reg

    # The agent's own beat rides with its ranks' beats (one message per node and period).
    session = ControlSession(args.control, current_registration, outbox, agent.execute, log, beats=agent.beats)
    sampler = None
    if args.memory_check_seconds > 0:
        sampler = MemorySampler(
            worker_id, outbox.put, log, meminfo, args.memory_check_seconds, args.memory_pressure_fraction
        )
    gpus = None
    if args.gpu_check_seconds > 0:
        gpus = GpuHealthSampler(
            worker_id,
            outbox.put,
            log,
            args.gpu_check_seconds,
            args.gpu_memory_pressure_fraction,
            devices={d.index for d in cuda} if cuda else None,  # (the devices this agent registered)
        )

    stop = threading.Event()
    signalled: list[tuple[int, float]] = []  # (signal, unix time): the first one decides

    def on_signal(signum, frame) -> None:
        if not signalled:
            signalled.append((signum, time.time()))
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, *NOTICE_SIGNALS):
        signal.signal(sig, on_signal)
    server.start([SERVICE_NAME, AuditServicer.SERVICE_NAME] + ([MEMORY_SERVICE_NAME] if memory is not None else []))
    session.start()
    if links is not None:
        links.start()
    if sampler is not None:
        sampler.start()
    if gpus is not None and not gpus.start():  # (no NVML: off, said in one line)
        gpus = None
    log.info(
        "worker serving",
        port=port,
        control=args.control,
        address=registration.address,
        slots=registration.slots,
        memory_bytes=registration.memory_bytes,  # the host's RAM / host_share: what its slots' quotas divide
        host_share=args.host_share,
        memory_check_seconds=args.memory_check_seconds,
        devices=[f"{d.kind}:{d.index} {d.name}" for d in registration.devices],
    )
    stop.wait()

    log.info("worker stopping")
    signum, signalled_unix = signalled[0] if signalled else (signal.SIGTERM, time.time())
    # Say it first: control places no rank here any more, and the exits that follow are
    # this agent's departure (one incident), not crashes.
    outbox.put(
        control_pb2.WorkerEvent(
            register=control_pb2.WorkerRegistration(
                worker_id=worker_id, incarnation=registration.incarnation, departing=True
            )
        )
    )
    if signum in NOTICE_SIGNALS and args.departure_seconds > 0 and agent.has_ranks():
        # A departure with notice: control checkpoints the jobs here and moves their ranks away
        # (it releases them here); the samplers and probes keep watching them meanwhile.
        outbox.put(announcement(registration.incarnation, args.departure_seconds, signalled_unix, signum))
        log.info(
            "departing: ranks kept until released",
            signal=signal.Signals(signum).name,
            deadline_s=args.departure_seconds,
        )
        why = wait_for_release(
            agent.has_ranks, session.connected, args.departure_seconds - (time.time() - signalled_unix)
        )
        log.info("departing: stopping", why=why)
    if sampler is not None:
        sampler.stop()
    if gpus is not None:
        gpus.stop()
    if links is not None:
        links.stop()
    agent.shutdown(SHUTDOWN_GRACE_SECONDS)  # first: no rank may outlive the agent
    if memory is not None:
        memory.close()
    session.close(drain_seconds=1.0)  # lets the ranks' RankExited go up if control is there
    server.stop(grace=0.5)
    if http is not None:
        http.shutdown()
    log.info("worker stopped")
    return 0


FORKSERVER_ENV = "SURGE_WORKER_RANK_FORKSERVER"
FORKSERVER_MODES = ("lazy", "eager", "off")


def forkserver_from_env(
    worker_id: str,
    run_dir: Path,
    rank_module: str,
    pump: rank_logs.LogPump,
    log_settings: rank_logs.LogSettings | None = None,
) -> RankForkServer | None:
    """The rank fork server (``SURGE_WORKER_RANK_FORKSERVER``: lazy | eager | off), for the
    real rank module only (a test's stand-in rank module starts as it is), and only where
    this process can adopt the ranks it forks (Linux ``PR_SET_CHILD_SUBREAPER``). (Its value
    was checked with the command line.)"""
    if os.environ.get(FORKSERVER_ENV, "lazy") == "off" or rank_module != DEFAULT_RANK_MODULE:
        return None
    if not become_subreaper():
        return None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    log_path = run_dir / "logs" / f"forkserver-{worker_id}.log"
    return RankForkServer(env, REPO_ROOT, log_path, pump, log_settings)


if __name__ == "__main__":
    sys.exit(main())
