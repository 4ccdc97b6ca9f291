"""Where the services are and stubs to call them.

Addresses come from flags/env (SURGE_CONTROL_ADDRESS, SURGE_DATA_ADDRESS,
SURGE_STORE_ADDRESS: the compose / multi-node case) or else from the local stack's
``stack.json``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc

from services.cli import stack
from services.cli.errors import CliError, from_rpc
from services.common import paths
from services.common.grpc_server import TlsConfigError, channel
from services.contract import Module, control_pb2_grpc, data_pb2_grpc, store_pb2_grpc

_STUBS = {
    "control": control_pb2_grpc.ControlServiceStub,
    "data": data_pb2_grpc.DataServiceStub,
    "store": store_pb2_grpc.StoreServiceStub,
}

T = TypeVar("T")


def address(service: str) -> str:
    env = os.environ.get(f"SURGE_{service.upper()}_ADDRESS")
    if env:
        return env
    procs = stack.read_stack()
    if procs and service in procs:
        return procs[service].address
    raise CliError(
        f"{service} address unknown: no local stack is running under {paths.surge_home()} "
        f"(run `surgectl up`, or set SURGE_HOME to the stack's home) and SURGE_{service.upper()}_ADDRESS is not set"
    )


def open_channel(addr: str) -> grpc.Channel:
    """A channel to ``addr`` (TLS per the environment), speaking as the operator
    (EXT_USER); a bad TLS setting is a CliError."""
    try:
        return channel(addr, module=Module.EXT_USER)
    except TlsConfigError as e:
        raise CliError(str(e)) from None


def new_stub(service: str, ch: grpc.Channel) -> object:
    return _STUBS[service](ch)


def rpc_error(error: grpc.RpcError, service: str, addr: str) -> CliError:
    """``from_rpc``, with the local stack's advice for an unreachable service. It never says
    `down`/`up`: that would kill the ranks of running jobs; `restart` starts only the one."""
    mapped = from_rpc(error, service, addr)
    if mapped.unreachable and not os.environ.get(f"SURGE_{service.upper()}_ADDRESS"):
        return CliError(
            f"{service} unreachable at {addr} although the local stack is recorded as up; "
            f"`surgectl restart {service}` starts it again on the same port"
            + (" (running jobs keep running)" if service == "control" else "")
        )
    return mapped


@contextmanager
def stub(service: str) -> Iterator[object]:
    """A stub for ``service``; gRPC failures inside the block become one-line CliErrors."""
    addr = address(service)
    with open_channel(addr) as ch:
        try:
            yield _STUBS[service](ch)
        except grpc.RpcError as e:
            raise rpc_error(e, service, addr) from None


def call(service: str, fn: Callable[[object], T]) -> T:
    with stub(service) as s:
        return fn(s)
