"""``surgectl export``: a committed version (made here by the real checkpoint manager and the
ranks' chunk writer, in this process) written as a Hugging Face directory or a plain
state_dict, with no stack running; each refusal one line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from services.compute.model import build_model
from services.contract import store_pb2
from services.jobspec import JobSpec, spec_to_json
from services.state.chunk_store import ChunkWriter
from services.store.checkpoint_manager import CheckpointManager
from tests.cli.test_housekeeping import assert_one_line, run_cli

pytestmark = pytest.mark.timeout(120)


def spec_of(**model) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "src",
            "steps": 4,
            "data": {"dataset": "words@v1", "seq_len": 16},
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, **model},
        }
    )


def commit_version(home: Path, spec: JobSpec, job: str = "src-1", step: int = 4) -> torch.nn.Module:
    """A version of ``job`` at ``step`` holding a model of ``spec`` (seed 11), as ranks write it."""
    model = build_model(spec.model, seed=11)
    manager = CheckpointManager(home / "store")
    staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0, baseline_every=1))
    writer = ChunkWriter(staged.staging_path, staged.chunk_path, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, storage_writer=writer, no_dist=True)
    manager.commit_checkpoint(
        store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json=spec_to_json(spec))
    )
    return model


def dataset_with_tokenizer(home: Path) -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = home / "datasets" / "words" / "v1"
    d.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])  # id 3, as `dataset prepare --tokenizer bpe:N` adds one
    tok.save(str(d / "tokenizer.json"))
    (d / "manifest.json").write_text(json.dumps({"name": "words", "version": "v1", "tokenizer": "tokenizer.json"}))
    return (d / "tokenizer.json").read_bytes()


def test_hf_export_loads_in_transformers_with_the_same_logits_and_the_datasets_tokenizer(
    surge_home, tmp_path, monkeypatch, capsys
):
    transformers = pytest.importorskip("transformers")
    model = commit_version(surge_home, spec_of(tie_embeddings=False))
    tokenizer = dataset_with_tokenizer(surge_home)
    out = tmp_path / "hf"
    code, stdout, err = run_cli(["export", "src-1:latest", "--format", "hf", "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert "exported src-1:1 (step 4) as hf to" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "surge_spec.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_bytes() == tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx_BT = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.eval()(idx_BT) - hf(idx_BT).logits).abs().max().item() < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello world")["input_ids"] == [1, 2] and tok.eos_token == "<|endoftext|>"
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (3, 3)  # its end of text, not Llama's 1 and 2
    assert not list(tmp_path.glob(".hf.*"))  # no temporary directory left


def test_torch_export_is_a_state_dict_that_build_model_loads_strictly(surge_home, tmp_path, monkeypatch, capsys):
    spec = spec_of(mlp="gelu")  # any model: the torch format has Surge's names
    model = commit_version(surge_home, spec)
    out = tmp_path / "pt"
    code, stdout, err = run_cli(["export", "src-1:1", "--format", "torch", "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert "no tokenizer" not in stdout  # (the torch format carries none)
    state = torch.load(out / "model.pt", weights_only=True)
    fresh = build_model(spec.model, seed=0)
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert json.loads((out / "surge_spec.json").read_text())["model"]["mlp"] == "gelu"


def test_export_refusals_are_one_line_and_write_nothing(surge_home, tmp_path, monkeypatch, capsys):
    def export(*argv):
        return run_cli(["export", *argv], monkeypatch, capsys)

    out = tmp_path / "out"
    code, _, err = export("src-1:1", "--out", str(out))
    assert_one_line(code, err, 2, "no checkpoints under", "store")  # (a version not there: as `resume --from`)
    commit_version(surge_home, spec_of(mlp="gelu"))
    code, _, err = export("src-1:1", "--format", "onnx", "--out", str(out))
    assert_one_line(code, err, 2, "--format", "'onnx'")
    code, _, err = export("src-1", "--out", str(out))
    assert_one_line(code, err, 2, '"src-1"', "<job>:<n>")
    code, _, err = export("src-1:7", "--out", str(out))
    assert_one_line(code, err, 2, "src-1:7 not found", "src-1:1")
    code, _, err = export("src-1:1", "--format", "hf", "--out", str(out))
    assert_one_line(code, err, 1, "model.mlp: gelu", "--format torch")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["surge"]  # (SURGE_HOME)
    code, _, err = export("src-1:1", "--format", "torch", "--out", "/proc/surge-export")
    assert_one_line(code, err, 1, "--out", "/proc/surge-export")

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = export("src-1:1", "--format", "torch", "--out", str(out))
    assert_one_line(code, err, 1, "--out", "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _, err = export("src-1:1", "--format", "torch", "--out", str(out), "--force")
    assert_one_line(code, err, 1, "--out", "not an earlier export")  # (--force replaces only an export)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_damaged_chunk_is_refused_naming_it_and_nothing_is_written(surge_home, tmp_path, monkeypatch, capsys):
    commit_version(surge_home, spec_of())
    chunks = sorted((surge_home / "store" / "checkpoints" / "src-1" / "chunks").rglob("*"))
    victim = max((p for p in chunks if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "hf"
    code, _, err = run_cli(["export", "src-1:1", "--out", str(out)], monkeypatch, capsys)
    assert_one_line(code, err, 1, "checkpoint src-1:1", victim.name[:12], "sha256 mismatch")
    assert not out.exists() and not list(tmp_path.glob(".hf.*"))


def test_an_empty_out_is_refused_and_force_replaces_only_an_earlier_export(surge_home, tmp_path, monkeypatch, capsys):
    """`export --out "" --force` replaced the current directory (``Path("")`` is ``.``, and
    --force replaced any non-empty folder). Missing parent folders are created."""
    commit_version(surge_home, spec_of())
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)

    def export(*argv):
        return run_cli(["export", "src-1:1", "--format", "torch", *argv], monkeypatch, capsys)

    code, _, err = export("--out", "", "--force")
    assert_one_line(code, err, 2, "--out", "empty")
    assert [p.name for p in work.iterdir()] == ["notes.txt"]
    for named in (".", "..", str(work)):  # the current folder, or one holding it: never replaced
        code, _, err = export("--out", named, "--force")
        assert_one_line(code, err, 2, "--out", "is the current directory or holds it")
    assert [p.name for p in work.iterdir()] == ["notes.txt"]

    # Missing parent folders are created (the README's `--out exports/notes-hf`, as save_pretrained);
    # a file in their way is refused, nothing created or read.
    code, _, err = export("--out", str(tmp_path / "nonexistent" / "a" / "b"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "nonexistent" / "a" / "b").iterdir()) == ["model.pt", "surge_spec.json"]
    (work / "afile").write_text("x")
    code, _, err = export("--out", "afile/sub/pt")
    assert_one_line(code, err, 2, "--out", "afile is not a directory")
    (work / "afile").unlink()
    code, _, err = run_cli(
        ["export", "src-1:99", "--format", "torch", "--out", str(tmp_path / "gone" / "pt")], monkeypatch, capsys
    )
    assert code == 2 and not (tmp_path / "gone").exists(), err  # (no such version: nothing created)

    code, _, err = export("--out", "pt")  # an earlier export is replaced with --force
    assert code == 0, err
    code, _, err = export("--out", "pt", "--force")
    assert code == 0, err
    assert sorted(p.name for p in (work / "pt").iterdir()) == ["model.pt", "surge_spec.json"]
    # ...but not the user's files put beside it (a fresh user's eval results went silently).
    (work / "pt" / "my_notes.txt").write_text("mine")
    (work / "pt" / "evals").mkdir()
    code, _, err = export("--out", "pt", "--force")
    assert_one_line(code, err, 1, "--out", "holds files an export does not write (evals/, my_notes.txt)")
    assert (work / "pt" / "my_notes.txt").read_text() == "mine"
    # Through a link to an earlier export: the link is replaced by the new export, its target kept.
    (work / "pt" / "my_notes.txt").unlink()
    (work / "pt" / "evals").rmdir()
    (work / "lnk").symlink_to(work / "pt")
    code, _, err = export("--out", "lnk", "--force")
    assert code == 0, err
    assert (work / "lnk").is_dir() and not (work / "lnk").is_symlink()
    assert sorted(p.name for p in work.iterdir()) == ["lnk", "notes.txt", "pt"]  # (no stray .lnk.old-*)


@pytest.mark.parametrize(
    "argv",
    [
        ["plot", "j", "--out", ""],
        ["plot", "j", "--metrics", ""],
        ["compare", "a", "b", "--out", ""],
        ["submit", ""],
        ["sweep", ""],
    ],
)
def test_an_empty_path_is_said_to_be_empty_never_taken_as_the_current_folder(argv, surge_home, monkeypatch, capsys):
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, "empty")


def test_compare_refuses_a_missing_parent_folder_of_its_out(surge_home, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["compare", "a", "b", "--out", str(tmp_path / "no" / "c.png")], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--out", "does not exist")


def _commit_newer_on_first_read(monkeypatch, home: Path, spec: JobSpec) -> list[str]:
    """The first read of a version commits a newer one with keep_last 1 first (the running
    job's retention deletes the version being read, its files gone from under the reader),
    then reads on: the reader fails as it would (DCP's own error)."""
    from services.compute import inference

    real, read = inference.load_model_for_inference, []

    def load(path, spec_):
        if not read:
            model = build_model(spec.model, seed=12)
            manager = CheckpointManager(home / "store")
            staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id="src-1", step=8, rank=0, baseline_every=1))
            writer = ChunkWriter(staged.staging_path, staged.chunk_path, sync_files=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save({"model": model.state_dict()}, storage_writer=writer, no_dist=True)
            manager.commit_checkpoint(
                store_pb2.CommitCheckpoint(
                    job_id="src-1", step=8, world_size=1, spec_json=spec_to_json(spec), keep_last=1
                )
            )
        read.append(str(path))
        return real(path, spec_)

    monkeypatch.setattr(inference, "load_model_for_inference", load)
    return read


def test_a_version_removed_while_it_is_exported_is_one_line_and_latest_is_read_again(
    surge_home, tmp_path, monkeypatch, capsys
):
    # A fresh admin exported a running job's :latest while its keep_last removed it: a traceback
    # (DCP's AssertionError "metadata is None"), twice.
    spec = spec_of()
    commit_version(surge_home, spec)
    read = _commit_newer_on_first_read(monkeypatch, surge_home, spec)
    code, _, err = run_cli(
        ["export", "src-1:1", "--out", str(tmp_path / "a"), "--format", "torch"], monkeypatch, capsys
    )
    assert_one_line(code, err, 1, "checkpoint src-1:1 was removed while it was read", "keep_last")
    assert not (tmp_path / "a").exists() and len(read) == 1
    commit_version(surge_home, spec, step=12)  # src-1:3; its read commits src-1:4, removing it
    read.clear()
    code, out, err = run_cli(
        ["export", "src-1:latest", "--out", str(tmp_path / "b"), "--format", "torch"], monkeypatch, capsys
    )
    assert code == 0, err
    assert len(read) == 2 and "exported src-1:4 (step 8)" in out, (read, out)


def test_a_version_named_by_its_jobs_name_is_exported_and_a_shared_name_is_one_line_ambiguous(
    surge_home, tmp_path, monkeypatch, capsys
):
    spec = spec_of()
    commit_version(surge_home, spec, job="src-a1b2c3")
    commit_version(surge_home, spec, job="srcx-d4e5f6")  # (a longer name that starts the same: not src's)
    code, stdout, err = run_cli(
        ["export", "src:1", "--format", "torch", "--out", str(tmp_path / "a")], monkeypatch, capsys
    )
    assert code == 0, err
    assert stdout.startswith(f"exported src-a1b2c3:1 (step 4) as torch to {tmp_path / 'a'}")
    commit_version(surge_home, spec, job="src-0f0f0f")
    for argv in (
        ["export", "src:latest", "--format", "torch", "--out", str(tmp_path / "b")],
        ["generate", "--checkpoint", "src:1"],
        ["eval", "src:1"],
    ):
        code, stdout, err = run_cli(argv, monkeypatch, capsys)
        ambiguous = "job name 'src' is ambiguous: jobs src-0f0f0f, src-a1b2c3 have checkpoint versions; name one"
        assert_one_line(code, err, 2, ambiguous)
    assert not (tmp_path / "b").exists()
    code, stdout, err = run_cli(
        ["export", "src-0f0f0f:1", "--format", "torch", "--out", str(tmp_path / "c")], monkeypatch, capsys
    )
    assert code == 0, err  # (an id: as before)


def test_a_name_whose_newest_live_run_has_no_versions_names_the_run_that_has(monkeypatch):
    # fresh37b: a queued `joba` (no versions yet) hid the running one's: `joba:1` was "not found".
    from services.cli import jobs

    live = {"joba": "joba-0bb883", "joba-525d47": "joba-525d47", "solo": "solo-123abc"}
    monkeypatch.setattr(jobs, "resolve_job", lambda ref: live[ref])
    have = {"joba-525d47", "solo-123abc"}
    assert jobs.resolve_versions_job("joba", ids=have) == "joba-525d47"
    assert jobs.resolve_versions_job("joba-525d47", ids=have) == "joba-525d47"  # (an id: as typed)
    assert jobs.resolve_versions_job("solo", ids=have) == "solo-123abc"  # (the live run has versions)
    two = have | {"joba-777777"}  # (two other runs have: the live one stays, its lookup says why)
    assert jobs.resolve_versions_job("joba", ids=two) == "joba-0bb883"
