"""`surgectl up` survives losing a port to another process between probe and bind, and
refuses bad operator input (fixed ports, log settings, SURGE_HOME) in one line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import grpc
import pytest

from services.cli import stack
from services.cli.errors import CliError
from services.common.grpc_server import EXIT_PORT_IN_USE
from tests.conftest import REPO, free_ports, kill_all, processes_with

pytestmark = pytest.mark.timeout(120)


def test_a_service_that_loses_its_port_is_restarted_on_a_fresh_one(surge_home, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = stack.free_port
    handed = iter([taken])  # the very first port handed out (store's gRPC port) is taken
    monkeypatch.setattr(stack, "free_port", lambda: next(handed, None) or real())
    procs = {}
    try:
        procs = stack.up(num_workers=1, timeout_s=60)
        assert procs["store"].port != taken
        assert set(procs) == {"store", "data", "control", "worker-0"}
        assert "in use" in open(procs["store"].log).read()  # the first attempt did lose it
        # ... and said so by its exit status, which is what up read
        lost = [c for c in stack._CHILDREN.values() if str(taken) in c.args]
        assert [c.returncode for c in lost] == [EXIT_PORT_IN_USE]
    finally:
        stack.down()
        kill_all([p.pid for p in procs.values()])
        squatter.close()


def test_up_after_down_gives_each_service_its_last_ports_while_free_and_writes_prometheus_targets(surge_home):
    """A Prometheus scraping the local stack keeps its targets across `down` / `up` (was: every
    port new at every `up`, every target down and every series' ``instance`` new): each service
    gets its last ports back (``run/ports.json``) unless one was taken since, and
    ``run/prometheus_targets.json`` (file_sd) lists every /metrics endpoint by service."""
    import json

    from services.common import paths

    def ports(procs):
        return {n: (p.port, p.metrics_port) for n, p in procs.items()}

    def targets():
        raw = json.loads((paths.run_dir() / "prometheus_targets.json").read_text())
        return {t["labels"]["service"]: t["targets"] for t in raw}

    pids, squatter = [], socket.socket()
    try:
        first = stack.up(num_workers=2, timeout_s=60)
        pids += [p.pid for p in first.values()]
        assert targets() == {n: [f"127.0.0.1:{p.metrics_port}"] for n, p in first.items()}
        stack.down()
        squatter.bind(("127.0.0.1", first["data"].metrics_port))  # taken while the stack was down
        squatter.listen()
        second = stack.up(num_workers=2, timeout_s=60)
        pids += [p.pid for p in second.values()]
        was, now = ports(first), ports(second)
        assert now["data"][1] != was["data"][1] and now["data"][0] == was["data"][0]
        assert {n: v for n, v in now.items() if n != "data"} == {n: v for n, v in was.items() if n != "data"}
        assert targets() == {n: [f"127.0.0.1:{p.metrics_port}"] for n, p in second.items()}
    finally:
        stack.down()
        kill_all(pids)
        squatter.close()


def test_the_workers_of_a_one_host_stack_each_register_their_share_of_its_memory(surge_home, monkeypatch):
    """Each of `up --workers 2`'s agents registered the whole host's RAM, so the allocator's
    CPU slot quotas summed to twice the host (fresh37 #7c): now each says its share."""
    import json
    import time

    meminfo = surge_home / "meminfo"
    meminfo.write_text("MemTotal: 25165824 kB\nMemFree: 12582912 kB\nMemAvailable: 12582912 kB\n")  # 24 GiB
    monkeypatch.setenv("SURGE_WORKER_MEMINFO", str(meminfo))
    monkeypatch.setenv("SURGE_WORKER_MEMORY_CHECK_SECONDS", "0")
    procs = {}
    try:
        procs = stack.up(num_workers=2, timeout_s=60)

        def serving(name: str) -> dict | None:  # the agent's start line (written before it serves)
            lines = [json.loads(x) for x in open(procs[name].log) if '"worker serving"' in x]
            return lines[-1] if lines else None

        deadline = time.monotonic() + 30
        while not all(serving(w) for w in ("worker-0", "worker-1")) and time.monotonic() < deadline:
            time.sleep(0.1)
        said = [serving(w) for w in ("worker-0", "worker-1")]
        assert [(s["memory_bytes"], s["host_share"]) for s in said] == [(12 * 2**30, 2)] * 2, said
    finally:
        stack.down()
        kill_all([p.pid for p in procs.values()])


def test_a_bad_fixed_port_is_one_line_naming_the_variable_and_starts_nothing(surge_home, monkeypatch):
    monkeypatch.setenv("SURGE_CONTROL_PORT", "http")
    with pytest.raises(CliError) as e:
        stack.up(num_workers=1)
    assert str(e.value) == "SURGE_CONTROL_PORT: expected a port number 1-65535, got 'http'" and e.value.code == 2
    assert stack.read_stack() is None  # nothing was started


def test_restart_without_a_stack_or_of_an_unknown_service_is_one_line(surge_home):
    with pytest.raises(CliError, match="no local stack is running"):
        stack.restart("control")
    stack.stack_file().parent.mkdir(parents=True)
    stack._write({"control": stack.ServiceProc("control", pid=2**22 + 1, port=1, log="x")})
    with pytest.raises(CliError) as e:
        stack.restart("contorl")
    assert "SERVICE: no service 'contorl'" in str(e.value) and "(one of: control)" in str(e.value)
    assert e.value.code == 2
    with pytest.raises(CliError, match="does not record its command line"):
        stack.restart("control")  # an old stack.json entry whose process is gone


def test_two_services_fixed_to_one_port_are_refused_naming_both_and_start_nothing(surge_home, monkeypatch):
    port = str(free_ports(1)[0])
    monkeypatch.setenv("SURGE_DATA_PORT", port)
    monkeypatch.setenv("SURGE_STORE_PORT", port)
    with pytest.raises(CliError) as e:
        stack.up(num_workers=1)
    assert (
        str(e.value) == (f"SURGE_DATA_PORT and SURGE_STORE_PORT are both {port}; every service needs a port of its own")
        and e.value.code == 2
    )
    assert stack.read_stack() is None and not (surge_home / "run").exists()  # nothing was started
    monkeypatch.delenv("SURGE_DATA_PORT")
    monkeypatch.setenv("SURGE_CONTROL_METRICS_PORT", port)  # a metrics port counts as well
    with pytest.raises(CliError, match="SURGE_CONTROL_METRICS_PORT and SURGE_STORE_PORT are both"):
        stack.up(num_workers=1)


def test_a_service_that_exits_after_another_answered_its_health_check_fails_up(surge_home, monkeypatch):
    # Without the refusal above, data and store share one port: one of them cannot listen
    # and exits, the other answers both health checks. up must not say the stack is up.
    monkeypatch.setattr(stack, "_check_fixed_ports", lambda fixed: {stack.env_port(v) for v in fixed})
    port = str(free_ports(1)[0])
    monkeypatch.setenv("SURGE_DATA_PORT", port)
    monkeypatch.setenv("SURGE_STORE_PORT", port)
    try:
        with pytest.raises(CliError) as e:
            stack.up(num_workers=1, timeout_s=60)
        assert re.fullmatch(r"(data|store) failed to start: cannot listen on 127\.0\.0\.1:\d+ .*", str(e.value)), str(
            e.value
        )
        assert "error:" not in str(e.value)
        assert stack.read_stack() is None  # what had started was stopped again
    finally:
        stack.down()
        kill_all(processes_with(f"--port {port} "))


def test_a_start_failure_is_relayed_without_the_services_own_error_prefix(surge_home, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    monkeypatch.setenv("SURGE_CONTROL_PORT", str(port))
    try:
        with pytest.raises(CliError) as e:
            stack.up(num_workers=1, timeout_s=60)
        assert str(e.value).startswith(f"control failed to start: cannot listen on 127.0.0.1:{port} "), str(e.value)
        assert str(e.value).endswith("(its port is fixed by SURGE_CONTROL_PORT)") and "error" not in str(e.value)
        assert stack.read_stack() is None
    finally:
        stack.down()
        squatter.close()


@pytest.mark.parametrize(
    "var, value, allowed",
    [
        ("SURGE_LOG_FORMAT", "xml", "json, console"),
        ("SURGE_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ],
)
def test_a_bad_log_setting_is_refused_by_up_before_anything_starts(surge_home, monkeypatch, var, value, allowed):
    monkeypatch.setenv(var, value)
    with pytest.raises(CliError) as e:
        stack.up(num_workers=1)
    assert str(e.value) == f"{var}: expected one of {allowed}, got {value!r}" and e.value.code == 2
    assert stack.read_stack() is None and not (surge_home / "run").exists()


@pytest.mark.parametrize("args", [("up",), ("dataset", "prepare", "--source", "."), ("plot", "some-job"), ("down",)])
def test_a_surge_home_that_is_not_a_directory_is_one_line_and_exit_2(tmp_path, args):
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    for home, extra in ((regular, ""), (regular / "sub", f" ({regular} is a file)")):
        env = {**os.environ, "SURGE_HOME": str(home)}
        r = subprocess.run(
            [sys.executable, "-m", "services.cli.surgectl", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip() == f"error: SURGE_HOME: {home} is not a directory{extra}", r.stderr


def test_a_tokens_file_given_to_up_is_kept_by_restart_and_remembered_across_down(surge_home, tmp_path, monkeypatch):
    """Per-team access never opens silently: `up --tokens` records the file in the store's and
    control's command lines (a `restart` without SURGE_TOKENS_FILE keeps it), and an `up` after
    `down` with no tokens file is refused naming it, unless `--no-tokens` says so."""
    from services.cli import clients, stack_access
    from services.common.access import entry_line
    from services.common.pids import pid_alive
    from services.contract import control_pb2

    monkeypatch.delenv("SURGE_TOKENS_FILE", raising=False)
    monkeypatch.delenv("SURGE_AUTH_TOKEN", raising=False)
    path = tmp_path / "tokens.yaml"
    path.write_text("principals:\n" + entry_line("root", "ops", "admin", "tok-root") + "\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("principals: 7\n")
    pids = []
    try:
        with pytest.raises(CliError) as e:
            stack.up(num_workers=1, tokens=str(bad))
        assert e.value.code == 2 and str(bad) in str(e.value) and stack.read_stack() is None
        procs = stack.up(num_workers=1, tokens=str(path))
        pids += [p.pid for p in procs.values()]
        for name in ("store", "control"):
            assert procs[name].args[-2:] == ["--tokens", str(path)]
        _, new = stack.restart("control")  # (no SURGE_TOKENS_FILE in this environment)
        pids.append(new.pid)
        assert f"--tokens\0{path}" in open(f"/proc/{new.pid}/cmdline").read()
        with clients.stub("control") as ctl, pytest.raises(grpc.RpcError) as refused:
            ctl.ListJobs(control_pb2.JobQuery(), timeout=10)  # no token: this control checks them
        assert refused.value.code().name == "UNAUTHENTICATED"
        # `up` over the running stack asked to change its access: refused, nothing changed.
        running = stack.read_stack()
        for asked, open_stack, says in ((None, True, f"checks tokens from {path}"), (str(bad), False, "--tokens")):
            with pytest.raises(stack.StackRunning) as up_again:
                stack.up(num_workers=1, tokens=asked, open_stack=open_stack)
            with pytest.raises(CliError) as e:
                stack_access.check_running(up_again.value.procs, asked, open_stack)
            assert e.value.code == 2 and says in str(e.value) and "nothing was changed" in str(e.value)
        stack_access.check_running(running, str(path), False)  # (the same file: nothing to refuse)
        # A tokens file broken by an edit: `restart control` refuses before stopping it.
        path.write_text("principals: [oops\n")
        with pytest.raises(CliError) as e:
            stack.restart("control")
        assert e.value.code == 2 and str(path) in str(e.value) and "control was not stopped" in str(e.value)
        assert stack.read_stack()["control"].pid == new.pid and pid_alive(new.pid)
        path.write_text("principals:\n" + entry_line("root", "ops", "admin", "tok-root") + "\n")
        stack.down()
        with pytest.raises(CliError) as e:
            stack.up(num_workers=1)
        assert e.value.code == 2 and f"checked tokens from {path}" in str(e.value) and "--no-tokens" in str(e.value)
        assert stack.read_stack() is None  # nothing was started
        procs = stack.up(num_workers=1, open_stack=True)
        pids += [p.pid for p in procs.values()]
        assert all("--tokens" not in p.args for p in procs.values())
        stack.down()
        procs = stack.up(num_workers=1)  # open is remembered too: no refusal now
        pids += [p.pid for p in procs.values()]
    finally:
        stack.down()
        kill_all(pids)
