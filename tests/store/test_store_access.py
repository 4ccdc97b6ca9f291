"""Per-team access on the store (issue 30 item 6): with control's tokens file, a team's token
reaches its own jobs' checkpoints and metric records only, an admin's every job; a Surge process
(a rank, control) needs the cluster's token; each job's team is learned from its own writes and
survives a restart. The real `python -m services.store` process on loopback."""

from __future__ import annotations

import json
import signal
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cli.cmd_jobs import _scores_lines
from services.cli.errors import CliError
from services.cli.job_records import job_scores
from services.common.access import entry_line
from services.common.grpc_server import channel
from services.contract import Module, engine_pb2, store_pb2, store_pb2_grpc
from services.dashboard.series import SAMPLED_EVENTS, STORE_RECORDS
from services.dashboard.sources import Sources
from tests.cli.test_housekeeping import assert_one_line, run_cli
from tests.control.test_access import denied
from tests.store.test_store_service import Store, store  # noqa: F401 - the real service's fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
CLUSTER = "tok-cluster"  # the stack's SURGE_AUTH_TOKEN: what ranks and control send
TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "root": "tok-root"}


@pytest.fixture
def tokens_env(tmp_path, monkeypatch):
    path = tmp_path / "tokens.yaml"
    path.write_text(
        "principals:\n"
        + "\n".join(
            entry_line(name, team, role, TOKENS[name])
            for name, team, role in (("alice", "vision", "user"), ("bob", "nlp", "user"), ("root", "ops", "admin"))
        )
        + "\n"
    )
    monkeypatch.setenv("SURGE_TOKENS_FILE", str(path))  # (the store process inherits it)
    monkeypatch.setenv("SURGE_AUTH_TOKEN", CLUSTER)
    return monkeypatch


@pytest.fixture
def team_store(tokens_env, store):  # noqa: F811 - (tokens_env first: the process reads it)
    return store


@contextmanager
def stub(port: int, env, module: int, token: str | None):
    with env.context() as m:
        if token is None:
            m.delenv("SURGE_AUTH_TOKEN", raising=False)
        else:
            m.setenv("SURGE_AUTH_TOKEN", token)
        ch = channel(f"127.0.0.1:{port}", module=module)
    with ch:
        yield store_pb2_grpc.StoreServiceStub(ch)


def write_as_a_rank(s, job: str, team: str, spec_team: str | None) -> None:
    """What a job's ranks write: the loop's first record (naming the team), two steps and a
    sample, then a committed version (its spec names ``spec_team``)."""
    records = [
        store_pb2.MetricRecord(config=store_pb2.LogCollectionConfig(job_id=job, team=team), seq=1),
        store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id=job, rank=0, step=1, loss=4.5), seq=2),
        store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id=job, rank=0, step=2, loss=4.0), seq=3),
        store_pb2.MetricRecord(
            sample=engine_pb2.SampleGenerated(job_id=job, rank=0, step=2, prompt="def ", text="x"), seq=4
        ),
        store_pb2.MetricRecord(
            scores=engine_pb2.EvaluationScores(
                job_id=job, eval_job_id=f"{job}-ev", version=f"{job}:1", scores={"ppl": 9}
            ),
            seq=5,
        ),
    ]
    list(s.Record(iter([store_pb2.MetricBatch(records=records)]), timeout=10))
    staged = s.BeginSave(store_pb2.SaveCheckpoint(job_id=job, step=2, rank=0), timeout=10)
    for name, data in {"__0_0.distcp": job.encode() * 100, ".metadata": b"meta"}.items():
        (Path(staged.staging_path) / name).write_bytes(data)
    spec = json.dumps({"team": spec_team}) if spec_team else "{}"
    s.CommitSave(store_pb2.CommitCheckpoint(job_id=job, step=2, world_size=1, spec_json=spec), timeout=10)


def record(s, job: str, step: int, team: str = "") -> None:
    """One Record stream of a step (after the loop's first record, naming ``team``)."""
    records = [store_pb2.MetricRecord(config=store_pb2.LogCollectionConfig(job_id=job, team=team), seq=1)] * bool(
        team
    ) + [store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id=job, rank=0, step=step, loss=1.0), seq=2)]
    list(s.Record(iter([store_pb2.MetricBatch(records=records)]), timeout=10))


def listed(s, job: str = "") -> list[str]:
    return [c.version for c in s.List(store_pb2.CheckpointQuery(job_id=job), timeout=10).checkpoints]


def metric_lines(s, job: str, record_type: str = "") -> list[dict]:
    parts = list(s.ReadMetrics(store_pb2.MetricsQuery(job_id=job, type=record_type), timeout=10))
    assert parts[0].found
    return [json.loads(line) for p in parts[1:] for line in p.text.decode().splitlines()]


def refusals(port: int) -> dict[tuple[str, str], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.labels["method"], s.labels["reason"]): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == "surge_control_access_refused_total"
    }


def test_a_teams_token_reaches_its_own_jobs_checkpoints_and_metrics_only(team_store, tokens_env, tmp_path, capsys):
    env, port = tokens_env, team_store.port
    with stub(port, env, Module.L2_TRAINING_LOOP, CLUSTER) as rank:
        write_as_a_rank(rank, "va", "vision", spec_team="vision")
        write_as_a_rank(rank, "nl", "", spec_team="nlp")  # learned from the committed version's spec
        write_as_a_rank(rank, "old", "", spec_team=None)  # nothing names its team
    # A process's call without the cluster's token: a person passing as control is refused.
    with stub(port, env, Module.L1_ORCHESTRATOR, "tok-alice") as forged:
        line = denied(
            lambda: forged.Load(store_pb2.LoadCheckpoint(version="nl:1"), timeout=10), grpc.StatusCode.UNAUTHENTICATED
        )
        assert "not authenticated" in line
        # Nor may it write as a rank (a write names a job: a team's token never reaches another's).
        assert "not authenticated" in denied(
            lambda: forged.BeginSave(store_pb2.SaveCheckpoint(job_id="nl", step=3), timeout=10),
            grpc.StatusCode.UNAUTHENTICATED,
        )
    with stub(port, env, Module.L2_TRAINING_LOOP, "tok-alice") as forged:
        assert "not authenticated" in denied(lambda: record(forged, "nl", 3), grpc.StatusCode.UNAUTHENTICATED)
    with stub(port, env, Module.L1_ORCHESTRATOR, CLUSTER) as control:  # control itself: every job
        assert control.Load(store_pb2.LoadCheckpoint(version="nl:1"), timeout=10).info.version == "nl:1"

    with stub(port, env, Module.EXT_USER, TOKENS["alice"]) as alice:
        assert listed(alice) == ["va:1"]  # every job's list: her team's versions only
        assert listed(alice, "va") == ["va:1"]
        assert alice.Load(store_pb2.LoadCheckpoint(version="va:latest"), timeout=10).info.version == "va:1"
        other = "job nl belongs to team nlp; your identity (alice) is team vision"
        assert denied(lambda: listed(alice, "nl")) == other
        assert denied(lambda: alice.Load(store_pb2.LoadCheckpoint(version="nl:1"), timeout=10)) == other
        assert (
            denied(lambda: alice.Delete(store_pb2.DeleteCheckpoint(version="nl:1", job_ended=True), timeout=10))
            == other
        )
        assert denied(lambda: alice.Verify(store_pb2.VerifyCheckpoints(job_id="nl"), timeout=10)) == other
        assert denied(lambda: metric_lines(alice, "nl")) == other
        assert "admin role" in denied(lambda: alice.Scrub(store_pb2.ScrubCheckpoints(), timeout=10))
        assert "admin role" in denied(lambda: alice.Load(store_pb2.LoadCheckpoint(version="latest"), timeout=10))
        assert "knows no team of job old" in denied(lambda: listed(alice, "old"))
        missing = denied(
            lambda: alice.Load(store_pb2.LoadCheckpoint(version="va:9"), timeout=10), grpc.StatusCode.NOT_FOUND
        )
        assert missing == "checkpoint va:9 not found"  # (the versions there are not listed to a team's token)
        assert [r["step"] for r in metric_lines(alice, "va") if r.get("type") == "step"] == [1, 2]
        assert [(r["type"], r["text"]) for r in metric_lines(alice, "va", "sample")] == [("sample", "x")]
    with stub(port, env, Module.EXT_USER, TOKENS["bob"]) as bob:
        assert listed(bob) == ["nl:1"]
    with stub(port, env, Module.EXT_USER, None) as nobody:
        denied(lambda: listed(nobody), grpc.StatusCode.UNAUTHENTICATED)
    with stub(port, env, Module.EXT_USER, TOKENS["root"]) as root:  # an admin: every job
        assert sorted(listed(root)) == ["nl:1", "old:1", "va:1"]
        assert [r["step"] for r in metric_lines(root, "nl") if r.get("type") == "step"] == [1, 2]

    counted = refusals(team_store.metrics_port)
    for method in ("List", "Load", "Delete", "Verify", "ReadMetrics"):
        assert counted[(method, "other_team")] >= 1, method
    assert counted[("Scrub", "admin_only")] == 1
    assert counted[("List", "team_unknown")] == 1
    assert counted[("List", "unauthenticated")] == 1

    # surgectl samples / plot read through the store: the other team's records are refused in
    # one line although its file is on this machine (SURGE_STORE_ROOT); control is down here,
    # so the ids are taken as given.
    env.setenv("SURGE_HOME", str(tmp_path / "cli-home"))
    env.setenv("SURGE_STORE_ROOT", str(team_store.root))
    env.setenv("SURGE_STORE_ADDRESS", f"127.0.0.1:{port}")
    env.setenv("SURGE_AUTH_TOKEN", TOKENS["alice"])
    assert (team_store.root / "metrics" / "nl.jsonl").is_file()
    code, out, _ = run_cli(["samples", "va"], env, capsys)
    assert code == 0 and out.splitlines() == ["step 2 prompt 0 (0 tokens, 0.00 s): 'def '", "  'x'"]
    code, out, _ = run_cli(["plot", "va", "--out", str(tmp_path / "va.png")], env, capsys)
    assert code == 0 and "(2 steps from the store)" in out and (tmp_path / "va.png").is_file()
    for argv in (["samples", "nl"], ["plot", "nl", "--out", str(tmp_path / "nl.png")]):
        code, _, err = run_cli(argv, env, capsys)
        assert_one_line(code, err, 1, other)
    assert not (tmp_path / "nl.png").exists()
    # `status`'s, `evaluate`'s and `compare`'s scores and the dashboard's curves, samples and
    # scores: through the store too (its refusal stands although nl's file is here).
    assert [(s.eval_job_id, s.scores) for s in job_scores("va")] == [("va-ev", {"ppl": 9.0})]
    with pytest.raises(CliError) as refused:
        job_scores("nl")
    assert str(refused.value).endswith(other) and "\n" not in str(refused.value)
    _scores_lines("nl")
    assert capsys.readouterr().out == ""
    _scores_lines("va")
    assert "ppl: 9  (va:1)" in capsys.readouterr().out
    sources = Sources(f"127.0.0.1:{port}", f"127.0.0.1:{port}", records_dir=team_store.root / "metrics")
    try:
        assert sources.series("va").steps == [1, 2] and sources.series("va").source == STORE_RECORDS
        assert [s.text for s in sources.samples("va")] == ["x"]
        assert [s.scores for s in sources.scores("va")] == [{"ppl": 9.0}]
        assert sources.series("nl").source == SAMPLED_EVENTS  # refused: control's (team-checked) events
        assert (sources.samples("nl"), sources.scores("nl")) == (None, None)

        # Restarted on the same root: each job's team is still known (kept on disk).
        team_store.proc.send_signal(signal.SIGTERM)
        assert team_store.proc.wait(timeout=10) == 0
        # The stack down: the local files are read (the machine's files, as `surgectl logs` does).
        code, out, _ = run_cli(["plot", "va", "--out", str(tmp_path / "va2.png")], env, capsys)
        assert code == 0 and f"from {team_store.root / 'metrics' / 'va.jsonl'}" in out
        # The stack down: the local files (as `logs`); the scores too.
        assert sources.series("nl").source == STORE_RECORDS
        assert [s.scores for s in sources.scores("nl")] == [{"ppl": 9.0}]
    finally:
        sources.close()
    assert [s.scores for s in job_scores("nl")] == [{"ppl": 9.0}]
    again = _restart(team_store, tmp_path)
    try:
        with stub(again.port, env, Module.EXT_USER, TOKENS["alice"]) as alice:
            assert listed(alice) == ["va:1"]
            assert denied(lambda: listed(alice, "nl")) == other
    finally:
        again.proc.send_signal(signal.SIGTERM)
        again.proc.wait(timeout=10)


def _restart(old: Store, tmp_path: Path) -> Store:
    from tests.conftest import free_ports
    from tests.store.test_store_service import answers_or_exits, spawn

    for _ in range(3):
        port, metrics_port = free_ports(2)
        with open(tmp_path / "store2.log", "wb") as out:
            proc = spawn(tmp_path, port, metrics_port, out)
        # (a loaded machine starts a Python service slowly: up to 2 minutes, until it answers or exits)
        if answers_or_exits(proc, port, polls=240):
            return Store(proc, port, metrics_port, old.root)
        proc.wait()
    raise AssertionError(f"the store did not start again: {(tmp_path / 'store2.log').read_text()[-2000:]}")


@pytest.fixture
def store_without_a_cluster_token(tmp_path, monkeypatch, store_tokens):  # noqa: F811
    """A store with the tokens file and no cluster token: a process's call is not token-checked,
    so a person's token sent as a rank's is what decides (grpc_guards._authenticate)."""
    monkeypatch.delenv("SURGE_AUTH_TOKEN", raising=False)
    return monkeypatch


@pytest.fixture
def store_tokens(tokens_env):
    return tokens_env


def test_a_teams_token_sent_as_a_ranks_writes_only_its_own_teams_jobs(store_without_a_cluster_token, tmp_path, request):
    """Issue 30 item 6's writes: BeginSave, CommitSave, the Record stream, the checkpoint data
    plane and PutProfile with a team's token are its team's; the ranks (no token) write every job."""
    env = store_without_a_cluster_token
    team_store = request.getfixturevalue("store")  # (started now: the cluster token is unset)
    port = team_store.port
    with stub(port, env, Module.L2_TRAINING_LOOP, None) as rank:  # a rank: every job, as before
        write_as_a_rank(rank, "va", "vision", spec_team="vision")
        write_as_a_rank(rank, "nl", "nlp", spec_team="nlp")
    other = "job nl belongs to team nlp; your identity (alice) is team vision"
    with stub(port, env, Module.L2_TRAINING_LOOP, TOKENS["alice"]) as alice:
        assert denied(lambda: record(alice, "nl", 3)) == other
        assert denied(lambda: alice.BeginSave(store_pb2.SaveCheckpoint(job_id="nl", step=3), timeout=10)) == other
        commit = store_pb2.CommitCheckpoint(job_id="nl", step=3, world_size=1, spec_json='{"team": "vision"}')
        assert denied(lambda: alice.CommitSave(commit, timeout=10)) == other
        profile = store_pb2.ProfileUpload(header=store_pb2.StoreProfile(job_id="nl", rank=0, seq=1))
        assert denied(lambda: alice.PutProfile(iter([profile]), timeout=10)) == other
        # A batch mixing her job's record and the other team's: refused whole, nothing of it written.
        mixed = [
            store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id=j, rank=0, step=9, loss=1.0), seq=k)
            for k, j in enumerate(("va", "nl"), 1)
        ]
        assert denied(lambda: list(alice.Record(iter([store_pb2.MetricBatch(records=mixed)]), timeout=10))) == other
        # Her own team's job: written as before; a new job takes her team, whatever its records say.
        record(alice, "va", 3)
        record(alice, "vnew", 1, team="nlp")
    with stub(port, env, Module.L5_CHECKPOINT_MANAGER, TOKENS["alice"]) as alice:  # a rank's data plane
        assert (
            denied(lambda: alice.HeldCheckpointChunks(store_pb2.HeldCheckpointChunksQuery(job_id="nl"), timeout=10))
            == other
        )
        header = store_pb2.CheckpointUploadHeader(job_id="nl", step=3)
        assert (
            denied(lambda: alice.PutCheckpointFiles(iter([store_pb2.CheckpointUpload(header=header)]), timeout=10))
            == other
        )
        files = store_pb2.CheckpointFilesQuery(version="nl:1", names=["manifest.json"])
        assert denied(lambda: list(alice.GetCheckpointFiles(files, timeout=10))) == other
    with stub(port, env, Module.EXT_USER, TOKENS["alice"]) as alice:
        assert [r["step"] for r in metric_lines(alice, "va") if r.get("type") == "step"] == [1, 2, 3]
        assert [r["step"] for r in metric_lines(alice, "vnew") if r.get("type") == "step"] == [1]
    with stub(port, env, Module.EXT_USER, TOKENS["bob"]) as bob:
        assert [r["step"] for r in metric_lines(bob, "nl") if r.get("type") == "step"] == [1, 2]  # no step 3 or 9
        assert listed(bob, "nl") == ["nl:1"]  # no version 3
        assert "belongs to team vision" in denied(lambda: metric_lines(bob, "vnew"))
    with stub(port, env, Module.L2_TRAINING_LOOP, TOKENS["root"]) as root:  # an admin writes any job
        record(root, "nl", 4)
    counted = refusals(team_store.metrics_port)
    for method in (
        "Record",
        "BeginSave",
        "CommitSave",
        "HeldCheckpointChunks",
        "PutCheckpointFiles",
        "PutProfile",
        "GetCheckpointFiles",
    ):
        assert counted[(method, "other_team")] >= 1, method
    assert counted[("Record", "other_team")] == 2
