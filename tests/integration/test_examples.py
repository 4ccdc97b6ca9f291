"""Every job spec under examples/jobs/ runs: one stack (control, data, store, two node
agents), the examples submitted one after another as a user would (`surgectl submit
examples/jobs/X.yaml --set ... --follow`), each for a few steps: the file as it is, with
only ``steps``, ``data.seq_len``, ``checkpoint`` and ``eval`` shortened by ``--set``. Each
FINISHES with finite losses, the tokens per step its layout says, and an evaluation at the
end. The fine-tunes start from the FSDP2 example's checkpoint: ``finetune_checkpoint``
through ``--set init_from.checkpoint``, ``finetune_hf_frozen`` from its `surgectl export
--format hf` through ``--set init_from.hf``.

The datasets the examples name are prepared here from small corpora: ``stdlib@v1`` (bytes)
from two standard-library packages; ``notes@v1`` (`dataset prepare --tokenizer bpe:4096`)
and ``notes-bytes@v1`` (bytes) from English prose: the docstrings of standard-library
modules, one text file per module.
"""

from __future__ import annotations

import ast
import json
import math
import re
import sysconfig
import time
from pathlib import Path

import pytest

from services.cli.spec_tools import load_spec
from services.data.prepare import prepare_dataset
from services.jobspec import load_job_spec
from tests.conftest import REPO
from tests.integration.test_end_to_end import cli, running_stack

EXAMPLES = REPO / "examples" / "jobs"
# What each example shows, beyond the demo (issue 15 part 8), in the order they run: the
# fine-tunes start from fsdp2's checkpoint.
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
}
STEPS = 3
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
    assert set(SHOWN) <= set(files), files
    for name in files:
        path = EXAMPLES / name
        spec = load_job_spec(path)
        assert SHOWN.get(name, lambda s: True)(spec), name
        header = re.match(r"(?:#.*\n)+", path.read_text())
        assert header and f"surgectl submit examples/jobs/{name}" in header.group(0), name


def docstring_corpus(out: Path, n: int = 120) -> Path:
    """English prose: the module, class and function docstrings of the first ``n``
    standard-library modules (sorted), one text file per module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True)
    written = 0
    for src in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(src.read_bytes())
        except (SyntaxError, ValueError):
            continue
        nodes = [tree, *(x for x in ast.walk(tree) if isinstance(x, (ast.ClassDef, ast.FunctionDef)))]
        docs = [d for d in map(ast.get_docstring, nodes) if d]
        if docs:
            (out / f"{src.stem}.txt").write_text("\n\n".join(docs) + "\n")
            written += 1
        if written == n:
            break
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory, ("json", "email"))


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_every_example_trains_a_few_steps_on_one_stack(stack, tmp_path):
    home = stack
    t0 = time.monotonic()
    notes = docstring_corpus(tmp_path / "notes")
    r = cli(
        home,
        "dataset",
        "prepare",
        *f"--name notes --version v1 --source {notes} --glob **/*.txt --tokenizer bpe:4096".split(),
    )
    assert r.returncode == 0, r.stderr
    for src, name, files in ((home / "corpus", "stdlib", "**/*.py"), (notes, "notes-bytes", "**/*.txt")):
        prepare_dataset(
            src, name, "v1", home / "datasets", val_fraction=0.2, include_glob=files
        )  # (corpus: json, email)

    seconds, jobs = {}, {}
    for name in SHOWN:
        start = time.monotonic()
        overrides = list(SHORT)
        if name == "fsdp2.yaml":  # the fine-tunes' source
            overrides.append("checkpoint.at_end=true")
        elif name == "finetune_checkpoint.yaml":
            overrides.append(f"init_from.checkpoint={jobs['fsdp2.yaml']}:latest")
        elif name == "finetune_hf_frozen.yaml":
            hf = tmp_path / "fsdp2-hf"
            r = cli(home, "export", f"{jobs['fsdp2.yaml']}:latest", "--format", "hf", "--out", str(hf))
            assert r.returncode == 0, r.stdout + r.stderr
            overrides.append(f"init_from.hf={hf}")
        spec, _, _ = load_spec(EXAMPLES / name, overrides)
        run = cli(home, "submit", str(EXAMPLES / name), *(f"--set={o}" for o in overrides), "--follow")
        assert run.returncode == 0, name + run.stdout[-3000:] + run.stderr
        jobs[name] = job_id = run.stdout.split("submitted ", 1)[1].split()[0]

        lines = (home / "store" / "metrics" / f"{job_id}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        steps = [r for r in records if r["type"] == "step" and int(r.get("rank", 0)) == 0]
        assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1)), name
        assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps), (name, steps)
        # The layout's global batch: dp x micro_batch_size x grad_accum rows of seq_len tokens.
        assert {int(r["tokens"]) for r in steps} == {spec.tokens_per_step}, (name, steps)
        evals = [r for r in records if r["type"] == "eval"]
        assert evals and all(math.isfinite(r["loss"]) for r in evals), (name, records)
        if name == "fp16.yaml":  # dynamic loss scaling, from the spec's init_scale
            assert steps[0]["loss_scale"] == spec.precision.scaling.init_scale, steps
        if name == "text_bpe.yaml":  # BPE ids: a fresh model's loss is about ln(vocabulary), not ln(256)
            assert steps[0]["loss"] > math.log(1024), steps
        if name == "finetune_hf_frozen.yaml":
            log = (home / "run" / "logs" / f"{job_id}.rank0.log").read_text()
            assert "model.freeze applied" in log, log[-3000:]
            print([line for line in log.splitlines() if "model.freeze applied" in line])
        seconds[name] = round(time.monotonic() - start, 1)
    status = {s["job_id"]: s for s in json.loads(cli(home, "status", "-o", "json").stdout)}
    for name, job_id in jobs.items():
        assert (status[job_id]["outcome"], int(status[job_id]["step"])) == ("FINISHED", STEPS), (name, status[job_id])
    print(f"examples: {seconds}, {time.monotonic() - t0:.1f} s with the datasets")
