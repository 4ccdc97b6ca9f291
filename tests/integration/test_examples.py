"""Every job spec under examples/jobs/ runs: one stack (control, data, store, two node
agents), the examples submitted one after another with `surgectl submit --follow`, each
for a few steps (its own spec, with only ``steps``, ``data.seq_len``, ``checkpoint`` and
``eval`` shortened),
and each FINISHED with finite losses, the tokens per step its layout says, and an
evaluation at the end. The datasets the examples name are prepared here from small
corpora: ``stdlib@v1`` (byte-level) from two standard-library packages, ``notes@v1``
(``--tokenizer bpe:4096``) from English prose: the docstrings of standard-library modules,
one text file per module.
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
import yaml

from services.jobspec import load_job_spec, parse_job_spec
from tests.conftest import REPO
from tests.integration.test_end_to_end import cli, running_stack

EXAMPLES = REPO / "examples" / "jobs"
# What each example shows, beyond the demo (issue 15 part 8).
SHOWN = {
    "fsdp2.yaml": lambda s: s.parallel.dp == 2 and s.parallel.data_parallel == "fsdp2",
    "tp.yaml": lambda s: s.parallel.tp == 2,
    "pp.yaml": lambda s: s.parallel.pp == 2,
    "bf16.yaml": lambda s: s.precision.dtype == "bf16",
    "fp16.yaml": lambda s: s.precision.dtype == "fp16",
    "grad_accum.yaml": lambda s: s.data.grad_accum > 1,
    "text_bpe.yaml": lambda s: s.data.dataset == "notes@v1" and s.model.vocab_size > 256,
}
STEPS = 3


def test_every_example_is_a_valid_spec_with_a_header_saying_how_to_run_it():
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert set(SHOWN) <= set(files), files
    for name in files:
        path = EXAMPLES / name
        spec = load_job_spec(path)
        assert SHOWN.get(name, lambda s: True)(spec), name
        header = re.match(r"(?:#.*\n)+", path.read_text())
        assert header and f"surgectl submit examples/jobs/{name}" in header.group(0), name


def shortened(path: Path, tmp_path: Path) -> Path:
    """The example at ``path`` for a few steps: ``steps`` = STEPS, rows of 64 tokens, no
    checkpoint, one evaluation batch at the end; everything else as written."""
    raw = yaml.safe_load(path.read_text())
    raw["steps"] = STEPS
    raw["data"]["seq_len"] = 64  # (fp16 on a CPU runs about 10x slower than fp32)
    raw["checkpoint"] = {"every_steps": 0, "at_end": False}
    raw["eval"] = {"every_steps": 0, "batches": 1, "at_end": True}
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


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
    for args in (
        ("--name", "stdlib", "--source", str(home / "corpus")),  # running_stack's copy of json and email
        ("--name", "notes", "--source", str(docstring_corpus(tmp_path / "notes")), "--glob", "**/*.txt"),
    ):
        tok = ("--tokenizer", "bpe:4096") if "notes" in args else ()
        r = cli(home, "dataset", "prepare", *args, "--version", "v1", "--val-fraction", "0.2", *tok)
        assert r.returncode == 0, r.stderr

    seconds, jobs = {}, {}
    for name in SHOWN:
        start = time.monotonic()
        spec_path = shortened(EXAMPLES / name, tmp_path)
        spec = parse_job_spec(spec_path.read_text())
        run = cli(home, "submit", str(spec_path), "--follow")
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
        seconds[name] = round(time.monotonic() - start, 1)
    status = {s["job_id"]: s for s in json.loads(cli(home, "status", "-o", "json").stdout)}
    for name, job_id in jobs.items():
        assert (status[job_id]["outcome"], int(status[job_id]["step"])) == ("FINISHED", STEPS), (name, status[job_id])
    print(f"examples: {seconds}, {time.monotonic() - t0:.1f} s with the datasets")
