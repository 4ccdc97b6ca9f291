"""python -m services.dashboard --port P --control ADDR --store ADDR [--control-metrics URL]
[--token-file F | --tokens FILE]: the dashboard's composition root.

Builds the read side (``Sources``: control's and the store's addresses, control's /metrics,
the store's metrics files when on this machine), the access check (the token: SURGE_AUTH_TOKEN,
else the first line of --token-file; with a tokens file, --tokens or SURGE_TOKENS_FILE, the one
control and the store check: any of its tokens, each caller's pages read with its own token, and
SIGHUP reads the file again as they do; SURGE_TLS_* as every service reads them) and serves the
pages until SIGTERM or SIGINT. It holds no state: stopped and started again, it shows the same.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from pathlib import Path

from services.common import logs, paths
from services.common.access import TOKENS_FILE_ENV, reload_tokens, tokens_of_flag
from services.common.grpc_server import AUTH_TOKEN_ENV, EXIT_PORT_IN_USE, TlsConfigError
from services.common.service_args import ServiceArgumentParser, env_option, listen_host, port
from services.dashboard import charts
from services.dashboard.access import Access, tls_context
from services.dashboard.server import Dashboard, Server, make_handler
from services.dashboard.sources import Sources


def main(argv: list[str] | None = None) -> int:
    p = ServiceArgumentParser(prog="python -m services.dashboard", description=__doc__.split("\n")[0])
    env_option(p, "--host", "SURGE_DASHBOARD_HOST", listen_host, "127.0.0.1", "address to listen on")
    env_option(p, "--port", "SURGE_DASHBOARD_PORT", port, "0", "HTTP port (0: any free port)")
    p.add_argument("--control", default=os.environ.get("SURGE_CONTROL_ADDRESS"), help="control's gRPC address")
    p.add_argument("--store", default=os.environ.get("SURGE_STORE_ADDRESS"), help="the store's gRPC address")
    p.add_argument("--control-metrics", default="", help="control's /metrics URL (the cluster page's slots)")
    p.add_argument("--token-file", type=Path, default=None, help=f"the token, when {AUTH_TOKEN_ENV} is not set")
    p.add_argument(
        "--tokens",
        default=os.environ.get(TOKENS_FILE_ENV) or "",
        help="the tokens file control and the store check: any of its tokens opens the pages, each read with "
        f"that token, so a team sees its own jobs (env {TOKENS_FILE_ENV}; replaces {AUTH_TOKEN_ENV} and --token-file)",
    )
    p.add_argument(
        "--records", type=Path, default=None, help="the store's metrics files (default: <store root>/metrics)"
    )
    args = p.parse_args(argv)
    if not args.control or not args.store:
        p.error("--control and --store are required (or SURGE_CONTROL_ADDRESS, SURGE_STORE_ADDRESS)")
    identities = tokens_of_flag(args.tokens)  # (a bad file: one line, exit 2)
    token = "" if identities is not None else os.environ.get(AUTH_TOKEN_ENV) or ""
    if identities is None and not token and args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            p.error(f"--token-file {args.token_file}: cannot read: {e.strerror or e}")
    if identities is None and not token:
        p.error(f"no token: set {AUTH_TOKEN_ENV} or --token-file (the pages show every job to whoever holds it)")
    log = logs.configure("dashboard")
    try:
        context, client_certificates = tls_context()
    except TlsConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sources = Sources(
        args.control,
        args.store,
        args.control_metrics,
        args.records or paths.store_root() / "metrics",
        per_caller=identities is not None,
    )
    handler = make_handler(Dashboard(sources), Access(token, identities), client_certificates)
    try:
        server = Server((args.host, args.port), handler)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_PORT_IN_USE if e.errno == errno.EADDRINUSE else 2
    if context is not None:
        server.secure(context)
    charts.warm_up()  # (before /healthz answers: the first page is drawn as fast as the next)
    scheme = "https" if context is not None else "http"
    log.info(
        "dashboard serving",
        url=f"{scheme}://{args.host}:{server.server_address[1]}/",
        control=args.control,
        tokens=args.tokens or None,
    )

    def stop(signum, frame) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()  # (shutdown waits for serve_forever)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if identities is not None:
        signal.signal(signal.SIGHUP, lambda *_: reload_tokens(identities, log))
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        sources.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
