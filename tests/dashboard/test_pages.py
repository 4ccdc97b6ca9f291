"""The dashboard's pages drawn from canned protobuf messages (no stack): what each page shows,
that the operator's and the ranks' text is escaped, the event filter, the curves' sources."""

from __future__ import annotations

import json
import math
import re

from services.cli.observe import parse
from services.cli.worker_slots import slots_of
from services.contract import Module, control_pb2, store_pb2
from services.dashboard import pages, series

JobState = control_pb2.JobState


def status(job_id: str = "demo-1", **kw) -> control_pb2.JobStatus:
    base = dict(job_id=job_id, name=job_id.split("-")[0], state=JobState.RUNNING, step=3, total_steps=10)
    base.update(kw)
    return control_pb2.JobStatus(**base)


def event(seq: int, kind: str, message: str, **st) -> control_pb2.JobEvent:
    return control_pb2.JobEvent(
        job_id="demo-1",
        seq=seq,
        unix_time=1_800_000_000 + seq,
        source=Module.L1_ORCHESTRATOR,
        type=kind,
        message=message,
        status=status(**st),
    )


def steps_series(n: int) -> series.Series:
    s = series.Series(source=series.STORE_RECORDS)
    for i in range(1, n + 1):
        s.steps.append(i)
        s.loss.append(5.0 / i)
        s.learning_rate.append(1e-3)
        s.grad_norm.append(1.0 / i)
        s.tokens_per_second.append(1000.0 + i)
    s.eval_steps, s.eval_loss = [n], [4.0]
    return s


def points(page: str, chart: str) -> int:
    m = re.search(rf'<figure id="chart-{chart}" data-points="(\d+)">', page)
    assert m, f"no chart {chart}"
    return int(m.group(1))


def test_the_jobs_page_lists_every_job_newest_first_and_escapes_what_the_operator_wrote():
    jobs = [
        status("old-1", created_unix=1, tags={"who": "<b>x</b>"}),
        status("new-2", created_unix=2, message="<script>alert(1)</script>"),
    ]
    page = pages.jobs_page(jobs, now=0)
    assert page.index('data-job="new-2"') < page.index('data-job="old-1"')
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "who=&lt;b&gt;x&lt;/b&gt;" in page
    assert '<a href="/job/new-2">' in page and 'action="/compare"' in page


def test_the_job_page_shows_every_curve_from_the_store_records_with_the_number_of_steps():
    page = pages.job_page(status(), [event(1, "state", "RUNNING")], frozenset(), steps_series(7), [], [])
    for chart in ("loss", "lr", "grad-norm", "tokens-per-second"):
        assert points(page, chart) == 7
    assert "data:image/svg+xml;base64," in page
    assert '<meta http-equiv="refresh"' in page  # a RUNNING job's page reloads itself


def test_a_terminated_jobs_page_does_not_reload_itself():
    done = status(state=JobState.TERMINATED, outcome=control_pb2.FINISHED)
    page = pages.job_page(done, [], frozenset(), None, [], [])
    assert 'http-equiv="refresh"' not in page and "No step recorded yet." in page


def test_the_event_filter_keeps_only_the_types_asked_for_and_ticks_them():
    events = [event(1, "state", "RUNNING"), event(2, "fault", "rank 1 silent"), event(3, "decision", "relaunch")]
    page = pages.job_page(status(), events, frozenset({"fault"}), None, [], [])
    assert 'class="event ev-fault"' in page and "rank 1 silent" in page
    assert "relaunch" not in page and 'class="event ev-state"' not in page
    assert 'value="fault" checked' in page and 'value="state">' in page
    every = pages.job_page(status(), events, frozenset(), None, [], [])
    assert every.count('class="event ') == 3


def test_curves_from_controls_sampled_events_say_there_is_no_learning_rate_or_gradient_norm():
    events = [event(1, "step", "", step=1, train_loss=3.0), event(2, "step", "", step=2, train_loss=2.5)]
    events.append(event(3, "eval", "", step=2, eval_loss=2.9))
    s = series.from_events(events)
    assert (s.steps, s.loss, s.eval_steps, s.eval_loss) == ([1, 2], [3.0, 2.5], [2], [2.9])
    page = pages.job_page(status(), events, frozenset(), s, [], [])
    assert points(page, "loss") == 2 and points(page, "tokens-per-second") == 2
    assert 'id="no-lr"' in page and 'id="no-grad-norm"' in page and "sampled" in page


def test_the_store_records_give_the_lowest_rank_and_a_replayed_step_keeps_its_last_record(tmp_path):
    f = tmp_path / "j.jsonl"
    rec = [
        {"type": "step", "rank": 1, "step": 1, "loss": 9.0, "learning_rate": 1, "grad_norm": 1, "tokens_per_second": 1},
        {"type": "step", "rank": 0, "step": 1, "loss": 4.0, "learning_rate": 0.1, "grad_norm": 2.0},
        {"type": "step", "rank": 0, "step": 2, "loss": "NaN", "learning_rate": 0.2, "grad_norm": 3.0},
        {"type": "step", "rank": 0, "step": 1, "loss": 3.5, "learning_rate": 0.1, "grad_norm": 2.0},
        {"type": "eval", "rank": 0, "step": 2, "loss": 3.1},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rec) + "\n{not json\n")
    s = series.from_records(f)
    assert s is not None and s.rank == 0 and s.steps == [1, 2]
    assert s.loss[0] == 3.5 and math.isnan(s.loss[1])
    assert s.learning_rate == [0.1, 0.2] and s.grad_norm == [2.0, 3.0] and math.isnan(s.tokens_per_second[0])
    assert (s.eval_steps, s.eval_loss) == ([2], [3.1])
    assert series.from_records(tmp_path / "absent.jsonl") is None


def test_checkpoints_and_log_lines_are_shown_and_an_unreachable_store_is_said():
    infos = [store_pb2.CheckpointInfo(version="demo-1:2", parent="demo-1:1", step=20, bytes=2_000_000)]
    logs = [parse(0, '{"timestamp": "2026-12-05T01:00:00.000Z", "level": "info", "event": "step <done>"}')]
    page = pages.job_page(status(), [], frozenset(), None, infos, logs)
    assert "class=checkpoint><td>demo-1:2</td><td>demo-1:1</td><td class=num>20</td>" in page
    assert "step &lt;done&gt;" in page
    away = pages.job_page(status(), [], frozenset(), None, None, None)
    assert "The store could not be reached" in away and "could not stream the rank logs" in away


def test_the_logs_page_follows_a_live_job_without_reloading_and_stops_when_it_ended():
    lines = [parse(0, f"plain line {i}") for i in range(pages.LOG_LINES + 5)] + [parse(1, "rank one")]
    page = pages.logs_page(status(), lines)
    assert 'http-equiv="refresh"' not in page and "scrollTo" in page  # (it reloaded every 2 s)
    assert f'data-live=1 data-seen="0:{pages.LOG_LINES + 5},1:1" data-src="/job/demo-1/logs/lines"' in page
    assert "fetch(pre.dataset.src" in page  # the follow: new lines appended
    assert "plain line 4<" not in page and f"plain line {pages.LOG_LINES + 4}" in page  # the newest LOG_LINES
    ended = pages.logs_page(status(state=JobState.TERMINATED), lines)
    assert 'http-equiv="refresh"' not in ended and "data-live=0" in ended and "fetch(" not in ended
    empty = pages.logs_page(status(), [])
    assert "No rank log lines yet." in empty and 'data-live=1 data-seen=""' in empty  # follows from nothing


METRICS = """\
# HELP surge_slots Rank slots of each registered worker, used or free.
# TYPE surge_slots gauge
surge_slots{kind="used",worker_id="worker-0"} 1.0
surge_slots{kind="free",worker_id="worker-0"} 0.0
surge_slots{kind="used",worker_id="worker-1"} 0.0
surge_slots{kind="free",worker_id="worker-1"} 1.0
# HELP surge_devices Devices each registered worker reported, by kind and model name.
# TYPE surge_devices gauge
surge_devices{kind="cuda",name="NVIDIA H200",worker_id="worker-0"} 8.0
surge_devices{kind="cpu",name="AMD EPYC <9654>",worker_id="worker-1"} 1.0
# HELP surge_jobs Jobs by state.
# TYPE surge_jobs gauge
surge_jobs{state="RUNNING"} 1.0
"""


def test_the_cluster_page_shows_each_workers_slots_from_controls_census_and_its_health():
    slots = slots_of(METRICS)
    assert slots == [
        pages.Slots("worker-0", 1, 0, (("cuda", "NVIDIA H200", 8),)),
        pages.Slots("worker-1", 0, 1, (("cpu", "AMD EPYC <9654>", 1),)),
    ]
    cordoned = [control_pb2.WorkerCordoned(worker_id="worker-1", reason="xid 79: GPU fell off the bus")]
    slow = status(slow_ranks=[control_pb2.SlowRank(rank=0, worker_id="worker-0", detail="2.1x compute")])
    page = pages.cluster_page(slots, [slow], cordoned, now=0)
    assert "2 workers registered; rank slots: 1 used, 1 free." in page
    assert "<td class=devices>8 x cuda NVIDIA H200</td>" in page
    assert "<td class=devices>1 x cpu AMD EPYC &lt;9654&gt;</td>" in page
    assert "cordoned: xid 79: GPU fell off the bus" in page and "slow: demo-1 rank 0: 2.1x compute" in page
    unknown = pages.cluster_page(None, [], [], now=0)
    assert "could not be read" in unknown
    gone = control_pb2.WorkerCordoned(worker_id="worker-2", reason="node agent lost: session closed", lost=True)
    page = pages.cluster_page(slots, [], [gone], now=0)
    assert 'data-worker="worker-2"' in page and "lost: node agent lost: session closed" in page


def test_the_queue_page_orders_the_queue_by_place_and_lists_the_placed_jobs():
    jobs = [
        status("b-2", state=JobState.STANDBY, queue_position=2, message="waits for 2 slots"),
        status("a-1", state=JobState.STANDBY, queue_position=1, priority=5, created_unix=100),
        status("r-3"),
    ]
    page = pages.queue_page(jobs, now=160)
    assert page.index(">a-1<") < page.index(">b-2<")
    assert "<td class=num>60 s</td>" in page and "waits for 2 slots" in page
    assert "placed (1)" in page and ">r-3<" in page


def test_compare_overlays_the_runs_and_lists_their_spec_differences_and_best_losses():
    spec_a = json.dumps({"name": "a", "optimizer": {"lr": 0.001}, "steps": 10})
    spec_b = json.dumps({"name": "b", "optimizer": {"lr": 0.003}, "steps": 10})
    runs = [
        pages.Run(status("a-1", spec_json=spec_a), steps_series(5)),
        pages.Run(status("b-2", spec_json=spec_b), steps_series(8)),
    ]
    page = pages.compare_page(runs, [])
    assert "<tr><td>optimizer.lr</td><td>0.001</td><td>0.003</td></tr>" in page
    assert "<td>steps</td>" not in page and "<td>name</td>" not in page  # the same, and always different
    assert points(page, "loss") == 8 and points(page, "lr") == 8
    assert "<td class=num>1.0000 (5)</td>" in page  # a's best train loss 5/5 at its last step
    pick = pages.compare_page(runs[:1], [status("a-1"), status("b-2")])
    assert "id=pick" in pick and 'value="b-2"' in pick


def test_the_job_page_shows_each_prompts_latest_sample_escaped_and_a_note_as_such(tmp_path):
    from services.cli.samples import read_samples

    f = tmp_path / "demo-1.jsonl"
    rec = [
        {"type": "step", "rank": 0, "step": 3, "loss": 4.0},
        {"type": "sample", "rank": 0, "step": 3, "prompt_index": 0, "prompt": "<a>", "text": "old", "tokens": 3},
        {
            "type": "sample",
            "rank": 0,
            "step": 3,
            "prompt_index": 1,
            "prompt": "b",
            "text": "",
            "note": "not generated: x",
        },
        {"type": "sample", "rank": 0, "step": 6, "prompt_index": 0, "prompt": "<a>", "text": "new <b>", "tokens": 7},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rec) + "\n")
    page = pages.job_page(status(), [], frozenset(), None, [], [], samples=read_samples(f))
    assert page.count("<tr class=sample") == 2
    assert "new &lt;b&gt;" in page and ">old<" not in page and "&lt;a&gt;" in page
    assert "<pre class=bad>[not generated: x]</pre>" in page
    none = pages.job_page(status(), [], frozenset(), None, [], [], samples=[])
    assert "No sample yet" in none
    away = pages.job_page(status(), [], frozenset(), None, [], [])
    assert "samples unknown" in away
    assert read_samples(tmp_path / "absent.jsonl") is None


def test_the_job_page_lists_the_evaluation_scores_recorded_for_it(tmp_path):
    from services.cli.scores import read_scores

    f = tmp_path / "demo-1.jsonl"
    rec = [
        {"type": "step", "rank": 0, "step": 3, "loss": 4.0},
        {"type": "scores", "job_id": "demo-1", "eval_job_id": "eval-demo-2", "version": "demo-1:3", "step": 30,
         "scores": {"ppl": 12.5, "hellaswag/acc,none": 0.25}, "command": "python x.py", "seconds": 2.0},
    ]  # fmt: skip
    f.write_text("\n".join(json.dumps(r) for r in rec) + "\n")
    page = pages.job_page(status(), [], frozenset(), None, [], [], scores=read_scores(f))
    assert page.count("<tr class=score") == 2
    assert '<tr class=score data-name="ppl"><td>demo-1:3</td><td class=num>30</td><td>ppl</td>' in page
    assert "evaluation scores" not in pages.job_page(status(), [], frozenset(), None, [], [], scores=[])
