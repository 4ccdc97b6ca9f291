"""The local stack's dashboard process (`surgectl dashboard`): started on demand beside the
stack, recorded in ``$SURGE_HOME/run/dashboard.json``, stopped by `surgectl down`.

`surgectl up` starts it beside the stack (``--no-dashboard``, or SURGE_UP_DASHBOARD=0, does
not: the tests' stacks, never looked at in a browser, set it); `surgectl dashboard` starts it
on demand when it is not running. The token it asks for is SURGE_AUTH_TOKEN when the stack has
one, else one made for this stack (``run/dashboard.token``, mode 0600): the URL printed holds it.
A stack with a tokens file (`up --tokens FILE`) hands the dashboard that file instead: any of its
tokens opens the pages, each read with its caller's token (services/dashboard/access.py); the URL
then holds SURGE_AUTH_TOKEN only when that is a token of the file (else: add ``?token=`` yours).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from services.cli import stack, stack_access
from services.cli.errors import CliError
from services.common import paths
from services.common.access import TOKENS_FILE_ENV, TokensFileError, load_tokens
from services.common.grpc_server import AUTH_TOKEN_ENV, EXIT_PORT_IN_USE, TLS_CERT_ENV
from services.common.pids import pid_alive

UP_ENV = "SURGE_UP_DASHBOARD"  # "0": `surgectl up` starts no dashboard unless --dashboard
START_SECONDS = 30.0
START_ATTEMPTS = 3  # a port taken between choosing it and binding it: another, up to this many times


@dataclass
class DashboardProc:
    pid: int
    port: int
    log: str
    tokens: str = ""  # the stack's tokens file it checks ("" none: the one token)

    @property
    def base_url(self) -> str:
        scheme = "https" if os.environ.get(TLS_CERT_ENV) else "http"
        return f"{scheme}://{stack.HOST}:{self.port}"


def record_file() -> Path:
    return paths.run_dir() / "dashboard.json"


def token_file() -> Path:
    return paths.run_dir() / "dashboard.token"


def token() -> str:
    """SURGE_AUTH_TOKEN, else this stack's own (made once, readable by its owner only)."""
    if os.environ.get(AUTH_TOKEN_ENV):
        return os.environ[AUTH_TOKEN_ENV]
    f = token_file()
    if not f.exists():
        f.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(24) + "\n")
    return f.read_text().strip()


def wanted_at_up(flag: bool | None) -> bool:
    """Whether `surgectl up` starts the dashboard: its ``--dashboard/--no-dashboard``, else
    yes unless SURGE_UP_DASHBOARD is "0"."""
    return flag if flag is not None else os.environ.get(UP_ENV, "1").strip() != "0"


def url_line(proc: DashboardProc) -> str:
    """The line `up` and `surgectl dashboard` print: the URL with its token, its pid and log.
    With a tokens file: with SURGE_AUTH_TOKEN when the file names it, else without a token (a
    stack's own token opens nothing there: each person opens it with theirs)."""
    where = f"(pid {proc.pid}, log {proc.log})"
    if not proc.tokens:
        return f"dashboard: {proc.base_url}/?token={quote(token(), safe='')}  {where}"
    mine = os.environ.get(AUTH_TOKEN_ENV) or ""
    if mine and _in_file(proc.tokens, mine):
        return f"dashboard: {proc.base_url}/?token={quote(mine, safe='')}  {where}"
    return f"dashboard: {proc.base_url}/?token=YOUR_TOKEN  (a token of {proc.tokens}; {where[1:]}"


def _in_file(tokens: str, candidate: str) -> bool:
    try:
        return load_tokens(tokens).authenticate([("authorization", f"Bearer {candidate}")], None) is not None
    except TokensFileError:
        return False


def running() -> DashboardProc | None:
    f = record_file()
    if not f.exists():
        return None
    proc = DashboardProc(**json.loads(f.read_text()))
    return proc if pid_alive(proc.pid) else None


PORT_KEY = "dashboard.port"  # (its entry in the stack's ports.json)


def start() -> DashboardProc:
    """The running dashboard of this stack, or a new one started and answering.

    Raises:
        CliError: no stack is running, or the dashboard did not start (its log's last line)."""
    if proc := running():
        return proc
    procs = stack.read_stack()
    if not procs or "control" not in procs or "store" not in procs:
        raise CliError("no local stack is running (`surgectl up` starts one; the dashboard reads it)")
    control = procs["control"]
    tokens = stack_access.recorded(control) or ""
    if not tokens:
        token()  # (made before the process reads it)
    # Its port of the last time first, as the services keep theirs (a bookmarked URL keeps
    # working across `down` / `up`; was: a new port at every start).
    first = stack.remembered_port(PORT_KEY)
    for attempt in range(START_ATTEMPTS):
        proc = _spawn(procs, first if attempt == 0 and first else stack.free_port(), tokens)
        record_file().write_text(json.dumps(asdict(proc)))
        status = _wait_answering(proc)
        if status is None:
            stack.remember_port(PORT_KEY, proc.port)
            return proc
        if status != EXIT_PORT_IN_USE or attempt == START_ATTEMPTS - 1:
            record_file().unlink(missing_ok=True)
            raise CliError(f"the dashboard did not start (control at {control.address}): {_last_line(proc.log)}")
    raise AssertionError("unreachable")


def stop(timeout_s: float = 5.0) -> bool:
    """SIGTERM the recorded dashboard (SIGKILL after ``timeout_s``); whether one ran."""
    proc = running()
    record_file().unlink(missing_ok=True)
    if proc is None:
        return False
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(proc.pid) and not _reaped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(proc.pid) and not _reaped(proc.pid):
        os.kill(proc.pid, signal.SIGKILL)
    return True


def _spawn(procs: dict, port: int, tokens: str) -> DashboardProc:
    """``tokens``: the stack's tokens file (control's recorded ``--tokens``), "" none."""
    log = paths.run_dir() / "logs" / "dashboard.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    control, store = procs["control"], procs["store"]
    args = [
        "--host", stack.HOST, "--port", str(port), "--control", control.address, "--store", store.address,
        *(["--tokens", tokens] if tokens else ["--token-file", str(token_file())]),
    ]  # fmt: skip
    if url := stack.control_metrics_url(procs):
        args += ["--control-metrics", url]
    env = {**os.environ, "SURGE_HOME": str(paths.surge_home()), "PYTHONUNBUFFERED": "1"}
    env.pop(TOKENS_FILE_ENV, None)  # (the stack's recorded file decides, never this shell's variable)
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "services.dashboard", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # (not stopped by a Ctrl-C of the surgectl that started it)
        )
    _CHILDREN[p.pid] = p
    return DashboardProc(pid=p.pid, port=port, log=str(log), tokens=tokens)


_CHILDREN: dict[int, subprocess.Popen] = {}


def _reaped(pid: int) -> bool:
    p = _CHILDREN.get(pid)
    return p is not None and p.poll() is not None


def _wait_answering(proc: DashboardProc) -> int | None:
    """None once /healthz answers; the exit status if the process ended first."""
    ctx = _client_context() if proc.base_url.startswith("https") else None
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        p = _CHILDREN[proc.pid]
        if p.poll() is not None:
            return p.returncode
        try:
            with urllib.request.urlopen(f"{proc.base_url}/healthz", timeout=2, context=ctx) as r:
                if r.status == 200:
                    return None
        except OSError:
            time.sleep(0.1)
    raise CliError(f"the dashboard did not answer within {START_SECONDS:.0f} s; log: {proc.log}")


def _client_context():
    """TLS as this CLI speaks it to the services: the stack's CA when set (else the loopback
    dashboard it just started is trusted as is), its certificate for mutual TLS."""
    import ssl

    from services.common.grpc_server import TLS_CA_ENV, TLS_KEY_ENV

    ca = os.environ.get(TLS_CA_ENV)
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    ctx.check_hostname = False  # (127.0.0.1: the certificate names the service, not the address)
    if not ca:
        ctx.verify_mode = ssl.CERT_NONE
    if os.environ.get(TLS_CERT_ENV) and os.environ.get(TLS_KEY_ENV):
        ctx.load_cert_chain(os.environ[TLS_CERT_ENV], os.environ[TLS_KEY_ENV])
    return ctx


def _last_line(log: str) -> str:
    try:
        lines = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no log at {log})"
    return lines[-1] if lines else f"(its log {log} is empty)"
