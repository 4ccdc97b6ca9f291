"""Identity across processes (services/common/identity.py): the calling module travels in the
metadata set by Surge's channels, every server checks it against the route table, and under
mutual TLS the certificate's role must be one that may claim it. Real servers on 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import AioServiceServer, ServiceServer, channel
from services.common.identity import ROLE_MODULES, CallerPolicy
from services.contract import Module as M
from services.contract import control_pb2, control_pb2_grpc
from services.contract.audit import violation_from_rpc
from services.contract.bus import TRAFFIC

SECURITY_VARS = ("SURGE_AUTH_TOKEN", "SURGE_TLS_CERT", "SURGE_TLS_KEY", "SURGE_TLS_CA", "SURGE_TLS_SERVER_NAME")


class Control(control_pb2_grpc.ControlServiceServicer):
    def GetJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id=request.job_id)


class AioControl(control_pb2_grpc.ControlServiceServicer):
    async def WatchJob(self, request, context):  # noqa: N802
        for seq in (1, 2):
            yield control_pb2.JobEvent(job_id=request.job_id, seq=seq)


@pytest.fixture
def env(monkeypatch):
    for var in SECURITY_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def serve(env):
    servers = []

    def start(aio: bool = False, **tls: str) -> str:
        for k, v in tls.items():
            env.setenv(k, v)
        s = (AioServiceServer if aio else ServiceServer)("control", "127.0.0.1", 0)
        control_pb2_grpc.add_ControlServiceServicer_to_server(AioControl() if aio else Control(), s.server)
        s.start(["surge.v1.ControlService"])
        servers.append(s)
        for k in tls:
            env.delenv(k)
        return f"127.0.0.1:{s.port}"

    yield start
    for s in servers:
        s.stop(grace=0)


def get(address: str, module: int | None):
    with channel(address, module=module) as ch:
        return control_pb2_grpc.ControlServiceStub(ch).GetJob(control_pb2.JobQuery(job_id="j"), timeout=10)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    return e.value


def test_every_surge_rpc_has_its_callers_in_the_route_table_or_the_plumbing_list():
    policy = CallerPolicy()  # raises for an RPC nobody may call
    assert policy.governs("/surge.v1.DataService/Stream") and not policy.governs("/grpc.health.v1.Health/Check")


def test_a_call_naming_a_module_the_route_table_lets_send_the_request_is_served(serve):
    address = serve()
    assert get(address, M.EXT_USER).job_id == "j"


def test_a_call_naming_no_module_or_a_module_that_may_not_send_the_request_is_refused_as_a_violation(serve):
    address = serve()
    before = TRAFFIC.snapshot().refused.get((M.L2_TRAINING_LOOP, "surge.v1.JobQuery", 0), 0)
    missing = refusal(lambda: get(address, None))
    assert "x-surge-module" in missing.details()
    wrong = refusal(lambda: get(address, M.L2_TRAINING_LOOP))
    report = violation_from_rpc(wrong)  # what the caller's relay reports up
    assert (report.sender, report.message) == (M.L2_TRAINING_LOOP, "surge.v1.JobQuery")
    assert TRAFFIC.snapshot().refused[(M.L2_TRAINING_LOOP, "surge.v1.JobQuery", 0)] == before + 1
    with grpc.insecure_channel(address) as ch:  # health checks name no module
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_an_asyncio_server_checks_a_streaming_call_the_same_way(serve):
    address = serve(aio=True)
    with channel(address, module=M.EXT_USER) as ch:
        events = list(control_pb2_grpc.ControlServiceStub(ch).WatchJob(control_pb2.JobQuery(job_id="w"), timeout=10))
    assert [e.seq for e in events] == [1, 2]
    with channel(address, module=M.EXT_HARDWARE) as ch:
        refusal(
            lambda: list(control_pb2_grpc.ControlServiceStub(ch).WatchJob(control_pb2.JobQuery(job_id="w"), timeout=10))
        )


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A CA and three certificates it signed for 127.0.0.1: the roles surge-user and
    surge-worker (as a DNS subject-alternative name), and one naming no role."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=surge test ca")
    for who, role in (("user", "surge-user"), ("worker", "surge-worker"), ("nobody", "someone")):
        (d / f"{who}.cnf").write_text(
            f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{role}\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who} host")
        run(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-extfile",
            f"{who}.cnf",
        )
    return {p.name: p for p in d.iterdir()}


def tls(certs: dict[str, Path], who: str) -> dict[str, str]:
    return {
        "SURGE_TLS_CERT": str(certs[f"{who}.pem"]),
        "SURGE_TLS_KEY": str(certs[f"{who}.key"]),
        "SURGE_TLS_CA": str(certs["ca.pem"]),
    }


def test_under_mutual_tls_the_certificate_role_must_be_one_that_may_claim_the_module(serve, env, certs):
    address = serve(**tls(certs, "worker"))  # the server's own certificate does not matter
    for k, v in tls(certs, "user").items():
        env.setenv(k, v)
    assert get(address, M.EXT_USER).job_id == "j"
    for k, v in tls(certs, "worker").items():
        env.setenv(k, v)
    assert M.EXT_USER not in ROLE_MODULES["surge-worker"]
    refused = refusal(lambda: get(address, M.EXT_USER))  # a worker's certificate speaking as the operator
    assert "surge-worker" in refused.details()
    for k, v in tls(certs, "nobody").items():
        env.setenv(k, v)
    assert "no Surge role" in refusal(lambda: get(address, M.EXT_USER)).details()
