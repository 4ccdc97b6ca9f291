"""`surgectl dashboard` without a stack, and the token it makes for the local stack."""

from __future__ import annotations

import stat

import pytest

from services.cli import dashboard
from services.cli.errors import CliError


def test_the_dashboard_is_not_started_without_a_stack_and_says_what_to_run(surge_home):
    with pytest.raises(CliError, match="no local stack is running .*surgectl up"):
        dashboard.start()
    assert dashboard.running() is None and not dashboard.record_file().exists()
    assert dashboard.stop() is False


def test_the_local_stacks_token_is_made_once_readable_by_its_owner_only(surge_home, monkeypatch):
    monkeypatch.delenv("SURGE_AUTH_TOKEN", raising=False)
    first = dashboard.token()
    assert len(first) >= 32 and dashboard.token() == first
    assert stat.S_IMODE(dashboard.token_file().stat().st_mode) == 0o600
    monkeypatch.setenv("SURGE_AUTH_TOKEN", "the-stacks-own")
    assert dashboard.token() == "the-stacks-own"  # the stack's token when it has one


def test_under_a_tokens_file_the_url_holds_the_callers_token_only_when_the_file_names_it(
    surge_home, monkeypatch, tmp_path
):
    from services.common.access import entry_line

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("principals:\n" + entry_line("alice", "vision", "user", "tok-alice") + "\n")
    proc = dashboard.DashboardProc(pid=1, port=8080, log="d.log", tokens=str(tokens))
    monkeypatch.setenv("SURGE_AUTH_TOKEN", "tok-alice")
    assert dashboard.url_line(proc).startswith("dashboard: http://127.0.0.1:8080/?token=tok-alice  (pid 1")
    monkeypatch.setenv("SURGE_AUTH_TOKEN", "the-stacks-own")  # opens nothing there: not printed
    line = dashboard.url_line(proc)
    assert "the-stacks-own" not in line and f"?token=YOUR_TOKEN  (a token of {tokens}; pid 1" in line
    assert not dashboard.token_file().exists()  # (no token of its own is made for such a stack)
    # A record written before this field: the one-token dashboard, as it was.
    assert dashboard.DashboardProc(pid=1, port=8080, log="d.log").tokens == ""


@pytest.mark.timeout(180)
def test_surgectl_dashboard_of_a_stack_with_a_tokens_file_hands_it_that_file(surge_home, monkeypatch, tmp_path):
    """The real dashboard process `start()` spawns for a stack whose control checks a tokens
    file (its recorded ``--tokens``): a token of the file passes its gate (control is not
    running here: 502, control's own answer), the one this shell's SURGE_AUTH_TOKEN holds does
    not, and this shell's SURGE_TOKENS_FILE is not what decides."""
    import json
    from http.client import HTTPConnection

    from services.common.access import entry_line

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("principals:\n" + entry_line("alice", "vision", "user", "tok-alice") + "\n")
    other = tmp_path / "other.yaml"
    other.write_text("principals:\n" + entry_line("eve", "nlp", "user", "tok-eve") + "\n")
    monkeypatch.setenv("SURGE_AUTH_TOKEN", "the-stacks-own")
    monkeypatch.setenv("SURGE_TOKENS_FILE", str(other))
    dashboard.record_file().parent.mkdir(parents=True, exist_ok=True)
    record = {"pid": 1, "port": 1, "log": "x.log", "service": "control", "args": ["--tokens", str(tokens)]}
    services = {"control": {**record, "name": "control"}, "store": {**record, "name": "store", "args": []}}
    (dashboard.record_file().parent / "stack.json").write_text(json.dumps({"services": services}))
    proc = dashboard.start()
    try:
        assert proc.tokens == str(tokens) and not dashboard.token_file().exists()

        def status(token: str) -> int:
            conn = HTTPConnection(f"127.0.0.1:{proc.port}", timeout=30)
            conn.request("GET", "/", headers={"Authorization": f"Bearer {token}"})
            code = conn.getresponse().status
            conn.close()
            return code

        assert status("tok-alice") == 502  # past the gate; control (port 1) does not answer
        assert status("the-stacks-own") == 401 and status("tok-eve") == 401
    finally:
        assert dashboard.stop() is True


def test_the_dashboard_port_of_the_last_start_is_taken_again_when_free(surge_home):
    # (as the services keep theirs across `down` / `up`: a bookmarked URL keeps working; was a new
    # port at every start, fresh-user trial)
    import socket

    from services.cli import stack
    from tests.ports import free_port

    stack.paths.run_dir().mkdir(parents=True, exist_ok=True)
    assert stack.remembered_port(dashboard.PORT_KEY) == 0  # (none yet: a fresh port)
    port = free_port()
    stack.remember_port(dashboard.PORT_KEY, port)
    assert stack.remembered_port(dashboard.PORT_KEY) == port
    with socket.socket() as taken:  # another process holds it now: not offered
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert stack.remembered_port(dashboard.PORT_KEY) == 0
