"""`surgectl sweep` and `compare`, in process: the trials a grid and a draw make, ASHA's
decisions at each rung, the spec differences and summaries, and the sweep's wait loop
stopping the trial ASHA names (against a fake control)."""

from __future__ import annotations

import math
import types

import pytest

from services.cli import cmd_experiments, compare, render, sweep
from services.cli.errors import CliError
from services.contract import control_pb2


def test_a_grid_is_the_product_and_draws_repeat_per_combination_reproducibly():
    axes = [sweep.parse_grid("optimizer.lr=1e-3,3e-3"), sweep.parse_grid("data.micro_batch_size=2,4,8")]
    got = sweep.trials(axes, count=5, seed=0)  # (no random axis: count is ignored)
    assert len(got) == 6 and {"optimizer.lr": "3e-3", "data.micro_batch_size": "8"} in got
    drawn = [sweep.parse_grid("seed=1,2"), sweep.parse_random("optimizer.weight_decay=0.001:0.1:log")]
    a, b = sweep.trials(drawn, count=3, seed=7), sweep.trials(drawn, count=3, seed=7)
    assert a == b and len(a) == 6 and a != sweep.trials(drawn, count=3, seed=8)
    assert all(0.001 <= float(t["optimizer.weight_decay"]) <= 0.1 for t in a)
    ints = sweep.trials([sweep.parse_random("steps=10:12")], count=20, seed=0)
    assert {t["steps"] for t in ints} <= {"10", "11", "12"} and len({t["steps"] for t in ints}) > 1


@pytest.mark.parametrize(
    "make, item, words",
    [
        (sweep.parse_grid, "optimizer.lr", "--grid 'optimizer.lr': expected KEY=V1,V2,..."),
        (sweep.parse_grid, "optimizer.lr=1e-3,,2e-3", "an empty value"),
        (sweep.parse_random, "optimizer.lr=0.1", "expected KEY=LOW:HIGH"),
        (sweep.parse_random, "optimizer.lr=a:b", "LOW and HIGH must be numbers"),
        (sweep.parse_random, "optimizer.lr=0.2:0.1", "need finite LOW <= HIGH"),
        (sweep.parse_random, "optimizer.lr=0:1:log", "a log range needs LOW > 0"),
        (sweep.parse_random, "optimizer.lr=1:inf", "need finite LOW <= HIGH"),
    ],
)
def test_a_malformed_axis_is_one_line_naming_the_option(make, item, words):
    with pytest.raises(CliError) as e:
        make(item)
    assert words in str(e.value) and e.value.code == 2


def test_a_key_swept_twice_or_nothing_swept_or_too_many_trials_is_refused():
    with pytest.raises(CliError, match="seed swept more than once"):
        sweep.trials([sweep.parse_grid("seed=1,2"), sweep.parse_random("seed=1:9")], 2, 0)
    with pytest.raises(CliError, match="at least one --grid or --random"):
        sweep.trials([], 2, 0)
    many = [sweep.parse_grid(f"k{i}=" + ",".join(map(str, range(10)))) for i in range(4)]
    with pytest.raises(CliError, match="10000 trials"):
        sweep.trials(many, 1, 0)


def test_rungs_and_asha_stop_only_trials_outside_the_best_third_once_three_reached_a_rung():
    assert sweep.rungs(10, 3, 100) == [10, 30, 90] and sweep.rungs(10, 3, 10) == []
    with pytest.raises(CliError):
        sweep.rungs(0, 3, 100)
    h = sweep.Halving(rungs=[10, 30], eta=3)
    assert h.reached("a", 10, 2.0) and h.reached("b", 12, 3.0)  # the first eta: too few to judge
    assert not h.reached("c", 10, 4.0)  # third at rung 10, worst: outside the best third
    assert h.reached("d", 11, 1.0)  # best of four
    assert h.seen[10] == {"a": 2.0, "b": 3.0, "c": 4.0, "d": 1.0}
    assert h.reached("a", 9999, 2.0) and h.seen[30] == {"a": 2.0}  # rung 30 recorded once, at its pass
    assert not h.reached("e", 10, math.nan)  # a NaN ranks last
    assert sweep.ranked({"x": math.nan, "y": 2.0, "z": 1.0}) == ["z", "y", "x"]


def test_spec_differences_name_each_key_that_differs_and_a_missing_key():
    def run(name: str, spec: dict) -> compare.Run:
        return compare.Run(control_pb2.JobStatus(job_id=name, name=name), compare.flatten(spec), render.History())

    a = run("a", {"name": "a", "optimizer": {"lr": 0.001, "betas": [0.9, 0.95]}, "steps": 10})
    b = run("b", {"name": "b", "optimizer": {"lr": 0.003, "betas": [0.9, 0.95]}, "steps": 10, "seed": 1})
    assert compare.spec_differences([a, b]) == [("optimizer.lr", ["0.001", "0.003"]), ("seed", ["-", "1"])]
    assert compare.spec_differences([a, a]) == []


def test_a_summary_takes_final_and_best_losses_and_the_median_rate_after_the_first_step():
    h = render.History(
        steps=[1, 2, 3, 4],
        loss=[5.0, 3.0, math.nan, 4.0],
        tokens_per_second=[10.0, 100.0, 300.0, 200.0],
        eval_steps=[2, 4],
        eval_loss=[3.5, 3.2],
    )
    s = compare.summarize(h)
    assert (s.steps, s.final_train, s.best_train, s.best_train_step) == (4, 4.0, 3.0, 2)
    assert (s.final_eval, s.best_eval, s.best_eval_step, s.tokens_per_second) == (3.2, 3.2, 4, 200.0)
    assert compare.summarize(h, status_rate=150.0).tokens_per_second == 150.0  # control's figure when it has one
    empty = compare.summarize(render.History())
    assert empty.steps == 0 and math.isnan(empty.final_train) and math.isnan(empty.tokens_per_second)


def test_the_overlaid_plot_is_written(tmp_path):
    h = render.History(steps=[1, 2], loss=[2.0, 1.5], tokens_per_second=[5.0, 6.0], eval_steps=[2], eval_loss=[1.7])
    runs = [compare.Run(control_pb2.JobStatus(job_id=j), {}, h) for j in ("a", "b")]
    out = compare.overlay_plot(runs, tmp_path / "c.png", "a vs b")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "name, words",
    [
        ("missing/c.png", "its directory {tmp}/missing does not exist"),
        ("afile/c.png", "its directory {tmp}/afile is not a directory"),
        (".", "is a directory"),
        ("c.jpg", "the file name must end in .png, .svg, .pdf"),
    ],
)
def test_compare_refuses_a_bad_out_before_it_reads_or_prints_anything_and_creates_no_folder(
    name, words, tmp_path, monkeypatch, capsys
):
    (tmp_path / "afile").write_text("x")

    def no_control(*a, **k):
        raise AssertionError("control was asked before --out was checked")

    monkeypatch.setattr(cmd_experiments.clients, "stub", no_control)
    with pytest.raises(CliError) as e:
        cmd_experiments.compare_jobs(["a", "b"], out=tmp_path / name, output="table")
    assert e.value.code == 2 and str(e.value).startswith("--out: ") and words.format(tmp=tmp_path) in str(e.value)
    assert capsys.readouterr().out == "" and not (tmp_path / "missing").exists()


class _FakeControl:
    """Three trials stepping 10 per read; at rung 10 only a (the best third) goes on."""

    def __init__(self) -> None:
        self.step = dict.fromkeys("abc", 0)
        self.loss = {"a": 1.0, "b": 2.0, "c": 3.0}
        self.stopped: list[str] = []

    def GetJob(self, q, timeout):  # noqa: N802 (the gRPC method's name)
        j = q.job_id
        if j not in self.stopped:
            self.step[j] = min(self.step[j] + 10, 30)
        done = self.step[j] >= 30 or j in self.stopped
        return control_pb2.JobStatus(
            job_id=j,
            step=self.step[j],
            train_loss=self.loss[j],
            state=control_pb2.TERMINATED if done else control_pb2.RUNNING,
            outcome=(control_pb2.STOPPED if j in self.stopped else control_pb2.FINISHED) if done else 0,
        )

    def StopJob(self, req, timeout):  # noqa: N802
        self.stopped.append(req.job_id)
        return control_pb2.JobStatus(job_id=req.job_id)


def test_the_wait_loop_stops_the_trial_asha_names_and_ranks_every_trial(monkeypatch):
    fake = _FakeControl()
    monkeypatch.setattr(cmd_experiments.clients, "stub", lambda service: _Ctx(fake))
    monkeypatch.setattr(cmd_experiments.time, "sleep", lambda s: None)
    record = {"sweep": "s", "trials": [{"job_id": j, "name": j, "settings": {}} for j in "abc"]}
    results, stopped, failed = cmd_experiments._wait(record, "train_loss", sweep.Halving([10, 20], eta=3), 0.1)
    # c arrives third and worst: stopped on arrival; b, second, went on until c's arrival made
    # three at the rung, of which only the best third (a) goes on: b is stopped in that round.
    assert stopped == {"b", "c"} and fake.stopped == ["c", "b"] and failed == set()
    assert sweep.ranked(results) == ["a", "b", "c"] and fake.step["c"] == 10 and fake.step["b"] == 10


class _Ctx(types.SimpleNamespace):
    def __init__(self, stub) -> None:
        super().__init__(stub=stub)

    def __enter__(self):
        return self.stub

    def __exit__(self, *exc) -> None:
        return None


def test_a_trial_judged_again_when_later_trials_reach_its_rung():
    h = sweep.Halving(rungs=[10, 20], eta=2)
    assert h.reached("worst", 10, 5.0)  # first at rung 10: too few to judge, goes on
    assert not h.reached("b", 10, 6.0)  # second, worse: stopped on arrival
    assert h.reached("c", 10, 3.0)  # third, best
    assert h.outranked({"worst", "c"}) == {"worst"}  # 5.0 is no longer in the best half of three
    assert h.outranked({"c"}) == set() and h.outranked({"never-reached"}) == set()


def test_sweep_and_tag_refusals_before_anything_is_sent(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from services.cli.surgectl import app

    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: s\nsteps: 20\nmodel: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}\n"
        "data: {dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}\neval: {every_steps: 0, at_end: false}\n"
    )
    sent = []
    monkeypatch.setattr(cmd_experiments, "send_submit", lambda *a: sent.append(a))
    monkeypatch.setattr(cmd_experiments, "resolve_job", lambda ref: ref)
    runner = CliRunner()
    cases = [
        (["sweep", str(spec), "--grid", "optimizer.lr=1e-3,1e-3"], "1e-3 given twice"),
        (["sweep", str(spec), "--grid", "optimizer.lr=1e-3", "--set", "optimizer.lr=2e-3"], "both --set and swept"),
        (["sweep", str(spec), "--grid", "name=a,b"], "name is not swept"),
        (["sweep", str(spec), "--grid", "nosuch.key=1,2"], "--grid nosuch.key: nosuch: unknown key"),
        (["sweep", str(spec), "--random", "optimizer.lrr=1e-4:1e-2:log"], "--random optimizer.lrr: optimizer.lrr"),
        (["sweep", str(spec), "--grid", "optimizer.lr=1e-3,2e-3"], "never evaluates"),
        (["tag", "j", "a=1", "--remove", "a"], "TAGS: a both set and removed"),
        (["note", "j", "  "], "TEXT: the note is empty"),
    ]
    for argv, words in cases:
        r = runner.invoke(app, argv, env={"COLUMNS": "200"})
        assert isinstance(r.exception, CliError) and r.exception.code == 2, (argv, r.output, r.exception)
        assert words in str(r.exception), (argv, r.exception)
    assert sent == []


def test_a_sweep_whose_later_trial_fails_a_submit_check_sends_no_trial(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from services.cli.surgectl import app

    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: s\nsteps: 20\nmodel: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}\n"
        "data: {dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}\n"
    )
    sent, checked = [], []

    def check(path, overrides):
        checked.append(overrides)
        if any(o == "data.dataset=nosuch@v1" for o in overrides):
            raise CliError("dataset nosuch@v1 not found", code=2)
        return "spec text", str(path)

    monkeypatch.setattr(cmd_experiments, "checked_submission", check)
    monkeypatch.setattr(cmd_experiments, "send_submit", lambda *a: sent.append(a))
    r = CliRunner().invoke(app, ["sweep", str(spec), "--grid", "data.dataset=tiny@v1,nosuch@v1"])
    assert isinstance(r.exception, CliError) and "nosuch@v1 not found" in str(r.exception)
    assert len(checked) == 2 and sent == []


def test_the_compare_table_has_a_header_for_every_cell_and_json_has_no_step_for_a_missing_best():
    h = render.History(steps=[1], loss=[math.nan], tokens_per_second=[1.0])
    status = control_pb2.JobStatus(job_id="a")
    status.tags["arm"] = "x"
    runs = [compare.Run(status, {}, h), compare.Run(control_pb2.JobStatus(job_id="b"), {}, h)]
    t = cmd_experiments._metrics_table(runs)
    assert [c.header for c in t.columns][:3] == ["job", "tags", "state"]
    assert all(len(c._cells) == 2 for c in t.columns)  # (every column has a cell per run: no shift)
    assert t.columns[1]._cells[0] == "arm=x"
    shown = compare.as_json(runs)["jobs"][0]
    assert shown["best_train"] is None and shown["best_train_step"] is None and shown["tags"] == {"arm": "x"}
