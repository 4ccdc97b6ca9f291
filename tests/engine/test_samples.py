"""Periodic samples (issue 31 item 4, eval.sample_every_steps): rank 0 continues the spec's
prompts at those boundaries with the KV-cache decoding `surgectl generate` uses, and reports
each as a SampleGenerated record for L5-2; generating changes nothing the job trains; a model
it cannot generate from (sharded, or not Surge's) gets a one-line note, never an error."""

from __future__ import annotations

import pytest
import torch
from rank_fakes import LocalRank, tiny_spec, torch_threads

from services.compute.decode import generate
from services.compute.model import build_model
from services.compute.samples import SHARDED_NOTE, SampleGenerator
from services.contract import engine_pb2

pytestmark = pytest.mark.timeout(180)

SAMPLES = {"sample_every_steps": 3, "sample_prompts": ["The ", "ab"], "sample_tokens": 8}


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def trained(tmp_path, **eval_section) -> LocalRank:
    rank = LocalRank(tiny_spec(steps=7, eval=eval_section), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.run()
    assert rank.error is None, rank.error
    return rank


def samples_of(rank: LocalRank) -> list[engine_pb2.SampleGenerated]:
    return [m for m in rank.store.metrics if isinstance(m, engine_pb2.SampleGenerated)]


def losses(rank: LocalRank) -> list[float]:
    return [m.loss for m in rank.store.metrics if isinstance(m, engine_pb2.StepCompleted)]


def test_samples_come_every_n_steps_per_prompt_and_leave_the_training_as_it_was(tmp_path):
    rank = trained(tmp_path / "a", **SAMPLES)
    got = samples_of(rank)
    assert [(s.step, s.prompt_index, s.prompt) for s in got] == [
        (3, 0, "The "),
        (3, 1, "ab"),
        (6, 0, "The "),
        (6, 1, "ab"),
    ]
    for s in got:
        assert s.note == "" and s.tokens == 8 and s.seconds > 0 and s.temperature == 0
        assert s.job_id == "job" and s.rank == 0
        assert len(s.text.encode("utf-8", errors="surrogatepass")) >= 1
    # Greedy and from the same weights: the same text again in a run of the same spec.
    again = samples_of(trained(tmp_path / "b", **SAMPLES))
    assert [s.text for s in again] == [s.text for s in got]
    # Rank 0's generation draws on none of the training's streams: the losses are those of a
    # run without samples, bit for bit.
    plain = trained(tmp_path / "c")
    assert losses(rank) == losses(plain)
    assert not samples_of(plain)


def test_a_seeded_temperature_draws_the_same_samples_and_another_seed_others(tmp_path):
    hot = {**SAMPLES, "sample_temperature": 1.5, "sample_tokens": 24, "sample_every_steps": 7}
    one = [s.text for s in samples_of(trained(tmp_path / "a", **hot))]
    two = [s.text for s in samples_of(trained(tmp_path / "b", **hot))]
    other = [s.text for s in samples_of(trained(tmp_path / "c", **hot, sample_seed=99))]
    assert one == two and len(one) == 2
    assert other != one


def test_the_generator_is_the_kv_cache_decoding_of_surgectl_generate():
    spec = tiny_spec()
    model = build_model(spec.model, seed=0)
    gen = SampleGenerator("cpu")
    gen.attach(model)
    (got,) = gen(["hello"], 12, temperature=0.0, seed=0, tokenizer="bytes", context_len=spec.data.seq_len)
    ids = torch.tensor(list(b"hello"))
    want = generate(model, ids, 12, 0.0, 0, context_len=spec.data.seq_len)[5:].tolist()
    assert got.note == "" and got.tokens == 12
    assert got.text == bytes(want).decode("utf-8", errors="replace")


def test_a_model_it_cannot_generate_from_gets_a_one_line_note_not_an_error():
    gen = SampleGenerator("cpu")
    (none,) = gen(["x"], 4, temperature=0.0, seed=0, tokenizer="bytes", context_len=64)
    assert none.text == "" and none.note == "not generated: no model loaded yet"
    gen.attach(torch.nn.Linear(2, 2))  # (what a pipeline stage is to it: not the whole model)
    (stage,) = gen(["x"], 4, temperature=0.0, seed=0, tokenizer="bytes", context_len=64)
    assert stage.note == SHARDED_NOTE and "\n" not in stage.note
    gen.attach(build_model(tiny_spec(model={"vocab_size": 300}).model, seed=0))
    (wrong,) = gen(["x"], 4, temperature=0.0, seed=0, tokenizer="bytes", context_len=64)
    assert wrong.note.startswith("not generated: tokenizer bytes:") and "vocab_size 256" in wrong.note
