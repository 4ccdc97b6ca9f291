"""gRPC plumbing shared by every service: a server with health checking and server
reflection, bound or failing clearly, and the client channel every caller uses.

Security is configured by environment only, so no service's flags change:

* ``SURGE_TLS_CERT`` + ``SURGE_TLS_KEY`` (PEM files): servers listen with TLS. With
  ``SURGE_TLS_CA`` as well, they require a client certificate signed by that CA (mutual TLS).
* ``SURGE_TLS_CA`` (PEM): clients (``channel()``) use TLS and verify the server against that
  CA; they present ``SURGE_TLS_CERT``/``SURGE_TLS_KEY`` when set (needed under mutual TLS).
  ``SURGE_TLS_SERVER_NAME`` overrides the name checked against the server's certificate.
* ``SURGE_AUTH_TOKEN``: servers require ``authorization: Bearer <token>`` on the mutating
  control RPCs (``MUTATING_METHODS``, grpc_guards.py) and answer UNAUTHENTICATED otherwise; clients send it
  on every call.
* A server given ``identities`` (control's tokens file, services/common/access.py) instead
  authenticates every call to an RPC the operator may call as a principal of that file (its
  token, else its client certificate), answers UNAUTHENTICATED for one that names none, and
  runs the handler with ``access.CALLER`` set to it.

Identity (always on, ``services/common/identity.py``): a client channel names the module its
process speaks for (``channel(address, module=...)``: metadata ``x-surge-module``); every
server refuses a Surge RPC whose caller names no module, or one the route table does not let
send that RPC's request, or (under mutual TLS) one its certificate's role may not claim:
PERMISSION_DENIED, reported as a boundary violation (trailing metadata, counted).

Every server also answers a request it cannot parse with INVALID_ARGUMENT naming the method
(instead of gRPC's bare "Exception deserializing request"), and refuses a message over
``MAX_MESSAGE_BYTES`` with RESOURCE_EXHAUSTED (gRPC's own check).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc.experimental import ChannelOptions
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import fencing
from services.common.access import Identities
from services.common.grpc_guards import AUTH_TOKEN_ENV, AioCallGuard, CallGuard
from services.common.identity import MODULE_METADATA

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # two services must never share a port silently
]

# For a channel or server that receives only small messages, at a pace (a rank's session
# commands and metric acks, the store's acks of a node's metric batches, control's node
# sessions): no BDP probe. gRPC's receiver otherwise sends a PING with (almost) every message
# it reads, to size a flow-control window that such a stream never fills: at one 1 KiB
# message a second, ~45 wake-ups a second of the receiver's event_engine threads and ~21 of
# the sender's, against ~20 and ~7 without it (bench/grpc_pings.py, grpcio 1.85). gRPC's
# default 64 KiB stream window stays: ample for such messages, and what bounds a stalled
# receiver's memory per stream (control holds thousands). Never on a channel of bulk data
# (micro-batches, checkpoint chunks): its window must grow with the link.
SMALL_MESSAGES = (("grpc.http2.bdp_probe", 0),)
# For a server whose many streams are small and paced (a node agent's rank sessions: a message
# a second per rank; the store's metric batches: one a second per node) but which also takes
# bulk data (memory copies from other agents, checkpoint chunks): no BDP probe, and a fixed
# 16 MiB stream window in its place, so a bulk stream is not held to gRPC's default 64 KiB
# (BDP's own window is max(4 MiB, 2 x BDP) at low memory pressure: 16 MiB covers a link's
# BDP up to ~8 MiB, e.g. 25 Gb/s at 2.5 ms). Not measured on a real link (loopback's
# throughput under this machine's load moved 220-980 MB/s either way).
SMALL_AND_BULK = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 << 20))

# For a channel whose only server stream is read by one thread of ours that nothing else
# waits on and that is mostly busy elsewhere (a rank's data reader waits on the loop's queue):
# that thread takes the stream's messages off gRPC's completion queue itself, with no channel
# spin thread. With one, every message woke two threads (the spin thread, which hands it on,
# and the reader), and the spin thread woke five times a second more for grpcio's 200 ms
# signal check while the stream was open (taking a rank's GIL from its training loop each
# time); without, the reader
# waits in gRPC only when it wants a message (a rank's data reader, while the loop's queue is
# full, waits there and nothing polls: the transport keeps what arrives up to its window, as
# before). Only unary-stream calls change; what they give up (``code()``, ``details()``
# before the call ended, a ``result()`` that blocks) no such reader uses. A rank's data
# stream, pair A of session 37: the ranks' spin threads 56 -> 26 wake-ups a second. Not for a
# reader that waits in gRPC all the time (an idle watch): it then wakes for grpcio's 200 ms
# check itself, as often as the spin thread did (control's store watch: no change).
SINGLE_THREADED_STREAM = ((ChannelOptions.SingleThreadedUnaryStream, 1),)

TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "SURGE_TLS_CERT", "SURGE_TLS_KEY", "SURGE_TLS_CA"
TLS_SERVER_NAME_ENV = "SURGE_TLS_SERVER_NAME"
# A service's exit status when the address it was told to listen on is held by another
# socket (EADDRINUSE's number on Linux): a supervisor (surgectl up / restart) reads it from
# the exit status to try another port or wait a moment, never from the log's words. Any other
# start-up refusal of the address (cannot resolve, no permission, TLS) is a usage error, 2.
EXIT_PORT_IN_USE = 98
EXIT_USAGE = 2


class PortInUse(RuntimeError):
    """This service cannot listen where it was told to (one line naming it). ``taken``:
    another socket holds the address (EADDRINUSE), typed where the bind failed."""

    def __init__(self, message: str, *, taken: bool = False):
        super().__init__(message)
        self.taken = taken

    @property
    def exit_status(self) -> int:
        """What the composition root exits with: ``EXIT_PORT_IN_USE`` when taken, else 2."""
        return EXIT_PORT_IN_USE if self.taken else EXIT_USAGE


class TlsConfigError(PortInUse):
    """The SURGE_TLS_* variables are incomplete or name unreadable files (one line).

    A PortInUse, so that every service's existing start-up handling (``except PortInUse``:
    one line on stderr, non-zero exit) reports it too: either way the port cannot be served.
    """


def _read_pem(var: str) -> bytes | None:
    path = os.environ.get(var)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{var}={path}: cannot read: {e.strerror or e}") from None


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS server credentials from SURGE_TLS_*, or None (plaintext) when no certificate is set.

    Raises:
        TlsConfigError: only one of certificate and key is set, or a file cannot be read.
    """
    cert, key, ca = _read_pem(TLS_CERT_ENV), _read_pem(TLS_KEY_ENV), _read_pem(TLS_CA_ENV)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise TlsConfigError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """TLS channel credentials from SURGE_TLS_*, or None (plaintext) when no CA is set."""
    ca = _read_pem(TLS_CA_ENV)
    if ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=_read_pem(TLS_KEY_ENV), certificate_chain=_read_pem(TLS_CERT_ENV)
    )


def _preflight(name: str, host: str, port: int) -> grpc.ServerCredentials | None:
    """The checks before a server is built: the port is free (checked before gRPC tries:
    its C core would log its own multi-line bind error first), and the TLS credentials
    (None: plaintext). Raises PortInUse, TlsConfigError."""
    problem = _bind_error(host, port) if port else None
    if problem:
        text, taken = problem
        raise PortInUse(f"{name}: cannot listen on {host}:{port} ({text})", taken=taken)
    return server_credentials()


def _bind(server, name: str, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Add ``host:port`` (TLS when ``credentials``) to a sync or aio server; the port bound.
    Raises PortInUse when gRPC cannot bind it."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:  # (the probe just found it free: another process took it in between)
        raise PortInUse(f"{name}: cannot listen on {address} (port already in use?)", taken=True)
    return bound


class ServiceServer:
    """Owns a grpc.Server plus its health servicer. Usage::

        s = ServiceServer("control", host, port)
        control_pb2_grpc.add_ControlServiceServicer_to_server(servicer, s.server)
        s.start(["surge.v1.ControlService"])

    TLS and the bearer token follow the SURGE_TLS_* and SURGE_AUTH_TOKEN variables (see
    the module docstring); ``identities`` (a tokens file's principals) authenticates the
    operator's RPCs instead of that token.

    Raises:
        PortInUse: the port cannot be bound.
        TlsConfigError: the TLS variables are incomplete or unreadable.
    """

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        max_workers: int = 32,
        identities: Identities | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ):
        self.name = name
        credentials = _preflight(name, host, port)
        self.tls = credentials is not None
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            options=[*GRPC_OPTIONS, *options],
            interceptors=[CallGuard(os.environ.get(AUTH_TOKEN_ENV) or None, identities)],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = _bind(self.server, name, host, port, credentials)

    def start(self, service_names: list[str]) -> None:
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.server.start()
        for svc in ["", *service_names]:
            self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


class AioServiceServer:
    """``ServiceServer`` on ``grpc.aio``: one asyncio loop, in a thread of its own, serves
    every RPC. Handlers written ``async`` run on that loop (a long stream costs no thread);
    plain ones run in a pool of ``executor_threads`` (grpc.aio's ``migration_thread_pool``),
    each holding a thread while it runs (a sync server-streaming RPC: its whole life).
    Health checking, reflection, TLS, the bearer token and the malformed-request answer
    are as in ``ServiceServer``. Usage as ServiceServer (``server``, ``start``, ``stop``);
    ``loop`` is where asyncio handlers live. ``options``: more gRPC server options;
    ``identities``: as in ``ServiceServer``; ``authenticate_every_call``: it authenticates the
    processes' RPCs too (grpc_guards.CallGuard's ``every_call``).

    Raises:
        PortInUse: the port cannot be bound.
        TlsConfigError: the TLS variables are incomplete or unreadable.
    """

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        executor_threads: int = 64,
        options: Sequence[tuple[str, Any]] = (),
        identities: Identities | None = None,
        authenticate_every_call: bool = False,
    ):
        self.name = name
        credentials = _preflight(name, host, port)
        self.tls = credentials is not None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-aio", daemon=True)
        self._thread.start()
        pool = futures.ThreadPoolExecutor(max_workers=executor_threads, thread_name_prefix=name)

        async def make() -> grpc.aio.Server:  # grpc.aio binds a server to the loop it is built on
            return grpc.aio.server(
                migration_thread_pool=pool,
                options=[*GRPC_OPTIONS, *options],
                interceptors=[
                    AioCallGuard(os.environ.get(AUTH_TOKEN_ENV) or None, identities, authenticate_every_call)
                ],
            )

        self.server = self.run(make())
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = _bind(self.server, name, host, port, credentials)
        except PortInUse:
            self._close_loop()
            raise

    def run(self, coroutine, timeout: float | None = 30.0):
        """Run ``coroutine`` on the server's loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self, service_names: list[str]) -> None:
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)

        async def start() -> None:
            await self.server.start()
            for svc in ["", *service_names]:
                await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)

        self.run(start())

    def stop(self, grace: float = 1.0) -> None:
        async def stop() -> None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)

        try:
            self.run(stop(), timeout=grace + 10.0)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


class _Headers(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed headers to every call: ``authorization: Bearer <token>`` (works on
    plaintext channels too, where gRPC refuses call credentials) and the calling module."""

    def __init__(self, headers: list[tuple[str, str]]):
        self._headers = headers

    def _details(self, details):
        metadata = [*(details.metadata or ()), *self._headers]
        generation = fencing.identity_header()  # (read per call: a rank learns it after its channels exist)
        if generation is not None:
            metadata.append(generation)
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class _Channel(grpc.Channel):
    """An intercepted channel that still closes and works as a context manager."""

    def __init__(self, raw: grpc.Channel, intercepted: grpc.Channel):
        self._raw, self._ch = raw, intercepted

    def subscribe(self, callback, try_to_connect=False):
        self._ch.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._ch.unsubscribe(callback)

    def unary_unary(self, method, *args, **kwargs):
        return self._ch.unary_unary(method, *args, **kwargs)

    def unary_stream(self, method, *args, **kwargs):
        return self._ch.unary_stream(method, *args, **kwargs)

    def stream_unary(self, method, *args, **kwargs):
        return self._ch.stream_unary(method, *args, **kwargs)

    def stream_stream(self, method, *args, **kwargs):
        return self._ch.stream_stream(method, *args, **kwargs)

    def close(self):
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None if it can (right now)."""
    problem = _bind_error(host, port)
    return problem[0] if problem else None


def _bind_error(host: str, port: int) -> tuple[str, bool] | None:
    """(why, whether another socket holds it: EADDRINUSE) if ``host:port`` cannot be
    listened on right now, else None."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        return f"cannot resolve host: {e.strerror}", False
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no clash
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "port already in use?", True
            return e.strerror or str(e), False
    return None


def serve_metrics(name: str, host: str, port: int):
    """Serve the process's Prometheus registry on ``host:port`` (its own port, never the
    gRPC one); returns the HTTP server, or None when ``port`` is 0.

    Raises:
        PortInUse: the port cannot be bound (one line naming the service).
    """
    if not port:
        return None
    from services.common import metrics_http  # (a thread that sleeps until a scrape: metrics_http.py)

    try:
        http = metrics_http.start(host, port)
    except OSError as e:
        raise PortInUse(
            f"{name}: cannot serve /metrics on {host}:{port}: {e.strerror or e}", taken=e.errno == errno.EADDRINUSE
        ) from None
    return http


def channel(
    address: str, options: Sequence[tuple[str, Any]] = (), module: int | None = None, bearer: bool = True
) -> grpc.Channel:
    """The client channel every Surge caller uses: TLS when SURGE_TLS_CA is set, the bearer
    token when SURGE_AUTH_TOKEN is set, Surge's message size limits plus ``options``, and
    ``module`` (a ``surge.v1.Module``: the module this process speaks for on this channel)
    named on every call (``x-surge-module``). Without ``module`` a Surge server refuses
    every RPC but health checks and reflection. ``bearer`` False: SURGE_AUTH_TOKEN is never
    sent; each call brings its own ``authorization`` (the dashboard under a tokens file reads
    as the person who opened the page, never with its own environment's token).

    Raises:
        TlsConfigError: a SURGE_TLS_* file cannot be read.
    """
    opts = [*GRPC_OPTIONS, *options]
    server_name = os.environ.get(TLS_SERVER_NAME_ENV)
    credentials = channel_credentials()
    if credentials is not None:
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        raw = grpc.secure_channel(address, credentials, options=opts)
    else:
        raw = grpc.insecure_channel(address, options=opts)
    headers = []  # (a rank's generation is added per call by _Headers: services/common/fencing.py)
    token = os.environ.get(AUTH_TOKEN_ENV) if bearer else None
    if token:
        headers.append(("authorization", f"Bearer {token}"))
    if module:
        from services.contract import Module

        headers.append((MODULE_METADATA, Module.Name(module)))
    return _Channel(raw, grpc.intercept_channel(raw, _Headers(headers)))
