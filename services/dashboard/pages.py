"""The dashboard's pages as HTML, from the protobuf messages control and the store answer.

Pure functions: messages in, a page (text) out, no I/O; the server reads, these render (and
tests/dashboard/test_pages.py renders canned messages). Every value from a message is
escaped (a job's name, tags, notes and log lines are the operator's or a rank's text).
Curves are SVG images drawn by matplotlib (``charts``); a chart's ``data-points`` attribute
says how many steps it shows.
"""

from __future__ import annotations

import base64
import html
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from services.cli import compare, render
from services.cli.event_types import EVENT_TYPES
from services.cli.observe import LogLine
from services.cli.samples import SampleLine, latest_per_prompt
from services.cli.scores import ScoresLine
from services.cli.worker_slots import Slots, health_of
from services.common.sizes import size_text
from services.contract import Module, control_pb2, store_pb2
from services.dashboard import charts, log_follow
from services.dashboard.series import Series

JobState = control_pb2.JobState
LIVE = frozenset({JobState.STANDBY, JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED, JobState.FAULT_FROZEN})
REFRESH_SECONDS = 5  # a page of a live job, the cluster and the queue reload themselves
LOG_LINES = 500  # lines a logs page shows (the newest); the job page shows fewer
JOB_PAGE_LOG_LINES = 40
# Events a job page shows: the newest of the types asked (control's journal selects them; a
# long job has 10^5 step events); ``?events=N`` asks for more, ``?events=all`` for every one.
JOB_PAGE_EVENTS = 200
MORE_PAGE_EVENTS = 2000  # the "more" link's N
MAX_PAGE_EVENTS = 1_000_000

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px}
header a{color:#cfe0ff;margin-right:16px;text-decoration:none}
header b{margin-right:24px}
main{padding:12px 16px}
table{border-collapse:collapse;background:#fff;margin:8px 0 16px}
th,td{border:1px solid #dde1e7;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.state-RUNNING{color:#0a7a26}.state-FAULT_FROZEN,.ev-fault,.bad{color:#b3261e}
.state-TERMINATED{color:#555}
pre{background:#fff;border:1px solid #dde1e7;padding:8px;overflow:auto;max-height:40em;font-size:12px}
figure{margin:4px 0;background:#fff;border:1px solid #dde1e7;display:inline-block}
figcaption{font-size:12px;color:#555;padding:2px 6px}
.muted{color:#777}
"""


@dataclass(frozen=True)
class Run:
    """One job of a comparison: its status (with its spec), its curves."""

    status: control_pb2.JobStatus
    series: Series


def e(value: object) -> str:
    return html.escape(str(value), quote=True)


def job_href(job_id: str) -> str:
    return f"/job/{quote(job_id, safe='')}"


def layout(title: str, body: str, refresh: int | None = None, now: float | None = None) -> str:
    """A whole page: the navigation, ``body`` (HTML), reloaded every ``refresh`` seconds."""
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now if now is not None else time.time()))
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{e(title)} · Surge</title>{meta}<style>{_CSS}</style></head><body>"
        '<header><b>Surge</b><a href="/">jobs</a><a href="/queue">queue</a><a href="/cluster">cluster</a>'
        f'<a href="/compare">compare</a><span class=muted style="float:right">read-only · {e(stamp)}</span></header>'
        f"<main><h1>{e(title)}</h1>{body}</main></body></html>"
    )


def state_cell(s: control_pb2.JobStatus) -> str:
    return f'<td class="state state-{JobState.Name(s.state)}">{e(render.state_text(s))}</td>'


def _num(x: float, fmt: str = "{:.4f}") -> str:
    return "—" if x == 0 or math.isnan(x) else fmt.format(x)


def jobs_page(jobs: Sequence[control_pb2.JobStatus], now: float | None = None) -> str:
    """Every job, newest first, with a form that overlays the ticked ones (``/compare``)."""
    rows = []
    for j in sorted(jobs, key=lambda j: -j.created_unix):
        tags = " ".join(f"{k}={v}" for k, v in sorted(j.tags.items()))
        rows.append(
            f'<tr class=job data-job="{e(j.job_id)}"><td><input type=checkbox name=job value="{e(j.job_id)}"></td>'
            f'<td><a href="{job_href(j.job_id)}">{e(j.job_id)}</a></td>{state_cell(j)}'
            f"<td class=num>{j.step}/{j.total_steps}</td><td class=num>{_num(j.train_loss)}</td>"
            f"<td class=num>{_num(j.eval_loss)}</td><td class=num>{j.tokens_per_second:,.0f}</td>"
            f"<td>{e(j.checkpoint_version or '—')}</td><td>{e(tags)}</td><td>{e(j.message)}</td></tr>"
        )
    table = (
        '<form action="/compare" method=get><table id=jobs><tr><th></th><th>job</th><th>state</th><th>step</th>'
        "<th>train loss</th><th>eval loss</th><th>tokens/s</th><th>checkpoint</th><th>tags</th><th>message</th></tr>"
        + "".join(rows)
        + "</table><button type=submit>compare the ticked jobs</button></form>"
    )
    body = table if rows else "<p>No jobs yet: <code>surgectl submit JOB.yaml</code> starts one.</p>"
    return layout("jobs", body, refresh=REFRESH_SECONDS, now=now)


def _waited(j: control_pb2.JobStatus, now: float) -> float:
    """A queued job's time in the queue, as `surgectl queue` counts it: this wait and its earlier
    ones (before it was preempted or requeued)."""
    return max(0.0, now - (j.queued_unix or j.created_unix)) + j.waited_seconds


def queue_page(jobs: Sequence[control_pb2.JobStatus], now: float | None = None) -> str:
    """Control's queue (place, priority, waited, what it waits for), then the jobs holding slots."""
    now = time.time() if now is None else now
    queued = sorted((j for j in jobs if j.queue_position), key=lambda j: j.queue_position)
    running = [j for j in jobs if j.state in LIVE and not j.queue_position]
    q = "".join(
        f'<tr class=queued><td class=num>{j.queue_position}</td><td><a href="{job_href(j.job_id)}">{e(j.job_id)}</a>'
        f"</td><td class=num>{j.priority}</td><td class=num>{j.world_size}</td>"
        f"<td class=num>{_waited(j, now):,.0f} s</td><td>{e(j.message)}</td></tr>"
        for j in queued
    )
    r = "".join(
        f'<tr class=placed><td><a href="{job_href(j.job_id)}">{e(j.job_id)}</a></td>{state_cell(j)}'
        f"<td class=num>{j.world_size}</td><td class=num>{j.step}/{j.total_steps}</td></tr>"
        for j in running
    )
    body = (
        f"<h2>queued ({len(queued)})</h2>"
        + (
            "<table id=queue><tr><th>#</th><th>job</th><th>priority</th><th>ranks</th><th>waited</th>"
            f"<th>waits for</th></tr>{q}</table>"
            if queued
            else "<p class=muted>The queue is empty.</p>"
        )
        + f"<h2>placed ({len(running)})</h2>"
        + (
            "<table id=placed><tr><th>job</th><th>state</th><th>ranks</th><th>step</th></tr>" + r + "</table>"
            if running
            else "<p class=muted>No job holds slots.</p>"
        )
    )
    return layout("queue", body, refresh=REFRESH_SECONDS, now=now)


def cluster_page(
    slots: Sequence[Slots] | None,
    jobs: Sequence[control_pb2.JobStatus],
    cordoned: Sequence[control_pb2.WorkerCordoned],
    now: float | None = None,
) -> str:
    """Each registered worker: its devices (kind, model, count), its slots (used, free) and its health (cordoned or quarantined
    with the reason, ranks on it named slow, data-plane links to it named degraded or down);
    ``slots`` None: control's /metrics could not be read (the page says so)."""
    by_id = {s.worker_id: s for s in slots or ()}
    rows = []
    for h in health_of(list(by_id), jobs, cordoned):
        s = by_id.get(h.worker_id)
        health = "<br>".join(f"<span class=bad>{e(f)}</span>" for f in h.findings) or "healthy"
        rows.append(
            f'<tr class=worker data-worker="{e(h.worker_id)}"><td>{e(h.worker_id)}</td>'
            f"<td class=devices>{e(s.devices_text()) if s else '—'}</td>"
            f"<td class=num>{s.used if s else '—'}</td><td class=num>{s.free if s else '—'}</td>"
            f"<td>{health}</td></tr>"
        )
    used = sum(s.used for s in slots or ())
    free = sum(s.free for s in slots or ())
    summary = (
        f"<p>{len(by_id)} workers registered; rank slots: {used} used, {free} free.</p>"
        if slots is not None
        else "<p class=bad>Control's /metrics could not be read: slots unknown (health below is control's).</p>"
    )
    table = (
        "<table id=workers><tr><th>worker</th><th>devices</th><th>slots used</th><th>slots free</th>"
        "<th>health</th></tr>" + "".join(rows) + "</table>"
        if rows
        else "<p class=muted>No worker is registered.</p>"
    )
    by_state: dict[str, int] = {}
    for j in jobs:
        by_state[JobState.Name(j.state)] = by_state.get(JobState.Name(j.state), 0) + 1
    states = ", ".join(f"{n} {k}" for k, n in sorted(by_state.items())) or "none"
    return layout("cluster", f"{summary}{table}<p>jobs: {e(states)}</p>", refresh=REFRESH_SECONDS, now=now)


def chart(name: str, title: str, ylabel: str, lines: list[charts.Line], log_y: bool = False) -> str:
    """A figure holding one chart (an SVG image); ``data-points``: the most points a line
    draws (at most charts.MOST_POINTS)."""
    lines = [charts.thin(line) for line in lines]
    svg = charts.svg(title, ylabel, lines, log_y=log_y)
    points = max((sum(1 for y in line.y if not math.isnan(y)) for line in lines), default=0)
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<figure id="chart-{e(name)}" data-points="{points}"><img alt="{e(title)}" '
        f'src="data:image/svg+xml;base64,{data}"></figure>'
    )


def curves(s: Series | None) -> str:
    """The four charts of one job: loss (train and held-out), learning rate, gradient norm, tokens/s."""
    if s is None or not s.steps:
        return "<p class=muted>No step recorded yet.</p>"
    out = [
        chart(
            "loss",
            "loss",
            "nats/token",
            [charts.Line("train", s.steps, s.loss), charts.Line("held-out", s.eval_steps, s.eval_loss, points=True)],
        )
    ]
    for name, title, ylabel, values in (
        ("lr", "learning rate", "lr", s.learning_rate),
        ("grad-norm", "gradient norm", "L2 norm", s.grad_norm),
        ("tokens-per-second", "throughput", "tokens/s", s.tokens_per_second),
    ):
        if any(not math.isnan(v) for v in values):
            out.append(chart(name, title, ylabel, [charts.Line(title, s.steps, values)]))
        else:
            out.append(f'<p class=muted id="no-{name}">No {e(title)} in {e(s.source)}.</p>')
    return f"<p class=muted>From {e(s.source)}, rank {s.rank}.</p>" + "".join(out)


def rank_form(job_id: str, rank: int) -> str:
    """A GET form for another rank's curves (``?rank=N``)."""
    return (
        f'<form id=rank-pick action="{job_href(job_id)}" method=get>rank '
        f'<input type=number name=rank min=0 value="{rank}" style="width:5em"> <button type=submit>show</button></form>'
    )


def events_table(events: Iterable[control_pb2.JobEvent], types: frozenset[str]) -> str:
    rows = []
    for ev in events:
        if types and ev.type not in types:
            continue
        when = time.strftime("%H:%M:%S", time.gmtime(ev.unix_time))
        src = Module.Name(ev.source) if ev.source else "-"
        rows.append(
            f'<tr class="event ev-{e(ev.type)}"><td class=num>{ev.seq}</td><td>{when}</td><td>{e(ev.type)}</td>'
            f"<td>{e(src)}</td><td>{e(ev.message)}</td></tr>"
        )
    return (
        "<table id=events><tr><th>seq</th><th>time (UTC)</th><th>type</th><th>source</th><th>message</th></tr>"
        + "".join(rows)
        + "</table>"
        if rows
        else "<p class=muted id=events>No events of these types.</p>"
    )


def type_filter(job_id: str, types: frozenset[str], tail: int = JOB_PAGE_EVENTS) -> str:
    """A GET form of one checkbox per event type (none ticked: every type); it keeps the
    page's ``?events`` (``tail``) when that is not the default."""
    boxes = "".join(
        f'<label><input type=checkbox name=type value="{t}"{" checked" if t in types else ""}> {t}</label> '
        for t in EVENT_TYPES
    )
    kept = "" if tail == JOB_PAGE_EVENTS else f'<input type=hidden name=events value="{tail or "all"}">'
    return (
        f'<form id=type-filter action="{job_href(job_id)}" method=get>{boxes}{kept}'
        "<button type=submit>filter</button></form>"
    )


def events_href(job_id: str, types: frozenset[str], rank: int, tail: int) -> str:
    """The job page with these types and rank, showing its newest ``tail`` events (0: all)."""
    query = [("type", t) for t in sorted(types)] + ([("rank", str(rank))] if rank else [])
    return f"{job_href(job_id)}?{urlencode([*query, ('events', str(tail) if tail else 'all')])}#events"


def events_more(job_id: str, shown: int, types: frozenset[str], rank: int, tail: int) -> str:
    """What the events table holds (the newest ``tail`` of these types, 0: all of them) and,
    when it may not be all, the links that ask for more (``?events=N``) or all (``?events=all``)."""
    kinds = " of these types" if types else ""
    if not shown:
        return ""  # (the table says there are none)
    if not tail or shown < tail:
        return f"<p class=muted id=events-shown>All {shown:,} events{kinds}.</p>"
    more = (
        f'<a id=events-more href="{e(events_href(job_id, types, rank, MORE_PAGE_EVENTS))}">the newest {MORE_PAGE_EVENTS:,}</a> or '
        if tail < MORE_PAGE_EVENTS
        else ""
    )
    return (
        f"<p class=muted id=events-shown>The newest {tail:,} events{kinds}; show {more}"
        f'<a id=events-all href="{e(events_href(job_id, types, rank, 0))}">all</a> '
        "(a long job has one step event a second: all may be a large page).</p>"
    )


def checkpoints_table(infos: Sequence[store_pb2.CheckpointInfo] | None) -> str:
    if infos is None:
        return "<p class=bad>The store could not be reached: checkpoints unknown.</p>"
    if not infos:
        return "<p class=muted>No checkpoint yet.</p>"
    rows = "".join(
        f"<tr class=checkpoint><td>{e(c.version)}</td><td>{e(c.parent or '—')}</td><td class=num>{c.step}</td>"
        f"<td class=num>{e(size_text(c.bytes))}</td><td>{e(render.checkpoint_kind(c)[0])}</td>"
        f"<td>{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(c.created_unix))}</td>"
        f"<td><code>{e(c.manifest_sha256[:12])}</code></td></tr>"
        for c in sorted(infos, key=lambda c: c.step)
    )
    return (
        "<table id=checkpoints><tr><th>version</th><th>parent</th><th>step</th><th>size</th><th>kind</th>"
        f"<th>created (UTC)</th><th>sha256</th></tr>{rows}</table>"
    )


def samples_table(samples: Sequence[SampleLine] | None) -> str:
    """Each prompt's latest periodic sample (eval.sample_every_steps); None: the store's
    records could not be read (refused, or the store down and its files elsewhere)."""
    if samples is None:
        return "<p class=muted id=samples>The store's records could not be read: samples unknown.</p>"
    if not samples:
        return "<p class=muted id=samples>No sample yet (the spec's eval.sample_every_steps: 0 is none).</p>"
    rows = "".join(
        f'<tr class=sample data-prompt="{s.prompt_index}"><td class=num>{s.step}</td><td><pre>{e(s.prompt)}</pre></td>'
        f"<td><pre{' class=bad' if s.note else ''}>{e(s.shown)}</pre></td>"
        f"<td class=num>{s.tokens}</td><td class=num>{s.seconds:.2f}</td></tr>"
        for s in latest_per_prompt(list(samples))
    )
    return (
        "<table id=samples><tr><th>step</th><th>prompt</th><th>continuation</th><th>tokens</th><th>seconds</th></tr>"
        f"{rows}</table>"
    )


def scores_table(scores: Sequence[ScoresLine] | None) -> str:
    """The job's evaluations (`surgectl evaluate`): one row per score of each, newest last;
    nothing when there is none (or the records are not here)."""
    if not scores:
        return ""
    rows = "".join(
        f'<tr class=score data-name="{e(name)}"><td>{e(line.version)}</td><td class=num>{line.step}</td>'
        f"<td>{e(name)}</td><td class=num>{value:.6g}</td><td>{e(line.eval_job_id)}</td></tr>"
        for line in scores
        for name, value in sorted(line.scores.items())
    )
    return (
        "<h2>evaluation scores</h2><table id=scores><tr><th>version</th><th>step</th><th>score</th><th>value</th>"
        f"<th>evaluation job</th></tr>{rows}</table>"
    )


def log_block(lines: Sequence[LogLine] | None, element_id: str = "logs") -> str:
    if lines is None:
        return "<p class=bad>Control could not stream the rank logs.</p>"
    if not lines:
        return f"<p class=muted id={element_id}>No rank log lines yet.</p>"
    return f"<pre id={element_id}>" + "\n".join(e(line.human()) for line in lines) + "</pre>"


def status_table(s: control_pb2.JobStatus) -> str:
    rows = [
        ("state", render.state_text(s)),
        ("step", f"{s.step}/{s.total_steps}"),
        ("train loss", _num(s.train_loss)),
        ("held-out loss", _num(s.eval_loss)),
        ("tokens/s", f"{s.tokens_per_second:,.0f}"),
        ("tokens seen (replays counted again)", f"{s.tokens_seen:,}"),
        ("ranks", f"{s.world_size} (dp {s.dp})"),
        ("checkpoint", f"{s.checkpoint_version or '—'} (step {s.checkpoint_step})"),
        ("MFU", render.mfu_text(s) if s.peak_tflops else "—"),
        ("tags", " ".join(f"{k}={v}" for k, v in sorted(s.tags.items())) or "—"),
        ("message", s.message),
    ]
    return "<table id=status>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>"


def job_page(
    status: control_pb2.JobStatus,
    events: Sequence[control_pb2.JobEvent],
    types: frozenset[str],
    series: Series | None,
    checkpoints: Sequence[store_pb2.CheckpointInfo] | None,
    logs: Sequence[LogLine] | None,
    now: float | None = None,
    samples: Sequence[SampleLine] | None = None,
    scores: Sequence[ScoresLine] | None = None,
    tail: int = JOB_PAGE_EVENTS,
) -> str:
    """One job: its status, curves, each prompt's latest sample, events (``types``: only
    those, none: all; ``events`` are the newest ``tail`` of them, 0: every one, and the page
    links to more), checkpoints and its newest log lines; reloads itself while the job is
    not TERMINATED."""
    j = status.job_id
    rank = series.rank if series is not None else 0
    body = (
        status_table(status)
        + "<h2>curves</h2>"
        + rank_form(j, rank)
        + curves(series)
        + "<h2>samples</h2>"
        + samples_table(samples)
        + scores_table(scores)
        + "<h2>events</h2>"
        + type_filter(j, types, tail)
        + events_more(j, len(events), types, rank, tail)
        + events_table(events, types)
        + "<h2>checkpoints</h2>"
        + checkpoints_table(checkpoints)
        + f'<h2>logs <a href="{job_href(j)}/logs" style="font-size:13px">follow all ranks</a></h2>'
        + log_block(None if logs is None else logs[-JOB_PAGE_LOG_LINES:])
    )
    live = status.state in LIVE
    return layout(f"job {j}", body, refresh=REFRESH_SECONDS if live else None, now=now)


def logs_page(status: control_pb2.JobStatus, lines: Sequence[LogLine] | None, now: float | None = None) -> str:
    """The newest ``LOG_LINES`` lines of every rank, merged by time; while the job is live the
    page follows: its script asks ``<job href>/logs/lines`` for the lines after those
    it shows and appends them, never reloading (log_follow.py: none repeated, none skipped)."""
    live = status.state in LIVE
    if lines is None:
        shown = "<p class=bad>Control could not stream the rank logs.</p>"
        live = False  # (nothing to count from: a reload of the page asks again)
    else:
        text = "\n".join(e(line.human()) for line in lines[-LOG_LINES:])
        shown = (
            f'<pre id=logs data-live={int(live)} data-seen="{e(log_follow.seen_text(lines))}" '
            f'data-src="{job_href(status.job_id)}/logs/lines" data-every={log_follow.POLL_SECONDS} '
            f"data-count={min(len(lines), LOG_LINES)}>{text}</pre>"
        )
        if not lines:
            shown = "<p class=muted id=nolines>No rank log lines yet.</p>" + shown
    body = (
        f'<p><a href="{job_href(status.job_id)}">back to the job</a> · {e(render.state_text(status))}</p>'
        + shown
        + "<a id=end></a>"
    )
    page = layout(f"logs of {status.job_id}", body, now=now)
    script = "<script>window.scrollTo(0, document.body.scrollHeight)</script>"
    if live:
        script += f"<script>{log_follow.SCRIPT}</script>"
    return page.replace("</body>", script + "</body>")


def compare_page(runs: Sequence[Run], jobs: Sequence[control_pb2.JobStatus], now: float | None = None) -> str:
    """Two or more jobs: their curves overlaid, final and best losses, their spec's
    differences (``compare``'s own rules, as `surgectl compare` prints them); with fewer than
    two, a form to pick them from ``jobs``."""
    if len(runs) < 2:
        options = "".join(
            f'<label><input type=checkbox name=job value="{e(j.job_id)}"> {e(j.job_id)}</label><br>'
            for j in sorted(jobs, key=lambda j: -j.created_unix)
        )
        body = (
            "<p>Tick two or more jobs.</p><form id=pick action=/compare method=get>"
            f"{options}<button type=submit>compare</button></form>"
        )
        return layout("compare", body, now=now)
    as_compare = [
        compare.Run(status=r.status, spec=compare.spec_mapping(r.status.spec_json), history=render.History())
        for r in runs
    ]
    label = {id(r): r.status.name or r.status.job_id for r in runs}
    rows = []
    for r in runs:
        s = r.series
        h = render.History(
            steps=list(s.steps),
            loss=list(s.loss),
            tokens_per_second=list(s.tokens_per_second),
            eval_steps=list(s.eval_steps),
            eval_loss=list(s.eval_loss),
        )
        m = compare.summarize(h, r.status.tokens_per_second)
        rows.append(
            f'<tr class=compared><td><a href="{job_href(r.status.job_id)}">{e(r.status.job_id)}</a></td>'
            f"{state_cell(r.status)}<td class=num>{m.steps}</td><td class=num>{_num(m.final_train)}</td>"
            f"<td class=num>{_num(m.best_train)} ({m.best_train_step})</td><td class=num>{_num(m.final_eval)}</td>"
            f"<td class=num>{_num(m.best_eval)} ({m.best_eval_step})</td>"
            f"<td class=num>{_num(m.tokens_per_second, '{:,.0f}')}</td></tr>"
        )
    metrics = (
        "<table id=summary><tr><th>job</th><th>state</th><th>steps</th><th>final train</th><th>best train (step)</th>"
        "<th>final held-out</th><th>best held-out (step)</th><th>tokens/s</th></tr>" + "".join(rows) + "</table>"
    )
    diffs = compare.spec_differences(as_compare)
    diff_table = (
        "<table id=spec-differences><tr><th>key</th>"
        + "".join(f"<th>{e(r.status.job_id)}</th>" for r in runs)
        + "</tr>"
        + "".join(f"<tr><td>{e(k)}</td>" + "".join(f"<td>{e(v)}</td>" for v in vals) + "</tr>" for k, vals in diffs)
        + "</table>"
        if diffs
        else "<p class=muted>Their specs set the same values (the name aside).</p>"
    )
    overlays = [
        chart(
            "loss",
            "train loss",
            "nats/token",
            [charts.Line(label[id(r)], r.series.steps, r.series.loss) for r in runs],
        ),
        chart(
            "eval-loss",
            "held-out loss",
            "nats/token",
            [charts.Line(label[id(r)], r.series.eval_steps, r.series.eval_loss, points=True) for r in runs],
        ),
        chart(
            "lr",
            "learning rate",
            "lr",
            [charts.Line(label[id(r)], r.series.steps, r.series.learning_rate) for r in runs],
        ),
        chart(
            "grad-norm",
            "gradient norm",
            "L2 norm",
            [charts.Line(label[id(r)], r.series.steps, r.series.grad_norm) for r in runs],
        ),
        chart(
            "tokens-per-second",
            "throughput",
            "tokens/s",
            [charts.Line(label[id(r)], r.series.steps, r.series.tokens_per_second) for r in runs],
        ),
    ]
    link = "/compare?" + urlencode([("job", r.status.job_id) for r in runs])
    body = (
        metrics
        + "<h2>curves</h2>"
        + "".join(overlays)
        + "<h2>spec differences</h2>"
        + diff_table
        + f'<p class=muted>This comparison: <a href="{e(link)}">{e(link)}</a></p>'
    )
    return layout("compare " + ", ".join(r.status.job_id for r in runs), body, now=now)


def error_page(code: int, message: str) -> str:
    return layout(f"{code}", f"<p class=bad id=error>{e(message)}</p>")
