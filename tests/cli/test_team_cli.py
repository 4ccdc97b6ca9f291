"""surgectl team set / list / remove and surgectl queue against the real control on loopback
gRPC (issue 30 items 1 and 4): bad input is one line and exit 2; the queue shows each waiting
job's place, team and why it waits, and each team's usage; -o json for scripts. And
`control --quotas` with a bad file: one line naming the file and the field, exit 2."""

from __future__ import annotations

import json

import pytest

from services.contract import control_pb2
from tests.cli.test_housekeeping import assert_one_line, run_cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def control_served(surge_home, monkeypatch):
    from tests.control.conftest import served_control

    with served_control(surge_home / "control.db", monkeypatch) as (control, stub):
        yield control, stub


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["team", "set", "vision", "--nominal", "-3"], ["--nominal: expected a number of slots 0-", "-3"]),
        (["team", "set", "vision", "--nominal", str(2**63)], ["--nominal: expected a number of slots 0-", str(2**63)]),
        (["team", "set", "vision", "--borrow-limit", "9" * 20], ["--borrow-limit: expected a number of slots"]),
        (["logs", "somejob", "--rank", str(2**31)], ["--rank"]),
        (["drain", "worker-0", "--deadline", "inf"], ["--deadline", "'inf' is not a number (a finite one is needed)"]),
        (["down", "--drain-seconds", "1e400"], ["--drain-seconds"]),
        (["restart", "control", "--grace-seconds", "inf"], ["--grace-seconds"]),
        (["team", "set", "vision", "--hard-limit", "lots"], ["--hard-limit: expected a number of slots", "'lots'"]),
        (["team", "set", "vision", "--weight", "0"], ["--weight: must be > 0, got 0"]),
        (
            ["team", "set", "vision", "--nominal", "4", "--hard-limit", "2"],
            ["--hard-limit: must be >= --nominal (4), got 2"],
        ),
        (["team", "set", "Vision!"], ["NAME: a team name is lowercase letters, digits and '-'", "'Vision!'"]),
        (["team", "set", ""], ["NAME: a team name is", "got ''"]),
        (["team", "set"], ["NAME: a team name is", "got ''"]),
        (["team", "remove", ""], ["NAME: a team name is", "got ''"]),
        (["team", "set", "--max-wait", "0"], ["--max-wait: expected minutes > 0", "'0'"]),
        (["team", "set", "--max-wait", "soon"], ["--max-wait: expected minutes > 0 or 'none', got 'soon'"]),
        (["team", "set", "--max-wait", "nan"], ["--max-wait: expected minutes > 0", "'nan'"]),
        (["team", "set", "vision", "--max-wait", "30"], ["--max-wait: the starvation bound is the cluster's"]),
        (["team", "set", "--max-wait", "30", "--weight", "2"], ["--max-wait: give it alone"]),
        (["team", "set", "vision", "--cohort", "A B"], ["cohort: String should match pattern"]),
        (["team", "remove", "nobody"], ["team 'nobody' has no quota of its own"]),
        (["queue", "-o", "yaml"], ["--output: expected 'table' or 'json'"]),
        (["team", "set", "v", "--quota", "gpu"], ["--quota: expected KIND=SLOTS[,KIND=SLOTS] with KIND gpu or cpu"]),
        (["team", "set", "v", "--quota", "tpu=4"], ["--quota: expected KIND=SLOTS", "'tpu=4'"]),
        (["team", "set", "v", "--quota", "gpu=-1"], ["--quota gpu: expected a number of slots 0-", "-1"]),
        (["team", "set", "v", "--quota", "gpu=1,gpu=2"], ["--quota: gpu given twice in 'gpu=1,gpu=2'"]),
        (["team", "set", "v", "--quota", ""], ["--quota: expected KIND=SLOTS"]),
        (["team", "set", "v", "--quota", "gpu=4", "--nominal", "4"], ["--quota: give --nominal", "not both"]),
        (["team", "set", "v", "--hard-limit", "cpu=x"], ["--hard-limit cpu: expected a number of slots", "'x'"]),
        (["team", "set", "v", "--quota", "cpu="], ["--quota cpu: expected a number of slots", "got nothing"]),
        # (the flag named, not control's field; each bound offers the word the README gives it)
        (["team", "set", "v", "--hard-limit", "0"], ["--hard-limit: expected a number of slots 1-", "'none'", "got 0"]),
        (["team", "set", "v", "--nominal", "x"], ["--nominal: expected a number of slots >= 0 or 'unlimited'"]),
        (
            ["team", "set", "v", "--quota", "cpu=1000001"],
            ["--quota cpu: expected a number of slots 0-1000000", "1000001"],
        ),
        (
            ["team", "set", "v", "--quota", "gpu=8", "--hard-limit", "gpu=4"],
            ["hard_limit.gpu: must be >= nominal (8 gpu), got 4"],
        ),
    ],
)
def test_surgectl_team_bad_input_is_one_line_and_exit_2(control_served, monkeypatch, capsys, argv, words):
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, *words)


def test_surgectl_queue_shows_place_team_and_why_and_each_team_s_usage(control_served, monkeypatch, capsys):
    from tests.control.conftest import registration, spec_yaml

    control, stub = control_served
    monkeypatch.setenv("COLUMNS", "300")  # (no wrapping: render's console reads it at every print)
    code, out, _ = run_cli(["team", "set", "vision", "--hard-limit", "2", "--weight", "2"], monkeypatch, capsys)
    assert code == 0 and "team vision: nominal unlimited, borrow limit unlimited, hard limit 2, weight 2" in out
    control.sessions.open(registration("w", 4))
    ids = {}
    for name, team, dp in (("a", "vision", 2), ("b", "vision", 1), ("c", "nlp", 3)):
        text = spec_yaml(name=name, dp=dp, extra=f"team: {team}")
        ids[name] = stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=text), timeout=10).job_id
    code, out, _ = run_cli(["queue"], monkeypatch, capsys)
    assert code == 0
    lines = [line for line in out.splitlines() if "job event" not in line]  # (control's own log, in-process)
    b_line = next(line for line in lines if ids["b"] in line)
    c_line = next(line for line in lines if ids["c"] in line)
    assert "│ 1 │" in b_line and "vision" in b_line and "team vision at its hard limit (2 of 2 slots held" in b_line
    assert "│ 2 │" in c_line and "nlp" in c_line and "needs 3 ranks" in c_line
    code, out, _ = run_cli(["queue", "-o", "json"], monkeypatch, capsys)
    (view,) = json.loads(out)
    # b first: vision's weighted share once b starts, (2 + 1) / 2, is below nlp's once c starts, 3 / 1
    assert [(q["job_id"], q["team"], q["position"]) for q in view["queue"]] == [
        (ids["b"], "vision", 1),
        (ids["c"], "nlp", 2),
    ]
    vision = next(t for t in view["teams"] if t["name"] == "vision")
    assert (vision["used"], vision["hard_limit"], vision["weight"], vision["waiting_jobs"]) == (2, 2, 2.0, 1)
    code, out, _ = run_cli(["team", "list"], monkeypatch, capsys)
    assert code == 0 and "vision" in out and "nlp (default)" in out  # (nlp: no quota of its own)
    code, out, _ = run_cli(["team", "remove", "vision"], monkeypatch, capsys)
    assert code == 0 and "team vision: quota removed" in out


def test_control_refuses_a_bad_quota_file_in_one_line(tmp_path, capsys):
    from services.control.__main__ import _parse_args

    bad = tmp_path / "quotas.yaml"
    bad.write_text("teams:\n  vision: {nominal: 4, borrow_limt: 2}\n")
    with pytest.raises(SystemExit) as done:
        _parse_args(["--port", "0", "--data", "h:1", "--store", "h:2", "--quotas", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1, err
    assert err[0].endswith(f"--quotas: {bad}: teams.vision.borrow_limt: unknown key")
    good = tmp_path / "ok.yaml"
    good.write_text("teams:\n  vision: {nominal: 4, borrow_limit: 2, weight: 2, cohort: research}\n")
    args = _parse_args(["--port", "0", "--data", "h:1", "--store", "h:2", "--quotas", str(good)])
    assert args.quota_book.get("vision").ceiling == 6


def test_surgectl_status_shows_a_running_job_s_borrowed_ranks():
    from services.cli.render import state_text

    JobState = control_pb2.JobState
    assert state_text(control_pb2.JobStatus(state=JobState.RUNNING, borrowed_slots=2)) == "RUNNING (2 borrowed)"
    assert state_text(control_pb2.JobStatus(state=JobState.RUNNING)) == "RUNNING"
    ended = control_pb2.JobStatus(state=JobState.TERMINATED, outcome=control_pb2.JobOutcome.FINISHED, borrowed_slots=2)
    assert state_text(ended) == "TERMINATED (FINISHED)"


def test_surgectl_team_set_changes_only_the_flags_given(control_served, monkeypatch, capsys):
    """A patch: `team set vision --weight 3` kept nothing else (a fresh user's team lost its
    hard limit and cohort)."""
    argv = [
        "team",
        "set",
        "vision",
        "--nominal",
        "1",
        "--borrow-limit",
        "0",
        "--hard-limit",
        "1",
        "--cohort",
        "research",
    ]
    code, out, _ = run_cli(argv, monkeypatch, capsys)
    assert code == 0 and "nominal 1, borrow limit 0, hard limit 1, weight 1, cohort research" in out
    code, out, _ = run_cli(["team", "set", "vision", "--weight", "3"], monkeypatch, capsys)
    assert code == 0 and "team vision: nominal 1, borrow limit 0, hard limit 1, weight 3, cohort research" in out
    code, out, _ = run_cli(["team", "set", "vision", "--hard-limit", "none"], monkeypatch, capsys)
    assert code == 0 and "nominal 1, borrow limit 0, hard limit none, weight 3, cohort research" in out
    code, _, err = run_cli(["team", "set", "vision", "--nominal", "4", "--hard-limit", "2"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--hard-limit: must be >= --nominal (4), got 2")
    code, _, err = run_cli(["team", "set", "vision", "--hard-limit", "1"], monkeypatch, capsys)
    assert code == 0, err  # (at nominal 1: allowed)


def test_surgectl_team_set_per_kind_quota_and_the_per_kind_columns(control_served, monkeypatch, capsys):
    from tests.control.conftest import registration, spec_yaml

    control, stub = control_served
    monkeypatch.setenv("COLUMNS", "300")
    argv = ["team", "set", "robotics", "--quota", "gpu=2,cpu=4", "--hard-limit", "gpu=2"]
    code, out, _ = run_cli(argv, monkeypatch, capsys)
    assert code == 0, out
    assert "team robotics: nominal gpu 2, cpu 4, borrow limit unlimited, hard limit gpu 2, cpu none" in out
    code, out, _ = run_cli(["team", "set", "robotics", "--quota", "cpu=8"], monkeypatch, capsys)  # (gpu kept)
    assert code == 0 and "nominal gpu 2, cpu 8, borrow limit unlimited, hard limit gpu 2, cpu none" in out
    control.sessions.open(registration("w", 6, cuda=2))
    ids = {}
    for name, device, dp in (("g", "gpu", 2), ("c", "cpu", 1), ("g2", "gpu", 1)):
        text = spec_yaml(name=name, dp=dp, extra="team: robotics").replace(
            "threads_per_rank: 1}", f"threads_per_rank: 1, device: {device}}}"
        )
        ids[name] = stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=text), timeout=10).job_id
    code, out, _ = run_cli(["queue"], monkeypatch, capsys)
    assert code == 0
    lines = [line for line in out.splitlines() if "job event" not in line]  # (control's own log, in-process)
    g2 = next(line for line in lines if ids["g2"] in line)
    assert "│ gpu " in g2 and "team robotics at its gpu hard limit (2 of 2 gpu slots held, this job needs 1)" in g2
    row = next(line for line in lines if line.startswith("│ robotics"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:6] == ["robotics", "3", "2", "1", "gpu 2, cpu 8", "0"], cells
    assert "cluster: 2 gpu, 4 cpu slots placeable" in out
    code, out, _ = run_cli(["team", "list", "-o", "json"], monkeypatch, capsys)
    (view,) = json.loads(out)
    r = next(t for t in view["teams"] if t["name"] == "robotics")
    assert (r["nominal"], r["used_by_kind"], view["cluster_by_kind"]) == (
        {"gpu": 2, "cpu": 8},
        {"gpu": 2, "cpu": 1},
        {"gpu": 2, "cpu": 4},
    )
    # A real JSON shape: each bound a number, null (none) or per kind; no -1, no *_by_kind twin.
    assert (r["hard_limit"], r["borrow_limit"], view["default_quota"]["nominal"]) == (
        {"gpu": 2, "cpu": None},
        None,
        None,
    )
    assert not [k for t in view["teams"] for k in t if k.endswith("_limit_by_kind") or k == "nominal_by_kind"]
    assert view["max_wait_minutes"] == 120
    code, out, _ = run_cli(["team", "set", "robotics", "--nominal", "6"], monkeypatch, capsys)  # back to an int
    assert code == 0 and "nominal 6, borrow limit unlimited, hard limit gpu 2, cpu none" in out


def test_the_cli_s_slot_bound_is_control_s():
    # (the CLI refuses what control would, so a stack that is down still says why, exit 2)
    from services.cli.cmd_teams import SLOTS_MAX
    from services.control.scheduler.quotas import MAX_SLOTS

    assert SLOTS_MAX == MAX_SLOTS


def test_surgectl_team_set_max_wait_sets_the_cluster_s_starvation_bound(control_served, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "300")
    code, out, err = run_cli(["team", "set", "--max-wait", "90"], monkeypatch, capsys)
    assert code == 0 and "starvation bound (every team): 90 min" in out, (out, err)
    code, out, _ = run_cli(["team", "list"], monkeypatch, capsys)
    assert code == 0 and "starvation bound 90 min" in out, out
    code, out, _ = run_cli(["team", "set", "--max-wait", "none"], monkeypatch, capsys)
    assert code == 0 and "starvation bound (every team): none" in out, out
    code, out, _ = run_cli(["queue", "-o", "json"], monkeypatch, capsys)
    (view,) = json.loads(out)
    assert view["max_wait_minutes"] is None
    code, out, _ = run_cli(["team", "list"], monkeypatch, capsys)
    assert code == 0 and "no starvation bound" in out, out
