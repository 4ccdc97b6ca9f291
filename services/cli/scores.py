"""A job's evaluation scores (an evaluation job's ``EvaluationScores``, recorded by the store
as ``type: scores`` lines in the evaluated job's metrics file): one reader for `surgectl
status JOB`, `surgectl evaluate --wait`, `compare` and the dashboard's job page."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.rotated_files import read_rotated


@dataclass(frozen=True)
class ScoresLine:
    eval_job_id: str
    version: str
    step: int
    command: str
    seconds: float
    scores: dict[str, float] = field(default_factory=dict)


def scores_records(text: str) -> list[ScoresLine]:
    """Every scores line of a metrics file's text, in order (a line that is not JSON passed over)."""
    found = []
    for line in text.splitlines():
        if '"scores"' not in line:
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict) or r.get("type") != "scores":
            continue
        raw = r.get("scores") if isinstance(r.get("scores"), dict) else {}
        found.append(
            ScoresLine(
                eval_job_id=str(r.get("eval_job_id", "")),
                version=str(r.get("version", "")),
                step=int(r.get("step", 0)),
                command=str(r.get("command", "")),
                seconds=float(r["seconds"]) if isinstance(r.get("seconds"), (int, float)) else 0.0,
                scores={str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))},
            )
        )
    return found


def read_scores(path: Path) -> list[ScoresLine] | None:
    """The scores in a job's metrics file; None when the file is not on this machine."""
    if not path.is_file():
        return None
    return scores_records(read_rotated(path))


def latest_scores(lines: list[ScoresLine]) -> dict[str, tuple[float, str]]:
    """Each score's latest value and the version it was measured on, by name. A name that
    two commands report (two hooks, a hook and an `evaluate`) is two scores, ``name
    [command]`` each: the later one never hides the other."""
    commands: dict[str, set[str]] = {}
    for line in lines:
        for name in line.scores:
            commands.setdefault(name, set()).add(line.command)
    out: dict[str, tuple[float, str]] = {}
    for line in lines:
        for name, value in line.scores.items():
            key = name if len(commands[name]) == 1 else f"{name} [{_short(line.command)}]"
            out[key] = (value, line.version)
    return out


def _short(command: str, width: int = 40) -> str:
    return command if len(command) <= width else command[: width - 1] + "…"
