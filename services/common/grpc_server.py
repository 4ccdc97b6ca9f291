"""A gRPC server with health checking and server reflection, bound or failing clearly."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # two services must never share a port silently
]


class PortInUse(RuntimeError):
    pass


class ServiceServer:
    """Owns a grpc.Server plus its health servicer. Usage::

        s = ServiceServer("control", host, port)
        control_pb2_grpc.add_ControlServiceServicer_to_server(servicer, s.server)
        s.start(["surge.v1.ControlService"])
    """

    def __init__(self, name: str, host: str, port: int, max_workers: int = 32):
        self.name = name
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            options=GRPC_OPTIONS,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise PortInUse(f"{name}: cannot listen on {host}:{port} (port already in use?)")
        self.port = bound

    def start(self, service_names: list[str]) -> None:
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.server.start()
        for svc in ["", *service_names]:
            self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)
