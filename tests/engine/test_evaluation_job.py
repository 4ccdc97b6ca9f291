"""An evaluation job in the loop (JobSpec.evaluation, issue 31 item 4): the version loaded by
init_from, exported in Hugging Face form, the command run with SURGE_EVAL_* in its
environment, its scores (a JSON object, or lm-evaluation-harness's results) pushed to L5-2 for
the evaluated job, the loop finished without a step; a command that fails or writes no score
fails the job with one line naming it and its exit code."""

from __future__ import annotations

import json
import sys

import pytest
from rank_fakes import LocalRank, tiny_spec, torch_threads

from services.contract import engine_pb2
from services.jobspec import JobSpec
from services.rank.evaluation_command import read_scores

pytestmark = pytest.mark.timeout(180)

# Reads the export with safetensors (what transformers reads) and writes two scores.
SCORER = """
import json, os, pathlib
from safetensors.torch import load_file
hf = pathlib.Path(os.environ["SURGE_EVAL_HF_DIR"])
config = json.loads((hf / "config.json").read_text())
weights = load_file(hf / "model.safetensors")
ckpt = pathlib.Path(os.environ["SURGE_EVAL_CHECKPOINT"])
pathlib.Path(os.environ["SURGE_EVAL_OUTPUT"]).write_text(json.dumps(
    {"tensors": len(weights), "layers": config["num_hidden_layers"], "checkpoint_found": int(ckpt.is_dir()), "name": "x"}
))
"""


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def trained_version(tmp_path) -> str:
    rank = LocalRank(tiny_spec(steps=2, checkpoint={"every_steps": 2, "at_end": True}), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.run()
    assert rank.error is None, rank.error
    return "job:2"


def evaluation(tmp_path, version: str, command: list[str]) -> LocalRank:
    raw = tiny_spec(steps=2).model_dump(mode="json", exclude_none=True)
    raw.update(
        name="eval-tiny",
        init_from={"checkpoint": version},
        evaluation={"source_job": "job", "version": version, "command": command, "timeout_seconds": 60},
    )
    rank = LocalRank(JobSpec.model_validate(raw), tmp_path, job_id="eval-1")
    rank.command(engine_pb2.StartTraining(job_id="eval-1"))
    rank.run()
    return rank


def test_the_command_scores_the_loaded_version_and_the_scores_go_to_the_evaluated_jobs_records(tmp_path, surge_home):
    version = trained_version(tmp_path)
    rank = evaluation(tmp_path, version, [sys.executable, "-c", SCORER])
    assert rank.error is None, rank.error
    (scores,) = [m for m in rank.store.metrics if isinstance(m, engine_pb2.EvaluationScores)]
    assert (scores.job_id, scores.eval_job_id, scores.version, scores.step) == ("job", "eval-1", "job:2", 2)
    got = dict(scores.scores)
    assert got.pop("tensors") >= 2 * 9 and got == {"layers": 2, "checkpoint_found": 1}  # ("name": no number)
    assert scores.seconds > 0 and "-c" in scores.command
    assert not [m for m in rank.store.metrics if isinstance(m, engine_pb2.StepCompleted)]  # trains nothing
    (done,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert not done.stopped
    assert not (surge_home / "run" / "evaluations" / "eval-1" / "hf").exists()  # the export is removed after


@pytest.mark.parametrize(
    ("script", "words"),
    [
        ("import sys; sys.exit(3)", ("exited with code 3", "sys.exit(3)")),
        ("pass", ("exited with code 0 but wrote no scores",)),
        (
            "import os, pathlib; pathlib.Path(os.environ['SURGE_EVAL_OUTPUT']).write_text('{\"a\": \"b\"}')",
            ("hold no number",),
        ),
    ],
)
def test_a_failing_command_or_one_without_scores_fails_the_job_in_one_line(tmp_path, surge_home, script, words):
    version = trained_version(tmp_path)
    rank = evaluation(tmp_path, version, [sys.executable, "-c", script])
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "config_error" and "\n" not in failed.detail
    assert all(w in failed.detail for w in words), failed.detail
    assert not [m for m in rank.store.metrics if isinstance(m, engine_pb2.EvaluationScores)]


def test_the_commands_arguments_name_the_paths_as_variables(tmp_path, surge_home):
    version = trained_version(tmp_path)
    script = "import json, sys; open(sys.argv[2], 'w').write(json.dumps({'args_ok': int(sys.argv[1].endswith('/hf'))}))"
    rank = evaluation(tmp_path, version, [sys.executable, "-c", script, "$SURGE_EVAL_HF_DIR", "${SURGE_EVAL_OUTPUT}"])
    assert rank.error is None, rank.error
    (scores,) = [m for m in rank.store.metrics if isinstance(m, engine_pb2.EvaluationScores)]
    assert dict(scores.scores) == {"args_ok": 1}


def test_the_command_does_not_inherit_the_rank_s_launch_variables(tmp_path, surge_home, monkeypatch):
    # A rank's node sets LOCAL_RANK (its device binding): passed on, lm-eval's `hf` model
    # (accelerate) took itself for a launched rank and failed (session 33's real run).
    version = trained_version(tmp_path)
    for var, value in (("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"), ("MASTER_PORT", "29500"), ("RANK", "0")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # (the device binding stays)
    script = (
        "import json, os; open(os.environ['SURGE_EVAL_OUTPUT'], 'w').write(json.dumps({"
        "'launch_vars': sum(v in os.environ for v in ('LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_PORT', 'RANK')), "
        "'device_kept': int(os.environ.get('CUDA_VISIBLE_DEVICES') == '3')}))"
    )
    rank = evaluation(tmp_path, version, [sys.executable, "-c", script])
    assert rank.error is None, rank.error
    (scores,) = [m for m in rank.store.metrics if isinstance(m, engine_pb2.EvaluationScores)]
    assert dict(scores.scores) == {"launch_vars": 0, "device_kept": 1}


def test_the_evaluation_s_export_names_the_tokenizer_s_end_of_text_as_surgectl_export_does(tmp_path):
    # Its export wrote no BOS/EOS before: lm-eval's hf model (its prefix token the BOS, else
    # the EOS) failed decoding None (session 33's real run). One writer now: hf_format's.
    from tokenizers import Tokenizer, models, pre_tokenizers

    from services.rank.evaluation_command import EvaluationCommand

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])  # id 3, as `dataset prepare --tokenizer bpe:N` adds one
    tok.save(str(tmp_path / "tokenizer.json"))
    from services.compute.model import build_model

    spec = tiny_spec(steps=2)
    state = build_model(spec.model, seed=0).state_dict()
    out = tmp_path / "hf"
    out.mkdir()
    assert EvaluationCommand._export(out, spec, str(tmp_path / "tokenizer.json"), lambda: (state, "")) == ""
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|endoftext|>", "<|endoftext|>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 3
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_lm_evaluation_harness_results_are_read_from_its_output_directory(tmp_path):
    out = tmp_path / "out"
    (out / "model__x").mkdir(parents=True)
    results = {
        "results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.01}},
        "config": {"model": "hf"},
    }
    (out / "model__x" / "results_2026-12-05T05-00-00.json").write_text(json.dumps(results))
    assert read_scores(out) == {"hellaswag/acc,none": 0.25, "hellaswag/acc_stderr,none": 0.01}
    flat = tmp_path / "scores.json"
    flat.write_text(json.dumps({"ppl": 12.5, "ok": True, "nan": float("nan")}))
    assert read_scores(flat) == {"ppl": 12.5}
    with pytest.raises(ValueError, match="wrote no results"):
        read_scores(_empty(tmp_path))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_an_evaluation_spec_needs_its_version_loaded_and_one_rank():
    raw = tiny_spec(steps=2).model_dump(mode="json", exclude_none=True)
    ev = {"source_job": "job", "version": "job:2", "command": ["true"]}
    with pytest.raises(ValueError, match="must also be init_from.checkpoint"):
        JobSpec.model_validate({**raw, "evaluation": ev})
    with pytest.raises(ValueError, match="runs one rank"):
        JobSpec.model_validate({**raw, "evaluation": ev, "init_from": {"checkpoint": "job:2"}, "parallel": {"dp": 2}})
