"""An evaluation job (``evaluation:``; `surgectl evaluate`, issue 31 item 4): a one-rank job
that trains nothing. It starts from a committed version of another job (``init_from.checkpoint``,
the same ``version``), writes the model in Hugging Face form when ``hf`` (the form
lm-evaluation-harness and ``transformers`` read), runs ``command`` with the checkpoint's and
the export's directories and an output path in its environment (SURGE_EVAL_CHECKPOINT,
SURGE_EVAL_HF_DIR, SURGE_EVAL_OUTPUT), reads the scores it wrote there (a JSON object of
name -> number, or lm-evaluation-harness's results JSON) and records them beside
``source_job``'s metrics in the store. It waits in control's queue for its slot like any job.
A command that fails, outlasts ``timeout_seconds`` or writes no score fails this job (one
line naming the command and its exit code); the source job is not touched."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from services.jobspec.base import _Strict

EVAL_COMMAND_ARGS_MAX = 64
EVAL_COMMAND_ARG_CHARS_MAX = 4096
EVAL_TIMEOUT_SECONDS_MAX = 7 * 24 * 3600.0  # a week: longer is a typo


class EvaluationJobSpec(_Strict):
    source_job: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    version: Annotated[str, Field(min_length=1, max_length=160)]  # also init_from.checkpoint
    command: list[Annotated[str, StringConstraints(min_length=1, max_length=EVAL_COMMAND_ARG_CHARS_MAX)]] = Field(
        ..., min_length=1, max_length=EVAL_COMMAND_ARGS_MAX
    )
    hf: bool = True  # write the Hugging Face export (SURGE_EVAL_HF_DIR); false: the checkpoint only
    timeout_seconds: float = Field(3600.0, gt=0, le=EVAL_TIMEOUT_SECONDS_MAX)


EVAL_HOOKS_MAX = 4  # a job's evaluation hooks: more is a typo, not a plan


class EvalHook(_Strict):
    """An evaluation job control submits by itself (``eval.hooks``): of every
    ``every_versions``-th committed version of the job (its number ``<job>:N`` divisible by
    it; 0: none), and/or of its newest version when it FINISHES (``on_finish``). The job is
    what `surgectl evaluate JOB --command ...` submits: one rank through the queue, its
    scores beside this job's metrics."""

    command: list[Annotated[str, StringConstraints(min_length=1, max_length=EVAL_COMMAND_ARG_CHARS_MAX)]] = Field(
        ..., min_length=1, max_length=EVAL_COMMAND_ARGS_MAX
    )
    every_versions: int = Field(0, ge=0, le=1_000_000)
    on_finish: bool = False
    hf: bool = True
    timeout_seconds: float = Field(3600.0, gt=0, le=EVAL_TIMEOUT_SECONDS_MAX)

    @model_validator(mode="after")
    def _fires(self) -> EvalHook:
        if not self.every_versions and not self.on_finish:
            raise ValueError("an evaluation hook needs every_versions > 0 or on_finish: true (else it never runs)")
        return self


# The evaluation phase's progress budget beyond the command's timeout (the export, the load).
PHASE_MARGIN_S = 300.0


def evaluation_job(
    source: object, job_id: str, version: str, command: list[str], hf: bool, timeout_seconds: float
) -> dict:
    """The job spec (a mapping, as a YAML file holds it) of an evaluation of ``version`` of
    job ``job_id`` whose effective spec is ``source`` (a JobSpec): its model and data, one
    rank, nothing saved or evaluated of its own, ``init_from`` the version's weights. What
    `surgectl evaluate` and control's evaluation hooks submit."""
    raw = source.model_dump(mode="json", exclude_none=True)  # type: ignore[attr-defined]
    for dropped in ("simulate", "notify", "init_from"):
        raw.pop(dropped, None)
    par = raw.get("parallel", {})
    raw.update(
        name=f"eval-{raw['name']}"[:40].rstrip("-"),
        parallel={k: par[k] for k in ("threads_per_rank", "peak_tflops_per_device") if k in par},
        init_from={"checkpoint": version, "load": "weights"},
        checkpoint={"every_steps": 0, "at_end": False},
        eval={
            "every_steps": 0,
            "at_end": False,
            "sample_every_steps": 0,
        },  # (no hooks: an evaluation evaluates nothing)
        evaluation={
            "source_job": job_id,
            "version": version,
            "command": list(command),
            "hf": hf,
            "timeout_seconds": timeout_seconds,
        },
    )
    raw.setdefault("liveness", {}).setdefault("phase_seconds", {})["evaluation"] = timeout_seconds + PHASE_MARGIN_S
    return raw
