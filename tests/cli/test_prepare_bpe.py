"""`surgectl dataset prepare --tokenizer bpe:N` (in this process): a BPE trained on a
directory of text and stored in the version; a bad N is one line and writes nothing."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_housekeeping import assert_one_line, run_cli


def text_corpus(root):
    root.mkdir()
    for i in range(12):
        (root / f"note{i}.txt").write_text(f"Note {i}: the quick brown fox jumps over the lazy dog. " * (i + 3))
    return root


def test_bpe_n_trains_a_tokenizer_and_the_version_keeps_it(surge_home, tmp_path, monkeypatch, capsys):
    src = text_corpus(tmp_path / "notes")
    argv = [
        "dataset",
        "prepare",
        "--name",
        "notes",
        "--source",
        str(src),
        "--tokenizer",
        "bpe:300",
    ]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    version = surge_home / "datasets" / "notes" / "v1"
    manifest = json.loads((version / "manifest.json").read_text())
    assert code == 0 and "tokenizer tokenizer.json" in out, out + err
    assert manifest["tokenizer"] == "tokenizer.json" and 257 < manifest["vocab_size"] <= 300
    assert manifest["tokenizer_source"].startswith("bpe:300: byte-level BPE trained on the train split")


@pytest.mark.parametrize("spec", ["bpe:100", "bpe:many"])
def test_a_bad_bpe_vocabulary_is_one_line_and_nothing_is_written(surge_home, tmp_path, monkeypatch, capsys, spec):
    src = text_corpus(tmp_path / "notes")
    argv = ["dataset", "prepare", "--name", "notes", "--source", str(src), "--tokenizer", spec]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, f"--tokenizer {spec}", "vocabulary size N from 258")
    assert not (surge_home / "datasets" / "notes").exists()
