"""The dashboard under mutual TLS (SURGE_TLS_CERT/KEY/CA, as the gRPC ports read them): an
operator's certificate (surge-user) and the token are served, a worker's certificate is
refused (403), no certificate fails the handshake. Certificates: tests/contract/test_identity.py's."""

from __future__ import annotations

import ssl
import threading
from http.client import HTTPSConnection

import pytest

from services.dashboard.access import Access, tls_context
from services.dashboard.server import Dashboard, Server, make_handler
from tests.contract.test_identity import certs, tls  # noqa: F401 (certs: a fixture)
from tests.dashboard.test_server import TOKEN, Canned


@pytest.fixture
def address(certs, monkeypatch):  # noqa: F811
    for k, v in tls(certs, "worker").items():  # (the server's own certificate: any the CA signed)
        monkeypatch.setenv(k, v)
    context, client_certificates = tls_context()
    assert context is not None and client_certificates
    server = Server(("127.0.0.1", 0), make_handler(Dashboard(Canned()), Access(TOKEN), client_certificates))
    server.secure(context)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(timeout=10)


def client(certs, who: str | None) -> ssl.SSLContext:  # noqa: F811
    ctx = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    if who:
        ctx.load_cert_chain(str(certs[f"{who}.pem"]), str(certs[f"{who}.key"]))
    return ctx


def get(address: str, ctx: ssl.SSLContext) -> int:
    host, port = address.split(":")
    conn = HTTPSConnection(host, int(port), context=ctx, timeout=10)
    try:
        conn.request("GET", "/", headers={"Authorization": f"Bearer {TOKEN}"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_an_operators_certificate_is_served_a_workers_is_refused_and_none_fails_the_handshake(certs, address):  # noqa: F811
    assert get(address, client(certs, "user")) == 200
    assert get(address, client(certs, "worker")) == 403
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(address, client(certs, None))
