"""Composition root of `control` (L1): the only place its modules are built and wired.

    python -m services.control --port P [--host 127.0.0.1] [--db PATH] --data ADDR --store ADDR
        [--metrics-port M] [--max-sessions N] [--webhook URL] [--tokens FILE]
        [--liveness-port U] [--liveness-advertise-port U] [--liveness-datagrams]

Environment: SURGE_CONTROL_PORT, SURGE_CONTROL_DB (default ``$SURGE_HOME/control.db``),
SURGE_DATA_ADDRESS, SURGE_STORE_ADDRESS, SURGE_CONTROL_METRICS_PORT (Prometheus
``/metrics``; default 0 = not served), SURGE_CONTROL_WEBHOOK (job-end webhook for jobs whose
spec names none: services/control/webhooks.py), SURGE_CONTROL_LIVENESS_PORT,
SURGE_CONTROL_LIVENESS_ADVERTISE_PORT and SURGE_CONTROL_LIVENESS_DATAGRAMS=on (the node agents'
liveness beats as UDP datagrams, opt-in: services/control/liveness_datagrams.py), SURGE_TOKENS_FILE (per-team access: principals
bound to teams, services/common/access.py; a file that cannot be read or is invalid is one
line on stderr and exit status 2). Also serves ``surge.v1.AuditService``. A port already
in use is one line on stderr and exit status 2; SIGTERM / SIGINT stop it cleanly (sessions
end, the journal closes).

Each module gets a CommandPort for every module it may command and an Emitter for its own
events; none holds a reference to another, so the route table's permissions are facts of
construction, checked again on every send. A send the table refuses is reported to the
fault detector as ``BoundaryViolationReported`` from EXT_CONTRACT (this process's contract
layer), as are the violations node agents relay from their ranks.

gRPC is served by ``grpc.aio`` (``AioServiceServer``): node agent sessions live on its
asyncio loop and their messages are applied by a small pool of threads (``EventApplier``:
each job's in order on the job's own queue, jobs in parallel), so a session costs no thread;
the operator RPCs run in a small thread pool.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from services.common import grpc_waits, logs, paths, stack_dump, thread_names
from services.common.access import TOKENS_FILE_ENV, reload_tokens, tokens_of_flag
from services.common.grpc_server import SMALL_MESSAGES, AioServiceServer, PortInUse, serve_metrics
from services.common.service_args import ServiceArgumentParser, address, env_option, listen_host, port
from services.contract import (
    Module,
    audit_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
    engine_pb2,
    store_pb2,
)
from services.contract.audit import AuditServicer, ViolationReporter
from services.contract.bus import Bus, RouteError
from services.contract.injection import env_error
from services.contract.relay import L1, L5, RANK, Link
from services.contract.validation import ContractError, refuse, validate_table, validate_wiring
from services.control import faults, metrics
from services.control.access import ControlAccess
from services.control.beat_stamps import BeatStamps
from services.control.event_applier import EventApplier, InOrder
from services.control.fault_detector import DEFAULT_RULES, FaultDetector
from services.control.job_store import JobStore
from services.control.liveness_datagrams import LivenessDatagrams
from services.control.orchestrator import PREEMPTION_CLAIM_S, Orchestrator
from services.control.recovery_controller import RecoveryController
from services.control.resource_allocator import ResourceAllocator
from services.control.scheduler import QuotaBook, QuotaFileError, load_quota_file
from services.control.server import ControlServicer
from services.control.session_hub import SessionHub
from services.control.sick_nodes import SickNodePolicy
from services.control.store_relay import StoreRelay
from services.control.watch_hub import WatchHub
from services.control.webhooks import WebhookSender
from services.jobspec import WEBHOOK_PATTERN

# What this process hosts on its bus: the four L1 modules, and the relays standing in for
# the operator, the node agents, the ranks' modules (the session hub, for every command an
# L1 module sends one), the checkpoint manager and the contract layer (checked by
# validate_wiring at start-up).
HOSTED = (
    Module.L1_ORCHESTRATOR,
    Module.L1_RESOURCE_ALLOCATOR,
    Module.L1_FAULT_DETECTOR,
    Module.L1_RECOVERY_CONTROLLER,
    Module.EXT_USER,
    Module.EXT_HARDWARE,
    *sorted(RANK),
    Module.L5_CHECKPOINT_MANAGER,
    Module.L5_METRICS_LOGGER,
    Module.EXT_CONTRACT,
)


@dataclass
class Control:
    """The wired control plane of one process (what tests and ``main`` hold)."""

    bus: Bus
    servicer: ControlServicer
    sessions: SessionHub
    journal: JobStore
    detector: FaultDetector
    orchestrator: Orchestrator
    store: StoreRelay
    webhooks: WebhookSender
    liveness: LivenessDatagrams | None = None  # the agents' liveness datagrams (None: not read)


def build(
    journal: JobStore,
    *,
    data_address: str,
    store_address: str,
    host: str = "127.0.0.1",
    fault_rules: Mapping[str, int] | None = None,
    sick_nodes: SickNodePolicy | None = None,
    persist_interval_s: float = 1.0,
    max_sessions: int = 8192,
    webhook: str = "",
    access: ControlAccess | None = None,
    preemption_grace_s: float = 60.0,
    preemption_min_run_s: float = 120.0,
    resize_min_interval_s: float = 60.0,
    quotas: QuotaBook | None = None,
    preemption_claim_s: float = PREEMPTION_CLAIM_S,
    liveness_port: int | None = None,
    liveness_advertise_port: int = 0,
) -> Control:
    """Build and wire the four L1 modules and the relays on one bus.

    Raises:
        RouteError: a wiring the route table does not allow (a bug, found at start-up).
        ContractError: the route table or this wiring breaks the contract (validation.py).
        ValueError: an invalid fault rule.

    ``quotas``: the teams' quotas from ``--quotas FILE`` (None: every team unlimited).
    ``liveness_port``: the UDP port on ``host`` where the node agents send their liveness beats
    as datagrams (0: any free one; None: none, they beat on their sessions; a port that cannot
    be bound: none, with a warning). ``liveness_advertise_port``: the port they are told (a
    NAT's; 0: the bound one).
    """
    # The reporter sends as EXT_CONTRACT on this same bus (bound just below), from its own
    # thread: the violating module may be mid-decision.
    reporter = ViolationReporter("control", structlog.get_logger("control"), deliver=lambda event: contract(event))
    bus = Bus(on_violation=reporter)
    validate_table(bus.table)
    contract = bus.emitter(Module.EXT_CONTRACT)

    allocator = ResourceAllocator(
        hardware=bus.port(
            Module.L1_RESOURCE_ALLOCATOR,
            Module.EXT_HARDWARE,
            commands=(control_pb2.LaunchRanks, control_pb2.ReleaseRanks),
        ),
        emit=bus.emitter(Module.L1_RESOURCE_ALLOCATOR),
        control_host=host,
        # The fresh rendezvous of a group rebuilt in place, to L2-2 of the job's ranks through
        # the session hub (its stand-in for the rank modules, subscribed below).
        parallel=bus.port(
            Module.L1_RESOURCE_ALLOCATOR,
            Module.L2_PARALLEL_STRATEGY,
            commands=(engine_pb2.RebuildParallelGroup,),
        ),
    )
    recovery = RecoveryController(
        resources=bus.port(
            Module.L1_RECOVERY_CONTROLLER, Module.L1_RESOURCE_ALLOCATOR, commands=(control_pb2.RebuildCommunicator,)
        )
    )
    # The node agents' sessions: routed events from the nodes go on this bus as the modules
    # that sent them (rank modules, their L4/L5 relays, EXT_CONTRACT), checked by the hub's link.
    sessions = SessionHub(bus, hardware=bus.emitter(Module.EXT_HARDWARE), journal=journal)
    # Their messages, applied per job in order (the servicer queues them on receipt).
    # An agent's beat that changes nothing is taken on the loop that reads it: stamped here,
    # its silence deadline (armed by L1-3) moved (services/control/beat_stamps.py).
    stamps = BeatStamps()
    applier = EventApplier(sessions, stamps=stamps)
    # A silence or stall deadline that fired is decided on the queue of the messages that
    # re-arm it, after those received before it fired: control's lag is no one's silence.
    detector = FaultDetector(
        emit=bus.emitter(Module.L1_FAULT_DETECTOR),
        rules=fault_rules,
        sick_nodes=sick_nodes,
        in_order=InOrder(applier),
        stamps=stamps,
        health=applier.health,  # control's own lag: agent verdicts wait while it is behind
    )
    # Every known fault class's, outcome's and cause's series at 0 (a series born at 1 reads 0
    # in increase(): rules and the dashboard missed each class's first fault).
    # (the detector's table: its defaults under control's overrides, validated just above)
    metrics.initialise_series({**DEFAULT_RULES, **(fault_rules or {})})
    watches = WatchHub()
    # Job-end webhooks (services/control/webhooks.py): queued here, POSTed on its own thread.
    webhooks = WebhookSender(webhook, spec_json=journal.spec_json)
    # What the store's modules send control's side comes back with a failed call, by name,
    # checked (the store may speak only for L5 modules).
    from_store = Link(bus, name="store service", near=L1, beyond=L5)
    store = StoreRelay(
        store_address,
        events=bus.emitter(Module.L5_CHECKPOINT_MANAGER),
        on_error=reporter.relay_rpc_error,
        back=from_store,
    )

    # Relays first, so that restoring jobs (inside Orchestrator()) publishes to a wired bus.
    bus.subscribe(Module.EXT_USER, control_pb2.JobEvent, _both(watches.on_job_event, webhooks.on_job_event))
    bus.subscribe(Module.EXT_HARDWARE, control_pb2.LaunchRanks, sessions.launch_ranks)
    bus.subscribe(Module.EXT_HARDWARE, control_pb2.ReleaseRanks, sessions.release_ranks)
    sessions.stand_in()  # every command from an L1 module to a rank module, by its name
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.VerifyCheckpoints, store.verify_checkpoints)
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.ScrubCheckpoints, store.scrub_checkpoints)
    bus.subscribe(Module.L5_METRICS_LOGGER, store_pb2.RetireMetricSeries, store.retire_metric_series)
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.RetireCheckpointSeries, store.retire_checkpoint_series)

    # Each L1 module is hosted: every route to it goes to the handler the table names
    # (Bus.host), and an event reaches its receivers in the table's order (receivers of its
    # route option), whatever the order of these lines.
    bus.host(Module.L1_RESOURCE_ALLOCATOR, allocator)
    # (What an L1 module does not handle its route says, with the reason: not_handled.)
    bus.host(Module.L1_RECOVERY_CONTROLLER, recovery)
    # The detector before the orchestrator is built: restoring a live job re-arms its watch.
    # Every failure event routed to L1-3 goes to on_failure, graded by (event, cause).
    bus.host(Module.L1_FAULT_DETECTOR, detector)

    orchestrator = Orchestrator(
        allocator=bus.port(
            Module.L1_ORCHESTRATOR,
            Module.L1_RESOURCE_ALLOCATOR,
            commands=(control_pb2.AllocateResources, control_pb2.ReleaseResources, control_pb2.CordonWorker),
        ),
        faults=bus.port(
            Module.L1_ORCHESTRATOR,
            Module.L1_FAULT_DETECTOR,
            commands=(control_pb2.StartFaultMonitoring, control_pb2.ResetFaultLedger),
        ),
        recovery=bus.port(Module.L1_ORCHESTRATOR, Module.L1_RECOVERY_CONTROLLER, commands=(control_pb2.StartRecovery,)),
        loop=bus.port(
            Module.L1_ORCHESTRATOR,
            Module.L2_TRAINING_LOOP,
            commands=(
                engine_pb2.StartTraining,
                engine_pb2.PauseTraining,
                engine_pb2.ResumeTraining,
                engine_pb2.StopTraining,
                engine_pb2.StepVerdict,
                engine_pb2.RevokeStandingOrder,
                engine_pb2.FreezeTraining,
                engine_pb2.ProfileSteps,
            ),
        ),
        emit=bus.emitter(Module.L1_ORCHESTRATOR),
        journal=journal,
        data_address=data_address,
        store_address=store_address,
        persist_interval_s=persist_interval_s,
        preemption_grace_s=preemption_grace_s,
        preemption_min_run_s=preemption_min_run_s,
        preemption_claim_s=preemption_claim_s,
        resize_min_interval_s=resize_min_interval_s,
        checkpoints=bus.port(
            Module.L1_ORCHESTRATOR,
            Module.L5_CHECKPOINT_MANAGER,
            commands=(store_pb2.VerifyCheckpoints, store_pb2.ScrubCheckpoints, store_pb2.RetireCheckpointSeries),
        ),
        # A job's end and its ranks' relaunch retire its series on the store's /metrics (its
        # end L5-1's too, through the port above).
        metric_series=bus.port(
            Module.L1_ORCHESTRATOR, Module.L5_METRICS_LOGGER, commands=(store_pb2.RetireMetricSeries,)
        ),
        quotas=quotas,
    )
    bus.host(Module.L1_ORCHESTRATOR, orchestrator)
    user = bus.port(
        Module.EXT_USER,
        Module.L1_ORCHESTRATOR,
        commands=(
            control_pb2.SubmitJobRequest,
            control_pb2.JobQuery,
            control_pb2.PauseJobRequest,
            control_pb2.ResumeJobRequest,
            control_pb2.ScaleJobRequest,
            control_pb2.StopJobRequest,
            control_pb2.DeleteJobRequest,
            control_pb2.RevokeOrderRequest,
            control_pb2.AnnotateJobRequest,
            control_pb2.ProfileJobRequest,
            control_pb2.UncordonWorkerRequest,
            control_pb2.DrainWorkerRequest,
            control_pb2.SetTeamQuotaRequest,
            control_pb2.TeamQuery,
        ),
    )
    # A liveness-only beat may come as a datagram (liveness_datagrams.py): the same route as a
    # session's AgentHeartbeat, taken by the same stamps or queued as the session's on the applier.
    liveness = None
    if liveness_port is not None:
        try:
            liveness = LivenessDatagrams(stamps, applier.events, host, liveness_port, liveness_advertise_port)
        except OSError as e:  # (the agents beat on their sessions: slower at scale, never wrong)
            structlog.get_logger("control").warning(
                "liveness datagrams off: the UDP port could not be bound", port=liveness_port, error=str(e)
            )
    servicer = ControlServicer(
        user=user,
        watches=watches,
        sessions=sessions,
        applier=applier,
        max_sessions=max_sessions,
        access=access,
        liveness=liveness,
    )
    # The store's answers are applied in order with the node agents' events, on one thread.
    store.post = servicer.applier.call
    validate_wiring(bus, HOSTED)
    return Control(
        bus=bus,
        servicer=servicer,
        sessions=sessions,
        journal=journal,
        detector=detector,
        orchestrator=orchestrator,
        store=store,
        webhooks=webhooks,
        liveness=liveness,
    )


def _both(first, second):
    """One EXT_USER subscription feeding the watch streams, then the webhooks."""

    def handler(msg, payload=None) -> None:
        first(msg, payload)
        second(msg, payload)

    return handler


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    p = ServiceArgumentParser(prog="python -m services.control", description="Surge control service (L1)")
    env_option(p, "--host", "SURGE_CONTROL_HOST", listen_host, "127.0.0.1", "address to listen on")
    env_option(p, "--port", "SURGE_CONTROL_PORT", port, help="gRPC port (0: any free port)")
    p.add_argument("--db", default=env.get("SURGE_CONTROL_DB") or str(paths.surge_home() / "control.db"))
    env_option(p, "--data", "SURGE_DATA_ADDRESS", address, help="host:port of the data service")
    env_option(p, "--store", "SURGE_STORE_ADDRESS", address, help="host:port of the store service")
    env_option(p, "--metrics-port", "SURGE_CONTROL_METRICS_PORT", port, "0", "Prometheus /metrics port (0: off)")
    # A session costs no thread (asyncio), only memory and its share of the applier: this is
    # an admission limit; the agent past it is refused with RESOURCE_EXHAUSTED and retries.
    p.add_argument(
        "--max-sessions",
        type=int,
        default=int(env.get("SURGE_CONTROL_MAX_SESSIONS") or 8192),
        help="node agent sessions held at once; more are refused (env SURGE_CONTROL_MAX_SESSIONS)",
    )
    # A sick node (services/control/sick_nodes.py): this many rank faults on one node (a
    # launch's ranks dying there in one incident: one) from this many launches (job,
    # generation) within the window quarantine it until `surgectl uncordon`.
    p.add_argument(
        "--sick-node-faults",
        type=int,
        default=env.get("SURGE_SICK_NODE_FAULTS") or "3",
        help="rank faults on one node that quarantine it; 0: never (env SURGE_SICK_NODE_FAULTS)",
    )
    p.add_argument(
        "--sick-node-incidents",
        type=int,
        default=env.get("SURGE_SICK_NODE_INCIDENTS") or "2",
        help="distinct launches (job, generation) those faults must come from (env SURGE_SICK_NODE_INCIDENTS)",
    )
    p.add_argument(
        "--sick-node-window-seconds",
        type=float,
        default=env.get("SURGE_SICK_NODE_WINDOW_SECONDS") or "600",
        help="how far back faults count (env SURGE_SICK_NODE_WINDOW_SECONDS)",
    )
    # Job-end webhooks (services/control/webhooks.py) for jobs whose spec names none.
    p.add_argument(
        "--webhook",
        default=env.get("SURGE_CONTROL_WEBHOOK") or "",
        help="http(s) URL POSTed a JSON when a job ends FINISHED or FAILED, unless its spec's "
        "notify.webhook names another (env SURGE_CONTROL_WEBHOOK)",
    )
    # Per-team access (services/common/access.py): the principals of control's user port.
    p.add_argument(
        "--tokens",
        default=env.get(TOKENS_FILE_ENV) or "",
        help="tokens file: principals (token digests, certificate names) bound to teams and roles; "
        f"a team then sees and controls its own jobs only (env {TOKENS_FILE_ENV}; default: none, "
        "SURGE_AUTH_TOKEN alone guards the mutating calls)",
    )
    # Priority preemption (services/control/orchestrator/preemption.py).
    p.add_argument(
        "--preemption-grace-seconds",
        type=float,
        default=env.get("SURGE_PREEMPTION_GRACE_SECONDS") or "60",
        help="how long a preempted job may take to checkpoint at a step boundary before it moves from "
        "its newest checkpoint (env SURGE_PREEMPTION_GRACE_SECONDS)",
    )
    p.add_argument(
        "--preemption-min-run-seconds",
        type=float,
        default=env.get("SURGE_PREEMPTION_MIN_RUN_SECONDS") or "120",
        help="a job started or resumed less than this long ago is not preempted (no thrashing; env "
        "SURGE_PREEMPTION_MIN_RUN_SECONDS)",
    )
    p.add_argument(
        "--preemption-claim-seconds",
        type=float,
        default=env.get("SURGE_PREEMPTION_CLAIM_SECONDS") or str(PREEMPTION_CLAIM_S),
        help="how long a preemptor waiting in the queue claims the slots its victims free, first in line; then "
        "it waits at its place in the fair order (env SURGE_PREEMPTION_CLAIM_SECONDS)",
    )
    p.add_argument(
        "--resize-min-interval-seconds",
        type=float,
        default=env.get("SURGE_RESIZE_MIN_INTERVAL_SECONDS") or "60",
        help="a job shrunk by a fault grows back at most once per this (env SURGE_RESIZE_MIN_INTERVAL_SECONDS)",
    )
    # The node agents' liveness beats as UDP datagrams (services/control/liveness_datagrams.py).
    env_option(
        p,
        "--liveness-port",
        "SURGE_CONTROL_LIVENESS_PORT",
        port,
        None,
        "UDP port of the agents' liveness datagrams (default: the gRPC port's number; 0: any free one)",
    )
    env_option(
        p,
        "--liveness-advertise-port",
        "SURGE_CONTROL_LIVENESS_ADVERTISE_PORT",
        port,
        "0",
        "the UDP port the agents are told to send to, where a NAT publishes it under another (0: the bound one)",
    )
    # Opt-in for now: at 10,000 simulated agents on a starved 2-core host the fallback flipped
    # sessions between datagrams and gRPC by the tens of thousands, and the control-restart case
    # was not measured with it (docs/LOG.md, session 36). Off, every agent beats on its session.
    p.add_argument(
        "--liveness-datagrams",
        action="store_true",
        default=None,
        help="read the node agents' liveness beats as UDP datagrams (env SURGE_CONTROL_LIVENESS_DATAGRAMS=on)",
    )
    # Teams' quotas (issue 30; services/control/scheduler/quotas.py): read at start; a team
    # set or removed by `surgectl team` since (journaled) keeps that.
    p.add_argument(
        "--quotas",
        default=env.get("SURGE_CONTROL_QUOTAS") or "",
        help="YAML file of the teams' quotas (nominal, borrow_limit, hard_limit, weight, cohort); "
        "none: every team unlimited (env SURGE_CONTROL_QUOTAS)",
    )
    args = p.parse_args(argv)
    if args.resize_min_interval_seconds < 0:
        p.error(f"--resize-min-interval-seconds must be >= 0, got {args.resize_min_interval_seconds:g}")
    if args.preemption_claim_seconds <= 0:
        p.error(f"--preemption-claim-seconds must be > 0, got {args.preemption_claim_seconds:g}")
    if args.preemption_grace_seconds <= 0 or args.preemption_min_run_seconds < 0:
        p.error(
            "--preemption-grace-seconds must be > 0 and --preemption-min-run-seconds >= 0, got "
            f"{args.preemption_grace_seconds:g} and {args.preemption_min_run_seconds:g}"
        )
    if args.webhook and not re.match(WEBHOOK_PATTERN, args.webhook):
        p.error(f"--webhook (or SURGE_CONTROL_WEBHOOK): expected an http:// or https:// URL, got {args.webhook!r}")
    if args.liveness_datagrams is None:  # (the flag not given: the variable, on or off, nothing else)
        raw = env.get("SURGE_CONTROL_LIVENESS_DATAGRAMS", "")
        datagrams = raw.strip().lower()
        if datagrams not in ("on", "off", ""):  # (was: anything but "on" silently meant off, "ON" included)
            p.error(f"SURGE_CONTROL_LIVENESS_DATAGRAMS: expected on or off, got {raw!r}")
        args.liveness_datagrams = datagrams == "on"
    if args.max_sessions < 1:
        p.error(f"--max-sessions must be >= 1, got {args.max_sessions}")
    if args.sick_node_faults < 0:
        p.error(f"--sick-node-faults must be >= 0 (0: never), got {args.sick_node_faults}")
    if args.sick_node_incidents < 1:
        p.error(f"--sick-node-incidents must be >= 1, got {args.sick_node_incidents}")
    if not 0 < args.sick_node_window_seconds <= 30 * 24 * 3600:
        p.error(f"--sick-node-window-seconds must be in (0, 2592000], got {args.sick_node_window_seconds:g}")
    args.quota_book = None
    if args.quotas:
        try:
            args.quota_book = load_quota_file(args.quotas)
        except QuotaFileError as e:
            p.error(f"--quotas: {e}")
    for name, flag, var in (
        ("port", "--port", "SURGE_CONTROL_PORT"),
        ("data", "--data", "SURGE_DATA_ADDRESS"),
        ("store", "--store", "SURGE_STORE_ADDRESS"),
    ):
        if getattr(args, name) is None:
            p.error(f"{flag} (or {var}) is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        return 2
    thread_names.install()  # its threads seen by name from outside (bench/stack_cost.py)
    stack_dump.install()  # `kill -USR2 PID`: every thread's stack into its log (a hang's diagnosis)
    grpc_waits.install()  # its stream readers wait without gRPC's 0.1 s poll (grpc_waits.py)
    log = logs.configure("control")
    identities = tokens_of_flag(args.tokens)  # (a bad file: one line, exit 2)
    try:
        # 64 threads: the operator RPCs (a WatchJob or StreamLogs stream holds one while open).
        # While more than max_pending_requests calls (gRPC core's default 1,000) wait for the
        # server to pick them up, core cancels a growing share of new ones (all past the hard
        # limit, 3,000): measured, 5,000 agents registering at once lost ~1,200 that way.
        pending = [
            ("grpc.server.max_pending_requests", args.max_sessions),
            ("grpc.server.max_pending_requests_hard_limit", 2 * args.max_sessions),
            *SMALL_MESSAGES,  # (each node's events, paced, draw no BDP ping: grpc_server.py)
        ]
        server = AioServiceServer(
            "control", args.host, args.port, executor_threads=64, options=pending, identities=identities
        )
        http = serve_metrics("control", args.host, args.metrics_port)
    except PortInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status  # EXIT_PORT_IN_USE when another holds it, else 2
    journal = faults.install(JobStore(args.db))  # (test-only injections, off by default)
    try:
        control = build(
            journal,
            data_address=args.data,
            store_address=args.store,
            host=args.host,
            max_sessions=args.max_sessions,
            webhook=args.webhook,
            access=ControlAccess(enforced=identities is not None),
            preemption_grace_s=args.preemption_grace_seconds,
            preemption_min_run_s=args.preemption_min_run_seconds,
            preemption_claim_s=args.preemption_claim_seconds,
            resize_min_interval_s=args.resize_min_interval_seconds,
            quotas=args.quota_book,
            liveness_port=None
            if not args.liveness_datagrams
            else (server.port if args.liveness_port is None else args.liveness_port),
            liveness_advertise_port=args.liveness_advertise_port,
            sick_nodes=SickNodePolicy(
                window_seconds=args.sick_node_window_seconds,
                faults=args.sick_node_faults,
                incidents=args.sick_node_incidents,
            ),
        )
    except (ContractError, RouteError) as e:
        server.stop(grace=0)
        journal.close()
        return refuse("control", e)
    control_pb2_grpc.add_ControlServiceServicer_to_server(control.servicer, server.server)
    # A fired silence deadline is decided behind what the server's loop has received by then.
    control.servicer.applier.receive_on(server.loop)
    audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditServicer("control"), server.server)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if identities is not None:
        signal.signal(signal.SIGHUP, lambda *_: reload_tokens(identities, log))
    server.start(["surge.v1.ControlService", AuditServicer.SERVICE_NAME])
    control.store.watch()  # the store's scrub findings, relayed for as long as control runs
    if control.liveness is not None:
        control.liveness.start()
    log.info(
        "control listening",
        address=f"{args.host}:{server.port}",
        db=args.db,
        data=args.data,
        store=args.store,
        metrics=args.metrics_port or None,
        tokens=args.tokens or None,
        liveness_udp=control.liveness.port if control.liveness is not None else None,
    )
    stop.wait()
    log.info("control stopping")
    control.detector.close()  # first: with the sessions ended, no beat arrives; that is no silence
    if control.liveness is not None:
        control.liveness.close()
    control.orchestrator.close()  # no recovery retry either: the restarted control resumes them
    control.store.close()
    control.webhooks.close(timeout_s=2.0)  # the notices of jobs that just ended, if they can go
    control.sessions.shutdown()  # before the server stops, so no session end reads as a lost node
    server.stop(grace=2.0)
    control.servicer.applier.stop()  # after the server: no message arrives any more
    if http is not None:
        http.shutdown()
    journal.close()
    log.info("control stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
