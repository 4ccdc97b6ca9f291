"""Specs people can drive (issue 15 part 4), in-process: `surgectl submit --set KEY=VALUE`
(validated like the file, errors naming the --set or the field), `submit --dry-run`
(validate, resolve the dataset from the catalog under $SURGE_HOME with no stack, estimate
memory per rank, print the effective spec, submit nothing), the effective spec control
journals from an overridden submit (`surgectl spec JOB`'s source), and the memory estimate:
hand-computed totals for known layouts, and its activations against what autograd really
saves for a small model. `surgectl spec JOB` and a dry run against a running data service:
tests/cli/test_resume_dp.py (a real stack it already runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import surgectl
from services.cli.errors import CliError
from services.cli.spec_tools import effective_yaml, load_spec, show_spec
from services.jobspec import JobSpec, parse_job_spec, spec_from_json, spec_to_json
from services.memory_estimate import estimate_memory

pytestmark = pytest.mark.timeout(120)

JOB = """\
name: tiny
steps: 4
model: {n_layers: 2, d_model: 32, n_heads: 2}
data: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 2}
precision: bf16
optimizer: {warmup_steps: 0}
"""


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(JOB)
    return path


def surgectl_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``surgectl ARGS`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["surgectl", *args])
    with pytest.raises(SystemExit) as done:
        surgectl.main()
    out, err = capsys.readouterr()
    return done.value.code, out, err


# ---------------------------------------------------------------- --set


def test_overrides_reach_every_kind_of_field_and_are_validated_as_a_whole(job):
    spec, text, source = load_spec(
        job,
        [
            "optimizer.lr=1e-3",  # a YAML 1.2 float (PyYAML alone reads a string)
            "steps=2000",
            "model.rope_theta=5.0e5",  # another (no sign after the e)
            "model.rope_scaling.factor=8",  # a section of a field that is None by default
            "checkpoint.async=false",  # a field spelled by its alias
            "precision.dtype=fp16",  # inside a section the file wrote in its short form
            "precision.loss_scale.init_scale=1024",  # a section the file does not have
            "fault_policy.restarts.rank_exit=2",  # a mapping's key
            "model.freeze=[blocks.0.*]",  # a list
            "data.seq_len=8",
            "data.seq_len=32",  # the last one wins
        ],
    )
    assert spec.optimizer.lr == 1e-3 and spec.steps == 2000 and spec.checkpoint.async_ is False
    assert spec.model.rope_theta == 5e5 and spec.model.rope_scaling.factor == 8.0
    assert spec.precision.dtype == "fp16" and spec.precision.scaling.init_scale == 1024.0
    assert spec.fault_policy.restarts == {"rank_exit": 2} and spec.model.freeze == ["blocks.0.*"]
    assert spec.data.seq_len == 32 and spec.model.n_layers == 2  # the file's other fields kept
    assert source.startswith(f"{job} with --set optimizer.lr=1e-3, steps=2000, ")
    # What is sent to control is the edited file: control's parse of it gives the same spec.
    assert parse_job_spec(text, source) == spec
    # No overrides: the file's own text and name, as before.
    assert load_spec(job) == (parse_job_spec(JOB, str(job)), JOB, str(job))


def leaves(fields: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every non-mapping value of a spec's dump (empty mappings too)."""
    out = []
    for key, value in fields.items():
        if isinstance(value, dict) and value:
            out += leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def test_every_field_of_the_model_is_overridable_new_sections_included(job):
    """Generic over the pydantic model: every leaf of the effective spec, set to its own
    value by --set, is accepted and changes nothing (a section added to JobSpec later is
    covered without a change here or in spec_tools)."""
    base = load_spec(job)[0]
    paths = leaves(base.model_dump(mode="json", by_alias=True))
    assert len(paths) > 80, len(paths)
    assert {"optimizer.lr", "checkpoint.async", "liveness.phase_seconds.compile"} <= {p for p, _ in paths}
    overrides = [f"{path}={json.dumps(value)}" for path, value in paths]  # JSON is YAML
    assert load_spec(job, overrides)[0] == base


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lrr=0.1", "--set optimizer.lrr=0.1: optimizer.lrr: unknown key (did you mean optimizer.lr?)"),
        ("stepz=3", "--set stepz=3: stepz: unknown key (did you mean steps?)"),
        (
            "model.zzz=1",
            "--set model.zzz=1: model.zzz: unknown key (model has: attention, d_model, ffn_hidden, freeze, ",
        ),
        (
            "optimizer.lr.x=1",
            "--set optimizer.lr.x=1: optimizer.lr is a value, not a section (optimizer.lr.x does not exist)",
        ),
        ("steps", "--set steps: expected KEY=VALUE with KEY a dotted field path"),
        ("optimizer..lr=1", "--set optimizer..lr=1: expected KEY=VALUE"),
        ("steps=[1", "--set steps=[1: line 1: malformed YAML: "),
    ],
)
def test_a_bad_override_path_is_one_line_naming_it_exit_2(job, monkeypatch, capsys, override, message):
    code, out, err = surgectl_main(monkeypatch, capsys, "submit", str(job), "--set", override)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optimizer.lr=-1", "optimizer.lr: Input should be greater than 0, got -1"),
        ("steps=2e3", "steps: Input should be a valid integer, got 2000.0"),
        ("data.seq_len=1e30", "data.seq_len: Input should be a valid integer"),
        ("data.pad_id=300", ": data.pad_id: 300 is not a token id of model.vocab_size 256"),  # a cross-field rule
        ("model.freeze=[nothing.*]", "model.freeze[0]: 'nothing.*' matches no parameter"),
        (
            "precision.loss_scale.init_scale=1024",
            ": precision: loss_scale is only used with dtype fp16, got dtype bf16",
        ),
    ],
)
def test_an_overridden_value_is_validated_like_the_file_naming_the_field(job, override, field):
    with pytest.raises(CliError) as caught:
        load_spec(job, [override])
    text = str(caught.value)
    assert caught.value.code == 2 and "\n" not in text
    assert text.startswith(f"{job} with --set {override}: "), text
    assert field in text, text


def test_the_effective_spec_reads_back_as_the_same_job(job):
    spec = load_spec(job, ["checkpoint.async=false", "fault_policy.actions.rank_exit=stop"])[0]
    text = effective_yaml(spec)
    assert "async: false" in text and "async_" not in text  # spelled as a file spells it
    assert parse_job_spec(text, "effective.yaml") == spec
    for output in ("yaml", "json"):  # `surgectl spec JOB` from control's journaled JSON
        assert parse_job_spec(show_spec(spec_to_json(spec), output), "spec") == spec
    with pytest.raises(CliError, match="--output: expected 'yaml' or 'json', got 'table'"):
        show_spec(spec_to_json(spec), "table")


def test_control_journals_the_overridden_spec_and_answers_it_with_spec(job, tmp_path):
    """The text an overridden submit sends is what control validates and journals; GetJob
    with_spec (what `surgectl spec JOB` asks) answers it."""
    from services.contract import control_pb2
    from services.control.__main__ import build
    from services.control.job_store import JobStore
    from tests.control.conftest import Plane

    spec, text, source = load_spec(job, ["steps=7", "optimizer.lr=1e-3", "precision=fp32"])
    journal = JobStore(tmp_path / "control.db")
    try:
        plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
        plane.register("wa")
        job_id = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path=source)).job_id
        answered = plane.user(control_pb2.JobQuery(job_id=job_id, with_spec=True))
        assert spec_from_json(answered.spec_json) == spec and answered.total_steps == 7
        (row,) = journal.load_jobs()
        assert spec_from_json(row.spec_json) == spec
    finally:
        journal.close()


# ---------------------------------------------------------------- --dry-run


@pytest.fixture
def catalog(surge_home) -> Path:
    """``tiny@v1`` (bytes, a held-out split) under $SURGE_HOME/datasets; no stack."""
    from services.data.prepare import prepare_dataset

    src = surge_home / "corpus"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.txt").write_text(f"document {i} " * 100)
    prepare_dataset(src, "tiny", "v1", surge_home / "datasets", val_fraction=0.2, include_glob="**/*.txt")
    return surge_home


def test_dry_run_with_no_stack_validates_reads_the_catalog_estimates_and_submits_nothing(
    job, catalog, monkeypatch, capsys
):
    # Control is "somewhere unreachable": a submit would fail; a dry run never asks it.
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", "127.0.0.1:9")
    code, out, err = surgectl_main(
        monkeypatch, capsys, "submit", str(job), "--set", "steps=100", "--set", "optimizer.lr=1e-3", "--dry-run"
    )
    assert code == 0 and err == "", err
    report = [line for line in out.splitlines() if line.startswith("#")]
    assert report[0] == f"# {job} with --set steps=100, optimizer.lr=1e-3: valid; nothing submitted (--dry-run)"
    assert report[1].startswith(f"# dataset tiny@v1 (read from the catalog under {catalog / 'datasets'}): 4 train ")
    assert "tokenizer bytes, vocabulary 256 (model.vocab_size 256)" in report[1]
    assert report[2].startswith("# training: 100 steps x 32 tokens a step (dp 1 x micro_batch_size 2 x ")
    assert report[4].startswith("# memory per rank (an estimate: tensors only;")
    assert any(line.startswith("#   total ") for line in report)
    # And on a GPU: the device's total (tensors, CUDA context, allocator reserve) and the host's.
    gpu = report.index(
        "# on a GPU, per rank (rules of thumb for CUDA's own memory, not measured; see services/memory_estimate.py):"
    )
    assert report[gpu + 1].startswith("#   tensors ") and report[gpu + 2].startswith("#   CUDA context ")
    assert any(line.startswith("#   GPU total ") for line in report[gpu:])
    assert any(line.startswith("#   host total ") for line in report[gpu:])
    # The in-memory checkpoint copy (issue 29 item 8): its size and the room in /dev/shm here.
    (copy,) = [line for line in report if line.startswith("# memory copy per rank ")]
    assert "(float32 parameters and AdamW moments)" in copy and ("free in /dev/shm" in copy or "cannot be read" in copy)
    # The output is a job file: the effective spec, every default filled, the overrides in.
    effective = parse_job_spec(out, "dry-run.yaml")
    assert effective == load_spec(job, ["steps=100", "optimizer.lr=1e-3"])[0]
    assert yaml.safe_load(out)["liveness"]["heartbeat_interval_seconds"] == 1.0
    assert not (catalog / "run").exists()  # nothing started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "data.dataset=nope@v1"], "data.dataset: dataset nope@v1 not found (have: tiny@v1)"),
        (["--set", "model.vocab_size=100"], "model.vocab_size: 100 is smaller than the dataset's vocabulary (256"),
    ],
)
def test_dry_run_refuses_what_a_submit_would_with_one_line(job, catalog, monkeypatch, capsys, args, message):
    code, out, err = surgectl_main(monkeypatch, capsys, "submit", str(job), *args, "--dry-run")
    assert code == 2 and out == "", out
    assert err.count("\n") == 1 and err.startswith(f"error: {job} with --set ") and message in err, err


def test_dry_run_refuses_banned_bytes_on_a_dataset_of_other_tokens(job, catalog, monkeypatch, capsys):
    """The data service's filter refuses banned_bytes on a BPE dataset when the ranks open
    their streams; a submit (and its dry run) refuses it first, naming the field."""
    from services.data.prepare import prepare_dataset

    prepare_dataset(
        catalog / "corpus", "tiny", "bpe", catalog / "datasets", tokenizer="bpe:300", include_glob="**/*.txt"
    )
    args = ["--set", "data.dataset=tiny@bpe", "--set", "model.vocab_size=512"]
    code, out, err = surgectl_main(monkeypatch, capsys, "submit", str(job), *args, "--dry-run")
    assert code == 0, err  # the same spec without banned_bytes is fine
    args += ["--set", "data.filter.banned_bytes=x"]
    code, out, err = surgectl_main(monkeypatch, capsys, "submit", str(job), *args, "--dry-run")
    assert code == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert "data.filter.banned_bytes: needs a dataset of the bytes tokenizer, tiny@bpe uses " in err, err


def test_dry_run_with_follow_is_a_usage_error(job, catalog, monkeypatch, capsys):
    code, out, err = surgectl_main(monkeypatch, capsys, "submit", str(job), "--dry-run", "--follow")
    assert (code, out) == (2, "") and err.startswith("error: --follow: nothing is submitted with --dry-run"), err


# ---------------------------------------------------------------- the memory estimate


def layout(dp=1, tp=1, pp=1, dpk="ddp", ac="false", model="", precision="fp32") -> JobSpec:
    """n_layers 2, d_model 32, n_heads 2, vocab 256, SwiGLU (F = 88), tied: 33,440
    parameters (embedding 8,192; a block 12,608: norms 64, q/k/v/proj 4,096, gate/up/down
    8,448; final norm 32); 2 rows x 16 tokens a micro-batch."""
    return parse_job_spec(
        "name: tiny\nsteps: 4\ndata: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 2}\n"
        f"model: {{n_layers: 2, d_model: 32, n_heads: 2{model}}}\nprecision: {precision}\n"
        f"parallel: {{dp: {dp}, tp: {tp}, pp: {pp}, data_parallel: {dpk}, activation_checkpointing: {ac}}}\n"
    )


# Hand-computed (bytes). Per block and token, fp32: two RMSNorms 2 x (8 x 32 + 4) = 520, the
# q/k/v input 128, q/k/v/output/copy 5 x 4 x 32 + the log-sum-exp 4 x 2 = 648, the MLP input
# 128, SwiGLU 4 x 4 x 88 = 1,408: 2,832. Logits per token 3 x 4 x 256 = 3,072 + the final
# norm 260 + the LM head's input 128 = 3,460.
CASES = {
    # 4 x 33,440 each for parameters and gradients, 8 x 33,440 AdamW; 2,832 x 2 blocks x 32
    # tokens = 181,248; 3,460 x 32 = 110,720.
    "fp32 dp 1": (layout(), 0, 827_008),
    # + DDP's buckets, 4 x 33,440.
    "fp32 ddp dp 2": (layout(dp=2), 0, 960_768),
    # frozen block 0: 20,832 trainable: gradients 83,328, AdamW 166,656.
    "fp32 frozen block": (layout(model=", freeze: ['blocks.0.*']"), 0, 133_760 + 83_328 + 166_656 + 291_968),
    # bf16, fsdp2 over 2, checkpointed: 16,720 held (66,880 + 66,880 + 133,760); gathered:
    # root 8,224 + 3 x block 12,608 = 46,048 x 4 = 184,192; casts (25,088 block linears +
    # the tied head 8,192) x 2 = 66,560; per block and token under autocast 520 + 192 + 328
    # + 128 + 704 = 1,872: 4 x 32 x 2 blocks x 32 + 1,872 x 32 = 68,096; logits (3,072 + 512
    # + 260 + 64) x 32 = 125,056.
    "bf16 fsdp2 dp 2 checkpointed": (layout(dp=2, dpk="fsdp2", ac="true", precision="bf16"), 0, 711_424),
    # tp 2: 20,896 held (block 6,336 x 2 + 8,192 + 32) x 16 = 334,336; per block and token
    # 520 + 128 + (320 + 4) + 128 + 704 = 1,804 x 2 x 32 = 115,456; logits 110,720.
    "fp32 tp 2": (layout(tp=2), 0, 560_512),
    # pp 2 (untied), 1F1B, 2 pipeline micro-batches of 1 row: stage 1 holds block 1, the
    # norm and the head, 20,832 x 16 = 333,312; one micro-batch in flight: 2,832 x 16 =
    # 45,312; logits 3,460 x 16 = 55,360 (stage 0: 20,800 x 16 + 2,832 x 32 = 423,424).
    "fp32 pp 2": (layout(pp=2, model=", tie_embeddings: false"), 1, 433_984),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimate_of_known_layouts_equals_the_hand_computed_bytes(name):
    spec, stage, total = CASES[name]
    est = estimate_memory(spec)
    assert (est.stage, est.total) == (stage, total), [(i.name, i.bytes) for i in est.items]
    lines = est.lines()
    assert lines[0].startswith("memory per rank (an estimate") and lines[-1].split()[0] == "total"


def test_the_gpu_estimate_adds_cuda_context_nccl_per_communicator_and_host_staging():
    """On a GPU: the tensors' estimate, the CUDA context, NCCL's buffers for each
    communicator a rank joins (the world and each axis narrower than it), the allocator's
    reserve; on the host, the process and (when the job checkpoints) its snapshot staging."""
    from services import memory_estimate as me

    nccl = me.NCCL_BUFFSIZE * 2 * 2 * me.NCCL_CHANNELS
    for spec, communicators in ((layout(), 0), (layout(dp=2), 1), (layout(dp=2, tp=2, dpk="fsdp2"), 3)):
        tensors = estimate_memory(spec)
        gpu = me.estimate_gpu_memory(spec, tensors)
        reserve = round(me.ALLOCATOR_RESERVE * tensors.total)
        assert gpu.device_total == tensors.total + me.CUDA_CONTEXT + communicators * nccl + reserve
        items = {i.name: i.bytes for i in tensors.items}
        assert gpu.host_total == me.HOST_RUNTIME + items["parameters"] + items["AdamW moments"]
    no_saves = parse_job_spec("name: t\nsteps: 1\ndata: {dataset: t@v1}\ncheckpoint: {every_steps: 0, at_end: false}\n")
    assert me.estimate_gpu_memory(no_saves).host_total == me.HOST_RUNTIME


@pytest.mark.parametrize("variant", ["fp32 sdpa", "bf16 math", "fp32 gelu", "fp32 sdpa gqa", "bf16 math gqa"])
def test_the_activation_estimate_matches_what_autograd_saves(variant):
    """The model Surge trains, one micro-batch forward with the backward unit's loss: the
    bytes of every tensor autograd saves for backward (the weights themselves left out)
    against the estimate's activations, the logits' saved part and the autocast casts."""
    import torch
    from torch.nn import functional

    from services.compute.model import Transformer

    precision = "bf16" if "bf16" in variant else "fp32"
    attention = ", attention: math" if "math" in variant else ""
    mlp = ", mlp: gelu" if "gelu" in variant else ""
    mlp += ", n_kv_heads: 2, qkv_bias: true" if "gqa" in variant else ""  # (4 query heads a k/v pair of 2)
    spec = parse_job_spec(
        "name: t\nsteps: 1\ndata: {dataset: t@v1, seq_len: 32, micro_batch_size: 2}\n"
        f"model: {{n_layers: 2, d_model: 64, n_heads: 4, vocab_size: 256{attention}{mlp}}}\nprecision: {precision}\n"
    )
    model = Transformer(spec.model)
    model.init_weights(0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(idx, attention=spec.attention)
        loss = functional.cross_entropy(logits.reshape(-1, 256).float(), idx.reshape(-1), reduction="sum")
    loss.backward()
    items = {i.name: i.bytes for i in estimate_memory(spec).items}
    # The logits item also counts the float32 logits and the gradient (alive, not saved):
    # 2 x 4 V a token (and the 2-byte logits under autocast).
    not_saved = (2 * 4 * 256 + (2 * 256 if precision == "bf16" else 0)) * 64
    estimate = items["activations"] + items["logits and loss"] - not_saved + items.get("autocast casts", 0)
    measured = sum(saved.values())
    print(f"{variant}: autograd saved {measured} bytes, estimated {estimate} ({estimate / measured - 1:+.2%})")
    assert abs(estimate / measured - 1) < 0.02


def test_the_dry_runs_memory_copy_line_shows_its_size_and_the_room_and_warns_when_it_cannot_fit():
    """Issue 29 item 8: a copy that does not fit the node's shared memory is skipped at every
    save (MemoryCopySkipped); the dry run says so before anything runs."""
    from services.cli.spec_tools import memory_copy_line
    from services.common.free_space import Room
    from services.memory_estimate import estimate_memory

    spec = parse_job_spec(
        "name: c\nsteps: 1\nmodel: {n_layers: 2, d_model: 64, n_heads: 4, vocab_size: 256}\n"
        "data: {dataset: x@v1, seq_len: 16, micro_batch_size: 1}\n",
        "job.yaml",
    )
    need = estimate_memory(spec).checkpoint_bytes
    params = sum(i.bytes for i in estimate_memory(spec).items if i.name == "parameters")
    assert need == 3 * params  # float32 weights and two AdamW moments, every parameter trainable
    fits = memory_copy_line(need, Room("/dev/shm", free_bytes=10 * need, cgroup_bytes=None))
    assert fits.startswith("memory copy per rank (newest checkpoint, in the node agent's shared memory): ")
    assert fits.endswith("here: " + Room("/dev/shm", 10 * need).describe())
    short = memory_copy_line(need, Room("/dev/shm", free_bytes=10 * need, cgroup_bytes=need // 2))
    assert "(cgroup memory: " in short and short.endswith(
        "too little for one copy: every save's copy would be skipped (MemoryCopySkipped)"
    )
