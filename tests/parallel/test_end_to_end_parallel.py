"""The full stack (control, data, store, two node agents, rank processes) trains a job spec
under FSDP2 (dp=2), under tensor parallelism (tp=2) and under pipeline parallelism (pp=2,
1F1B, with a held-out evaluation through the pipeline): submitted with surgectl, trained,
checkpointed asynchronously through the store (sharded DTensor state; under pp each stage
writes its own keys), and sampled from the committed checkpoint as one whole model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import processes_with
from tests.integration.test_end_to_end import cli, running_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

JOB = """\
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def train_and_sample(
    home: Path, tmp_path: Path, name: str, parallel: str, tie: bool = True, eval_every: int = 0
) -> list[dict]:
    """Submit the job, check it FINISHED at step 16 with both ranks reporting the same
    falling loss, checkpoints at 8 and 16, text sampled from the last one and no rank
    process left; returns the job's metrics records."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(JOB.format(name=name, parallel=parallel, tie=str(tie).lower(), eval_every=eval_every))
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
def test_a_job_spec_trains_checkpoints_and_samples_under(stack, tmp_path, name, parallel):
    train_and_sample(stack, tmp_path, name, parallel)


def test_a_pp2_job_trains_evaluates_checkpoints_and_samples(stack, tmp_path):
    records = train_and_sample(
        stack, tmp_path, "e2e-pp2", "{pp: 2, pipeline_schedule: 1f1b, microbatches: 2}", tie=False, eval_every=8
    )
    evals = [r for r in records if r.get("type") == "eval"]
    assert evals and all(r["loss"] > 0 for r in evals)
