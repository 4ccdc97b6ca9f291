"""The dashboard under per-team access (issue 30 item 6 x issue 31 item 1): with a tokens file,
any of its tokens opens the pages, and each page is read WITH THAT TOKEN, so control's and the
store's own team rules decide what it shows: a team's token sees its team's jobs only (another
team's job page says it is refused, in control's one line), an admin's every job; a token the
file does not name (the stack's own cluster token included) is 401.

The real `python -m services.dashboard` process (tokens file from SURGE_TOKENS_FILE, the
stack's cluster token in its SURGE_AUTH_TOKEN, which must open nothing) reading the real store
process (the same tokens file) and control's real plane and server in-process, on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest

from services.common.access import load_tokens
from services.common.grpc_server import EXIT_PORT_IN_USE
from services.contract import Module, store_pb2
from services.control.store_relay import StoreRelay
from tests.conftest import free_ports
from tests.control.test_access import SECURITY_VARS, caller, served, submit
from tests.store.test_store_access import CLUSTER, TOKENS, stub, write_as_a_rank
from tests.store.test_store_service import answers_or_exits, spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
TOKENS_YAML = (
    "principals:\n"
    "  - {name: alice, team: vision, token_sha256: %s}\n"
    "  - {name: bob, team: nlp, token_sha256: %s}\n"
    "  - {name: root, team: ops, role: admin, token_sha256: %s}\n"
)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _store(root: Path) -> tuple[subprocess.Popen, int]:
    for _ in range(3):  # a port taken between picking and binding: pick again
        port, metrics_port = free_ports(2)
        with open(root / "store.log", "wb") as out:
            proc = spawn(root, port, metrics_port, out)
        if answers_or_exits(proc, port, polls=240):
            return proc, port
    pytest.fail(f"the store did not start: {(root / 'store.log').read_text()[-2000:]}")


def _dashboard(root: Path, control: str, store: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SURGE_HOME": str(root / "home"), "PYTHONUNBUFFERED": "1"}
    for _ in range(3):
        (port,) = free_ports(1)
        with open(root / "dashboard.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.dashboard", "--host", "127.0.0.1", "--port", str(port)]
                + ["--control", control, "--store", store],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120  # (a loaded 2-core host starts a Python service slowly)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if get(f"127.0.0.1:{port}", "/healthz")[0] == 200:
                    return proc, f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.2)
        _stop(proc)
        if proc.returncode != EXIT_PORT_IN_USE:
            break
    pytest.fail(f"the dashboard did not answer: {(root / 'dashboard.log').read_text()[-2000:]}")


def get(base: str, path: str, token: str | None = None, headers: dict | None = None) -> tuple[int, str, object]:
    conn = HTTPConnection(base, timeout=30)
    conn.request("GET", path, headers={**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})})
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    return r.status, body, r


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    """(dashboard address, alice's job id (vision), bob's job id (nlp)): each job has a committed
    version in the store, written as its rank would."""
    from services.common.access import token_digest

    root = tmp_path_factory.mktemp("teams")
    tokens = root / "tokens.yaml"
    tokens.write_text(TOKENS_YAML % tuple(token_digest(TOKENS[n]) for n in ("alice", "bob", "root")))
    with pytest.MonkeyPatch.context() as env:
        for var in SECURITY_VARS:
            env.delenv(var, raising=False)
        env.setenv("SURGE_TOKENS_FILE", str(tokens))  # (the store and the dashboard read it)
        env.setenv("SURGE_AUTH_TOKEN", CLUSTER)  # the stack's own token: what ranks send
        # (control verifies a job's versions with the store on its applier: none here)
        env.setattr(
            StoreRelay, "verify_checkpoints", lambda self, msg, payload=None: store_pb2.CheckpointVerification()
        )
        store, store_port = _store(root)
        try:
            with served(root, env, load_tokens(tokens)) as (_, control):
                with caller(control, env, TOKENS["alice"]) as alice, caller(control, env, TOKENS["bob"]) as bob:
                    mine, theirs = submit(alice, "seg").job_id, submit(bob, "lm").job_id
                with stub(store_port, env, Module.L2_TRAINING_LOOP, CLUSTER) as rank:
                    write_as_a_rank(rank, mine, "vision", spec_team="vision")
                    write_as_a_rank(rank, theirs, "nlp", spec_team="nlp")
                dashboard, base = _dashboard(root, control, f"127.0.0.1:{store_port}")
                try:
                    yield base, mine, theirs
                finally:
                    _stop(dashboard)
        finally:
            _stop(store)


def test_each_teams_token_sees_its_own_job_only_and_another_teams_job_page_is_refused(teams):
    base, vision_job, nlp_job = teams
    for who, own, other, line in (
        ("alice", vision_job, nlp_job, f"job {nlp_job} belongs to team nlp; your identity (alice) is team vision"),
        ("bob", nlp_job, vision_job, f"job {vision_job} belongs to team vision; your identity (bob) is team nlp"),
    ):
        token = TOKENS[who]
        for path in ("/", "/queue", "/cluster", "/compare"):
            status, body, _ = get(base, path, token)
            assert status == 200, (who, path, body)
            assert other not in body, (who, path)  # control listed the caller's team's jobs only
        assert own in get(base, "/", token)[1] and own in get(base, "/queue", token)[1]
        # Its own job: control's status and the store's checkpoints, both read with its token.
        status, body, _ = get(base, f"/job/{own}", token)
        assert status == 200 and f"{own}:1" in body, (who, body)
        # Another team's job, by id: control's refusal, one line, nothing of the job.
        for path in (f"/job/{other}", f"/job/{other}/logs", f"/compare?job={own}&job={other}"):
            status, body, _ = get(base, path, token)
            assert status == 403, (who, path, body)
            assert f"<p class=bad id=error>refused: {line}</p>" in body and f"{other}:1" not in body
        # The cookie the URL's token is traded for identifies the caller: the same view.
        status, _, r = get(base, f"/?token={token}")
        assert status == 303 and r.getheader("Location") == "/"
        cookie = r.getheader("Set-Cookie")
        assert cookie.startswith(f"surge_dashboard={token};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        status, body, _ = get(base, "/", headers={"Cookie": cookie.split(";")[0]})
        assert status == 200 and own in body and other not in body


def test_an_admins_token_sees_both_teams_jobs(teams):
    base, vision_job, nlp_job = teams
    status, body, _ = get(base, "/", TOKENS["root"])
    assert status == 200 and vision_job in body and nlp_job in body
    for job in (vision_job, nlp_job):
        status, body, _ = get(base, f"/job/{job}", TOKENS["root"])
        assert status == 200 and f"{job}:1" in body, body


def test_a_token_the_file_does_not_name_is_401_the_stacks_own_included(teams):
    base, vision_job, _ = teams
    for token in ("tok-nobody", CLUSTER, None):  # (CLUSTER: the dashboard's own SURGE_AUTH_TOKEN)
        for path in ("/", f"/job/{vision_job}", f"/?token={token}"):
            status, body, r = get(base, path, token)
            assert status == 401 and vision_job not in body, (token, path)
            assert r.getheader("WWW-Authenticate") and r.getheader("Set-Cookie") is None
    status, _, _ = get(base, "/", headers={"Cookie": f"surge_dashboard={CLUSTER}"})
    assert status == 401
