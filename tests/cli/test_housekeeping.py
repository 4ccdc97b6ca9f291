"""surgectl housekeeping: a job looked up by id or name, and one line (no traceback) for
every failure a user can cause, each case run in-process through ``main()``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import grpc
import pytest

from services.cli.errors import CliError
from services.cli.jobs import resolve_job
from services.contract import control_pb2, control_pb2_grpc, store_pb2, store_pb2_grpc

TERMINATED, RUNNING, STANDBY = control_pb2.TERMINATED, control_pb2.RUNNING, control_pb2.STANDBY


class _Control:
    """Answers ListJobs with fixed jobs (what resolve_job asks control)."""

    def __init__(self, *jobs: tuple[str, str, int, float]):
        self.jobs = [control_pb2.JobStatus(job_id=i, name=n, state=st, created_unix=t) for i, n, st, t in jobs]

    def ListJobs(self, query, timeout=None):  # noqa: N802 - the gRPC method's name
        return control_pb2.JobList(jobs=self.jobs)

    def GetJob(self, query, timeout=None):  # noqa: N802 - asked for an id the list lacks
        raise _NotFound()


class _NotFound(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self):
        return "no such job"


def test_a_job_is_found_by_id_or_by_name():
    control = _Control(("demo-1", "demo", TERMINATED, 1.0), ("other-2", "other", RUNNING, 2.0))
    assert resolve_job("demo-1", control) == "demo-1"
    assert resolve_job("demo", control) == "demo-1"
    assert resolve_job("other", control) == "other-2"


def test_a_shared_name_means_its_one_live_job_and_is_ambiguous_between_two_live_ones():
    control = _Control(
        ("demo-1", "demo", TERMINATED, 1.0),
        ("demo-2", "demo", RUNNING, 2.0),
        ("demo-4", "demo", TERMINATED, 4.0),
    )
    assert resolve_job("demo", control) == "demo-2"  # (the ended ones set aside: a name run again)
    control = _Control(
        ("demo-1", "demo", TERMINATED, 1.0),
        ("demo-2", "demo", RUNNING, 2.0),
        ("demo-3", "demo", STANDBY, 3.0),
    )
    with pytest.raises(CliError) as e:  # (was: demo-3, the newest: `stop demo` stopped the queued one)
        resolve_job("demo", control)
    assert e.value.code == 2 and str(e.value) == (
        "job name 'demo' is ambiguous: 2 live jobs have it (demo-2 (RUNNING), demo-3 (STANDBY)); give the id"
    )


def test_a_name_of_several_ended_jobs_is_ambiguous_listing_the_ids():
    control = _Control(("demo-1", "demo", TERMINATED, 1.0), ("demo-2", "demo", TERMINATED, 2.0))
    with pytest.raises(CliError) as e:
        resolve_job("demo", control)
    assert e.value.code == 2 and "ambiguous" in str(e.value) and "demo-1, demo-2" in str(e.value)


def test_an_unknown_job_is_one_line_exit_2():
    with pytest.raises(CliError) as e:
        resolve_job("nope", _Control(("demo-1", "demo", RUNNING, 1.0)))
    assert e.value.code == 2 and "'nope'" in str(e.value)


# ------------------------------------------------------------------- no traceback


def unwritable(tmp_path: Path) -> Path:
    """A directory nothing can be created in: read-only by mode, or (root ignores modes)
    under /sys, where mkdir is refused."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o500)
        return d
    if not Path("/sys").is_dir() or os.access("/sys", os.W_OK) and _can_mkdir(Path("/sys/surge-probe")):
        pytest.skip("no unwritable directory for root here")
    return Path("/sys")


def _can_mkdir(p: Path) -> bool:
    try:
        p.mkdir()
    except OSError:
        return False
    p.rmdir()
    return True


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``surgectl argv`` in this process: (exit code, stdout, stderr). An exception other
    than SystemExit escaping main() is the traceback a user would see: the test fails."""
    from services.cli.surgectl import main

    monkeypatch.setattr(sys, "argv", ["surgectl", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    out, err = capsys.readouterr()
    return done.value.code, out, err


def assert_one_line(code: int, err: str, expected_code: int, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == expected_code and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err and all(w in lines[0] for w in words), err


def test_plot_to_an_unwritable_path_is_one_line(surge_home, tmp_path, monkeypatch, capsys):
    metrics = surge_home / "store" / "metrics" / "j.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(
        "".join(
            json.dumps({"type": "step", "rank": 0, "step": s, "loss": 2.0, "tokens_per_second": 9.0}) + "\n"
            for s in (1, 2)
        )
    )
    out = unwritable(tmp_path) / "sub" / "x.png"
    code, _, err = run_cli(["plot", "j", "--out", str(out)], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--out", str(out))
    # SURGE_HOME unwritable: the default output under it is named as SURGE_HOME
    monkeypatch.setenv("SURGE_HOME", str(unwritable(tmp_path) / "home"))
    code, _, err = run_cli(["plot", "j", "--metrics", str(metrics)], monkeypatch, capsys)
    assert_one_line(code, err, 2, "SURGE_HOME")
    # --out a file name matplotlib cannot write by its suffix: one line, nothing written
    code, _, err = run_cli(
        ["plot", "j", "--metrics", str(metrics), "--out", str(tmp_path / "x.txt")], monkeypatch, capsys
    )
    assert_one_line(code, err, 2, "--out", "x.txt", ".png")
    assert not (tmp_path / "x.txt").exists()
    # --out a directory: the default name in it (not <dir>.png beside it)
    code, out_text, err = run_cli(["plot", "j", "--metrics", str(metrics), "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "j-loss.png").stat().st_size > 0 and str(tmp_path / "j-loss.png") in out_text


def test_logs_with_the_stack_down_read_the_local_rank_files_by_id_or_name(surge_home, monkeypatch, capsys):
    logs = surge_home / "run" / "logs"
    logs.mkdir(parents=True)
    line = '{"timestamp": "2026-12-01T10:00:0%d", "event": "step %d", "rank": 0}\n'
    (logs / "demo-0a0a0a.rank0.log").write_text(line % (1, 1))
    (logs / "demo-0b0b0b.rank0.log").write_text(line % (2, 2) + line % (3, 3))
    os.utime(logs / "demo-0a0a0a.rank0.log", (1, 1))  # the older run of the name
    code, out, err = run_cli(["logs", "demo", "-o", "json"], monkeypatch, capsys)
    assert code == 0 and out.splitlines() == [(line % (2, 2)).strip(), (line % (3, 3)).strip()], (code, err)
    code, out, err = run_cli(["logs", "demo-0a0a0a", "-o", "json"], monkeypatch, capsys)
    assert code == 0 and out.splitlines() == [(line % (1, 1)).strip()], (code, err)
    code, _, err = run_cli(["logs", "other"], monkeypatch, capsys)  # (no files of it, control not there)
    assert_one_line(code, err, 1, "no rank logs of 'other' on this machine", "control address unknown")


def test_up_with_an_unwritable_home_is_one_line_and_starts_nothing(tmp_path, monkeypatch, capsys):
    home = unwritable(tmp_path) / "surge-home"
    monkeypatch.setenv("SURGE_HOME", str(home))
    code, out, err = run_cli(["up", "--workers", "1"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "SURGE_HOME", str(home))
    assert out == "" and not home.exists()


def test_dataset_prepare_into_an_unwritable_home_is_one_line_naming_surge_home(tmp_path, monkeypatch, capsys):
    source = tmp_path / "text"
    source.mkdir()
    (source / "a.txt").write_text("some text to tokenize\n")
    home = unwritable(tmp_path) / "surge-home"
    monkeypatch.setenv("SURGE_HOME", str(home))
    argv = ["dataset", "prepare", "--name", "n", "--version", "v1", "--source", str(source)]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, "SURGE_HOME", str(home))
    assert not home.exists()


@pytest.mark.parametrize(
    "argv,expected_code,words",
    [
        (["status", "nojob"], 1, ["control address unknown"]),
        (["events", "nojob"], 1, ["control address unknown"]),
        (["logs", "nojob"], 1, ["control address unknown"]),
        (["stop", "nojob"], 1, ["control address unknown"]),
        (["pause", "nojob"], 1, ["control address unknown"]),
        (["resume", "nojob", "--from", "not-a-version"], 1, ["control address unknown"]),
        (["checkpoints", "nojob"], 1, ["address unknown"]),
        (["plot", "nojob"], 1, ["control address unknown"]),
        (["plot", "nojob", "--metrics", "/nonexistent/m.jsonl"], 1, ["--metrics"]),
        (["generate", "--checkpoint", "bad:version"], 2, ["no checkpoints under"]),  # read in-process
        (["dataset", "list"], 1, ["data address unknown"]),
        (["dataset", "prepare", "--source", "/nonexistent-dir", "--name", "x"], 2, ["--source", "/nonexistent-dir"]),
        (["submit", "/nonexistent.yaml"], 2, ["/nonexistent.yaml"]),
        (["restart", "control"], 1, ["no local stack"]),
        (["status", "-o", "yaml"], 2, ["--output", "table"]),  # (the option is checked before any call)
        (["status"], 1, ["address unknown"]),
        (["delete", "job", "nojob"], 1, ["control address unknown"]),
        (["delete", "checkpoint", "no-colon"], 2, ["VERSION", "'<job>:<n>'"]),
        (["delete", "checkpoint", "j:latest"], 2, ["VERSION"]),
        (["delete", "checkpoint", "j:1"], 1, ["control address unknown"]),
        (["delete", "dataset", "no-at"], 2, ["DATASET", "'name@version'"]),
        (["delete", "dataset", "tiny@v1"], 1, ["control address unknown"]),
        (["delete", "frobnicate", "x"], 2, ["frobnicate"]),
    ],
)
def test_a_failure_with_the_stack_down_is_one_line(argv, expected_code, words, surge_home, monkeypatch, capsys):
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, expected_code, *words)


def test_a_piped_table_keeps_its_columns(monkeypatch, capsys):
    """Not a terminal (capsys): each row on one line, no cell cut to 'st…'."""
    from services.cli import render

    monkeypatch.delenv("COLUMNS", raising=False)
    job = control_pb2.JobStatus(
        job_id="a-rather-long-job-name-0123456789",
        state=RUNNING,
        step=10,
        total_steps=100,
        tokens_per_second=12345,
        checkpoint_version="a-rather-long-job-name-0123456789:3",
        message="a message long enough to be wrapped into many lines of an eighty column table",
    )
    render.console.print(render.jobs_table([job]))
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if job.job_id in line]
    assert job.message in row and job.checkpoint_version in row and "RUNNING" in row and "…" not in out


def test_a_console_made_while_columns_was_set_reads_it_at_each_print(monkeypatch, capsys):
    """COLUMNS is the width of the moment it is printed at, not of the moment the console was
    made (render's consoles are made at import: a test that had set COLUMNS then left every
    later table in that process cut to its width)."""
    from services.cli import render

    monkeypatch.setenv("COLUMNS", "60")
    console = render._Console()
    monkeypatch.delenv("COLUMNS")
    job = control_pb2.JobStatus(
        job_id="a-rather-long-job-name-0123456789", state=RUNNING, message="a message longer than sixty columns " * 2
    )
    console.print(render.jobs_table([job]))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if job.job_id in line]
    assert job.message.strip() in row and "…" not in row, row
    monkeypatch.setenv("COLUMNS", "60")
    console.print(render.jobs_table([job]))
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 60


# ------------------------------------------------------------------- in use by a job's init_from


@pytest.fixture
def control_served(surge_home, monkeypatch):
    """The real control plane (build()) on loopback gRPC, no worker registered: a stub;
    SURGE_CONTROL_ADDRESS set (the store's is unknown)."""
    from tests.control.conftest import served_control

    with served_control(surge_home / "control.db", monkeypatch) as (_, stub):
        yield stub


def test_a_checkpoint_a_queued_job_starts_from_is_not_deleted(control_served, monkeypatch, capsys):
    from tests.control.conftest import spec_yaml

    def submit(name: str) -> str:
        text = spec_yaml(name=name, dp=1, extra="init_from: {checkpoint: src-1a2b:3}")
        return control_served.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=text), timeout=10).job_id

    ft, ft2 = submit("ft"), submit("ftb")  # queued (no worker): each would load src-1a2b:3 when it starts
    code, out, err = run_cli(["delete", "checkpoint", "src-1a2b:3"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "checkpoint src-1a2b:3 is in use", f"jobs {ft}, {ft2} start from it")
    assert "deleted" not in out
    # Another version of that job is not theirs: the store is asked (its address is unknown here).
    code, _, err = run_cli(["delete", "checkpoint", "src-1a2b:2"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "store")
    assert "in use" not in err
    for job in (ft, ft2):  # once they ended, it is the store's to decide
        control_served.StopJob(control_pb2.StopJobRequest(job_id=job, queued_only=True), timeout=10)
    code, _, err = run_cli(["delete", "checkpoint", "src-1a2b:3"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "store")
    assert "in use" not in err


class _Catalog(store_pb2_grpc.StoreServiceServicer):
    """The store's catalog as the CLI reads it (List, Delete), for fixed versions: a stand-in
    served on loopback gRPC (the real store's catalog is tested in tests/store)."""

    def __init__(self, versions: list[str]):
        self.versions, self.deleted = list(versions), []

    def List(self, request, context):  # noqa: N802 - the gRPC method's name
        return store_pb2.CheckpointList(
            checkpoints=[
                store_pb2.CheckpointInfo(version=v, job_id=v.rpartition(":")[0], step=int(v.rpartition(":")[2]))
                for v in self.versions
                if not request.job_id or v.rpartition(":")[0] == request.job_id
            ]
        )

    def Delete(self, request, context):  # noqa: N802
        if request.version not in self.versions:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint {request.version}")
        self.versions.remove(request.version)
        self.deleted.append(request.version)
        return store_pb2.CheckpointDeleted(version=request.version, bytes_freed=1000)


@pytest.fixture
def catalog_served(monkeypatch):
    from concurrent import futures

    catalog = _Catalog([])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    store_pb2_grpc.add_StoreServiceServicer_to_server(catalog, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("SURGE_STORE_ADDRESS", f"127.0.0.1:{port}")
    try:
        yield catalog
    finally:
        server.stop(grace=0)


def _ended_job(control, name: str) -> str:
    """A job of ``name`` submitted (queued: no worker) and stopped: TERMINATED."""
    from tests.control.conftest import spec_yaml

    job = control.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name=name, dp=1)), timeout=10).job_id
    control.StopJob(control_pb2.StopJobRequest(job_id=job, queued_only=True), timeout=10)
    return job


def test_delete_jobs_hint_lists_its_versions_by_id_and_by_name(control_served, catalog_served, monkeypatch, capsys):
    # (session 35's trial: the hint `surgectl checkpoints low-b-22af6c` said "no job" exit 2)
    job = _ended_job(control_served, "lowb")
    catalog_served.versions = [f"{job}:59", "other-abcdef:3"]
    code, out, err = run_cli(["delete", "job", job], monkeypatch, capsys)
    assert code == 0 and f"surgectl checkpoints {job}" in out, (out, err)
    for ref in (job, "lowb"):  # its id as the hint says, or its name
        code, out, err = run_cli(["checkpoints", ref, "-o", "json"], monkeypatch, capsys)
        assert code == 0 and [c["version"] for c in json.loads(out)] == [f"{job}:59"], (ref, out, err)
    code, _, err = run_cli(["checkpoints", "nosuch"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "no job 'nosuch'")


def test_checkpoints_of_a_jobs_name_says_once_which_job_id_it_resolved_to(
    control_served, catalog_served, monkeypatch, capsys
):
    # (small43: with several runs of one name an operator could not tell whose versions were listed)
    job = _ended_job(control_served, "lowd")
    catalog_served.versions = [f"{job}:59", f"{job}:60"]
    code, out, err = run_cli(["checkpoints", "lowd"], monkeypatch, capsys)
    assert code == 0 and out.count(f"lowd: job {job}") == 1, (out, err)
    assert out.index(f"lowd: job {job}") < out.index("┏"), out  # (before the table; the rest is control's log)
    code, out, err = run_cli(["checkpoints", job], monkeypatch, capsys)  # (its id: nothing to say)
    assert code == 0 and f"{job}:59" in out and "lowd: job" not in out, (out, err)
    code, out, err = run_cli(["checkpoints", "lowd", "-o", "json"], monkeypatch, capsys)  # (json stays json)
    assert code == 0 and [c["version"] for c in json.loads(out)] == [f"{job}:59", f"{job}:60"], (out, err)


def test_delete_checkpoint_takes_the_jobs_name_as_its_id(control_served, catalog_served, monkeypatch, capsys):
    # (session 35's trial: `delete checkpoint wait-c:60` said "job wait-c has no checkpoint versions")
    job = _ended_job(control_served, "waitc")
    catalog_served.versions = [f"{job}:60"]
    code, out, err = run_cli(["delete", "checkpoint", "waitc:60"], monkeypatch, capsys)
    assert code == 0 and f"deleted checkpoint {job}:60" in out, (out, err)
    assert catalog_served.deleted == [f"{job}:60"]


def test_resume_from_a_version_named_by_its_jobs_name_asks_control_for_the_id(
    control_served, catalog_served, monkeypatch, capsys
):
    job = _ended_job(control_served, "resn")
    seen = []
    real = control_pb2_grpc.ControlServiceStub

    class Seen(real):  # (what the CLI sends control, then the real control answers)
        def __init__(self, channel):
            super().__init__(channel)
            resume = self.ResumeJob

            def asked(req, **kw):
                seen.append(req.from_version)
                return resume(req, **kw)

            self.ResumeJob = asked

    from services.cli import clients

    monkeypatch.setitem(clients._STUBS, "control", Seen)
    run_cli(["resume", job, "--from", "resn:4"], monkeypatch, capsys)
    assert seen == [f"{job}:4"]


def test_plot_by_a_jobs_name_with_the_stack_down_reads_its_newest_local_file(surge_home, tmp_path, monkeypatch, capsys):
    # (was: the name taken as an id, no such file, then control asked: "control address unknown", exit 1,
    # while `plot ID` and `logs NAME` worked; found by the fresh user)
    metrics = surge_home / "store" / "metrics"
    metrics.mkdir(parents=True)
    for job, steps in (("met-0a1b2c", (1, 2)), ("met-3d4e5f", (1, 2, 3)), ("other-7a8b9c", (1,))):
        lines = [
            json.dumps({"type": "step", "rank": 0, "step": s, "loss": 2.0, "tokens_per_second": 9.0}) for s in steps
        ]
        (metrics / f"{job}.jsonl").write_text("".join(line + "\n" for line in lines))
    os.utime(metrics / "met-0a1b2c.jsonl", (1, 1))  # (the older run of the name)
    code, out, err = run_cli(["plot", "met", "--out", str(tmp_path / "m.png")], monkeypatch, capsys)
    assert (code, err) == (0, ""), err
    assert "(3 steps from " in out and "met-3d4e5f.jsonl" in out, out
    code, _, err = run_cli(["plot", "nosuch", "--out", str(tmp_path / "n.png")], monkeypatch, capsys)
    assert code != 0 and "address unknown" in err  # (no file of that name either: control is what could know it)
