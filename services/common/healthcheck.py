"""One gRPC health check, for container health checks and scripts.

    python -m services.common.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

Asks the standard ``grpc.health.v1.Health/Check`` (over TLS and with the bearer token when
the SURGE_TLS_* / SURGE_AUTH_TOKEN variables say so, like every Surge client). Exit status 0
when the service is SERVING; otherwise one line on stderr and status 1.

Example: python -m services.common.healthcheck 127.0.0.1:50051 --service surge.v1.ControlService
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import TlsConfigError, channel


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str | None:
    """None when ``service`` at ``address`` is SERVING, else why not (one line)."""
    try:
        with channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=False
            )
    except grpc.RpcError as e:
        return f"{address}: {e.code().name}: {e.details()}"
    except TlsConfigError as e:
        return str(e)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck",
        description="Exit 0 when a Surge service answers SERVING on the gRPC health service.",
        epilog="Example: python -m services.common.healthcheck 127.0.0.1:50051",
    )
    p.add_argument("address", help="HOST:PORT of the service")
    p.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = p.parse_args(argv)
    problem = check(args.address, args.service, args.timeout)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
