"""Composition root of the ``data`` service: the one place its modules are built and wired.

    python -m services.data --port P [--host 127.0.0.1] [--data-root DIR] [--metrics-port M]

Environment: SURGE_DATA_PORT (default port), SURGE_DATA_ROOT (default data root, else
$SURGE_HOME/datasets), SURGE_DATA_METRICS_PORT (Prometheus ``/metrics``; default 0 = not
served). ``--port 0`` lets the kernel choose; the port is logged either way. Also serves
``surge.v1.AuditService`` (the route counts of every bus of this process).

Wiring (permissions as construction-time facts): each module gets an Emitter for its own
events and CommandPorts only for modules the route table lets it command: L4-1 may
command the prefetcher (ActivateSource); L4-2..L4-5 command nobody and only publish down
the data path. L2-1's ports (held by the stream relay) reach all five. Anything else would
fail here, at start-up, with a RouteError. A send refused at run time is logged and
counted here and returned to the calling rank as PERMISSION_DENIED (see ``server.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from services.common import logs, paths
from services.common.grpc_server import PortInUse, ServiceServer, serve_metrics
from services.contract import Module, audit_pb2_grpc, data_pb2, data_pb2_grpc
from services.contract.audit import AuditServicer, ViolationReporter
from services.contract.bus import Bus, RouteError
from services.contract.validation import ContractError, refuse, validate_table, validate_wiring
from services.data.batch_packer import BatchPacker
from services.data.dataset_versions import DatasetVersions
from services.data.prefetcher import Prefetcher
from services.data.sample_filter import SampleFilter
from services.data.server import DataServicer, StreamRelay
from services.data.shuffler import Shuffler

L2 = Module.L2_TRAINING_LOOP
VERSIONS, PREFETCHER, SHUFFLER, FILTER, PACKER = (
    Module.L4_DATASET_VERSIONS, Module.L4_PREFETCHER, Module.L4_SHUFFLER, Module.L4_FILTER, Module.L4_BATCH_PACKER,
)
# What each bus hosts (checked by validate_wiring): the registry serves the operator; a
# stream's bus hosts the five L4 modules and the relay standing in for the rank's L2-1.
REGISTRY_HOSTED = (VERSIONS, Module.EXT_USER)
STREAM_HOSTED = (L2, VERSIONS, PREFETCHER, SHUFFLER, FILTER, PACKER)


def build_registry(root: Path, on_violation=None) -> tuple[Bus, DatasetVersions]:
    """The process-wide bus with L4-1 alone, for the operator's Mount and List."""
    bus = Bus(on_violation=on_violation)
    validate_table(bus.table)
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER))
    bus.subscribe(VERSIONS, data_pb2.MountDataset, versions.mount_dataset)
    bus.subscribe(VERSIONS, data_pb2.DatasetQuery, versions.list_datasets)
    validate_wiring(bus, REGISTRY_HOSTED)
    return bus, versions


def build_stream(root: Path, on_violation=None, queue_batches: int = 64) -> StreamRelay:
    """One stream's pipeline on its own bus: L4-1 -> L4-2 -> L4-3 -> L4-4 -> L4-5, with the
    relay standing in for L2-1."""
    bus = Bus(on_violation=on_violation)
    versions = DatasetVersions(root, bus.emitter(VERSIONS), bus.port(VERSIONS, PREFETCHER))
    prefetcher = Prefetcher(bus.emitter(PREFETCHER))
    shuffler = Shuffler(bus.emitter(SHUFFLER))
    sample_filter = SampleFilter(bus.emitter(FILTER))
    packer = BatchPacker(bus.emitter(PACKER))
    relay = StreamRelay(
        open_stream=bus.port(L2, VERSIONS),
        set_prefetch=bus.port(L2, PREFETCHER),
        shuffle_plan=bus.port(L2, SHUFFLER),
        filter_rules=bus.port(L2, FILTER),
        packer_config=bus.port(L2, PACKER),
        close=prefetcher.close,
        queue_batches=queue_batches,
    )
    for module, message, handler in (
        (VERSIONS, data_pb2.OpenStream, versions.open_stream),
        (PREFETCHER, data_pb2.SetPrefetch, prefetcher.set_prefetch),
        (PREFETCHER, data_pb2.ActivateSource, prefetcher.activate_source),
        (SHUFFLER, data_pb2.ShufflePlan, shuffler.shuffle_plan),
        (SHUFFLER, data_pb2.SamplesRead, shuffler.samples_read),
        (FILTER, data_pb2.FilterRules, sample_filter.filter_rules),
        (FILTER, data_pb2.SamplesShuffled, sample_filter.samples_shuffled),
        (PACKER, data_pb2.PackerConfig, packer.packer_config),
        (PACKER, data_pb2.SamplesFiltered, packer.samples_filtered),
        (L2, data_pb2.MicroBatch, relay.on_micro_batch),
        (L2, data_pb2.FilterReport, relay.on_filter_report),
        (L2, data_pb2.DataExhausted, relay.on_data_exhausted),
    ):
        bus.subscribe(module, message, handler)
    validate_wiring(bus, STREAM_HOSTED)
    return relay


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.data", description="Surge data service (L4)")
    p.add_argument("--port", type=int, default=int(os.environ.get("SURGE_DATA_PORT", "50052")))
    p.add_argument("--host", default=os.environ.get("SURGE_DATA_HOST", "127.0.0.1"))
    p.add_argument("--data-root", type=Path, default=None, help="default: $SURGE_DATA_ROOT or $SURGE_HOME/datasets")
    p.add_argument("--metrics-port", type=int, default=os.environ.get("SURGE_DATA_METRICS_PORT") or 0,
                   help="Prometheus /metrics port (env SURGE_DATA_METRICS_PORT; 0 = off)")
    args = p.parse_args(argv)
    root = (args.data_root or paths.datasets_root()).resolve()
    log = logs.configure("data", root=str(root))

    # No channel up from here: refusals are logged and counted, then returned to the caller.
    violation = ViolationReporter("data", log)
    try:
        bus, _ = build_registry(root, violation)
        build_stream(root, violation)  # a stream's wiring, checked once before serving
    except (ContractError, RouteError) as e:
        return refuse("data", e)
    servicer = DataServicer(
        mount=bus.port(Module.EXT_USER, VERSIONS),
        list_datasets=bus.port(Module.EXT_USER, VERSIONS),
        new_stream=lambda: build_stream(root, violation),
        log=log,
    )
    try:
        server = ServiceServer("data", args.host, args.port)
        http = serve_metrics("data", args.host, args.metrics_port)
    except PortInUse as e:  # a usage error, exit 2, as control, store and the node agent
        print(f"error: {e}", file=sys.stderr)
        return 2
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
