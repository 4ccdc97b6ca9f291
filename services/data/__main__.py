"""Composition root of the ``data`` service: the one place its modules are built and wired.

    python -m services.data --port P [--host 127.0.0.1] [--data-root DIR] [--metrics-port M]
        [--remote s3://BUCKET/PREFIX [--s3-endpoint URL] [--cache-bytes N] [--cache-block-bytes N]]

Environment: SURGE_DATA_PORT (default port), SURGE_DATA_ROOT (default data root, else
$SURGE_HOME/datasets), SURGE_DATA_METRICS_PORT (Prometheus ``/metrics``; default 0 = not
served). ``--port 0`` lets the kernel choose; the port is logged either way. Also serves
``surge.v1.AuditService`` (the route counts of every bus of this process).

``--remote`` (SURGE_DATA_REMOTE): versions pushed there (``surgectl dataset push``) are
served too, their token files read through one bounded block cache under
``<data_root>/.cache/blocks`` (``--cache-bytes``, SURGE_DATA_CACHE_BYTES, default 2 GiB;
blocks of ``--cache-block-bytes``, default 8 MiB); the endpoint as the push command takes it
(``--s3-endpoint``, AWS_ENDPOINT_URL), credentials from the standard ``AWS_*`` variables.

Wiring (permissions as construction-time facts): each module is hosted on the bus
(``Bus.host``: every route to it goes to the handler the table names) and gets an Emitter
for its own events and CommandPorts, typed by the commands it sends, only for modules the
route table lets it command: L4-1 may command the prefetcher (ActivateSource); L4-2..L4-5
command nobody and only publish down the data path. L2-1's ports (held by the stream relay)
reach all five. Anything else -- or a port command no handler here takes -- fails here, at
start-up, with a RouteError or ContractError. A send refused at run time is logged and
counted here and returned to the calling rank as PERMISSION_DENIED (see ``server.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

from services.common import grpc_waits, logs, paths, stack_dump, thread_names
from services.common.grpc_server import AioServiceServer, PortInUse, serve_metrics
from services.common.process_exit import leave_after_stop
from services.common.service_args import ServiceArgumentParser, env_option, listen_host, port
from services.contract import Module, audit_pb2_grpc, data_pb2, data_pb2_grpc, route_pb2
from services.contract.audit import AuditServicer, ViolationReporter
from services.contract.bus import Bus, RouteError
from services.contract.injection import env_error
from services.contract.relay import L1, L4, Link, Outbox
from services.contract.validation import ContractError, refuse, validate_table, validate_wiring
from services.data.batch_packer import BatchPacker
from services.data.block_cache import BLOCK_BYTES, CACHE_DIR, CAPACITY_BYTES, BlockCache
from services.data.dataset_versions import DatasetVersions
from services.data.errors import DataError
from services.data.prefetcher import Prefetcher
from services.data.remote_versions import RemoteVersions
from services.data.sample_filter import SampleFilter
from services.data.server import DataServicer, StreamRelay
from services.data.shuffler import Shuffler

L2 = Module.L2_TRAINING_LOOP
VERSIONS, PREFETCHER, SHUFFLER, FILTER, PACKER = (
    Module.L4_DATASET_VERSIONS,
    Module.L4_PREFETCHER,
    Module.L4_SHUFFLER,
    Module.L4_FILTER,
    Module.L4_BATCH_PACKER,
)
# What each bus hosts (checked by validate_wiring): the registry serves the operator; a
# stream's bus hosts the five L4 modules and the relay standing in for the rank's L2-1.
REGISTRY_HOSTED = (VERSIONS, Module.EXT_USER)
# (and L1: the stream's link stands in for the fault detector, for failure events)
STREAM_HOSTED = (L2, VERSIONS, PREFETCHER, SHUFFLER, FILTER, PACKER, *sorted(L1))


def build_registry(root: Path, on_violation=None, remote: RemoteVersions | None = None) -> tuple[Bus, DatasetVersions]:
    """The process-wide bus with L4-1 alone, for the operator's Mount and List (``main``
    hands out the operator's ports, then checks the wiring again)."""
    bus = Bus(on_violation=on_violation)
    validate_table(bus.table)
    # No prefetcher here: a stream opens on its own bus (no L2-1 port reaches this one), so
    # L4-1's port to L4-2 sends nothing on this bus.
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER, commands=()), remote)
    bus.host(VERSIONS, versions)
    validate_wiring(bus, REGISTRY_HOSTED)
    return bus, versions


def build_stream(
    root: Path,
    on_violation=None,
    io_pool: Executor | None = None,
    remote: RemoteVersions | None = None,
    routed: Outbox | None = None,
) -> StreamRelay:
    """One stream's pipeline on its own bus: L4-1 -> L4-2 -> L4-3 -> L4-4 -> L4-5, with the
    relay standing in for L2-1. Each module is hosted (``Bus.host``: every route to it goes to
    the handler the table names); the relay is subscribed for the three L2-1 inputs it
    forwards to the rank. ``io_pool``: the token reads' pool, shared by every stream (None:
    the prefetcher makes one of its own). ``remote``: the versions in object storage and their
    block cache, shared by every stream (None: local versions only). A mixture's components
    (``mixture.py``) are streams built the same way, their failure events going back with the
    mixture's (``routed``)."""
    bus = Bus(on_violation=on_violation)
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER), remote)
    prefetcher = Prefetcher(bus.emitter(PREFETCHER), io_pool)
    bus.host(VERSIONS, versions)  # (the operator holds no port on a stream's bus)
    bus.host(PREFETCHER, prefetcher)
    bus.host(SHUFFLER, Shuffler(bus.emitter(SHUFFLER)))
    bus.host(FILTER, SampleFilter(bus.emitter(FILTER)))
    bus.host(PACKER, BatchPacker(bus.emitter(PACKER)))
    relay = StreamRelay(
        open_stream=bus.port(L2, VERSIONS, commands=(data_pb2.OpenStream,)),
        set_prefetch=bus.port(L2, PREFETCHER, commands=(data_pb2.SetPrefetch,)),
        shuffle_plan=bus.port(L2, SHUFFLER, commands=(data_pb2.ShufflePlan,)),
        filter_rules=bus.port(L2, FILTER, commands=(data_pb2.FilterRules,)),
        packer_config=bus.port(L2, PACKER, commands=(data_pb2.PackerConfig,)),
        assemble_batches=bus.port(L2, PACKER, commands=(data_pb2.AssembleBatches,)),
        close=prefetcher.close,
        component=lambda: build_stream(root, on_violation, io_pool, remote, relay.routed),
        routed=routed,
    )
    for message, handler in (
        (data_pb2.MicroBatch, relay.on_micro_batch),
        (data_pb2.FilterReport, relay.on_filter_report),
        (data_pb2.DataExhausted, relay.on_data_exhausted),
    ):
        bus.subscribe(L2, message, handler)
    # A failure event of the stream's modules routed to L2-1 or L1 goes back to the rank with
    # the stream's end, by its name (the rank's relay puts it on its bus, its session up).
    Link(bus, name="data stream", near=L4, beyond=L1 | {L2}, send=relay.routed.put).stand_in(
        kinds=(route_pb2.EVENT,), where=lambda route: route.failure
    )
    validate_wiring(bus, STREAM_HOSTED)
    return relay


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def main(argv: list[str] | None = None) -> int:
    p = ServiceArgumentParser(prog="python -m services.data", description="Surge data service (L4)")
    thread_names.install()  # its threads seen by name from outside (bench/stack_cost.py)
    stack_dump.install()  # `kill -USR2 PID`: every thread's stack into its log (a hang's diagnosis)
    grpc_waits.install()  # its stream readers wait without gRPC's 0.1 s poll (grpc_waits.py)
    env_option(p, "--port", "SURGE_DATA_PORT", port, "50052", "gRPC port (0: any free port)")
    env_option(p, "--host", "SURGE_DATA_HOST", listen_host, "127.0.0.1", "address to listen on")
    p.add_argument("--data-root", type=Path, default=None, help="default: $SURGE_DATA_ROOT or $SURGE_HOME/datasets")
    env_option(p, "--metrics-port", "SURGE_DATA_METRICS_PORT", port, "0", "Prometheus /metrics port (0: off)")
    p.add_argument("--work-threads", type=_positive, default=8, help="threads for the streams' bus work (default 8)")
    p.add_argument("--io-threads", type=_positive, default=16, help="threads for token reads (default 16)")
    env = os.environ.get
    p.add_argument(
        "--remote",
        default=env("SURGE_DATA_REMOTE", ""),
        help="s3://BUCKET/PREFIX: serve versions pushed there too (SURGE_DATA_REMOTE)",
    )
    p.add_argument(
        "--s3-endpoint", default=env("AWS_ENDPOINT_URL", ""), help="S3-compatible endpoint URL (AWS_ENDPOINT_URL)"
    )
    p.add_argument(
        "--cache-bytes",
        type=_positive,
        default=env("SURGE_DATA_CACHE_BYTES", str(CAPACITY_BYTES)),
        help="the remote token files' block cache bound (SURGE_DATA_CACHE_BYTES, default 2 GiB)",
    )
    p.add_argument("--cache-block-bytes", type=_positive, default=BLOCK_BYTES, help="its block size (default 8 MiB)")
    args = p.parse_args(argv)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        return 2
    root = (args.data_root or paths.datasets_root()).resolve()
    log = logs.configure("data", root=str(root))
    remote = None
    if args.remote:
        if not args.remote.startswith("s3://") or len(args.remote.rstrip("/")) <= len("s3://"):
            print(f"error: --remote: expected s3://BUCKET[/PREFIX], got {args.remote!r}", file=sys.stderr)
            return 2
        try:
            cache = BlockCache(root / CACHE_DIR, args.cache_block_bytes, args.cache_bytes)
            remote = RemoteVersions(args.remote, root, cache, args.s3_endpoint)
            remote.check()
        except DataError as e:  # a bound below one block, storage that does not answer
            print(f"error: --remote: {e}", file=sys.stderr)
            return 2

    # No channel up from here: refusals are logged and counted, then returned to the caller.
    violation = ViolationReporter("data", log)
    # Two bounded pools for every stream: the bus work (short pieces: open a stream,
    # assemble a few batches, Mount/List/Delete) and the token reads it waits on.
    work = ThreadPoolExecutor(max_workers=args.work_threads, thread_name_prefix="data-work")
    io_pool = ThreadPoolExecutor(max_workers=args.io_threads, thread_name_prefix="data-io")
    try:
        bus, _ = build_registry(root, violation, remote)
        servicer = DataServicer(
            mount=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.MountDataset,)),
            list_datasets=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.DatasetQuery,)),
            new_stream=lambda: build_stream(root, violation, io_pool, remote),
            log=log,
            executor=work,
            delete=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.DeleteDataset,)),
        )
        validate_wiring(bus, REGISTRY_HOSTED)  # again, with the operator's ports
        build_stream(root, violation)  # a stream's wiring, checked once before serving
    except (ContractError, RouteError) as e:
        return refuse("data", e)
    try:
        # grpc.aio: a stream is an async generator on the server's loop, not a thread.
        server = AioServiceServer("data", args.host, args.port, executor_threads=8)
        http = serve_metrics("data", args.host, args.metrics_port)
    except PortInUse as e:  # one line, as control, store and the node agent
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status  # EXIT_PORT_IN_USE when another holds it, else 2
    data_pb2_grpc.add_DataServiceServicer_to_server(servicer, server.server)
    audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditServicer("data"), server.server)
    server.start([data_pb2.DESCRIPTOR.services_by_name["DataService"].full_name, AuditServicer.SERVICE_NAME])
    log.info("listening", address=f"{args.host}:{server.port}", port=server.port, metrics=args.metrics_port or None)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    stop.wait()
    log.info("stopping")
    server.stop(grace=2.0)
    work.shutdown(wait=False, cancel_futures=True)
    io_pool.shutdown(wait=False, cancel_futures=True)
    if http is not None:
        http.shutdown()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    leave_after_stop(main())
