"""Per-team access on control's user port (issue 30 item 6): a tokens file binds tokens and
client certificates to principals of a team and a role; a team sees and controls its own jobs
only, an admin every job and the nodes; every refusal is one line and counted.

The real control plane (build()) served by its real server (AioServiceServer, with its
interceptor) on loopback gRPC, called through Surge's own client channel; no node agents, no
ranks: jobs wait in the queue, which is all access needs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common.access import CALLER, Identities, TokensFileError, entry_line, load_tokens, token_digest
from services.common.grpc_server import AioServiceServer, ServiceServer, channel
from services.contract import Module, control_pb2, control_pb2_grpc
from services.control.__main__ import Control, build
from services.control.access import ControlAccess
from services.control.job_store import JobStore
from tests.contract.test_identity import certs, tls  # noqa: F401 - the TLS fixture that makes certificates
from tests.control.conftest import settle, spec_yaml, stop_plane

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
SECURITY_VARS = ("SURGE_AUTH_TOKEN", "SURGE_TLS_CERT", "SURGE_TLS_KEY", "SURGE_TLS_CA", "SURGE_TLS_SERVER_NAME")
TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "root": "tok-root"}
TOKENS_YAML = f"""\
principals:
{entry_line("alice", "vision", "user", TOKENS["alice"])}
{entry_line("bob", "nlp", "user", TOKENS["bob"])}
{entry_line("root", "ops", "admin", TOKENS["root"])}
  - name: carol
    team: vision
    certificate: user host   # the CN of tests/contract/test_identity.py's operator certificate
"""


def refused_count(method: str, reason: str) -> float:
    return REGISTRY.get_sample_value("surge_control_access_refused_total", {"method": method, "reason": reason}) or 0.0


@pytest.fixture
def env(monkeypatch):
    for var in SECURITY_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@contextlib.contextmanager
def served(tmp_path: Path, env, identities: Identities | None, **tls_vars: str) -> Iterator[tuple[Control, str]]:
    """Control's plane and its real server on 127.0.0.1 (TLS from ``tls_vars``): (plane, address)."""
    journal = JobStore(tmp_path / "control.db")
    plane = build(
        journal,
        data_address="d:1",
        store_address="s:1",
        persist_interval_s=0.0,
        access=ControlAccess(enforced=identities is not None),
    )
    with env.context() as m:
        for k, v in tls_vars.items():
            m.setenv(k, v)
        server = AioServiceServer("control", "127.0.0.1", 0, executor_threads=8, identities=identities)
    control_pb2_grpc.add_ControlServiceServicer_to_server(plane.servicer, server.server)
    server.start(["surge.v1.ControlService"])
    try:
        yield plane, f"127.0.0.1:{server.port}"
    finally:
        server.stop(grace=0)
        stop_plane(plane)


@contextlib.contextmanager
def caller(address: str, env, token: str | None = None, **tls_vars: str):
    """A stub speaking as the operator through Surge's client channel, with SURGE_AUTH_TOKEN
    ``token`` (None: none) and TLS from ``tls_vars``, as surgectl would."""
    with env.context() as m:
        if token is not None:
            m.setenv("SURGE_AUTH_TOKEN", token)
        for k, v in tls_vars.items():
            m.setenv(k, v)
        ch = channel(address, module=Module.EXT_USER)
    with ch:
        yield control_pb2_grpc.ControlServiceStub(ch)


@pytest.fixture
def identities(tmp_path) -> Identities:
    path = tmp_path / "tokens.yaml"
    path.write_text(TOKENS_YAML)
    return load_tokens(path)


def submit(stub, name: str, extra: str = "", team: str = "") -> control_pb2.JobStatus:
    return stub.SubmitJob(
        control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name=name, extra=extra), spec_path="job.yaml", team=team),
        timeout=10,
    )


def denied(call, code=grpc.StatusCode.PERMISSION_DENIED) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value
    assert "\n" not in e.value.details()
    return e.value.details()


def test_each_team_sees_and_controls_its_own_jobs_only(tmp_path, env, identities, store_with_no_versions):
    with (
        served(tmp_path, env, identities) as (plane, address),
        caller(address, env, TOKENS["alice"]) as alice,
        caller(address, env, TOKENS["bob"]) as bob,
    ):
        mine, theirs = submit(alice, "seg"), submit(bob, "lm")
        assert (mine.team, theirs.team) == ("vision", "nlp")  # the caller's team, the spec naming none
        assert [j.job_id for j in alice.ListJobs(control_pb2.JobQuery(), timeout=10).jobs] == [mine.job_id]
        assert [j.job_id for j in bob.ListJobs(control_pb2.JobQuery(), timeout=10).jobs] == [theirs.job_id]
        assert alice.GetJob(control_pb2.JobQuery(job_id=mine.job_id), timeout=10).team == "vision"
        assert list(alice.WatchJob(control_pb2.JobQuery(job_id=mine.job_id), timeout=10))  # its own events

        line = f"job {theirs.job_id} belongs to team nlp; your identity (alice) is team vision"
        assert denied(lambda: alice.GetJob(control_pb2.JobQuery(job_id=theirs.job_id), timeout=10)) == line
        # The CLI's JOB argument says the same, not "no job" (a fresh user could not tell a typo
        # from another team's job); a name of another team's job stays unknown (names are not ids).
        from services.cli.errors import CliError
        from services.cli.jobs import resolve_job

        with pytest.raises(CliError) as e:
            resolve_job(theirs.job_id, stub=alice)
        assert str(e.value) == line
        with pytest.raises(CliError, match="^no job 'lm': no job has that id or name"):
            resolve_job("lm", stub=alice)
        # `surgectl checkpoints` with no JOB: of the store's versions, the caller's team's jobs'.
        from services.cli.cmd_checkpoints import _of_my_team
        from services.contract import store_pb2

        versions = [store_pb2.CheckpointInfo(job_id=j.job_id, version=f"{j.job_id}:1") for j in (mine, theirs)]
        with env.context() as m:
            m.setenv("SURGE_CONTROL_ADDRESS", address)
            m.setenv("SURGE_AUTH_TOKEN", TOKENS["alice"])
            assert [v.job_id for v in _of_my_team(versions)] == [mine.job_id]
        assert denied(lambda: list(alice.WatchJob(control_pb2.JobQuery(job_id=theirs.job_id), timeout=10))) == line
        logs = control_pb2.LogQuery(job_id=theirs.job_id, rank=-1)
        assert denied(lambda: list(alice.StreamLogs(logs, timeout=10))) == line
        stops, tags = refused_count("StopJob", "other_team"), refused_count("AnnotateJob", "other_team")
        assert denied(lambda: alice.StopJob(control_pb2.StopJobRequest(job_id=theirs.job_id), timeout=10)) == line
        tag = control_pb2.AnnotateJobRequest(job_id=theirs.job_id, set_tags={"mine": "yes"})
        assert denied(lambda: alice.AnnotateJob(tag, timeout=10)) == line
        assert refused_count("StopJob", "other_team") == stops + 1
        assert refused_count("AnnotateJob", "other_team") == tags + 1
        after = bob.GetJob(control_pb2.JobQuery(job_id=theirs.job_id), timeout=10)
        assert after.state == control_pb2.STANDBY and "mine" not in after.tags  # nothing was relayed
        # Its own job: the same commands are carried out.
        assert alice.AnnotateJob(control_pb2.AnnotateJobRequest(job_id=mine.job_id, set_tags={"a": "b"}), timeout=10)
        alice.StopJob(control_pb2.StopJobRequest(job_id=mine.job_id), timeout=10)
        assert settle(
            lambda: alice.GetJob(control_pb2.JobQuery(job_id=mine.job_id), timeout=10).state, control_pb2.TERMINATED
        )


def test_an_admin_sees_and_stops_every_job_and_only_an_admin_drains_or_uncordons_a_node(
    tmp_path, env, identities, store_with_no_versions
):
    with (
        served(tmp_path, env, identities) as (plane, address),
        caller(address, env, TOKENS["alice"]) as alice,
        caller(address, env, TOKENS["bob"]) as bob,
        caller(address, env, TOKENS["root"]) as root,
    ):
        a, b = submit(alice, "seg"), submit(bob, "lm")
        assert {j.job_id for j in root.ListJobs(control_pb2.JobQuery(), timeout=10).jobs} == {a.job_id, b.job_id}
        assert root.GetJob(control_pb2.JobQuery(job_id=b.job_id), timeout=10).team == "nlp"
        root.StopJob(control_pb2.StopJobRequest(job_id=b.job_id), timeout=10)
        assert settle(
            lambda: root.GetJob(control_pb2.JobQuery(job_id=b.job_id), timeout=10).state, control_pb2.TERMINATED
        )

        plane.sessions.open(_registration("node-1"))
        drains, uncordons = refused_count("DrainWorker", "admin_only"), refused_count("UncordonWorker", "admin_only")
        drain = control_pb2.DrainWorkerRequest(worker_id="node-1", deadline_seconds=60)
        assert denied(lambda: alice.DrainWorker(drain, timeout=10)) == (
            "drain a node needs the admin role; your identity (alice) is a user of team vision"
        )
        uncordon = control_pb2.UncordonWorkerRequest(worker_id="node-1")
        assert "needs the admin role" in denied(lambda: bob.UncordonWorker(uncordon, timeout=10))
        assert refused_count("DrainWorker", "admin_only") == drains + 1
        assert refused_count("UncordonWorker", "admin_only") == uncordons + 1
        assert not root.ListJobs(control_pb2.JobQuery(), timeout=10).cordoned  # the user's drain did nothing
        root.DrainWorker(drain, timeout=10)
        assert [c.worker_id for c in root.ListJobs(control_pb2.JobQuery(), timeout=10).cordoned] == ["node-1"]
        root.UncordonWorker(uncordon, timeout=10)
        assert not root.ListJobs(control_pb2.JobQuery(), timeout=10).cordoned

        # The queue: a user sees every team's usage, and its own team's waiting jobs only.
        waiting = [submit(alice, "w1"), submit(bob, "w2")]  # (no worker has a free slot: both wait)
        assert {q.job_id for q in root.ListTeams(control_pb2.TeamQuery(), timeout=10).queue} >= {
            w.job_id for w in waiting
        }
        seen = alice.ListTeams(control_pb2.TeamQuery(), timeout=10)
        assert waiting[0].job_id in {q.job_id for q in seen.queue} and {q.team for q in seen.queue} == {"vision"}
        assert {t.name for t in seen.teams} >= {"vision", "nlp"}

        # `surgectl down` stops every team's stack: refused for a user's token, nothing stopped.
        assert alice.ListJobs(control_pb2.JobQuery(), timeout=10).team_view == "vision"
        assert root.ListJobs(control_pb2.JobQuery(), timeout=10).team_view == ""
        from services.cli.cmd_stack import _require_whole_view, restart
        from services.cli.errors import CliError

        with env.context() as m:
            m.setenv("SURGE_CONTROL_ADDRESS", address)
            m.setenv("SURGE_AUTH_TOKEN", TOKENS["alice"])
            with pytest.raises(CliError, match=r"needs an admin token \(yours sees team vision's jobs only\)"):
                _require_whole_view()
            # ... and so is `surgectl restart` of any service (a worker's carries every team's ranks).
            with pytest.raises(CliError, match=r"^surgectl restart stops services every team's jobs run on"):
                restart("worker-0", grace_seconds=0.0)
            m.setenv("SURGE_AUTH_TOKEN", TOKENS["root"])
            _require_whole_view()  # (an admin's: no refusal)

        # Quotas are the admin's: a user's `surgectl team set` is refused, an admin's is kept.
        quota = control_pb2.SetTeamQuotaRequest(
            quota=control_pb2.TeamQuota(
                name="vision", nominal=4, borrow_limit=-1, hard_limit=-1, weight=1.0, cohort="default"
            )
        )
        assert "set or remove a team's quota needs the admin role" in denied(
            lambda: alice.SetTeamQuota(quota, timeout=10)
        )
        root.SetTeamQuota(quota, timeout=10)
        teams = {t.name: t for t in root.ListTeams(control_pb2.TeamQuery(), timeout=10).teams}
        assert teams["vision"].nominal == 4


def _registration(worker_id: str) -> control_pb2.WorkerRegistration:
    from tests.control.conftest import registration

    return registration(worker_id, slots=1)


def test_a_spec_naming_another_team_is_refused_unless_the_caller_is_an_admin(
    tmp_path, env, identities, store_with_no_versions
):
    with (
        served(tmp_path, env, identities) as (plane, address),
        caller(address, env, TOKENS["alice"]) as alice,
        caller(address, env, TOKENS["root"]) as root,
    ):
        before = refused_count("SubmitJob", "spec_team")
        assert denied(lambda: submit(alice, "x", extra="team: nlp")) == (
            "job.yaml: team: 'nlp' is another team; your identity (alice) is team vision "
            "(only an admin submits for another team)"
        )
        assert refused_count("SubmitJob", "spec_team") == before + 1
        assert not root.ListJobs(control_pb2.JobQuery(), timeout=10).jobs  # nothing was created
        assert submit(alice, "own", extra="team: vision").team == "vision"
        # What a client puts in the request's team is not its to say: control overwrites it.
        assert submit(alice, "forged", team="nlp").team == "vision"
        assert submit(root, "for-nlp", extra="team: nlp").team == "nlp"
        assert submit(root, "own-team").team == "ops"


def test_a_call_with_no_token_or_an_unknown_one_is_refused_unauthenticated(
    tmp_path, env, identities, store_with_no_versions
):
    with (
        served(tmp_path, env, identities) as (_, address),
        caller(address, env) as anonymous,
        caller(address, env, "not-a-token") as stranger,
    ):
        before = refused_count("ListJobs", "unauthenticated")
        for stub in (anonymous, stranger):
            line = denied(
                lambda s=stub: s.ListJobs(control_pb2.JobQuery(), timeout=10), grpc.StatusCode.UNAUTHENTICATED
            )
            assert "not authenticated" in line and "SURGE_AUTH_TOKEN" in line
        assert refused_count("ListJobs", "unauthenticated") == before + 2
        denied(lambda: submit(anonymous, "x"), grpc.StatusCode.UNAUTHENTICATED)


def test_without_a_tokens_file_control_behaves_as_before(tmp_path, env, store_with_no_versions):
    with served(tmp_path, env, None) as (plane, address), caller(address, env) as anyone:
        job = submit(anyone, "x", extra="team: nlp")
        assert job.team == "nlp"  # the spec's team, no identity asked
        assert submit(anyone, "y").team == "default"
        assert submit(anyone, "z", team="vision").team == "default"  # (only control's access sets it)
        assert len(anyone.ListJobs(control_pb2.JobQuery(), timeout=10).jobs) == 3
        anyone.StopJob(control_pb2.StopJobRequest(job_id=job.job_id), timeout=10)
        assert settle(
            lambda: anyone.GetJob(control_pb2.JobQuery(job_id=job.job_id), timeout=10).state, control_pb2.TERMINATED
        )


def test_a_client_certificate_named_in_the_tokens_file_is_its_teams_principal(
    tmp_path,
    env,
    identities,
    certs,  # noqa: F811 - the fixture imported above
    store_with_no_versions,
):
    with (
        served(tmp_path, env, identities, **tls(certs, "worker")) as (_, address),
        caller(address, env, **tls(certs, "user")) as carol,
        caller(address, env, TOKENS["bob"], **tls(certs, "user")) as bob,
        caller(address, env, **tls(certs, "nobody")) as nobody,
    ):
        job = submit(carol, "seg")
        assert job.team == "vision"
        assert [j.job_id for j in carol.ListJobs(control_pb2.JobQuery(), timeout=10).jobs] == [job.job_id]
        # A token, when sent, names the principal, whatever the certificate.
        assert not bob.ListJobs(control_pb2.JobQuery(), timeout=10).jobs
        line = denied(lambda: bob.StopJob(control_pb2.StopJobRequest(job_id=job.job_id), timeout=10))
        assert line == f"job {job.job_id} belongs to team vision; your identity (bob) is team nlp"
        # A certificate of no Surge role: refused by the role check (identity.py), as without a tokens file.
        denied(lambda: nobody.ListJobs(control_pb2.JobQuery(), timeout=10))
        # An operator's certificate (role surge-user) that the file does not name: no principal.
        dave_tls = {**tls(certs, "user"), "SURGE_TLS_CERT": str(_operator_cert(certs, "dave"))}
        with caller(address, env, **dave_tls) as dave:
            denied(lambda: dave.ListJobs(control_pb2.JobQuery(), timeout=10), grpc.StatusCode.UNAUTHENTICATED)


def _operator_cert(made: dict[str, Path], who: str) -> Path:
    """A certificate of the test CA for the user's key, CN ``who`` with the role surge-user."""
    d = made["ca.pem"].parent
    (d / f"{who}.cnf").write_text("subjectAltName=DNS:surge-user\nextendedKeyUsage=clientAuth\n")
    key, csr, pem = str(made["user.key"]), str(d / f"{who}.csr"), d / f"{who}.pem"
    for args in (
        ["req", "-new", "-key", key, "-out", csr, "-subj", f"/CN={who}"],
        ["x509", "-req", "-in", csr, "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", str(pem)]
        + ["-days", "2", "-extfile", f"{who}.cnf"],
    ):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    return pem


# ------------------------------------------------------------------ the tokens file


def test_a_principal_is_found_by_its_tokens_digest_or_its_certificate_name(identities):
    def bearer(token):
        return (("authorization", f"Bearer {token}"),)

    assert identities.authenticate(bearer("tok-alice"), None).name == "alice"
    assert identities.authenticate(bearer("tok-root"), None).admin
    assert identities.authenticate(bearer("tok-nobody"), ["user host"]) is None  # a wrong token is no fallback
    assert identities.authenticate((), ["localhost", "user host"]).name == "carol"
    assert identities.authenticate((), ["someone else"]) is None
    assert identities.authenticate((), None) is None
    assert "tok-alice" not in TOKENS_YAML and token_digest("tok-alice") in TOKENS_YAML  # only digests stored


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("principals:\n  - {name: a, team: Vision, token_sha256: " + "0" * 64 + "}\n", "principals.0.team: String"),
        ("principals:\n  - {name: a, team: v}\n", "principals.0: needs token_sha256"),
        ("principals:\n  - {name: a, team: v, role: root, certificate: a}\n", "principals.0.role: Input should be"),
        ("principals:\n  - {name: a, team: v, token: abc}\n", "principals.0.token: unknown key"),
        ("principals:\n  - {name: a, team: v, token_sha256: abc}\n", "principals.0.token_sha256: String should"),
        ("principals:\n  - {name: a, team: v, certificate: surge-user}\n", "principals.0.certificate: 'surge-user'"),
        (
            "principals:\n  - {name: a, team: v, certificate: x}\n  - {name: a, team: w, certificate: y}\n",
            "principals.1.name: 'a' is named twice",
        ),
        ("principals: [\n", "not valid YAML (line 2)"),
        ("", "principals: Field required"),
    ],
)
def test_a_bad_tokens_file_is_one_line_naming_the_file_and_the_field(tmp_path, text, line):
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(TokensFileError) as e:
        load_tokens(path)
    assert str(e.value).startswith(f"{path}: {line}") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "service",
    [
        ["services.control", "--port", "0", "--data", "d:1", "--store", "s:1", "--db", "{tmp}/control.db"],
        ["services.store", "--port", "0", "--metrics-port", "0", "--root", "{tmp}/store"],
    ],
    ids=["control", "store"],
)
def test_a_service_with_a_bad_tokens_file_exits_2_with_one_line(tmp_path, service):
    bad = tmp_path / "tokens.yaml"
    bad.write_text("principals:\n  - {name: a, team: Vision, certificate: x}\n")
    done = subprocess.run(
        [sys.executable, "-m", *(a.format(tmp=tmp_path) for a in service), "--tokens", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {bad}: principals.0.team: String should match pattern")
    assert len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(TokensFileError, match=r"none\.yaml: cannot read: No such file"):
        load_tokens(tmp_path / "none.yaml")


def test_surgectl_token_new_prints_a_token_and_the_line_that_admits_it(tmp_path):
    from typer.testing import CliRunner

    from services.cli.surgectl import app

    result = CliRunner().invoke(app, ["token", "new", "--name", "dana", "--team", "nlp", "--role", "admin"])
    assert result.exit_code == 0, result.output
    token = result.output.split("token: ", 1)[1].split()[0]
    line = result.output.strip().splitlines()[-1]
    assert token not in line
    path = tmp_path / "tokens.yaml"
    path.write_text("principals:\n" + line + "\n")
    found = load_tokens(path).authenticate((("authorization", f"Bearer {token}"),), None)
    assert (found.name, found.team, found.role) == ("dana", "nlp", "admin")
    hashed = CliRunner().invoke(
        app, ["token", "hash", "--name", "dana", "--team", "nlp", "--role", "admin"], input=token
    )
    assert hashed.exit_code == 0 and hashed.output.strip() == line.strip()


def test_a_token_revoked_in_the_file_is_refused_once_control_reads_it_again(
    tmp_path, env, identities, store_with_no_versions
):
    with served(tmp_path, env, identities) as (_, address), caller(address, env, TOKENS["bob"]) as bob:
        assert not bob.ListJobs(control_pb2.JobQuery(), timeout=10).jobs
        path = Path(identities.source)
        path.write_text("principals:\n  - {name: bob, team: Nope}\n")
        with pytest.raises(TokensFileError):
            identities.reload()  # (control on SIGHUP: logged, and the principals read before stay)
        assert not bob.ListJobs(control_pb2.JobQuery(), timeout=10).jobs
        path.write_text(TOKENS_YAML.replace(entry_line("bob", "nlp", "user", TOKENS["bob"]) + "\n", ""))
        assert identities.reload() == 3
        denied(lambda: bob.ListJobs(control_pb2.JobQuery(), timeout=10), grpc.StatusCode.UNAUTHENTICATED)


class _WhoAsks(control_pb2_grpc.ControlServiceServicer):
    """Answers with the principal the interceptor handed the handler (CALLER)."""

    def GetJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id=CALLER.get().name, team=CALLER.get().team)

    def WatchJob(self, request, context):  # noqa: N802 - a plain generator: each step sees the caller
        for seq in (1, 2):
            yield control_pb2.JobEvent(job_id=CALLER.get().name, seq=seq)


@pytest.mark.parametrize("server_class", [ServiceServer, AioServiceServer])
def test_every_kind_of_handler_runs_as_the_calls_principal(env, identities, server_class):
    server = server_class("control", "127.0.0.1", 0, identities=identities)
    control_pb2_grpc.add_ControlServiceServicer_to_server(_WhoAsks(), server.server)
    server.start(["surge.v1.ControlService"])
    try:
        address = f"127.0.0.1:{server.port}"
        with caller(address, env, TOKENS["alice"]) as alice, caller(address, env, TOKENS["root"]) as root:
            assert alice.GetJob(control_pb2.JobQuery(job_id="j"), timeout=10).team == "vision"
            assert root.GetJob(control_pb2.JobQuery(job_id="j"), timeout=10).job_id == "root"
            events = list(alice.WatchJob(control_pb2.JobQuery(job_id="j"), timeout=10))
            assert [(e.job_id, e.seq) for e in events] == [("alice", 1), ("alice", 2)]
        assert CALLER.get() is None  # (set around the handler only)
    finally:
        server.stop(grace=0)


def test_a_command_reading_the_files_itself_asks_control_first_with_the_callers_token(
    tmp_path, surge_home, env, identities, store_with_no_versions, capsys
):
    # A fresh admin's find: with a tokens file, bob (nlp) exported vision's job's weights with
    # `surgectl export`, which reads SURGE_HOME itself, though every service refused him.
    from tests.cli.test_export import commit_version, spec_of
    from tests.cli.test_housekeeping import assert_one_line, run_cli

    with served(tmp_path, env, identities) as (plane, address), caller(address, env, TOKENS["alice"]) as alice:
        job = submit(alice, "seg").job_id
        commit_version(surge_home, spec_of(), job=job)
        (surge_home / "run").mkdir(exist_ok=True)
        (surge_home / "run" / "tokens_file").write_text(str(tmp_path / "tokens.yaml") + "\n")  # (as `up --tokens`)
        env.setenv("SURGE_CONTROL_ADDRESS", address)
        export = ["export", f"{job}:1", "--format", "torch", "--out"]
        env.setenv("SURGE_AUTH_TOKEN", TOKENS["bob"])
        code, _, err = run_cli([*export, str(tmp_path / "b")], env, capsys)
        assert_one_line(code, err, 1, f"job {job} belongs to team vision; your identity (bob) is team nlp")
        code, _, err = run_cli(["generate", "--checkpoint", f"{job}:latest", "--prompt", "hi"], env, capsys)
        assert_one_line(code, err, 1, f"job {job} belongs to team vision")
        # `latest` alone may be another team's newest; a missing one names no other job's versions.
        code, _, err = run_cli(["generate", "--checkpoint", "latest", "--prompt", "hi"], env, capsys)
        assert_one_line(code, err, 2, "name the job, JOB:latest")
        code, _, err = run_cli(
            ["export", "nope:latest", "--format", "torch", "--out", str(tmp_path / "n")], env, capsys
        )
        assert_one_line(code, err, 2, "checkpoint nope:latest not found: no checkpoint of job nope")
        assert job not in err
        assert not (tmp_path / "b").exists()
        env.setenv("SURGE_AUTH_TOKEN", TOKENS["alice"])
        code, out, err = run_cli([*export, str(tmp_path / "a")], env, capsys)
        assert code == 0 and (tmp_path / "a" / "model.pt").is_file(), err
    # Control down while the stack checks tokens: nobody can say, so nothing is read.
    code, _, err = run_cli([*export, str(tmp_path / "c")], env, capsys)
    assert_one_line(code, err, 1, "checks per-team tokens", "`surgectl up` first")
    env.delenv("SURGE_CONTROL_ADDRESS")
    (surge_home / "run" / "tokens_file").unlink()  # an open stack: the files' permissions are the boundary
    code, out, err = run_cli([*export, str(tmp_path / "d")], env, capsys)
    assert code == 0, err
