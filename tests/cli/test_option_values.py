"""surgectl's number options through their one parser (services/cli/numbers.py) and the
argument checks made before any call (the stack down: exit 2, one line naming the option)."""

from __future__ import annotations

import pytest

from tests.cli.test_housekeeping import assert_one_line, run_cli

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # NaN fell through to the range check: "should be less than or equal to N" / ">= 0"
        (["scale", "j", "--dp", "2", "--wait-seconds", "nan"], ["--wait-seconds", "'nan' is not a number"]),
        (["status", "--watch", "--interval", "nan"], ["--interval", "'nan' is not a number"]),
        (["down", "--drain-seconds", "nan"], ["--drain-seconds", "'nan' is not a number"]),
        (["restart", "control", "--grace-seconds", "NaN"], ["--grace-seconds", "'NaN' is not a number"]),
        (["up", "--resume-seconds", "nan"], ["--resume-seconds", "'nan' is not a number"]),
        (["up", "--resume-seconds", "soon"], ["--resume-seconds", "'soon' is not a number"]),
        (["drain", "w", "--deadline", "nan"], ["--deadline", "'nan' is not a number"]),
        # a drain's deadline is capped like the other durations (was: 1e308 accepted)
        (["drain", "w", "--deadline", "1e308"], ["--deadline", "must be <= 604800 (a week), got 1e308"]),
        (["drain", "w", "--deadline", "0"], ["--deadline", "must be > 0, got 0"]),
        (["status", "--interval", "0.1"], ["--interval", "must be >= 0.2, got 0.1"]),
        (["status", ""], ["JOB: a job id or name is required"]),  # (was: every job listed, exit 0)
        (["team", "set", "vision", "--cohort", ""], ["--cohort: empty"]),  # (was: accepted)
        (["team", "set", "vision", "--cohort", "  "], ["--cohort: empty"]),
        # session 32: a profile's wait is capped like the other durations (was: 1e30 accepted)
        (["profile", "j", "--wait-seconds", "1e30"], ["--wait-seconds", "must be <= 604800 (a week), got 1e30"]),
        (["events", "j", "--reconnect-seconds", "nan"], ["--reconnect-seconds", "'nan' is not a number"]),
        (["logs", "j", "--reconnect-seconds", "1e400"], ["--reconnect-seconds", "is not a number"]),
        (["tag", "j", "k="], ["TAGS", "'k='", "an empty value", "--remove k"]),  # (was: set to "")
        (["tag", "j", "k= "], ["TAGS", "an empty value"]),
    ],
)
def test_a_bad_option_value_is_one_line_naming_it_exit_2(argv, words, surge_home, monkeypatch, capsys):
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, *words)


def test_a_cordon_says_uncordon_with_its_worker():
    from rich.console import Console

    from services.cli import render
    from services.contract import control_pb2

    drained = control_pb2.WorkerCordoned(worker_id="worker-1", reason="draining: leaves within 0.5 s")
    sick = control_pb2.WorkerCordoned(worker_id="worker-2", reason="quarantined", quarantine=True)
    console = Console(width=300)
    with console.capture() as shown:
        console.print(render.cordons_table([drained, sick]))
    rows = {line.split()[1]: line for line in shown.get().splitlines() if "worker-" in line and "│" in line}
    # (was: "its node agent registers again (`surgectl restart WORKER`)" for a drain's cordon)
    assert "`surgectl uncordon worker-1`" in rows["worker-1"] and "restart" not in rows["worker-1"]
    assert "`surgectl uncordon worker-2`" in rows["worker-2"]
