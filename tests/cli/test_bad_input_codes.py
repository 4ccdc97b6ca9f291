"""A bad value of an option is the user's input: one line naming the option, exit 2 (as
`submit`, `delete` and `logs --rank` answer it), before anything is read or written. Each was
exit 1 (or a traceback's text) before session 32."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_export import commit_version, spec_of
from tests.cli.test_housekeeping import assert_one_line, run_cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "notes.txt"
    src.write_text("hello world\n" * 20)
    return str(src)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--name", "", "--source", "{src}"], ["--name", "empty"]),
        (["--name", "../evil", "--source", "{src}"], ["--name", "'../evil'"]),
        (["--version", "", "--source", "{src}"], ["--version", "empty"]),
        (["--version", "../evil", "--source", "{src}"], ["--version", "'../evil'"]),
        (["--source", "/nonexistent-dir"], ["--source", "/nonexistent-dir"]),
        (["--source", ""], ["--source", "empty"]),
        (["--source", "{src}", "--tokenizer", "bpe:0"], ["--tokenizer bpe:0", "from 258"]),
        (["--source", "{src}", "--tokenizer", "bpe:-5"], ["--tokenizer bpe:-5", "from 258"]),
        (["--source", "{src}", "--tokenizer", "bpe:nan"], ["--tokenizer bpe:nan", "from 258"]),
        (["--source", "{src}", "--tokenizer", "bpe:99999999999"], ["--tokenizer bpe:99999999999", "to 1048576"]),
        (["--source", "{src}", "--tokenizer", "/nonexistent/tok.json"], ["--tokenizer", "no such file"]),
        (["--source", "{empty}"], ["no non-empty text file"]),
    ],
)
def test_dataset_prepare_refuses_a_bad_option_exit_2_and_writes_nothing(
    args, words, corpus, surge_home, monkeypatch, capsys
):
    empty = surge_home.parent / "empty-source"
    empty.mkdir(exist_ok=True)
    argv = ["dataset", "prepare", "--name", "n", *[a.format(src=corpus, empty=empty) for a in args]]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, *words)
    assert not (surge_home / "datasets").exists() or not any((surge_home / "datasets").iterdir())
    assert not (surge_home.parent / "evil").exists()


def test_eval_of_a_dataset_not_prepared_is_exit_2(surge_home, monkeypatch, capsys):
    commit_version(surge_home, spec_of())
    code, _, err = run_cli(["eval", "src-1:latest", "--dataset", "nosuch@v1"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "nosuch@v1", "not found")


def test_plot_of_a_rank_the_records_do_not_hold_is_exit_2(surge_home, monkeypatch, capsys):
    metrics = surge_home / "m.jsonl"
    metrics.write_text("".join(json.dumps({"type": "step", "rank": 0, "step": s, "loss": 2.0}) + "\n" for s in (1, 2)))
    code, _, err = run_cli(["plot", "j", "--metrics", str(metrics), "--rank", "7"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--rank 7", "ranks present: 0")


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_generate_says_the_seeds_range(seed, surge_home, monkeypatch, capsys):
    code, _, err = run_cli(
        ["generate", "--seed", seed], monkeypatch, capsys
    )  # (was: "Overflow when unpacking long long")
    assert_one_line(code, err, 2, "--seed", "18446744073709551615" if seed != "-1" else "greater than or equal to 0")


@pytest.mark.parametrize("empty", ["", "  "])
def test_rollback_to_an_empty_version_is_exit_2_not_the_newest(empty, surge_home, monkeypatch, capsys):
    # (an unset shell variable: `rollback J --version "$V"` rolled back to the newest version)
    code, _, err = run_cli(["rollback", "some-job", "--version", empty], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--version: empty")


@pytest.mark.parametrize("command", ["uncordon", "drain"])
def test_an_empty_worker_is_exit_2_naming_the_argument(command, surge_home, monkeypatch, capsys):
    argv = [command, ""] + (["--deadline", "30"] if command == "drain" else [])
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, "WORKER: empty")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["eval", "src-1:latest", "--dataset", ""], ["--dataset: empty"]),
        (["evaluate", "some-job", "--command", "true", "--version", ""], ["--version: empty"]),
        (["generate", "--checkpoint", "src-1:latest", "--prompt", ""], ["--prompt: empty"]),
    ],
)
def test_an_empty_value_is_exit_2_never_the_default(argv, words, surge_home, monkeypatch, capsys):
    # (a fresh user's: `eval --dataset ""` ran on the job's own, `evaluate --version ""` queued the
    # latest, `generate --prompt ""` wrote a NUL byte, each exit 0)
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, *words)
