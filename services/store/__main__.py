"""Composition root of the `store` service: the only place its modules are built and wired.

    python -m services.store --port P --metrics-port M [--host 127.0.0.1] [--root DIR] [--tokens FILE]
                             [--scrub-interval-seconds S] [--series-linger-seconds L]

(env ``SURGE_STORE_PORT``, ``SURGE_STORE_METRICS_PORT``, ``SURGE_STORE_ROOT``,
``SURGE_STORE_SCRUB_INTERVAL_S``, ``SURGE_STORE_SERIES_LINGER_SECONDS``: an ended rank's
Prometheus series are removed L seconds after its loop ended, by this root's timer;
the root defaults to ``services.common.paths.store_root()``).

Where checkpoint bytes live and how ranks move them (SaveStaged.transfer tells every rank):

    --backend local --transfer path     (default) ranks write the store root's directories
                                        themselves: a filesystem mounted at the same path on
                                        every node (SURGE_STORE_BACKEND, SURGE_STORE_TRANSFER)
    --backend local --transfer stream   nothing shared: ranks stream their files to the store
                                        over gRPC, the store writes its own disk
    --backend s3 --s3-url s3://BUCKET/PREFIX [--s3-endpoint URL]
                                        chunks in S3-compatible object storage (s3fs), written
                                        and read by the ranks themselves; the small index files
                                        stream to the store, which keeps the catalog on its disk
                                        (SURGE_STORE_S3_URL, SURGE_STORE_S3_ENDPOINT; credentials
                                        from the standard AWS_* variables of each process)
Every S seconds (0, the default: never) the operator's scrub schedule sends L5-1 a
``ScrubCheckpoints`` for every job (as EXT_USER: the operator configured it): every committed
checkpoint version is re-hashed and its verdict recorded; a version newly found corrupt is
published (``StoreService.WatchCheckpoints``). The schedule's thread is this composition
root's, not L5-1's (modules keep no thread or timer of their own). gRPC ``surge.v1.StoreService`` and
``surge.v1.AuditService`` with health and reflection on P (``grpc.aio``: a stream holds no
thread, the save's control calls have the server's pool to themselves, see server.py); Prometheus ``/metrics`` on M. A
port in use is a one-line error and exit status 1; SIGTERM or SIGINT stops it cleanly
(status 0).

Wiring: L5-1 and L5-2 command nobody, so they get no ports; each is hosted on the bus
(``Bus.host``: every route to it goes to the handler the table names). The relay gets one
command port per remote sender that the route table lets command them, typed by the
messages that sender may send there, and nothing else.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import REGISTRY

from services.common import grpc_waits, logs, paths, stack_dump, thread_names
from services.common.access import TOKENS_FILE_ENV, reload_tokens, tokens_of_flag
from services.common.deadlines import Deadlines
from services.common.grpc_server import SMALL_AND_BULK, AioServiceServer, PortInUse, serve_metrics
from services.common.service_args import ServiceArgumentParser, env_option, listen_host, port, seconds
from services.contract import Module, audit_pb2_grpc, engine_pb2, route_pb2, store_pb2, store_pb2_grpc
from services.contract.audit import AuditServicer, ViolationReporter
from services.contract.bus import Bus, CommandPort, RouteError
from services.contract.injection import env_error
from services.contract.relay import L1, L5, RANK, Link
from services.contract.validation import ContractError, refuse, validate_table, validate_wiring
from services.store import metric_files
from services.store.access import StoreAccess
from services.store.checkpoint_manager import CheckpointManager
from services.store.chunk_roots import FsspecChunks
from services.store.job_teams import JobTeams
from services.store.metrics_logger import SERIES_LINGER_S, MetricsLogger
from services.store.profile_files import ProfileFiles
from services.store.server import StoreRelay

CKPT, METRICS = Module.L5_CHECKPOINT_MANAGER, Module.L5_METRICS_LOGGER
# Threads of the aio server's own pool: the plain handlers, i.e. the save's control calls
# (BeginSave, CommitSave, Load, List, Delete) and the audit query. The streams run on its
# loop and the relay's pools (services/store/server.py), so these are never taken by them.
CONTROL_THREADS = 16


def wire(
    root: Path,
    log,
    registry=REGISTRY,
    scrub_interval_s: float = 0.0,
    defer=None,
    transfer: int = store_pb2.TRANSFER_PATH,
    chunks: FsspecChunks | None = None,
    later=None,
    linger_s: float = SERIES_LINGER_S,
    team_scoped: bool = False,
) -> tuple[StoreRelay, MetricsLogger, ScrubSchedule]:
    """Build L5-1, L5-2 and the relay on one bus. Returns the relay, the logger (to close)
    and the operator's scrub schedule (to start and stop). ``defer``: where L5-2's sinks
    work (``main`` gives its sink thread; None: on the record's own thread). ``transfer``,
    ``chunks``: where checkpoint bytes live (:func:`checkpoint_storage`). ``later``, ``linger_s``:
    the timer that removes an ended rank's series from L5-2's Prometheus series (and an ended
    job's from L5-1's), and after how long (None: at once). ``team_scoped``: a tokens file authenticates the operator's calls, and
    a team reaches its own jobs' checkpoints and metrics only (access.py; each job's team kept
    under ``root``, job_teams.py)."""
    # No channel up from here: refusals are logged and counted, then returned to the caller.
    bus = Bus(on_violation=ViolationReporter("store", log))
    validate_table(bus.table)
    manager = CheckpointManager(
        root,
        registry=registry,
        emit=bus.emitter(CKPT),
        transfer=transfer,
        chunks=chunks,
        later=later,
        linger_s=linger_s,
    )
    profiles = ProfileFiles(root)  # L5-2's profiles: the relay stages an upload, the logger keeps it
    metrics = MetricsLogger(
        root,
        registry=registry,
        emit=bus.emitter(METRICS),
        defer=defer,
        later=later,
        linger_s=linger_s,
        profiles=profiles,
    )
    bus.host(
        CKPT,
        manager,
        not_handled={
            store_pb2.FlushCheckpoint: "a rank's own pending write: the rank's store relay answers it in the rank process",
            engine_pb2.HealState: "state from a live peer: L5-1's rank side (the state manager) does it over the rank's group",
        },
    )
    bus.host(METRICS, metrics)
    # One port per remote sender the table lets send what the relay forwards, typed by it.
    forwarded = {
        CKPT: (
            store_pb2.SaveCheckpoint,
            store_pb2.CommitCheckpoint,
            store_pb2.LoadCheckpoint,
            store_pb2.CheckpointQuery,
            store_pb2.DeleteCheckpoint,
            store_pb2.VerifyCheckpoints,
            store_pb2.ScrubCheckpoints,
            store_pb2.WatchCheckpointsRequest,
            store_pb2.RetireCheckpointSeries,
        ),
        METRICS: (
            engine_pb2.StepCompleted,
            engine_pb2.EvalCompleted,
            engine_pb2.SampleGenerated,
            engine_pb2.EvaluationScores,
            store_pb2.LogCollectionConfig,
            store_pb2.StopLogCollection,
            store_pb2.StoreProfile,
            store_pb2.RetireMetricSeries,
        ),
    }
    ports: dict[tuple[int, int], CommandPort] = {}
    for receiver, types in forwarded.items():
        senders = {s for t in types for s in bus.table.route(t).senders}
        for sender in sorted(senders):
            sent = tuple(t for t in types if bus.table.allows(sender, t, receiver))
            ports[(sender, receiver)] = bus.port(sender, receiver, commands=sent)
    # The data planes: L5-1's own methods; L5-2's profile staging.
    access = StoreAccess(JobTeams(root) if team_scoped else None)
    relay = StoreRelay(
        ports, log, check=bus.check, files=manager, profiles=profiles, access=access, records=root / "metrics"
    )
    # The relay stands in for control's L1-1 as the receiver of CheckpointCorrupt.
    bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.CheckpointCorrupt, relay.on_checkpoint_corrupt)
    # A failure event of L5-1 / L5-2 routed to the caller's side (L1, a rank's L2-1) goes back
    # with the call's end, by its name (the caller's relay puts it on its bus).
    back = Link(bus, name="store calls", near=L5, beyond=L1 | RANK, send=relay.routed_out).stand_in(
        kinds=(route_pb2.EVENT,), where=lambda route: route.failure
    )
    schedule = ScrubSchedule(
        bus.port(Module.EXT_USER, CKPT, commands=(store_pb2.ScrubCheckpoints,)), scrub_interval_s, log
    )
    # Hosted: L5-1, L5-2, and every remote sender the relay commands them as (or receives for).
    validate_wiring(
        bus, {CKPT, METRICS, Module.L1_ORCHESTRATOR, *(sender for sender, _ in ports), *(module for _, module in back)}
    )
    return relay, metrics, schedule


TRANSFERS = {"path": store_pb2.TRANSFER_PATH, "stream": store_pb2.TRANSFER_STREAM}


def checkpoint_storage(backend: str, transfer: str, s3_url: str, s3_endpoint: str) -> tuple[int, FsspecChunks | None]:
    """(SaveStaged.transfer, the object store for chunks or None) of a deployment's choice.

    Raises:
        ValueError: an unknown backend or transfer, s3 without a URL, or a bucket that cannot
            be listed now (one line).
    """
    if backend == "local":
        if transfer not in TRANSFERS:
            raise ValueError(
                f"--transfer (or SURGE_STORE_TRANSFER) {transfer!r}: expected one of {', '.join(TRANSFERS)}"
            )
        return TRANSFERS[transfer], None
    if backend == "s3":
        if not s3_url.startswith("s3://") or len(s3_url) <= len("s3://"):
            raise ValueError(f"--backend s3 needs --s3-url s3://BUCKET[/PREFIX] (SURGE_STORE_S3_URL), got {s3_url!r}")
        chunks = FsspecChunks(s3_url, endpoint_url=s3_endpoint)
        try:
            chunks.check()
        except Exception as e:  # noqa: BLE001 - any failure to reach it: one line, no service
            raise ValueError(f"--s3-url {s3_url}: cannot be used ({type(e).__name__}: {e})") from None
        return store_pb2.TRANSFER_FSSPEC, chunks
    raise ValueError(f"--backend (or SURGE_STORE_BACKEND) {backend!r}: expected local or s3")


class ScrubSchedule:
    """The operator's standing order, kept by the composition root: every ``interval_s``
    seconds, ``ScrubCheckpoints`` (every job) to L5-1 through ``port`` (as EXT_USER)."""

    def __init__(self, port: CommandPort, interval_s: float, log):
        self._port, self._interval, self._log = port, interval_s, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scrub-schedule", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                done = self._port(store_pb2.ScrubCheckpoints()).message
                self._log.info(
                    "checkpoints_scrubbed",
                    versions=len(done.versions),
                    newly_corrupt=[c.version for c in done.newly_corrupt],
                    seconds=round(done.seconds, 3),
                )
            except Exception as e:  # noqa: BLE001 - the next interval tries again
                self._log.error("checkpoint_scrub_failed", error=f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    thread_names.install()  # its threads seen by name from outside (bench/stack_cost.py)
    stack_dump.install()  # `kill -USR2 PID`: every thread's stack into its log (a hang's diagnosis)
    grpc_waits.install()  # its stream readers wait without gRPC's 0.1 s poll (grpc_waits.py)
    p = ServiceArgumentParser(prog="python -m services.store", description=__doc__.split("\n")[0])
    env_option(p, "--host", "SURGE_STORE_HOST", listen_host, "127.0.0.1", "address to listen on")
    env_option(p, "--port", "SURGE_STORE_PORT", port, help="gRPC port (0: any free port)")
    env_option(p, "--metrics-port", "SURGE_STORE_METRICS_PORT", port, help="Prometheus /metrics port (0: off)")
    p.add_argument(
        "--root", type=Path, default=None, help="store root (default: SURGE_STORE_ROOT or $SURGE_HOME/store)"
    )
    p.add_argument(
        "--scrub-interval-seconds",
        type=seconds("SURGE_STORE_SCRUB_INTERVAL_S"),
        default=env("SURGE_STORE_SCRUB_INTERVAL_S", "0"),
        help="re-hash every committed checkpoint version this often (0: never; env SURGE_STORE_SCRUB_INTERVAL_S)",
    )
    p.add_argument(
        "--series-linger-seconds",
        type=seconds("SURGE_STORE_SERIES_LINGER_SECONDS"),
        default=env("SURGE_STORE_SERIES_LINGER_SECONDS", str(SERIES_LINGER_S)),
        help="a rank's Prometheus series are removed this long after its training loop ended "
        "(env SURGE_STORE_SERIES_LINGER_SECONDS)",
    )
    p.add_argument("--backend", default=env("SURGE_STORE_BACKEND", "local"), help="local | s3 (SURGE_STORE_BACKEND)")
    p.add_argument(
        "--transfer",
        default=env("SURGE_STORE_TRANSFER", "path"),
        help="local backend: path | stream (SURGE_STORE_TRANSFER)",
    )
    p.add_argument("--s3-url", default=env("SURGE_STORE_S3_URL", ""), help="s3://BUCKET[/PREFIX] (SURGE_STORE_S3_URL)")
    p.add_argument(
        "--s3-endpoint", default=env("SURGE_STORE_S3_ENDPOINT", ""), help="S3 endpoint URL (SURGE_STORE_S3_ENDPOINT)"
    )
    p.add_argument(
        "--tokens",
        default=env(TOKENS_FILE_ENV) or "",
        help="control's tokens file: the operator's calls are authenticated by it and a team reaches "
        f"its own jobs' checkpoints and metrics only (env {TOKENS_FILE_ENV}; default: none)",
    )
    args = p.parse_args(argv)
    if problem := metric_files.env_problem():
        p.error(problem)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if args.port is None or args.metrics_port is None:
        p.error("--port and --metrics-port are required (or SURGE_STORE_PORT, SURGE_STORE_METRICS_PORT)")
    if args.port == args.metrics_port and args.port != 0:
        p.error(f"--port and --metrics-port must differ, both are {args.port}")
    try:
        transfer, chunks = checkpoint_storage(args.backend, args.transfer, args.s3_url, args.s3_endpoint)
    except (ValueError, ImportError) as e:
        p.error(str(e))
    root = (args.root or paths.store_root()).resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--root {root} (or SURGE_STORE_ROOT, SURGE_HOME): cannot be created: {e.strerror or e}")
    log = logs.configure("store", root=str(root))
    identities = tokens_of_flag(args.tokens)  # (a bad file: one line, exit 2)

    try:
        # Every call authenticated, the ranks' writes too: a write names a job, whose team its
        # caller must be (services/store/access.py check_write).
        server = AioServiceServer(
            "store",
            args.host,
            args.port,
            executor_threads=CONTROL_THREADS,
            identities=identities,
            authenticate_every_call=True,
            options=SMALL_AND_BULK,  # (the nodes' metric batches, a second apart, draw no BDP ping)
        )
        http = serve_metrics("store", args.host, args.metrics_port)
    except PortInUse as e:  # one line, as control, data and the node agent
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status  # EXIT_PORT_IN_USE when another holds it, else 2

    # L5-2's sinks (TensorBoard, W&B) write on this root's one thread, in order: a record is
    # acknowledged once it is in the JSONL file, whatever a sink costs (a W&B run opens in seconds).
    sinks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metric-sinks")
    # The timer that removes an ended rank's series (one heap and one thread, not one per job).
    series_timer = Deadlines("store-series", workers=1)
    try:
        relay, metrics, schedule = wire(
            root,
            log,
            scrub_interval_s=args.scrub_interval_seconds,
            defer=sinks.submit,
            transfer=transfer,
            chunks=chunks,
            later=series_timer.after,
            linger_s=args.series_linger_seconds,
            team_scoped=identities is not None,
        )
    except (ContractError, RouteError) as e:
        if http is not None:
            http.shutdown()
        return refuse("store", e)
    store_pb2_grpc.add_StoreServiceServicer_to_server(relay, server.server)
    audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditServicer("store"), server.server)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if identities is not None:
        signal.signal(signal.SIGHUP, lambda *_: reload_tokens(identities, log))
    server.start(["surge.v1.StoreService", AuditServicer.SERVICE_NAME])
    schedule.start()
    log.info(
        "serving", address=f"{args.host}:{server.port}", metrics=f"{args.host}:{http.server_port}" if http else "off"
    )
    stop.wait()
    log.info("stopping")
    schedule.stop()
    server.stop(grace=2.0)
    relay.close()
    if http is not None:
        http.shutdown()
    series_timer.close()
    metrics.close()
    sinks.shutdown(wait=True)  # the sinks closed: event files flushed, W&B runs finished
    return 0


if __name__ == "__main__":
    sys.exit(main())
