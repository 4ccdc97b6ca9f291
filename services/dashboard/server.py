"""The dashboard's HTTP side: routes, the access check, answers. Read-only: GET and HEAD only.

Routes: ``/`` jobs, ``/queue``, ``/cluster``, ``/job/<job>`` (``?type=fault&type=...``: only
those events; an unknown type is refused, 400, in the CLI's words; ``?rank=N``: that rank's
curves, default 0; ``?events=N``: the newest N events of those types, default
``pages.JOB_PAGE_EVENTS``, ``all``: the whole history), ``/job/<job>/logs``
(follows a live job: its script asks ``/job/<job>/logs/lines?seen=RANK:COUNT,...`` for the
lines after those it shows, JSON, log_follow.py), ``/compare?job=A&job=B...``, and ``/healthz`` (no data: what `surgectl
dashboard` waits for); a job is its id or its name, as on the CLI (404: neither; 403 with
control's one line: another team's job, under a tokens file). Every other method is refused
(405): the dashboard changes nothing.

A page is drawn on its request's own thread (``ThreadingHTTPServer``); each answer carries
``Server-Timing: page;dur=<ms>`` (the time to read and draw it), which the tests and
docs/LOG.md report as page times.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import grpc

from services.cli.errors import CliError
from services.cli.event_types import event_types
from services.common.job_refs import UnknownJob
from services.dashboard import log_follow, pages
from services.dashboard.access import Access, operator_certificate
from services.dashboard.sources import Sources

log = logging.getLogger("surge.dashboard")


class PageError(Exception):
    """A request the dashboard answers with ``status`` and a one-line ``message`` (an unknown
    job, an unknown event type), as the CLI would refuse the same words."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class Dashboard:
    """The pages, each a function of the request's query reading from ``sources``. A job is
    named by its id or its name, as on the CLI."""

    def __init__(self, sources: Sources):
        self._src = sources

    def as_caller(self, token: str) -> Dashboard:
        """The pages read as the holder of ``token`` (a tokens file: control and the store
        decide what it sees)."""
        return Dashboard(self._src.as_caller(token))

    def jobs(self) -> str:
        return pages.jobs_page(self._src.jobs().jobs)

    def queue(self) -> str:
        return pages.queue_page(self._src.jobs().jobs)

    def cluster(self) -> str:
        listed = self._src.jobs()
        return pages.cluster_page(self._src.slots(), listed.jobs, listed.cordoned)

    def _job_id(self, ref: str) -> str:
        try:
            return self._src.resolve(ref)
        except UnknownJob as e:
            raise PageError(HTTPStatus.NOT_FOUND, str(e)) from None

    def job(self, ref: str, query: dict[str, list[str]]) -> str:
        try:
            types = frozenset(event_types(query.get("type", ())))
        except CliError as e:  # (the CLI's words: "--type: unknown event type ...")
            raise PageError(HTTPStatus.BAD_REQUEST, str(e).replace("--type: ", "type: ", 1)) from None
        rank_text = query.get("rank", ["0"])[0]
        if not rank_text.isdigit() or int(rank_text) >= 2**31:
            raise PageError(HTTPStatus.BAD_REQUEST, f"rank: expected a whole number >= 0, got {rank_text!r}")
        tail = events_shown(query.get("events", [""])[0])
        job_id = self._job_id(ref)
        status = self._src.job(job_id)
        if status.world_size and int(rank_text) >= status.world_size:  # (else rank 0's curves, unsaid)
            raise PageError(
                HTTPStatus.NOT_FOUND,
                f"rank: {job_id} has no rank {rank_text} (its ranks are 0-{status.world_size - 1})",
            )
        events = self._src.events(job_id, tail, sorted(types))  # (control's journal selects them)
        records = self._src.job_records(job_id, int(rank_text))
        return pages.job_page(
            status,
            events,
            types,
            records.series,
            self._src.checkpoints(job_id),
            self._src.logs(job_id),
            samples=records.samples,
            scores=records.scores,
            tail=tail,
        )

    def logs(self, ref: str) -> str:
        job_id = self._job_id(ref)
        return pages.logs_page(self._src.job(job_id), self._src.logs(job_id))

    def log_lines(self, ref: str, query: dict[str, list[str]]) -> str:
        """The lines after ``seen`` (each rank's count the page shows), JSON (log_follow.py)."""
        try:
            seen = log_follow.parse_seen(query.get("seen", [""])[0])
        except ValueError as err:
            raise PageError(HTTPStatus.BAD_REQUEST, str(err)) from None
        job_id = self._job_id(ref)
        status = self._src.job(job_id)  # (before the lines: a line written after it is read next time)
        return log_follow.answer(self._src.logs(job_id), seen, status.state in pages.LIVE)

    def compare(self, query: dict[str, list[str]]) -> str:
        wanted = list(dict.fromkeys(self._job_id(j) for v in query.get("job", ()) for j in v.split(",") if j))
        runs = []
        for job_id in wanted:
            status = self._src.job(job_id)
            runs.append(pages.Run(status, self._src.series(job_id)))
        return pages.compare_page(runs, [] if len(runs) >= 2 else self._src.jobs().jobs)


def events_shown(text: str) -> int:
    """A job page's ``?events``: how many of the newest events it shows (0: ``all``; none
    given: ``pages.JOB_PAGE_EVENTS``).

    Raises:
        PageError: 400, neither ``all`` nor a whole number from 1 to ``pages.MAX_PAGE_EVENTS``.
    """
    if not text:
        return pages.JOB_PAGE_EVENTS
    if text == "all":
        return 0
    if not text.isdigit() or not 1 <= int(text) <= pages.MAX_PAGE_EVENTS:
        raise PageError(
            HTTPStatus.BAD_REQUEST, f"events: expected 'all' or a whole number 1-{pages.MAX_PAGE_EVENTS}, got {text!r}"
        )
    return int(text)


# A service's refusal, answered as the HTTP status that says it (any other: 502, the service's words).
_RPC_STATUS = {
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,  # another team's job
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,  # a token the service no longer knows
}


def make_handler(dashboard: Dashboard, access: Access, client_certificates: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "SurgeDashboard"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # (http.server's access log, into ours)
            log.info("%s %s", self.address_string(), format % args)

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _refuse_method(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, pages.error_page(405, "the dashboard is read-only"), head=False)

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method

        def _answer(self, head: bool) -> None:
            t0 = time.perf_counter()
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if url.path == "/healthz":
                return self._send(HTTPStatus.OK, "ok", head, content_type="text/plain")
            if client_certificates and not operator_certificate(self.connection.getpeercert()):
                return self._send(
                    HTTPStatus.FORBIDDEN,
                    pages.error_page(403, "the client certificate is not an operator's (surge-user)"),
                    head,
                )
            caller = access.by_header_or_cookie(self.headers.get("Authorization"), self.headers.get("Cookie"))
            if caller is None:
                offered = query.get("token", [None])[0]
                if access.by_query(offered):
                    rest = urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs], doseq=True)
                    return self._redirect(url.path + (f"?{rest}" if rest else ""), access.cookie_header(offered))
                return self._send(
                    HTTPStatus.UNAUTHORIZED,
                    pages.error_page(
                        401, "not authorized: open the URL `surgectl dashboard` prints (it holds the token)"
                    ),
                    head,
                    extra={"WWW-Authenticate": 'Bearer realm="surge"'},
                )
            # A tokens file: the page is read with the caller's token (control's and the store's
            # team rules decide what it shows); else with the dashboard's own.
            route = self._route(dashboard.as_caller(caller) if access.per_caller else dashboard, url.path, query)
            data = url.path.endswith("/logs/lines")  # (a script's JSON, not a page: its errors are JSON too)
            if route is None:
                return self._fail(HTTPStatus.NOT_FOUND, f"no page {url.path}", head, data)
            try:
                page = route()
            except PageError as e:
                return self._fail(e.status, str(e), head, data)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                what = e.details() if hasattr(e, "details") else str(e)
                status = _RPC_STATUS.get(code, HTTPStatus.BAD_GATEWAY)
                if status in (HTTPStatus.FORBIDDEN, HTTPStatus.UNAUTHORIZED):  # (the service's own one line)
                    return self._fail(status, f"refused: {what}", head, data)
                return self._fail(status, f"{getattr(code, 'name', code)}: {what}", head, data)
            ms = (time.perf_counter() - t0) * 1000
            kind = "application/json" if data else "text/html; charset=utf-8"
            self._send(HTTPStatus.OK, page, head, content_type=kind, extra={"Server-Timing": f"page;dur={ms:.1f}"})

        def _fail(self, status: HTTPStatus, text: str, head: bool, data: bool) -> None:
            """An error, as a page or (``data``) as the JSON ``{"error": text}``."""
            if data:
                return self._send(status, json.dumps({"error": text}), head, content_type="application/json")
            return self._send(status, pages.error_page(int(status), text), head)

        def _route(self, dashboard: Dashboard, path: str, query: dict[str, list[str]]) -> Callable[[], str] | None:
            if path == "/":
                return dashboard.jobs
            if path == "/queue":
                return dashboard.queue
            if path == "/cluster":
                return dashboard.cluster
            if path == "/compare":
                return lambda: dashboard.compare(query)
            if path.startswith("/job/"):
                rest = path[len("/job/") :]
                if rest.endswith("/logs/lines"):
                    job = unquote(rest[: -len("/logs/lines")])
                    return (lambda: dashboard.log_lines(job, query)) if job else None
                if rest.endswith("/logs"):
                    job = unquote(rest[: -len("/logs")])
                    return (lambda: dashboard.logs(job)) if job else None
                job = unquote(rest)
                return (lambda: dashboard.job(job, query)) if job and "/" not in job else None
            return None

        def _redirect(self, location: str, cookie: str) -> None:
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header("Location", location)
            self.send_header("Set-Cookie", cookie)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _send(
            self,
            status: HTTPStatus,
            text: str,
            head: bool,
            content_type: str = "text/html; charset=utf-8",
            extra: dict[str, str] | None = None,
        ) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # (a job's page is a snapshot of now)
            self.send_header("X-Content-Type-Options", "nosniff")
            # Pages hold no script but the logs page's (its scroll and its follow, which asks
            # this server for new lines): nothing else may run, load or be asked.
            self.send_header(
                "Content-Security-Policy",
                "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                "connect-src 'self'; form-action 'self'",
            )
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True  # (a page being drawn never holds up the service's exit)
    allow_reuse_address = True

    def secure(self, context: ssl.SSLContext) -> None:
        """Serve over TLS with ``context`` (``access.tls_context``). The handshake happens on
        the request's thread, not in accept(): a slow client holds up only itself."""
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
