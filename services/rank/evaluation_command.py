"""An evaluation job's command (JobSpec.evaluation, services/jobspec/evaluation.py), run by its
one rank's loop once the version's weights are loaded: the Hugging Face export written by L3-1
from the model it holds (ExportModel; services/compute/hf_format.py, the writer `surgectl
export --format hf` uses), the command run with its paths in the environment, the scores read
back.

The command runs without a shell; ``$SURGE_EVAL_*`` in its arguments are replaced by these
values. The environment the command gets (besides the rank's own, less its launcher's
torch.distributed variables: ``LAUNCH_VARS``):

* ``SURGE_EVAL_CHECKPOINT``: the version's directory in the store (Surge's DCP files);
* ``SURGE_EVAL_HF_DIR``: the export (``config.json``, ``model.safetensors``, the dataset's
  ``tokenizer.json`` when it has one), or "" when ``evaluation.hf`` is false;
* ``SURGE_EVAL_OUTPUT``: where it writes its scores: a JSON object of name -> number, or
  lm-evaluation-harness's results (``--output_path $SURGE_EVAL_OUTPUT``: a file, or a
  directory it writes ``results_*.json`` under; ``results.<task>.<metric>`` become
  ``<task>/<metric>``).

Everything goes under ``<work>/<eval job>/`` (``$SURGE_HOME/run/evaluations`` by default);
the export is removed after the command, its output and log kept. A failure is a one-line
reason naming the command and its exit code (the loop reports it as the job's fault)."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from services.jobspec import JobSpec

# The launcher's torch.distributed variables of the rank (LOCAL_RANK, LOCAL_WORLD_SIZE from the
# node's device binding; the others as torchrun would set them) are not passed on: the command
# is a program of its own, not a member of the rank's group. With LOCAL_RANK set,
# lm-evaluation-harness's `hf` model (through accelerate) took itself for one rank of a
# launch and failed in init_process_group ("environment variable RANK expected", session 33's
# real run). The device binding (CUDA_VISIBLE_DEVICES, thread counts) is kept.
LAUNCH_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
SCORES_MAX = 256  # names recorded per evaluation (a larger results file: the first, sorted)
SCORE_NAME_CHARS_MAX = 200
_log = structlog.get_logger("evaluation")


@dataclass(frozen=True)
class EvaluationResult:
    scores: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    command: str = ""
    error: str = ""  # "": scores were read; else the one-line reason the job fails with


class EvaluationCommand:
    """Runs an evaluation job's command; the export is written by whoever holds the model
    (``export``: the loop's ExportModel to L3-1, which owns the weights)."""

    def __init__(self, work_root: Path) -> None:
        self._root = work_root

    def __call__(
        self,
        spec: JobSpec,
        job_id: str,
        checkpoint_path: str,
        tokenizer: str,
        export: Callable[[], tuple[dict | None, str]],
    ) -> EvaluationResult:
        """``export()``: a copy of the model's weights (L3-1's ExportModel) and "", or None
        and why not; ``tokenizer``: the dataset's ("bytes" or a tokenizers JSON's path)."""
        ev = spec.evaluation
        assert ev is not None
        shown = shlex.join(ev.command)[:500]
        work = self._root / job_id
        out = work / "output"
        hf_dir = work / "hf"
        try:
            shutil.rmtree(work, ignore_errors=True)  # (a relaunch starts over)
            out.parent.mkdir(parents=True, exist_ok=True)
            if ev.hf:
                hf_dir.mkdir()
        except OSError as e:
            return EvaluationResult(command=shown, error=f"evaluation: {work}: {e.strerror or e}")
        if ev.hf and (why := self._export(hf_dir, spec, tokenizer, export)):
            shutil.rmtree(hf_dir, ignore_errors=True)
            return EvaluationResult(command=shown, error=f"evaluation: the export for `{shown}` failed: {why}")
        env = {
            **{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS},
            "SURGE_EVAL_CHECKPOINT": checkpoint_path,
            "SURGE_EVAL_HF_DIR": str(hf_dir) if ev.hf else "",
            "SURGE_EVAL_OUTPUT": str(out),
            "SURGE_EVAL_SOURCE_JOB": ev.source_job,
            "SURGE_EVAL_VERSION": ev.version,
        }
        argv = [_expand(arg, env) for arg in ev.command]
        t0 = time.perf_counter()
        try:
            with open(work / "command.log", "wb") as log:
                done = subprocess.run(
                    argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=ev.timeout_seconds
                )
        except subprocess.TimeoutExpired:
            return EvaluationResult(
                command=shown, error=f"evaluation command `{shown}` ran past {ev.timeout_seconds:g} s (killed)"
            )
        except OSError as e:  # not found, not executable
            return EvaluationResult(
                command=shown, error=f"evaluation command `{shown}` did not start: {e.strerror or e}"
            )
        finally:
            shutil.rmtree(hf_dir, ignore_errors=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            return EvaluationResult(
                command=shown,
                seconds=seconds,
                error=f"evaluation command `{shown}` exited with code {done.returncode} (log: {work / 'command.log'})",
            )
        try:
            scores = read_scores(out)
        except ValueError as e:
            return EvaluationResult(
                command=shown, seconds=seconds, error=f"evaluation command `{shown}` exited with code 0 but {e}"
            )
        _log.info("evaluation_scored", command=shown, scores=len(scores), seconds=round(seconds, 3))
        return EvaluationResult(scores=scores, seconds=seconds, command=shown)

    @staticmethod
    def _export(directory: Path, spec: JobSpec, tokenizer: str, export: Callable[[], tuple[dict | None, str]]) -> str:
        """The Hugging Face export into ``directory``; "" when written, else why not."""
        from services.compute import hf_format

        state, why = export()
        if state is None:
            return why
        try:
            end = None  # (`surgectl export`'s writer: BOS/EOS named, the model's eos_token_id set)
            if tokenizer and tokenizer != "bytes" and Path(tokenizer).is_file():
                end = hf_format.save_tokenizer(directory, tokenizer, spec.data.seq_len)
            hf_format.save_hf(directory, state, spec, eos_token_id=end)
        except (OSError, ValueError) as e:  # ValueError: a model with no Hugging Face form (HfFormatError)
            return f"{type(e).__name__}: {e}"[:500]
        return ""


def _expand(arg: str, env: dict[str, str]) -> str:
    """``$SURGE_EVAL_*`` / ``${SURGE_EVAL_*}`` in an argument replaced by this run's values
    (the command runs without a shell; other ``$`` text is left as written)."""
    for name in sorted((k for k in env if k.startswith("SURGE_EVAL_")), key=len, reverse=True):
        arg = arg.replace("${" + name + "}", env[name]).replace("$" + name, env[name])
    return arg


def read_scores(out: Path) -> dict[str, float]:
    """The scores at ``out``: a JSON file, or the newest ``results*.json`` under a directory
    (lm-evaluation-harness's ``--output_path``). Raises ValueError (one line): none written,
    not JSON, or no number in it."""
    path = out
    if out.is_dir():
        found = sorted(out.rglob("results*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ValueError(f"wrote no results*.json under {out}")
        path = found[-1]
    elif not out.is_file():
        raise ValueError(f"wrote no scores to {out} (SURGE_EVAL_OUTPUT)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"its scores {path} are not JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("results"), dict):  # lm-evaluation-harness
        flat = {
            f"{task}/{metric}": value
            for task, metrics in data["results"].items()
            if isinstance(metrics, dict)
            for metric, value in metrics.items()
        }
    elif isinstance(data, dict):
        flat = data
    else:
        raise ValueError(f"its scores {path} are not a JSON object of name -> number")
    scores = {
        str(k)[:SCORE_NAME_CHARS_MAX]: float(v)
        for k, v in sorted(flat.items())
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    if not scores:
        raise ValueError(f"its scores {path} hold no number")
    return dict(list(scores.items())[:SCORES_MAX])
