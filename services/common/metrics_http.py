"""A service's Prometheus ``/metrics`` over HTTP, served by a thread that sleeps until a
scrape comes (issue 28 item 3: the stack's CPU per step).

Why not ``prometheus_client.start_http_server``: its thread runs ``serve_forever()`` with
socketserver's default 0.5 s poll, two wake-ups a second per process whether or not anyone
scrapes (control, store, data and each node agent: 0.05-0.1 ms of CPU a second each on the
2-core test machine, bench/stack_cost.py's ``Thread-N (serve`` rows). The poll exists only so
that ``shutdown()`` is seen; here the thread polls once a minute and :meth:`MetricsServer.shutdown`
wakes it with a connection of its own, so a service still stops at once. The app is
``prometheus_client``'s own (``make_wsgi_app``: the same text, the same ``name[]`` filter),
each scrape on its own daemon thread as before.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app

IDLE_POLL_S = 60.0  # how often the serving thread wakes with no scrape (shutdown does not wait for it)


class _Silent(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """A scrape is no log line (prometheus_client's handler is silent too)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """The HTTP server of one process's registry (``start``)."""

    daemon_threads = True
    thread: threading.Thread  # the serving thread

    def shutdown(self) -> None:
        """Stop serving and return once the serving thread has: it is woken by connections
        to this server until it notices (socketserver's own shutdown waits for its poll)."""
        ending = threading.Thread(target=super().shutdown, name="metrics-http-stop", daemon=True)
        ending.start()
        while ending.is_alive():
            self._poke()
            ending.join(0.05)

    def _poke(self) -> None:
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::", ""):  # (bound to every address: its loopback answers)
            host = "::1" if self.address_family == socket.AF_INET6 else "127.0.0.1"
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
        except OSError:
            pass  # (not listening any more: the serving thread is ending)


def start(host: str, port: int, registry: Any = REGISTRY) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (IPv6 when the host is an IPv6 address or name).

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (MetricsServer,), {"address_family": family})
    httpd = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Silent)
    httpd.thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": IDLE_POLL_S}, name="metrics-http", daemon=True
    )
    httpd.thread.start()
    return httpd
