"""Composition root of the ``data`` service: the one place its modules are built and wired.

    python -m services.data --port P [--host 127.0.0.1] [--data-root DIR] [--metrics-port M]

Environment: SURGE_DATA_PORT (default port), SURGE_DATA_ROOT (default data root, else
$SURGE_HOME/datasets), SURGE_DATA_METRICS_PORT (Prometheus ``/metrics``; default 0 = not
served). ``--port 0`` lets the kernel choose; the port is logged either way. Also serves
``surge.v1.AuditService`` (the route counts of every bus of this process).

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

import signal
import sys
import threading
from pathlib import Path

from services.common import logs, paths
from services.common.grpc_server import PortInUse, ServiceServer, serve_metrics
from services.common.service_args import ServiceArgumentParser, env_option, listen_host, port
from services.contract import Module, audit_pb2_grpc, data_pb2, data_pb2_grpc, route_pb2
from services.contract.audit import AuditServicer, ViolationReporter
from services.contract.bus import Bus, RouteError
from services.contract.injection import env_error
from services.contract.relay import L1, L4, Link
from services.contract.validation import ContractError, refuse, validate_table, validate_wiring
from services.data.batch_packer import BatchPacker
from services.data.dataset_versions import DatasetVersions
from services.data.prefetcher import Prefetcher
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


def build_registry(root: Path, on_violation=None) -> tuple[Bus, DatasetVersions]:
    """The process-wide bus with L4-1 alone, for the operator's Mount and List (``main``
    hands out the operator's ports, then checks the wiring again)."""
    bus = Bus(on_violation=on_violation)
    validate_table(bus.table)
    # No prefetcher here: a stream opens on its own bus (no L2-1 port reaches this one), so
    # L4-1's port to L4-2 sends nothing on this bus.
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER, commands=()))
    bus.host(VERSIONS, versions)
    validate_wiring(bus, REGISTRY_HOSTED)
    return bus, versions


def build_stream(root: Path, on_violation=None, queue_batches: int = 64) -> StreamRelay:
    """One stream's pipeline on its own bus: L4-1 -> L4-2 -> L4-3 -> L4-4 -> L4-5, with the
    relay standing in for L2-1. Each module is hosted (``Bus.host``: every route to it goes to
    the handler the table names); the relay is subscribed for the three L2-1 inputs it
    forwards to the rank."""
    bus = Bus(on_violation=on_violation)
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER))
    prefetcher = Prefetcher(bus.emitter(PREFETCHER))
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
        close=prefetcher.close,
        queue_batches=queue_batches,
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


def main(argv: list[str] | None = None) -> int:
    p = ServiceArgumentParser(prog="python -m services.data", description="Surge data service (L4)")
    env_option(p, "--port", "SURGE_DATA_PORT", port, "50052", "gRPC port (0: any free port)")
    env_option(p, "--host", "SURGE_DATA_HOST", listen_host, "127.0.0.1", "address to listen on")
    p.add_argument("--data-root", type=Path, default=None, help="default: $SURGE_DATA_ROOT or $SURGE_HOME/datasets")
    env_option(p, "--metrics-port", "SURGE_DATA_METRICS_PORT", port, "0", "Prometheus /metrics port (0: off)")
    args = p.parse_args(argv)
    if bad := env_error():  # a malformed test-only injection: one line, not a service without it
        print(f"error: {bad}", file=sys.stderr)
        return 2
    root = (args.data_root or paths.datasets_root()).resolve()
    log = logs.configure("data", root=str(root))

    # No channel up from here: refusals are logged and counted, then returned to the caller.
    violation = ViolationReporter("data", log)
    try:
        bus, _ = build_registry(root, violation)
        servicer = DataServicer(
            mount=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.MountDataset,)),
            list_datasets=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.DatasetQuery,)),
            new_stream=lambda: build_stream(root, violation),
            log=log,
            delete=bus.port(Module.EXT_USER, VERSIONS, commands=(data_pb2.DeleteDataset,)),
        )
        validate_wiring(bus, REGISTRY_HOSTED)  # again, with the operator's ports
        build_stream(root, violation)  # a stream's wiring, checked once before serving
    except (ContractError, RouteError) as e:
        return refuse("data", e)
    try:
        server = ServiceServer("data", args.host, args.port)
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
    if http is not None:
        http.shutdown()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
