"""A real lm-evaluation-harness run through `surgectl evaluate` (issue 31 item 4), offline.

    .venv/bin/python bench/lm_eval_hook.py [--work /tmp/surge-lm-eval] [--steps 150] [--out FILE]

What it does, each step on its own (nothing of the project's .venv is touched):

1. A venv of its own, ``WORK/venv`` (kept between runs), with ``lm-eval[hf]`` from the package
   registry; torch from the same local CPU wheel the Makefile installs (pip's constraints).
2. A corpus (the standard library's ``json`` and ``email`` packages, copied), a dataset of it
   with a byte-level BPE (``dataset prepare --tokenizer bpe:1024``: an HF export needs a
   tokenizer file, lm-eval's ``hf`` model reads it), a stack of one worker under
   ``WORK/home`` (its own SURGE_HOME), and a small job trained on it to the end.
3. Two LOCAL lm-eval tasks (``WORK/tasks``, ``--include_path``) over JSONL files written here
   from the corpus's own lines, so that nothing is downloaded (``dataset_path: json``):
   ``surge_code_mc``, multiple choice: a line's first half, its own second half against three
   other lines' (acc, acc_norm; chance 0.25); ``surge_code_ppl``, rolling log-likelihood of
   source chunks (word/byte perplexity, bits per byte).
4. ``surgectl evaluate JOB --wait --command 'env HF_HUB_OFFLINE=1 ... lm_eval --model hf
   --model_args pretrained=$SURGE_EVAL_HF_DIR ...'``: an evaluation job through control's
   queue; its scores recorded beside the job's metrics and shown by ``surgectl status JOB``.

Prints the command, the scores and the wall time of each phase; writes them as JSON to
``--out`` (default bench/results/lm_eval_hook.json). The stack is taken down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LM_EVAL = "lm-eval[hf]==0.4.13"  # the release this was run with (docs/LOG.md, session 33)
PACKAGES = ("json", "email")  # the corpus: standard library packages, here on every machine

JOB = """\
name: lm-eval-src
steps: {steps}
seed: 0
model: {{n_layers: 2, d_model: 64, n_heads: 2, mlp: swiglu, tie_embeddings: true, vocab_size: 1024}}
data: {{dataset: lmeval@v1, seq_len: 128, micro_batch_size: 8}}
parallel: {{dp: 1}}
optimizer: {{lr: 3.0e-3, warmup_steps: 20, min_lr_ratio: 0.1}}
checkpoint: {{every_steps: {steps}, keep_last: 1}}
eval: {{every_steps: 0, at_end: false}}
"""

MC_TASK = """\
task: surge_code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

PPL_TASK = """\
task: surge_code_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def _run(cmd: list[str], env: dict | None = None, timeout: float = 1800, check: bool = True) -> str:
    print("$", " ".join(cmd), flush=True)
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and got.returncode != 0:
        sys.exit(f"failed ({got.returncode}): {' '.join(cmd)}\n{got.stdout[-4000:]}\n{got.stderr[-4000:]}")
    return got.stdout


def venv(work: Path) -> Path:
    """WORK/venv with lm-eval (made once); the path of its ``lm_eval``."""
    lm_eval = work / "venv" / "bin" / "lm_eval"
    if not lm_eval.exists():
        base = shutil.which("python3") or sys.executable
        _run([base, "-m", "venv", str(work / "venv")])
        pip = str(work / "venv" / "bin" / "pip")
        # torch first, as the Makefile does: the local CPU wheel, not a CUDA build from the registry
        _run([pip, "install", "-q", "torch==2.13.0", "numpy"], timeout=3600)
        _run([pip, "install", "-q", LM_EVAL], timeout=3600)
    return lm_eval


def corpus_lines(src: Path) -> list[str]:
    """The corpus's lines that make a fair multiple-choice item: code or prose, 40-100 chars."""
    lines = []
    for path in sorted(src.rglob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            text = line.strip()
            if 40 <= len(text) <= 100 and not text.startswith("#") and text.count(" ") >= 3:
                lines.append(text)
    return sorted(set(lines))


def write_tasks(work: Path, src: Path, items: int) -> Path:
    """The two local tasks and their JSONL data under WORK/tasks; returns that folder."""
    rng = random.Random(0)
    lines = corpus_lines(src)
    picked = rng.sample(lines, items)
    halves = []
    for text in picked:
        cut = text.rfind(" ", 0, len(text) // 2 + 1)
        halves.append((text[:cut], text[cut:]))
    tasks = work / "tasks"
    shutil.rmtree(tasks, ignore_errors=True)
    tasks.mkdir(parents=True)
    with open(tasks / "mc.jsonl", "w") as f:
        for i, (context, rest) in enumerate(halves):
            others = rng.sample([r for j, (_, r) in enumerate(halves) if j != i], 3)
            gold = rng.randrange(4)
            choices = others[:gold] + [rest] + others[gold:]
            f.write(json.dumps({"context": context, "choices": choices, "gold": gold}) + "\n")
    chunks = []
    for path in sorted(src.rglob("*.py"))[:40]:
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= 1500:
            chunks.append(text[500:1500])
    with open(tasks / "ppl.jsonl", "w") as f:
        for text in chunks[:12]:
            f.write(json.dumps({"text": text}) + "\n")
    (tasks / "surge_code_mc.yaml").write_text(MC_TASK.format(data=tasks / "mc.jsonl"))
    (tasks / "surge_code_ppl.yaml").write_text(PPL_TASK.format(data=tasks / "ppl.jsonl"))
    return tasks


def status_scores(status: str) -> list[str]:
    """The lines `surgectl status JOB` shows under its evaluation scores (not the job table)."""
    lines = status.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("evaluation scores")), len(lines))
    return [ln.strip() for ln in lines[at + 1 :] if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/surge-lm-eval"), help="venv, stack, tasks (kept)")
    ap.add_argument("--steps", type=int, default=400, help="the trained job's steps")
    ap.add_argument("--items", type=int, default=64, help="multiple-choice items")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lm_eval_hook.json")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}

    t0 = time.monotonic()
    lm_eval = venv(work)
    version = _run([str(work / "venv" / "bin" / "python"), "-c", "import lm_eval; print(lm_eval.__version__)"])
    times["venv_s"] = time.monotonic() - t0

    home = work / "home"
    shutil.rmtree(home, ignore_errors=True)
    src = work / "corpus"
    shutil.rmtree(src, ignore_errors=True)
    for name in PACKAGES:
        shutil.copytree(
            Path(sysconfig.get_paths()["stdlib"]) / name, src / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    env = {**os.environ, "SURGE_HOME": str(home), "COLUMNS": "200"}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS", "SURGE_AUTH_TOKEN"):
        env.pop(var, None)
    surgectl = [sys.executable, "-m", "services.cli.surgectl"]
    tasks = write_tasks(work, src, args.items)
    command = " ".join(
        [
            # (no shell: `env` sets what keeps lm-eval and datasets off the network)
            "env HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
            f"HF_DATASETS_CACHE={work / 'hf-datasets'} HF_HOME={work / 'hf-home'}",
            str(lm_eval),
            "--model hf --model_args pretrained=$SURGE_EVAL_HF_DIR,dtype=float32",
            f"--tasks surge_code_mc,surge_code_ppl --include_path {tasks}",
            "--device cpu --batch_size 8 --output_path $SURGE_EVAL_OUTPUT",
        ]
    )
    result: dict = {"lm_eval": version.strip(), "command": command}
    try:
        t0 = time.monotonic()
        _run(
            [*surgectl, "dataset", "prepare", "--name", "lmeval", "--version", "v1", "--source", str(src)]
            + ["--tokenizer", "bpe:1024", "--val-fraction", "0.1", "--quiet"],
            env,
        )
        _run([*surgectl, "up", "--workers", "1"], env, timeout=300)
        times["stack_s"] = time.monotonic() - t0

        t0 = time.monotonic()
        spec = work / "job.yaml"
        spec.write_text(JOB.format(steps=args.steps))
        out = _run([*surgectl, "submit", str(spec), "--follow"], env, timeout=3600)
        job = out.split("submitted ", 1)[1].split()[0]
        times["train_s"] = time.monotonic() - t0
        result["job"] = job

        t0 = time.monotonic()
        evaluated = _run(
            [*surgectl, "evaluate", job, "--timeout", "3000", "--wait", "--command", command], env, timeout=3600
        )
        times["evaluate_s"] = time.monotonic() - t0
        print(evaluated)
        status = _run([*surgectl, "status", job], env)
        print(status)
        result["evaluate_output"] = evaluated.strip().splitlines()[-20:]
        result["status_scores"] = status_scores(status)
    finally:
        _run([*surgectl, "down"], env, timeout=300, check=False)
    result["seconds"] = {k: round(v, 1) for k, v in times.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["seconds"]), f"-> {args.out}")


if __name__ == "__main__":
    main()
