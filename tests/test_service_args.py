"""The four services' command lines (services/common/service_args.py): a bad flag or
environment value is one line on stderr naming the flag and its variable, exit status 2, and
nothing started. Real processes for the services; the value types directly."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services.common.service_args import address, host, port, seconds
from services.worker.rank_process import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text", ["-1", "65536", "99999", "x", "", "1.5"])
def test_a_port_outside_0_to_65535_is_refused_naming_its_variable(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"0-65535 \\(the flag or SURGE_X_PORT\\), got {text!r}"):
        port("SURGE_X_PORT")(text)


def test_ports_at_the_limits_are_taken():
    assert [port()(t) for t in ("0", "1", "65535")] == [0, 1, 65535]


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "-0.5", "abc", ""])
def test_seconds_must_be_finite_and_not_negative(text):
    with pytest.raises(argparse.ArgumentTypeError, match="finite number of seconds >= 0"):
        seconds("SURGE_X_S")(text)
    assert seconds()("0") == 0.0 and seconds()("1e6") == 1e6


@pytest.mark.parametrize("text", ["bad host!", "", "-lead.example", "a..b", "x" * 64, "gpu/1"])
def test_a_host_that_is_no_name_or_address_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="host name or IP address"):
        host("SURGE_X_HOST")(text)


@pytest.mark.parametrize(
    "text", ["head.example", "gpu-1", "node_01", "10.0.0.7", "::1", "[::1]", "surge-control-0.surge-control"]
)
def test_names_and_addresses_are_hosts(text):
    assert host()(text) == text


def test_a_listening_host_may_be_a_wildcard():
    assert [host(wildcard=True)(t) for t in ("0.0.0.0", "::", "")] == ["0.0.0.0", "::", ""]
    with pytest.raises(argparse.ArgumentTypeError):
        host()("0.0.0.0 ")


@pytest.mark.parametrize("text", ["garbage", "head:0", "head:65536", "head:", ":50051", "bad host:1", "head:5x"])
def test_an_address_is_host_colon_port(text):
    with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT with a port 1-65535"):
        address("SURGE_X_ADDRESS")(text)
    assert address()("head.example:50051") == "head.example:50051" and address()("[::1]:1") == "[::1]:1"


CASES = [
    ("store", ["--port", "99999", "--metrics-port", "0"], {}, "argument --port: expected a port number 0-65535"),
    ("store", ["--metrics-port", "0"], {"SURGE_STORE_PORT": "-1"}, "(the flag or SURGE_STORE_PORT), got '-1'"),
    ("store", ["--port", "0", "--metrics-port", "0", "--root", "/proc/nope"], {}, "--root /proc/nope"),
    ("store", ["--port", "0", "--metrics-port", "0"], {"SURGE_STORE_SCRUB_INTERVAL_S": "nan"}, "got 'nan'"),
    ("store", ["--port", "0", "--metrics-port", "0"], {"SURGE_STORE_TRANSFER": "Stream"}, "SURGE_STORE_TRANSFER"),
    ("worker", ["--port", "70000", "--control", "127.0.0.1:1"], {}, "expected a port number 0-65535"),
    ("worker", ["--port", "0", "--control", "garbage"], {}, "argument --control: expected HOST:PORT"),
    ("worker", ["--port", "0", "--control", "127.0.0.1:1", "--advertise", "bad host!"], {}, "--advertise"),
    ("worker", ["--port", "0", "--control", "127.0.0.1:1"], {"SURGE_WORKER_MEMORY_COPY_BYTES": "-1"}, "_BYTES"),
    ("worker", ["--port", "0", "--control", "127.0.0.1:1"], {"SURGE_WORKER_MEMORY_COPY_SHM": "maybe"}, "on or off"),
    ("data", [], {"SURGE_DATA_PORT": "x"}, "(the flag or SURGE_DATA_PORT), got 'x'"),
    ("control", ["--port", "0", "--data", "nohost", "--store", "a:1"], {}, "argument --data: expected HOST:PORT"),
    ("control", ["--port", "0", "--data", "a:1", "--store", "a:1", "--sick-node-faults", "-1"], {}, "0: never"),
    (
        "control",
        ["--port", "0", "--data", "a:1", "--store", "a:1"],
        {"SURGE_SICK_NODE_FAULTS": "x"},
        "--sick-node-faults",
    ),
    ("control", ["--port", "0", "--data", "a:1", "--store", "a:1", "--sick-node-window-seconds", "nan"], {}, "window"),
]


@pytest.mark.parametrize(("service", "argv", "env", "says"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_start_up_value_is_one_line_and_exit_2(service, argv, env, says, tmp_path):
    run_env = {**os.environ, "SURGE_HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT), **env}
    r = subprocess.run(
        [sys.executable, "-m", f"services.{service}", *argv],
        env=run_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"python -m services.{service}: error: "), r.stderr
    assert says in r.stderr, r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "control.db").exists()  # nothing started
