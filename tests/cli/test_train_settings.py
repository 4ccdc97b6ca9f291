"""Issue 15 part 6 from the terminal, in this process, with no stack running:

* ``dataset prepare --source DIR`` takes every text file by default (binary and hidden files
  skipped and counted), ``--include`` picks by glob; a version with no held-out split is
  written with a one-line warning, recorded in its manifest, and a job that evaluates on it
  is refused at submit (the check, on the real L4-1's answer).
* ``surgectl eval VERSION`` and ``surgectl generate --checkpoint VERSION`` read a committed
  version (the real checkpoint manager's catalog and chunk files) and a dataset under
  SURGE_HOME directly; every failure is one line.
(The job's own final eval loss reproduced by ``surgectl eval``: tests/integration/test_end_to_end.py.)
"""

from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.nn import functional

from services.cli.errors import CliError
from services.cli.evaluation import check_held_out, mount
from services.compute.model import build_model
from services.contract import data_pb2, store_pb2
from services.data.__main__ import build_stream
from services.data.prepare import prepare_dataset
from services.jobspec import JobSpec, spec_to_json
from services.state.chunk_store import ChunkWriter
from services.store.checkpoint_manager import CheckpointManager
from tests.cli.test_housekeeping import assert_one_line, run_cli


def text_corpus(src: Path) -> Path:
    rng = random.Random(1)
    for i in range(8):
        (src / f"note{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (src / f"note{i}.txt").write_text("".join(f"line {j} of note {i}: {rng.random():.6f}\n" for j in range(40)))
    (src / "docs").mkdir()
    (src / "docs" / "guide.md").write_text("# Guide\n\nSome prose, and ünïcode.\n")
    (src / "docs" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 20)
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]\n")
    (src / ".env").write_text("SECRET=1\n")
    return src


SPEC = {
    "name": "tj",
    "steps": 2,
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 2},
    "data": {"dataset": "tiny@v1", "seq_len": 32, "micro_batch_size": 2},
    "eval": {"batches": 2},
}


@pytest.fixture
def home(surge_home, tmp_path) -> Path:
    """SURGE_HOME with dataset tiny@v1 (text files, 30 % held out) and version tj:1 of a
    model (its initial weights) committed by the real checkpoint manager."""
    prepare_dataset(
        text_corpus(tmp_path / "src"), "tiny", "v1", surge_home / "datasets", val_fraction=0.3, include_glob=None
    )
    spec = JobSpec.model_validate(SPEC)
    manager = CheckpointManager(surge_home / "store")
    staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id="tj", step=2, rank=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": build_model(spec.model, spec.seed).state_dict()}
        dcp.save(
            state, storage_writer=ChunkWriter(staged.staging_path, staged.chunk_path, sync_files=False), no_dist=True
        )
    manager.commit_checkpoint(
        store_pb2.CommitCheckpoint(job_id="tj", step=2, world_size=1, spec_json=spec_to_json(spec))
    )
    return surge_home


def bpe_versions(datasets: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """notes@v1 and notes@v2, each with its own ``bpe:280`` trained on other words (two
    tokenizers, one vocabulary size: the user trial's case), and notes@v3, v2's text
    tokenized with v1's tokenizer.json. -> their directories."""

    def corpus(d: Path, words: list[str], seed: int) -> Path:
        rng = random.Random(seed)
        d.mkdir(parents=True)
        for i in range(6):
            (d / f"f{i}.txt").write_text("".join(" ".join(rng.choices(words, k=12)) + "\n" for _ in range(60)))
        return d

    a = corpus(tmp_path / "greek", ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"], 1)
    b = corpus(tmp_path / "colours", ["red", "green", "blue", "yellow", "orange", "violet"], 2)
    kw = {"val_fraction": 0.3, "include_glob": None}
    v1 = prepare_dataset(a, "notes", "v1", datasets, tokenizer="bpe:280", **kw)
    v2 = prepare_dataset(b, "notes", "v2", datasets, tokenizer="bpe:280", **kw)
    v3 = prepare_dataset(b, "notes", "v3", datasets, tokenizer=str(v1.path / "tokenizer.json"), **kw)
    assert v1.vocab_size == v2.vocab_size == v3.vocab_size == 280
    assert (v1.path / "tokenizer.json").read_bytes() != (v2.path / "tokenizer.json").read_bytes()
    return v1.path, v2.path, v3.path


# ------------------------------------------------------------------ dataset prepare


def test_prepare_takes_every_text_file_by_default_and_skips_binary_and_hidden_ones(
    surge_home, tmp_path, monkeypatch, capsys
):
    src = text_corpus(tmp_path / "src")
    code, out, err = run_cli(["dataset", "prepare", "--name", "notes", "--source", str(src)], monkeypatch, capsys)
    assert code == 0 and err == "", err
    path = surge_home / "datasets" / "notes" / "v1"
    manifest = json.loads((path / "manifest.json").read_text())
    docs = sorted((path / "train.docs.txt").read_text().split() + (path / "val.docs.txt").read_text().split())
    assert docs == ["docs/guide.md", *(f"note{i}.txt" for i in range(8))]
    assert manifest["skipped"] == {"empty_files": 0, "binary_files": 1, "hidden_files": 2}
    assert manifest["include_glob"] is None and "warnings" not in manifest


def test_include_picks_files_by_glob(surge_home, tmp_path, monkeypatch, capsys):
    src = text_corpus(tmp_path / "src")
    argv = ["dataset", "prepare", "--name", "md", "--source", str(src), "--include", "**/*.md"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    path = surge_home / "datasets" / "md" / "v1"
    assert code == 0 and (path / "train.docs.txt").read_text() == "docs/guide.md\n"
    assert json.loads((path / "manifest.json").read_text())["include_glob"] == "**/*.md"


def test_a_directory_of_nothing_but_binary_files_is_one_line(surge_home, tmp_path, monkeypatch, capsys):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.dat").write_bytes(b"\0\1\2")
    code, out, err = run_cli(["dataset", "prepare", "--source", str(tmp_path / "bin")], monkeypatch, capsys)
    assert_one_line(code, err, 2, "no non-empty text file", "1 binary")  # (the source is the input: exit 2)
    assert not (surge_home / "datasets" / "stdlib").exists()


@pytest.mark.parametrize("argv", [["--val-fraction", "0"], ["--include", "note0.txt"]])
def test_a_version_without_held_out_files_warns_in_one_line_and_records_it(
    surge_home, tmp_path, monkeypatch, capsys, argv
):
    src = text_corpus(tmp_path / "src")
    code, out, err = run_cli(["dataset", "prepare", "--name", "nv", "--source", str(src), *argv], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1 and lines[0].startswith("warning: nv@v1: no held-out split"), err
    assert "eval: {every_steps: 0, at_end: false}" in lines[0]
    manifest = json.loads((surge_home / "datasets" / "nv" / "v1" / "manifest.json").read_text())
    assert manifest["splits"]["val"]["documents"] == 0 and manifest["warnings"] == [lines[0].removeprefix("warning: ")]
    # Preparing it again (unchanged) warns again, from the manifest.
    code, out, err = run_cli(["dataset", "prepare", "--name", "nv", "--source", str(src), *argv], monkeypatch, capsys)
    assert code == 0 and err.strip() == lines[0]


def test_a_job_that_evaluates_on_a_dataset_without_held_out_split_is_refused(surge_home, tmp_path):
    prepare_dataset(
        text_corpus(tmp_path / "src"), "nv", "v1", surge_home / "datasets", val_fraction=0.0, include_glob=None
    )
    ready = mount("nv@v1", verify=True)  # the real L4-1's answer, as the data service gives it
    on = JobSpec.model_validate({**SPEC, "data": {**SPEC["data"], "dataset": "nv@v1"}, "eval": {"every_steps": 0}})
    with pytest.raises(CliError) as refused:
        check_held_out(on, ready, "job.yaml")
    assert refused.value.code == 2
    assert str(refused.value).startswith("job.yaml: eval: dataset nv@v1 has no held-out split")
    off = on.model_copy(update={"eval": on.eval.model_copy(update={"at_end": False})})
    check_held_out(off, ready, "job.yaml")  # evaluation off: nothing to refuse


# ------------------------------------------------------------------ eval and generate


def reference_loss(home: Path, batches: int) -> tuple[float, int]:
    """The same micro-batches through the data pipeline's own modules, and the loss of the
    weights that were saved, computed here."""
    spec = JobSpec.model_validate(SPEC)
    d = spec.data
    req = data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name="tiny", version="v1"), split="val", max_batches=batches,
        packer=data_pb2.PackerConfig(seq_len=d.seq_len, micro_batch_size=d.micro_batch_size, mode=data_pb2.PACK,
                                     separator_id=0, world_size=1),
        filter=data_pb2.FilterRules(min_tokens=d.filter.min_tokens, banned_bytes=d.filter.banned_bytes.encode()),
        prefetch=data_pb2.SetPrefetch(watermark=d.prefetch.watermark, threads=d.prefetch.threads),
    )  # fmt: skip
    model = build_model(spec.model, spec.seed).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in build_stream(home / "datasets").batches(req):
            x, y = (
                torch.from_numpy(np.frombuffer(b, "<i4").reshape(mb.batch_size, mb.seq_len).astype(np.int64))
                for b in (mb.input_ids, mb.labels)
            )
            total += float(functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
            tokens += int((y != -100).sum())
    return total / tokens, tokens


def test_eval_reads_a_committed_version_and_a_dataset_without_a_stack(home, monkeypatch, capsys):
    code, out, err = run_cli(["eval", "tj:1", "-o", "json"], monkeypatch, capsys)
    assert code == 0, err
    got = json.loads(out)
    loss, tokens = reference_loss(home, batches=2)  # default: eval.batches (2) x dp (1)
    assert (got["version"], got["step"], got["dataset"], got["split"], got["batches"]) == (
        "tj:1",
        2,
        "tiny@v1",
        "val",
        2,
    )
    assert got["tokens"] == tokens == 2 * 2 * 32 and got["loss"] == pytest.approx(loss, rel=1e-6)
    assert abs(got["loss"] - math.log(256)) < 0.5  # an untrained byte model: about ln 256
    code, out, err = run_cli(["eval", "latest", "--dataset", "tiny@v1", "--batches", "3"], monkeypatch, capsys)
    assert code == 0 and out.startswith("tj:1 (step 2) on tiny@v1 val: loss ") and "3 batches" in out, err


def test_generate_reads_a_committed_version_without_a_stack(home, monkeypatch, capsys):
    argv = ["generate", "--checkpoint", "tj:latest", "--prompt", "line ", "--max-new-tokens", "8"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 0 and out.startswith("line "), err


def test_generate_continues_several_prompts_each_as_it_would_alone(home, monkeypatch, capsys):
    """Repeated --prompt: one load, prompts of one length in tokens decoded as one batch; the
    greedy continuation of each is its own alone (bytes: "ab" and "cd" batch, "xyz" does not)."""
    from services.compute import inference

    shapes, real = [], inference.generate

    def seen(model, prompt_ids, *args, **kwargs):
        shapes.append(tuple(prompt_ids.shape))
        return real(model, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(inference, "generate", seen)
    greedy = ["--checkpoint", "tj:latest", "--max-new-tokens", "6", "--temperature", "0"]
    alone = {}
    for p in ("ab", "xyz", "cd"):
        code, out, err = run_cli(["generate", *greedy, "--prompt", p], monkeypatch, capsys)
        assert code == 0, err
        alone[p] = out.rstrip("\n")
    shapes.clear()
    code, out, err = run_cli(
        ["generate", *greedy, "--prompt", "ab", "--prompt", "xyz", "--prompt", "cd"], monkeypatch, capsys
    )
    assert code == 0, err
    assert sorted(shapes) == [(1, 3), (2, 2)]  # "ab" and "cd" as one [2, 2] batch
    parts = out.rstrip("\n").split("--- prompt ")
    assert [x.split("\n", 1)[0] for x in parts[1:]] == ["1 of 3", "2 of 3", "3 of 3"]
    assert [x.split("\n", 1)[1].rstrip("\n") for x in parts[1:]] == [alone["ab"], alone["xyz"], alone["cd"]]


def test_generate_decodes_a_small_model_on_one_thread_and_gives_the_threads_back(home, monkeypatch, capsys):
    """A small model's decoding on torch's intra-op threads spun them for nothing: 200 demo
    tokens 27.6 s on two threads, 1.7 s on one (a loaded 2-core host; docs/LOG.md session 31)."""
    import torch

    from services.compute import inference

    seen, real = [], inference.generate

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(inference, "generate", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        code, out, err = run_cli(
            ["generate", "--checkpoint", "tj:latest", "--max-new-tokens", "4"], monkeypatch, capsys
        )
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert code == 0 and seen == [1] and after == 3, (err, seen, after)


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["eval", "tj:9"], 2, ["checkpoint tj:9 not found", "have: tj:1"]),  # (as `resume --from`)
        (["eval", "tj"], 2, ['checkpoint version "tj"']),
        (["eval", "tj:1", "--dataset", "nope@v1"], 2, ["dataset nope@v1 not found"]),  # (as submit and delete say it)
        (["eval", "tj:1", "--dataset", "nope"], 2, ["--dataset 'nope'", "name@version"]),
        (["eval", "tj:1", "--split", "test"], 2, ["--split"]),
        (["eval", "tj:1", "-o", "yaml"], 2, ["--output"]),
        (["generate", "--checkpoint", "other:1"], 2, ["checkpoint other:1 not found"]),
    ],
)
def test_eval_and_generate_failures_are_one_line(home, monkeypatch, capsys, argv, code, words):
    assert_one_line(*run_cli(argv, monkeypatch, capsys)[::2], code, *words)


def test_eval_with_no_checkpoint_store_is_one_line(surge_home, monkeypatch, capsys):
    code, out, err = run_cli(["eval", "latest"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "no checkpoints under", str(surge_home / "store"))


def test_eval_on_a_dataset_without_held_out_split_is_one_line(home, tmp_path, monkeypatch, capsys):
    prepare_dataset(text_corpus(tmp_path / "nv"), "nv", "v1", home / "datasets", val_fraction=0.0, include_glob=None)
    code, out, err = run_cli(["eval", "tj:1", "--dataset", "nv@v1"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "--dataset nv@v1: no held-out split", "--split train")
    code, out, err = run_cli(["eval", "tj:1", "--dataset", "nv@v1", "--split", "train"], monkeypatch, capsys)
    assert code == 0 and "on nv@v1 train: loss" in out, err


def test_eval_of_a_damaged_version_names_the_file(home, monkeypatch, capsys):
    chunk = sorted((home / "store" / "checkpoints" / "tj" / "chunks").rglob("*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    code, out, err = run_cli(["eval", "tj:1"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "checkpoint tj:1: ", chunk.name, "sha256 mismatch")
    assert err.count("checkpoint tj:1") == 1


def test_eval_on_a_dataset_of_another_tokenizer_is_refused_naming_both(home, tmp_path, monkeypatch, capsys):
    """The user trial: same vocabulary size, other tokenizer: a loss printed with no warning.
    Refused (exit 2, one line); the same tokenizer on other text is evaluated."""
    from tests.cli.test_export import commit_version

    v1, _, _ = bpe_versions(home / "datasets", tmp_path)
    spec = {**SPEC, "model": {**SPEC["model"], "vocab_size": 288}, "data": {**SPEC["data"], "dataset": "notes@v1"}}
    commit_version(home, JobSpec.model_validate(spec), job="bt", step=2)
    code, out, err = run_cli(["eval", "bt:1", "--dataset", "notes@v2"], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--dataset notes@v2: checkpoint bt:1: trained on notes@v1 (tokenizer sha256:")
    assert "prepared with another tokenizer" in err and f"--tokenizer {v1 / 'tokenizer.json'}" in err
    code, out, err = run_cli(["eval", "bt:1", "--dataset", "notes@v3", "--batches", "1"], monkeypatch, capsys)
    assert code == 0 and "on notes@v3 val: loss" in out, err  # v1's tokenizer, other text
    code, out, err = run_cli(["eval", "bt:1", "--batches", "1"], monkeypatch, capsys)
    assert code == 0 and "on notes@v1 val: loss" in out, err  # its own dataset: nothing to compare


def test_eval_on_another_dataset_when_the_jobs_own_is_deleted_is_refused(home, tmp_path, monkeypatch, capsys):
    import shutil

    shutil.rmtree(home / "datasets" / "tiny" / "v1")
    prepare_dataset(text_corpus(tmp_path / "nv"), "nv", "v1", home / "datasets", val_fraction=0.3, include_glob=None)
    code, out, err = run_cli(["eval", "tj:1", "--dataset", "nv@v1"], monkeypatch, capsys)
    assert_one_line(
        code, err, 2, "--dataset nv@v1: checkpoint tj:1: trained on dataset tiny@v1, which cannot be read",
        "dataset tiny@v1 not found", "cannot be checked against nv@v1's",
    )  # fmt: skip


def test_a_held_out_split_far_over_its_share_of_tokens_is_said_in_one_line(surge_home, tmp_path, monkeypatch, capsys):
    """Documents are held out whole: 16 files, one large, --val-fraction 0.02 held out the large
    one (79 % of the tokens) and said nothing (a new user's trial)."""
    from services.data.prepare.encode import split_key

    src = tmp_path / "src"
    src.mkdir()
    names = [f"n{i:02}.txt" for i in range(16)]
    keys = {name: split_key(name) / 2**64 for name in names}
    big = min(names, key=keys.get)  # the rule's first pick, whatever val_fraction
    assert keys[big] < 0.02 or all(k >= 0.02 for k in keys.values())  # (held out by the rule or the fallback)
    for name in names:
        (src / name).write_text(f"note {name}\n" * (4_000 if name == big else 20))

    def prepare(version: str, fraction: str) -> tuple[list[str], dict]:
        argv = ["dataset", "prepare", "--name", "lop", "--version", version, "--source", str(src)]
        code, out, err = run_cli([*argv, "--val-fraction", fraction], monkeypatch, capsys)
        assert code == 0, err
        manifest = json.loads((surge_home / "datasets" / "lop" / version / "manifest.json").read_text())
        return [line for line in err.strip().splitlines() if line.startswith("warning: ")], manifest

    lines, manifest = prepare("v1", "0.02")
    val = manifest["splits"]["val"]
    assert (surge_home / "datasets" / "lop" / "v1" / "val.docs.txt").read_text().splitlines()[0] == big
    share = val["tokens"] / (val["tokens"] + manifest["splits"]["train"]["tokens"])
    assert share > 0.7 and len(lines) == 1, lines
    assert lines[0].startswith(f"warning: lop@v1: the held-out split has {share:.0%} of the tokens")
    assert "--val-fraction 0.02 asked" in lines[0] and "documents are held out whole" in lines[0]
    assert manifest["warnings"] == [lines[0].removeprefix("warning: ")]
    (src / big).write_text(f"note {big}\n" * 20)  # the same files, even sizes: nothing to say
    lines, manifest = prepare("v2", "0.02")
    assert lines == [] and "warnings" not in manifest and manifest["splits"]["val"]["documents"] >= 1
