"""`surgectl status` / `compare` read a job's latest scores: two commands reporting one score
name are two scores, never one hiding the other."""

from __future__ import annotations

import json

from services.cli.scores import latest_scores, scores_records


def _line(command: str, version: str, **scores: float) -> str:
    return json.dumps({"type": "scores", "command": command, "version": version, "step": 1, "scores": scores})


def test_one_name_from_two_commands_is_two_scores_and_a_name_of_one_command_keeps_its_name():
    long = "python eval.py --tasks " + "x" * 60
    text = "\n".join(
        [
            _line("hellaswag.sh", "v1", accuracy=0.41, loss=2.0),
            _line(long, "v1", accuracy=0.77),
            _line("hellaswag.sh", "v2", accuracy=0.43, loss=1.9),
            "not json",
        ]
    )
    latest = latest_scores(scores_records(text))
    assert latest["accuracy [hellaswag.sh]"] == (0.43, "v2")
    short = [k for k in latest if k.startswith("accuracy [python eval.py")]
    assert len(short) == 1 and latest[short[0]] == (0.77, "v1") and len(short[0]) <= len("accuracy []") + 40
    assert latest["loss"] == (1.9, "v2") and "accuracy" not in latest
    assert latest_scores(scores_records(_line("a.sh", "v3", f1=0.5))) == {"f1": (0.5, "v3")}
