"""bench/lm_eval_hook.py's local lm-eval tasks: made from the corpus alone (no download), each
multiple-choice item's gold choice the true rest of its corpus line, the task files naming the
local JSONL through `dataset_path: json`. (The run itself, lm-eval through `surgectl evaluate`,
is the bench's: `make bench-lm-eval`.)"""

from __future__ import annotations

import json

import yaml

from bench.lm_eval_hook import corpus_lines, write_tasks


def test_the_local_tasks_are_the_corpus_own_lines_and_read_their_jsonl_by_path(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    body = "\n".join(f"value_{i} = compute_something(alpha, beta, gamma + {i})  # n" for i in range(20))
    (src / "a.py").write_text("x = 1\n" + body + "\n" + "y" * 2000 + "\n")
    lines = corpus_lines(src)
    assert len(lines) == 20 and "x = 1" not in lines  # (too short a line makes no fair item)

    tasks = write_tasks(tmp_path, src, items=8)
    items = [json.loads(x) for x in (tasks / "mc.jsonl").read_text().splitlines()]
    assert len(items) == 8
    for item in items:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert item["context"] + item["choices"][item["gold"]] in lines  # gold: the line's own rest
    assert {item["gold"] for item in items} != {items[0]["gold"]}  # the gold's place varies

    for name, data in (("surge_code_mc", "mc.jsonl"), ("surge_code_ppl", "ppl.jsonl")):
        task = yaml.safe_load((tasks / f"{name}.yaml").read_text())
        assert task["task"] == name and task["dataset_path"] == "json"
        assert task["dataset_kwargs"]["data_files"]["test"] == str(tasks / data)
    ppl = [json.loads(x)["text"] for x in (tasks / "ppl.jsonl").read_text().splitlines()]
    assert ppl and all(len(t) == 1000 for t in ppl)


def test_the_recorded_scores_are_the_lines_status_shows_under_its_evaluation_scores():
    from bench.lm_eval_hook import status_scores

    status = "jobs\n| j | FINISHED |\nevaluation scores (its evaluation jobs):\n  t/acc,none: 0.31  (j:1)\n\n  t/x: 2  (j:1)\n"
    assert status_scores(status) == ["t/acc,none: 0.31  (j:1)", "t/x: 2  (j:1)"]
    assert status_scores("jobs\n| j |\n") == []  # (no scores: nothing)
