"""Every job spec under examples/jobs/ runs (the presets for 8-GPU nodes are dry-run instead:
``PRESETS``), and a newcomer's path from their own text to
Hugging Face and back works (issue 15 part 8 and its acceptance), on one stack (control,
data, store, two node agents of two slots each: two 2-rank jobs at a time), the examples that
start from nothing submitted together (control queues what does not fit), the fine-tunes
after them.

Each example is submitted as a user would (`surgectl submit examples/jobs/X.yaml --set ...
--follow`), for a few steps: the file as it is, with only ``steps``, ``data.seq_len``,
``checkpoint`` and ``eval`` shortened by ``--set``. Each FINISHES with finite losses, the
tokens per step its layout says and an evaluation at the end. Chained like the examples'
headers: ``finetune_checkpoint`` starts from the FSDP2 example's last checkpoint; the BPE
example's model (`dataset prepare --tokenizer bpe:4096` of a directory of text) is exported
with `surgectl export --format hf` (while the other examples train), loaded by
``transformers`` with Surge's logits (1e-5, fp32), and ``finetune_hf_frozen`` starts from that
directory with half its blocks frozen, submitted while ``finetune_checkpoint`` and
``rebuild`` hold every slot: it waits in the queue, then runs; its loss is read back from its
TensorBoard event files.

Corpora: ``stdlib@v1`` (bytes) from two standard-library packages; the text: the docstrings
of standard-library modules, one text file per module (``notes@v1`` BPE, ``notes-bytes@v1``
bytes, ``notes@v2`` more of them, with the exported model's tokenizer).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from services.cli.spec_tools import load_spec
from services.data.prepare import prepare_dataset
from services.jobspec import load_job_spec
from services.rank.faults import lift_pace
from tests.conftest import REPO, processes_with
from tests.integration.test_end_to_end import SURGECTL, cli, running_stack
from tests.sink_readers import tensorboard_points

EXAMPLES = REPO / "examples" / "jobs"
# What each example shows, beyond the demo, in the order they run (the fine-tunes start
# from the fsdp2 and text_bpe jobs).
SHOWN = {
    "fsdp2.yaml": lambda s: s.parallel.dp == 2 and s.parallel.data_parallel == "fsdp2",
    "tp.yaml": lambda s: s.parallel.tp == 2,
    "pp.yaml": lambda s: s.parallel.pp == 2,
    "bf16.yaml": lambda s: s.precision.dtype == "bf16",
    "fp16.yaml": lambda s: s.precision.dtype == "fp16",
    "grad_accum.yaml": lambda s: s.data.grad_accum > 1,
    "text_bpe.yaml": lambda s: s.data.dataset == "notes@v1" and s.model.vocab_size > 256,
    "finetune_checkpoint.yaml": lambda s: s.init_from is not None and s.init_from.checkpoint is not None,
    "finetune_hf_frozen.yaml": lambda s: s.init_from is not None and s.init_from.hf is not None and s.model.freeze,
    "rebuild.yaml": lambda s: s.fault_policy.action_for("rank_exit", "SEVERE") == "rebuild",
}
# Presets shaped like the models people fine-tune, sized for 8-GPU nodes: checked as specs
# (shape, header) and dry-run on the stack's data service (`submit --dry-run`: validated,
# dataset resolved, memory per rank estimated on the CPU and on a GPU), never trained here:
# a step of a 1 B-parameter model takes minutes on two CPU cores. The dry run swaps in the
# stack's byte-level dataset and leaves init_from out (the weights are not on this machine).
PRESETS = {
    "llama3_2_1b.yaml": lambda s: (s.model.n_heads, s.model.kv_heads) == (32, 8) and s.model.rope_scaling is not None,
    "qwen2_5_0_5b.yaml": lambda s: (s.model.n_heads, s.model.kv_heads, s.model.qkv_bias) == (14, 2, True),
    "smollm2_135m.yaml": lambda s: (s.model.n_heads, s.model.kv_heads, s.model.n_layers) == (9, 3, 30),
    "gpt2_124m.yaml": lambda s: (s.model.n_layers, s.model.d_model, s.model.mlp) == (12, 768, "gelu"),
    "llama3_8b.yaml": lambda s: (s.model.d_model, s.model.kv_heads, s.model.tie_embeddings) == (4096, 8, False),
}
STEPS = 3
# Submitted after the others, in this order: the fine-tunes need the fsdp2 and text_bpe jobs'
# checkpoints, and rebuild fills the slots finetune_checkpoint leaves, so that
# finetune_hf_frozen queues.
LAST = ("rebuild.yaml", "finetune_checkpoint.yaml", "finetune_hf_frozen.yaml")
# A few steps of rows of 64 tokens (fp16 on a CPU runs about 10x slower than fp32), no
# checkpoint, one evaluation batch at the end.
SHORT = (
    f"steps={STEPS}",
    "data.seq_len=64",
    "checkpoint.every_steps=0",
    "checkpoint.at_end=false",
    "eval.every_steps=0",
    "eval.batches=1",
)


def test_every_example_is_a_valid_spec_with_a_header_saying_how_to_run_it():
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert set(SHOWN) | set(PRESETS) <= set(files), files
    for name in files:
        path = EXAMPLES / name
        spec = load_spec(path)[0]  # as `surgectl submit` reads it (a relative init_from.hf made absolute)
        assert {**SHOWN, **PRESETS}.get(name, lambda s: True)(spec), name
        if name in PRESETS:  # GPU settings
            assert spec.precision.dtype == "bf16" and spec.parallel.dp == 8, name
        header = re.match(r"(?:#.*\n)+", path.read_text())
        assert header and f"surgectl submit examples/jobs/{name}" in header.group(0), name


def docstring_corpus(out: Path, first: int, n: int) -> Path:
    """English prose: the module, class and function docstrings of standard-library
    modules ``first`` .. ``first + n - 1`` (those with any, sorted), one text file each."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True)
    k = 0
    for src in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(src.read_bytes())
        except (SyntaxError, ValueError):
            continue
        nodes = [tree, *(x for x in ast.walk(tree) if isinstance(x, (ast.ClassDef, ast.FunctionDef)))]
        docs = [d for d in map(ast.get_docstring, nodes) if d]
        if docs:
            if k >= first:
                (out / f"{src.stem}.txt").write_text("\n\n".join(docs) + "\n")
            k += 1
        if k == first + n:
            break
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # One stack for the examples and the parallel layouts' end-to-end checks below (each had
    # its own); tiny@v1 (and the examples' stdlib@v1) from json, email and logging. Two slots
    # a worker: two of the examples' 2-rank jobs train at once (one after another they took
    # 166 s of a CI run, most of it each job's start-up and end, not its three steps).
    # rebuild's and finetune_checkpoint's ranks are paced (slow_steps) until finetune_hf_frozen
    # is seen queued behind them: forked ranks start in milliseconds, and an unpaced 3-step job
    # could end before the next submit (a loaded machine takes seconds to start a CLI).
    paced = ",".join(f"{job}:slow_steps@1:rank={r}:seconds=20" for job in ("rebuild", "finetune-ckpt") for r in (0, 1))
    env = {"SURGE_WORKER_SLOTS": "2", "SURGE_FAULT_INJECT": paced}
    yield from running_stack(tmp_path_factory, ("json", "email", "logging"), env=env)


def finished_steps(home: Path, name: str, job_id: str, spec) -> list[dict]:
    """Rank 0's step records of the job, checked: steps 1..STEPS with finite losses and the
    layout's tokens per step (dp x micro_batch_size x grad_accum x seq_len); and an evaluation."""
    records = [json.loads(x) for x in (home / "store" / "metrics" / f"{job_id}.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step" and int(r.get("rank", 0)) == 0]
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1)), name
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps), (name, steps)
    assert {int(r["tokens"]) for r in steps} == {spec.tokens_per_step}, (name, steps)
    evals = [r for r in records if r["type"] == "eval"]
    assert evals and all(math.isfinite(r["loss"]) for r in evals), (name, records)
    return steps


@pytest.mark.integration
@pytest.mark.timeout(500)
def test_every_example_runs_and_own_text_goes_to_hugging_face_and_back(stack, tmp_path, monkeypatch):
    home = stack
    t0 = time.monotonic()
    notes = docstring_corpus(tmp_path / "notes", 0, 120)
    prep = f"--name notes --version v1 --source {notes} --tokenizer bpe:4096"
    r = cli(home, "dataset", "prepare", *prep.split())
    assert r.returncode == 0, r.stderr
    for src, name, files in ((home / "corpus", "stdlib", "**/*.py"), (notes, "notes-bytes", "**/*.txt")):
        prepare_dataset(
            src, name, "v1", home / "datasets", val_fraction=0.2, include_glob=files
        )  # (corpus: json, email, logging)

    dry_run_presets(home, monkeypatch)
    seconds, jobs, specs = {}, {}, {}
    started: list[subprocess.Popen] = []  # every `submit --follow`: ended by PID if the test fails first

    def submit(name: str, *, follow: bool) -> subprocess.Popen | None:
        """`surgectl submit EXAMPLE --set ...` (``follow``: --follow, left running: its
        process ends with the job); else waited for (submitted)."""
        overrides = [*SHORT, "checkpoint.at_end=true"] if name in ("fsdp2.yaml", "text_bpe.yaml") else list(SHORT)
        if name == "finetune_checkpoint.yaml":
            overrides.append("init_from.checkpoint=fsdp2:latest")  # by name: the newest fsdp2 run
        if name == "finetune_hf_frozen.yaml":
            overrides.append(f"init_from.hf={hf}")
        specs[name] = load_spec(EXAMPLES / name, overrides)[0]
        argv = ["submit", str(EXAMPLES / name), *(f"--set={o}" for o in overrides)]
        if follow:
            started.append(proc := cli_process(home, *argv, "--follow"))
            return proc
        run = cli(home, *argv)
        assert run.returncode == 0, name + run.stdout[-3000:] + run.stderr
        jobs[name] = run.stdout.split("submitted ", 1)[1].split()[0]
        return None

    def finish(name: str, proc: subprocess.Popen) -> list[dict]:
        """The `submit --follow` of ``name`` ended: its job FINISHED (exit 0), checked."""
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, name + out[-3000:] + err
        jobs[name] = job_id = out.split("submitted ", 1)[1].split()[0]
        seconds[name] = round(time.monotonic() - start, 1)
        return finished_steps(home, name, job_id, specs[name])

    try:
        # The examples that start from nothing, together: control runs two at a time, queues the rest.
        start = time.monotonic()
        order = sorted((n for n in SHOWN if n not in LAST), key=lambda n: n != "text_bpe.yaml")  # (its export next)
        first = {name: submit(name, follow=True) for name in order}
        steps = finish("text_bpe.yaml", first.pop("text_bpe.yaml"))
        assert steps[0]["loss"] > math.log(1024), steps[0]  # BPE ids: a fresh model's loss is about ln(vocabulary)
        # Ready for the fine-tunes while the other examples train.
        hf = export_and_compare_logits(home, f"{jobs['text_bpe.yaml']}:latest", tmp_path, monkeypatch)
        more = docstring_corpus(tmp_path / "more-notes", 120, 60)  # more text, the exported tokenizer
        tok = str(hf / "tokenizer.json")
        prepare_dataset(more, "notes", "v2", home / "datasets", tokenizer=tok, include_glob="**/*.txt")
        for name, proc in first.items():
            steps = finish(name, proc)
            if name == "fp16.yaml":  # dynamic loss scaling, from the spec's init_scale
                assert steps[0]["loss_scale"] == specs[name].precision.scaling.init_scale, steps[0]

        # rebuild and finetune_checkpoint take the four slots, so finetune_hf_frozen queues behind them.
        start = time.monotonic()
        submit("rebuild.yaml", follow=False)
        submit("finetune_checkpoint.yaml", follow=False)
        frozen = submit("finetune_hf_frozen.yaml", follow=True)
        deadline = time.monotonic() + 120
        while not any(  # (status, as the operator reads it: the queued job and its place)
            j["name"] == "finetune-hf" and int(j.get("queue_position", 0)) == 1
            for j in json.loads(cli(home, "status", "-o", "json").stdout)
        ):
            assert time.monotonic() < deadline, "finetune_hf_frozen never queued behind rebuild"
            time.sleep(0.5)
        for name in ("rebuild.yaml", "finetune_checkpoint.yaml"):
            lift_pace(home / "run" / "faults", jobs[name])
        steps = finish("finetune_hf_frozen.yaml", frozen)
        job_id = jobs["finetune_hf_frozen.yaml"]
        # It waited in the queue behind finetune_checkpoint and rebuild, which then finished too.
        events = [json.loads(x) for x in cli(home, "events", job_id, "-o", "json").stdout.splitlines()]
        assert any(e["type"] == "queue" and e["message"].startswith("queued at position 1") for e in events), events
        for name in ("rebuild.yaml", "finetune_checkpoint.yaml"):
            ended = cli(home, "events", jobs[name], "--follow")  # (until it ends, if it has not)
            assert ended.returncode == 0, name + ended.stdout[-3000:] + ended.stderr
            finished_steps(home, name, jobs[name], specs[name])
        log = (home / "run" / "logs" / f"{job_id}.rank0.log").read_text()
        frozen_lines = [json.loads(x) for x in log.splitlines() if '"model.freeze applied"' in x]
        assert frozen_lines and frozen_lines[0]["frozen_tensors"] == 2 * 9 + 1, log[
            -3000:
        ]  # two blocks, the tied embedding
        # The loss in TensorBoard: the JSONL's values, step for step.
        assert tensorboard_points(home / "store" / "metrics" / job_id / "tensorboard", "train/loss", STEPS) == [
            (int(r["step"]), r["loss"]) for r in steps
        ]
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    status = {s["job_id"]: s for s in json.loads(cli(home, "status", "-o", "json").stdout)}
    for name, job_id in jobs.items():
        assert (status[job_id]["outcome"], int(status[job_id]["step"])) == ("FINISHED", STEPS), (name, status[job_id])
    print(f"examples: {seconds}, {time.monotonic() - t0:.1f} s with the datasets")


def cli_process(home: Path, *args: str) -> subprocess.Popen:
    """`surgectl ARGS` started, not waited for (text stdout and stderr piped), as ``cli`` runs it."""
    env = {**os.environ, "SURGE_HOME": str(home), "COLUMNS": "200"}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        env.pop(var, None)
    return subprocess.Popen(
        [*SURGECTL, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def dry_run_presets(home: Path, monkeypatch) -> None:
    """`surgectl submit PRESET --dry-run` (in this process: no stack of their size here) for
    each preset, on the stack's ``stdlib@v1``: valid, the model as the file writes it, and
    the memory per rank on the CPU and on a GPU reported."""
    from services.cli.jobs import dry_run_job
    from services.jobspec import parse_job_spec

    monkeypatch.setenv("SURGE_HOME", str(home))
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    for name in PRESETS:
        report = dry_run_job(EXAMPLES / name, ["data.dataset=stdlib@v1", "init_from=null"])
        lines = report.splitlines()
        assert lines[0].endswith("valid; nothing submitted (--dry-run)"), (name, lines[0])
        assert "(the data service at " in lines[1], (name, lines[1])  # the stack's, not the catalog read directly
        assert any(x.startswith("#   GPU total ") for x in lines) and any(
            x.startswith("#   host total ") for x in lines
        )
        assert parse_job_spec(report, "dry-run.yaml").model == load_job_spec(EXAMPLES / name).model, name


def export_and_compare_logits(home: Path, version: str, tmp_path: Path, monkeypatch) -> Path:
    """`surgectl export VERSION --format hf`; the directory loads in transformers with
    Surge's logits (its ``--format torch`` state_dict in Surge's own model) to 1e-5, and holds
    the dataset's tokenizer; ``generate`` samples from VERSION. Returns the directory."""
    transformers = pytest.importorskip("transformers")
    from services.cli.export import export_version
    from services.compute.model import build_model
    from services.jobspec import spec_from_json

    hf = tmp_path / "notes-hf"
    r = cli(home, "export", version, "--format", "hf", "--out", str(hf))
    assert r.returncode == 0, r.stdout + r.stderr
    monkeypatch.setenv("SURGE_HOME", str(home))
    export_version(version, "torch", tmp_path / "notes-torch")
    spec = spec_from_json((tmp_path / "notes-torch" / "surge_spec.json").read_text())
    model = build_model(spec.model, seed=0).eval()
    model.load_state_dict(torch.load(tmp_path / "notes-torch" / "model.pt", weights_only=True))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    ids_BT = torch.randint(0, spec.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids_BT) - theirs(ids_BT).logits).abs().max().item()
    assert diff < 1e-5, diff
    assert (hf / "tokenizer.json").read_bytes() == (home / "datasets" / "notes" / "v1" / "tokenizer.json").read_bytes()
    # `surgectl generate` (in this process) decodes with the dataset's BPE.
    from services.cli import evaluation

    text = evaluation.generate(version, "The ", 8, 0.8, 40, 0)
    assert text.startswith("The ") and len(text) > len("The "), text
    return hf


# ---------------------------------------------------------------------------------------
# The full stack (control, data, store, two node agents, rank processes) trains a job spec
# under FSDP2 (dp=2), under tensor parallelism (tp=2) and under pipeline parallelism (pp=2,
# 1F1B, with a held-out evaluation through the pipeline): submitted with surgectl, trained,
# checkpointed asynchronously through the store (sharded DTensor state; under pp each stage
# writes its own keys), and sampled from the committed checkpoint as one whole model.
# (Formerly tests/parallel/test_end_to_end_parallel.py, on a stack of its own.)

PARALLEL_JOB = """\
name: {name}
steps: 16
seed: 0
model: {{n_layers: 2, d_model: 64, n_heads: 4, vocab_size: 256, tie_embeddings: {tie}}}
data:
  dataset: tiny@v1
  seq_len: 64
  micro_batch_size: 4
  grad_accum: 2
  filter: {{min_tokens: 16, banned_bytes: "\\0"}}
parallel: {parallel}
optimizer: {{lr: 3.0e-3, warmup_steps: 4}}
checkpoint: {{every_steps: 8, keep_last: 2}}
eval: {{every_steps: {eval_every}, batches: 2}}
"""


def train_and_sample(
    home: Path, tmp_path: Path, name: str, parallel: str, tie: bool = True, eval_every: int = 0
) -> list[dict]:
    """Submit the job, check it FINISHED at step 16 with both ranks reporting the same
    falling loss, checkpoints at 8 and 16, text sampled from the last one and no rank
    process left; returns the job's metrics records."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(PARALLEL_JOB.format(name=name, parallel=parallel, tie=str(tie).lower(), eval_every=eval_every))
    run = cli(home, "submit", str(spec), "--follow")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    job_id = run.stdout.split("submitted ", 1)[1].split()[0]

    status = json.loads(cli(home, "status", job_id, "-o", "json").stdout)[0]
    assert status["state"] == "TERMINATED" and status["outcome"] == "FINISHED" and int(status["step"]) == 16

    records = [json.loads(line) for line in (home / "store" / "metrics" / f"{job_id}.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("type") == "step"]
    by_rank = {rank: [r["loss"] for r in steps if int(r.get("rank", 0)) == rank] for rank in (0, 1)}
    # Both ranks report the global loss (under pp, stage 0 reports the last stage's).
    assert len(by_rank[0]) == 16 and by_rank[0] == by_rank[1] and all(x > 0 for x in by_rank[0])
    assert sum(by_rank[0][-4:]) / 4 < sum(by_rank[0][:4]) / 4 - 0.2

    cks = json.loads(cli(home, "checkpoints", job_id, "-o", "json").stdout)
    assert [int(c["step"]) for c in cks] == [8, 16]
    gen = cli(home, "generate", "--checkpoint", cks[-1]["version"], "--prompt", "def ", "--max-new-tokens", "10")
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
    assert processes_with(f"--job {job_id}") == []
    return records


@pytest.mark.parametrize(
    ("name", "parallel"),
    [("e2e-fsdp2", "{dp: 2, data_parallel: fsdp2, activation_checkpointing: true}"), ("e2e-tp2", "{tp: 2}")],
)
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_job_spec_trains_checkpoints_and_samples_under(stack, tmp_path, name, parallel):
    train_and_sample(stack, tmp_path, name, parallel)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_pp2_job_trains_evaluates_checkpoints_and_samples(stack, tmp_path):
    records = train_and_sample(
        stack, tmp_path, "e2e-pp2", "{pp: 2, pipeline_schedule: 1f1b, microbatches: 2}", tie=False, eval_every=8
    )
    evals = [r for r in records if r.get("type") == "eval"]
    assert evals and all(r["loss"] > 0 for r in evals)
