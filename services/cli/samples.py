"""A job's periodic samples (``eval.sample_every_steps``): the ``type: sample`` lines of the
store's metrics file (services/store/metrics_logger.py), for ``surgectl samples`` and the
dashboard's job page. One reader for both (as ``observe.step_records`` is for the curves)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.rotated_files import read_rotated


@dataclass(frozen=True)
class SampleLine:
    step: int
    prompt_index: int
    prompt: str
    text: str
    tokens: int
    seconds: float
    note: str  # "": generated; else why not

    @property
    def shown(self) -> str:
        """The continuation, or the note in brackets when there is none."""
        return self.text if not self.note else f"[{self.note}]"


def sample_records(text: str) -> list[SampleLine]:
    """Every sample line of a metrics file's text (its rotated files first), in order. A line
    that is not JSON (a write cut short by a crash) is passed over: the curves' reader names
    it; this reader is for display."""
    found = []
    for line in text.splitlines():
        if '"sample"' not in line:  # (cheap: most lines are steps)
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict) or r.get("type") != "sample":
            continue
        found.append(
            SampleLine(
                step=int(r.get("step", 0)),
                prompt_index=int(r.get("prompt_index", 0)),
                prompt=str(r.get("prompt", "")),
                text=str(r.get("text", "")),
                tokens=int(r.get("tokens", 0)),
                seconds=float(r.get("seconds", 0.0)) if isinstance(r.get("seconds"), (int, float)) else 0.0,
                note=str(r.get("note", "")),
            )
        )
    return found


def read_samples(path: Path) -> list[SampleLine] | None:
    """The samples of a job's metrics file; None when the file is not on this machine."""
    if not path.is_file():
        return None
    return sample_records(read_rotated(path))


def latest_per_prompt(samples: list[SampleLine]) -> list[SampleLine]:
    """Each prompt's latest sample (a step replayed after a rollback: its last record)."""
    latest: dict[int, SampleLine] = {}
    for s in samples:
        if s.prompt_index not in latest or s.step >= latest[s.prompt_index].step:
            latest[s.prompt_index] = s
    return [latest[i] for i in sorted(latest)]
