"""``surgectl samples JOB``: a job's periodic samples from the store's records (each
boundary's prompts in order, ``--last N`` boundaries, ``-o json``), run in-process."""

from __future__ import annotations

import json

from tests.cli.test_housekeeping import assert_one_line, run_cli


def write(path, *records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def sample(step: int, i: int, text: str, **kw) -> dict:
    return {"type": "sample", "rank": 0, "step": step, "prompt_index": i, "prompt": f"p{i}", "text": text, **kw}


def test_samples_lists_each_boundarys_prompts_and_last_keeps_the_latest(surge_home, monkeypatch, capsys):
    write(
        surge_home / "store" / "metrics" / "j.jsonl",
        {"type": "step", "rank": 0, "step": 1, "loss": 2.0},
        sample(5, 0, "a\nb", tokens=3, seconds=0.25),
        sample(5, 1, "c", tokens=1),
        sample(10, 0, "", note="not generated: the model is sharded"),
    )
    code, out, _ = run_cli(["samples", "j"], monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "step 5 prompt 0 (3 tokens, 0.25 s): 'p0'" and lines[1] == "  'a\\nb'"
    assert lines[-1] == "  '[not generated: the model is sharded]'"
    code, out, _ = run_cli(["samples", "j", "--last", "1", "-o", "json"], monkeypatch, capsys)
    assert code == 0
    (only,) = json.loads(out)
    assert only["step"] == 10 and only["note"].startswith("not generated")


def test_samples_of_a_job_without_any_says_how_to_get_them(surge_home, monkeypatch, capsys):
    write(surge_home / "store" / "metrics" / "k.jsonl", {"type": "step", "rank": 0, "step": 1, "loss": 2.0})
    code, out, _ = run_cli(["samples", "k"], monkeypatch, capsys)
    assert code == 0 and "no samples yet" in out and "eval.sample_every_steps" in out
    code, _, err = run_cli(["samples", "k", "--metrics", str(surge_home / "nope.jsonl")], monkeypatch, capsys)
    assert_one_line(code, err, 1, "nope.jsonl", "no such file")


def test_evaluate_makes_an_argument_naming_a_file_here_absolute_and_leaves_other_words(tmp_path, monkeypatch):
    # The command runs in the evaluation's own directory on the rank's node: the README's
    # `python examples/eval/perplexity.py held_out.txt` named nothing there (a fresh user's run).
    from services.cli.cmd_evaluate import _absolute_if_here

    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "score.py").write_text("")
    (tmp_path / "held_out.txt").write_text("text")
    monkeypatch.chdir(tmp_path)
    argv = ["python", "examples/score.py", "held_out.txt", "--out", "$SURGE_EVAL_OUTPUT", "missing.txt", "/abs/x"]
    assert [_absolute_if_here(a) for a in argv] == [
        "python",
        str(tmp_path / "examples" / "score.py"),
        str(tmp_path / "held_out.txt"),
        "--out",
        "$SURGE_EVAL_OUTPUT",
        "missing.txt",
        "/abs/x",
    ]
