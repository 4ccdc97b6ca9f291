"""An evaluation job's run (JobSpec.evaluation; services/jobspec/evaluation.py): no step. Once
started, with the evaluated version's weights loaded (``init_from.checkpoint``, the start's
own load), the loop has its command run (``evaluator``: the composition root's
services/rank/evaluation_command.py; the weights it exports are L3-1's copy, ExportModel: the
loop never holds L3-1's own tensors) and pushes the scores to L5-2 as
an ``EvaluationScores`` record of the evaluated job; then it finishes. A command that fails
or writes no score is the job's fault (``config_error``: the same on every relaunch, so
FAILED at once, with the one-line reason naming the command and its exit code). The loop is
marked as evaluating meanwhile, within ``liveness.phase_seconds.evaluation`` (which
`surgectl evaluate` sets past the command's timeout). A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

from services.common import phase as ph
from services.contract import engine_pb2
from services.engine.training_loop.faults import TrainingFault


class EvaluationJob:
    """The run of an evaluation job (a part of ``TrainingLoop``, see loop.py)."""

    _evaluated_path = ""  # the loaded version's directory (init_from's load)
    _evaluated_step = 0

    def _run_evaluation_job(self) -> None:
        ev = self._spec.evaluation
        if self._evaluator is None:
            raise TrainingFault("config_error", "evaluation: this rank was built without an evaluation runner")
        self._phase = "evaluating"
        self._mark.enter(ph.EVALUATION, total=1)
        result = self._evaluator(self._spec, self._job_id, self._evaluated_path, self._tokenizer, self._export_model)
        if result.error:
            raise TrainingFault("config_error", result.error)
        self._mark.advance()
        self._emit(engine_pb2.EvaluationScores(
            job_id=ev.source_job, rank=self._rank, eval_job_id=self._job_id, version=ev.version,
            step=self._evaluated_step, scores=result.scores, command=result.command, seconds=result.seconds,
        ))  # fmt: skip
        self._phase = "stepping"
        self._finish(stopped=False)

    def _export_model(self) -> tuple[dict | None, str]:
        """L3-1's copy of the model's weights ({name: tensor}) and "", or None and why not."""
        reply = self._p.shard_loader(engine_pb2.ExportModel())
        return (reply.payload, "") if not reply.message.error else (None, reply.message.error)
