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
from services.common.grpc_server import TlsConfigError, channel
from services.contract import control_pb2_grpc, data_pb2_grpc, store_pb2_grpc

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
        f"{service} address unknown: no local stack is running (run `surgectl up`) "
        f"and SURGE_{service.upper()}_ADDRESS is not set"
    )


@contextmanager
def stub(service: str) -> Iterator[object]:
    """A stub for ``service``; gRPC failures inside the block become one-line CliErrors."""
    addr = address(service)
    try:
        ch = channel(addr)
    except TlsConfigError as e:
        raise CliError(str(e)) from None
    with ch:
        try:
            yield _STUBS[service](ch)
        except grpc.RpcError as e:
            error = from_rpc(e, service, addr)
            if "unreachable" in str(error) and not os.environ.get(f"SURGE_{service.upper()}_ADDRESS"):
                error = CliError(
                    f"{service} unreachable at {addr} although the local stack is recorded as up; "
                    "run `surgectl down`, then `surgectl up`"
                )
            raise error from None


def call(service: str, fn: Callable[[object], T]) -> T:
    with stub(service) as s:
        return fn(s)
