"""Who may read the dashboard: the holder of the token, over mutual TLS where the stack uses it.

The same gate as control's user port (services/common/grpc_guards.py), made stricter for
pages that show every job to whoever opens them:

* a token is always required (SURGE_AUTH_TOKEN when the stack sets one, else the one
  `surgectl dashboard` made for this stack): as ``Authorization: Bearer <token>``, or once
  as ``?token=<token>`` in the URL, which answers with a cookie holding that token (HttpOnly,
  SameSite=Strict) and a redirect to the same page without it;
* with a tokens file (``--tokens FILE`` / SURGE_TOKENS_FILE, the file control and the store
  check: services/common/access.py), any token of that file opens the pages (its digest
  compared with every principal's, as the gRPC servers do) and no other: the pages are then
  read WITH THAT TOKEN (``per_caller``), so control's and the store's own team rules decide
  what each caller sees. The dashboard filters nothing itself: one source of truth;
* with SURGE_TLS_CERT/KEY the pages are served over TLS; with SURGE_TLS_CA as well, a client
  certificate signed by that CA is required and its identity (CN or DNS SAN) must be a role
  that may speak as the operator (``ROLE_MODULES``: surge-user), as on the gRPC ports.

Tokens are compared in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import os
import ssl
from http.cookies import SimpleCookie
from urllib.parse import quote, unquote

from services.common.access import Identities
from services.common.grpc_server import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsConfigError
from services.common.identity import ROLE_MODULES
from services.contract import Module

COOKIE = "surge_dashboard"
OPERATOR_ROLES = frozenset(r for r, modules in ROLE_MODULES.items() if Module.EXT_USER in modules)


class Access:
    """The token check and, under mutual TLS, the certificate check. ``Access(token)``: the
    one token (non-empty) opens every page, read with the dashboard's own credentials;
    ``Access(identities=...)``: any token of a tokens file, each caller's pages read with its
    own token (``per_caller``)."""

    def __init__(self, token: str = "", identities: Identities | None = None):
        if identities is None and not token:
            raise ValueError("the dashboard needs a token: it shows every job to whoever holds one")
        self._token = token.encode()
        self._identities = identities

    @property
    def per_caller(self) -> bool:
        """Whether each page is read with its caller's token (a tokens file)."""
        return self._identities is not None

    def _same(self, offered: str | None) -> bool:
        if not offered:
            return False
        if self._identities is not None:
            return self._identities.authenticate([("authorization", f"Bearer {offered}")], None) is not None
        return hmac.compare_digest(offered.encode(), self._token)

    def by_header_or_cookie(self, authorization: str | None, cookie: str | None) -> str | None:
        """The token the request carries (Bearer header, or the cookie set earlier) when it
        opens the pages; None when it carries none that does."""
        if authorization and authorization.startswith("Bearer "):
            offered = authorization[len("Bearer ") :]
            if self._same(offered):
                return offered
        if cookie:
            jar = SimpleCookie()
            try:
                jar.load(cookie)
            except Exception:  # (a malformed Cookie header: as if none; http.cookies raises its own CookieError)
                return None
            if COOKIE in jar and self._same(offered := unquote(jar[COOKIE].value)):
                return offered
        return None

    def by_query(self, token: str | None) -> bool:
        return self._same(token)

    def cookie_header(self, token: str) -> str:
        """The cookie that identifies the caller by ``token`` (one it was opened with)."""
        # (percent-encoded: a token of a tokens file may hold what a cookie value may not, ";" or a space)
        return f"{COOKIE}={quote(token, safe='')}; HttpOnly; SameSite=Strict; Path=/"


def certificate_names(peer: dict | None) -> set[str]:
    """The CN and DNS SANs of a peer certificate (``SSLSocket.getpeercert()``)."""
    if not peer:
        return set()
    names = {value for rdn in peer.get("subject", ()) for key, value in rdn if key == "commonName"}
    names |= {value for kind, value in peer.get("subjectAltName", ()) if kind == "DNS"}
    return names


def operator_certificate(peer: dict | None) -> bool:
    """Whether a client certificate names a role that may speak as the operator."""
    return bool(certificate_names(peer) & OPERATOR_ROLES)


def tls_context() -> tuple[ssl.SSLContext | None, bool]:
    """(the server's TLS context from SURGE_TLS_*, or None: plaintext; whether a client
    certificate is required: SURGE_TLS_CA is set).

    Raises:
        TlsConfigError: only one of certificate and key is set."""
    cert, key, ca = (os.environ.get(v) for v in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV))
    if not cert and not key:
        return None, False
    if not cert or not key:
        raise TlsConfigError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except OSError as e:
        raise TlsConfigError(f"TLS files: cannot read: {e.strerror or e}") from None
    return ctx, bool(ca)
