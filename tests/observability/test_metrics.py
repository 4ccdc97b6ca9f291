"""/metrics of every service of a real stack: promtool accepts each endpoint, names follow the
Prometheus conventions, job series carry job and rank, a real Prometheus scrapes the stack
and serves the job's final training loss, and the Grafana dashboard only queries metrics
that exist."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.observability.conftest import require_tool, scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "surge.json"
# Series the metrics logger sets per rank of a job (services/store/metrics_logger.py).
PER_RANK = {
    "surge_train_loss",
    "surge_learning_rate",
    "surge_grad_norm",
    "surge_tokens_per_second",
    "surge_step_seconds",
    "surge_step_phase_seconds",
    "surge_loss_scale",
    "surge_train_step",
    "surge_train_epoch",
    "surge_train_steps_total",
    "surge_skipped_steps_total",
    "surge_eval_loss",
    "surge_eval_seconds",
    "surge_eval_runs_total",
}


def families(text: str) -> dict[str, str]:
    """Metric family name (as exposed on the TYPE line) -> type."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            out[name] = kind
    return out


def test_promtool_accepts_the_metrics_of_every_service(obs_stack):
    promtool = require_tool("promtool", "prometheus")
    problems = {}
    for name, s in obs_stack.services.items():
        assert s["metrics_port"], f"{name} serves no /metrics"
        r = subprocess.run(
            [promtool, "check", "metrics"], input=scrape(s["metrics_port"]), capture_output=True, text=True, timeout=60
        )
        if r.returncode != 0 or (r.stdout + r.stderr).strip():
            problems[name] = (r.stdout + r.stderr).strip()
    assert problems == {}, "\n".join(f"{n}: {p}" for n, p in problems.items())


def test_names_follow_the_conventions_and_job_series_carry_job_and_rank(obs_stack):
    job = obs_stack.job_id
    bad = []
    seen_per_rank: dict[str, set[str]] = {}
    for name, s in obs_stack.services.items():
        text = scrape(s["metrics_port"])
        for fam, kind in families(text).items():
            if not fam.startswith("surge_"):
                continue
            if kind == "counter" and not fam.endswith("_total"):
                bad.append(f"{name}: counter {fam} does not end in _total")
            if kind != "counter" and fam.endswith("_total"):
                bad.append(f"{name}: {kind} {fam} ends in _total")
            if re.search(r"_(ms|millis|milliseconds|us|microseconds|minutes|hours|kb|mb|gb|kib|mib|gib|percent)$", fam):
                bad.append(f"{name}: {fam} is not in base units (seconds, bytes, ratios)")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("job") == job and sample.name in PER_RANK:
                    seen_per_rank.setdefault(sample.name, set()).add(sample.labels.get("rank", ""))
                if (
                    sample.name.startswith("surge_checkpoint")
                    and sample.labels
                    and "job" not in sample.labels
                    and not sample.name.startswith("surge_checkpoint_failures")  # (control's, by cause: every job's)
                ):
                    bad.append(f"{name}: {sample.name} {sample.labels} has no job label")
    assert bad == []
    # Every per-rank series of the job is there, for both ranks.
    assert {k: v for k, v in seen_per_rank.items() if v != {"0", "1"}} == {}
    assert PER_RANK - set(seen_per_rank) == set()
    # The job's throughput is one series (rank 0's figure), not one per rank to be summed.
    store = scrape(obs_stack.services["store"]["metrics_port"])
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(store)
        for s in f.samples
        if s.labels.get("job") == job and "tokens_per_second" in s.name
    }
    job_tps = {k: v for k, v in samples.items() if k[0] == "surge_job_tokens_per_second"}
    assert list(job_tps) == [("surge_job_tokens_per_second", (("job", job),))]
    assert job_tps[list(job_tps)[0]] == samples[("surge_tokens_per_second", (("job", job), ("rank", "0")))]
    # So are its tokens trained: counted once, not once per rank (each rank reports the all-rank count).
    tokens = [
        (s.labels, s.value)
        for f in text_string_to_metric_families(store)
        for s in f.samples
        if s.name == "surge_train_tokens_total" and s.labels.get("job") == job
    ]
    assert [labels for labels, _ in tokens] == [{"job": job}] and tokens[0][1] > 0, tokens


def test_a_real_prometheus_scrapes_the_stack_and_serves_the_final_training_loss(obs_stack):
    if not obs_stack.prometheus:
        pytest.skip(obs_stack.prometheus_skip)
    job, final = obs_stack.job_id, obs_stack.status["train_loss"]
    records = [
        json.loads(line) for line in (obs_stack.home / "store" / "metrics" / f"{job}.jsonl").read_text().splitlines()
    ]
    last_rank0 = [r for r in records if r["type"] == "step" and int(r["rank"]) == 0][-1]
    assert abs(last_rank0["loss"] - final) < 1e-6  # control's status is rank 0's last step

    query = f'surge_train_loss{{job="{job}",rank="0"}}'
    deadline, got = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        result = _query(obs_stack.prometheus, query)
        if result:
            got = float(result[0]["value"][1])
            if abs(got - final) < 1e-6:
                break
        time.sleep(0.5)
    assert got is not None and abs(got - final) < 1e-6, f"Prometheus answered {got}, the job ended at {final}"

    targets = json.loads(_get(f"{obs_stack.prometheus}/api/v1/targets"))["data"]["activeTargets"]
    assert {t["labels"]["service"]: t["health"] for t in targets} == {name: "up" for name in obs_stack.services}


def test_the_grafana_dashboard_queries_metrics_that_the_stack_exports(obs_stack):
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("loss", "tokens per second", "step time breakdown", "fault", "recovery"):
        assert topic in titles, f"no panel about {topic}"

    exported: set[str] = set()
    for s in obs_stack.services.values():
        exported |= set(families(scrape(s["metrics_port"])))
    queried = {m for e in exprs for m in re.findall(r"\b(surge_[a-z0-9_]+)", e)}

    def family(name: str) -> str:
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name.removesuffix(suffix) in exported:
                return name.removesuffix(suffix)
        return name

    assert sorted(m for m in queried if family(m) not in exported) == []

    if obs_stack.prometheus:  # and every expression is valid PromQL
        for e in exprs:
            if e.startswith("label_values("):
                continue
            r = json.loads(
                _get(
                    f"{obs_stack.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": e.replace("$job", ".*")})
                )
            )
            assert r["status"] == "success", (e, r)


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _query(base: str, promql: str) -> list:
    r = json.loads(_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert r["status"] == "success", r
    return r["data"]["result"]


RULES = REPO / "deploy" / "rules" / "surge-alerts.yml"
# Labels Prometheus adds at the scrape (deploy/prometheus.yml's `service`, the target's
# `instance`, the scrape job's `job` on series without one), and histograms' `le`.
SCRAPE_LABELS = {"job", "instance", "service", "le"}


def _expr_labels(expr: str) -> set[str]:
    """Label names a PromQL expression reads: in selectors ({name="..."}) and in by / without /
    on / ignoring / group_left / group_right clauses."""
    names = set()
    for inner in re.findall(r"\{([^}]*)\}", expr.replace("{{", "").replace("}}", "")):
        names |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", inner))
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    return names


def _exported_labels(obs_stack) -> dict[str, set[str]]:
    """Family -> label names, from a real stack's /metrics samples; for a family the stack
    exports with no sample now, from the in-process registry's declaration of it (a counter no
    violation has touched yet, a per-job gauge of control once every job ended)."""
    from prometheus_client import REGISTRY

    import services.contract.bus
    import services.control.metrics  # noqa: F401 (their metrics register on import)
    from services.control.cluster_metrics import ClusterCollector

    out: dict[str, set[str]] = {}
    for s in obs_stack.services.values():
        for family in text_string_to_metric_families(scrape(s["metrics_port"])):
            labels = out.setdefault(family.name, set())
            for sample in family.samples:
                labels |= set(sample.labels)
    for family in ClusterCollector().describe():
        if not out.get(family.name):
            out[family.name] = set(family._labelnames)  # (the declared label names)
    for name, collector in REGISTRY._names_to_collectors.items():
        if name in out and not out[name]:
            out[name] = set(getattr(collector, "_labelnames", ()))
    return out


def test_every_metric_and_label_an_alert_rule_or_a_dashboard_panel_reads_is_exported(obs_stack):
    # fresh36 F3: the rules must read what the services export (a misspelt name or label is
    # an alert that never fires), the dashboard's panels too.
    import yaml

    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    exprs = {r["alert"]: r["expr"] for r in rules}
    exprs |= {f"{p['title']} {t['refId']}": t["expr"] for p in dash["panels"] for t in p.get("targets", [])}
    exported = _exported_labels(obs_stack)

    def family(name: str) -> str:
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name.removesuffix(suffix) in exported:
                return name.removesuffix(suffix)
        return name.removesuffix("_total") if name.removesuffix("_total") in exported else name

    problems = []
    for where, expr in exprs.items():
        names = {family(m) for m in re.findall(r"\b(surge_[a-z0-9_]+)", expr)}
        problems += [f"{where}: {n} not exported" for n in sorted(names) if n not in exported]
        known = set().union(*(exported.get(n, set()) for n in names)) | SCRAPE_LABELS
        problems += [f"{where}: label {label} on none of {sorted(names)}" for label in _expr_labels(expr) - known]
    assert problems == []
    # (the counters' label sets are there at 0 before any fault: what increase() needs)
    text = scrape(obs_stack.services["control"]["metrics_port"])
    assert 'surge_faults_total{class="worker_lost",grade="SEVERE",role="cause"}' in text
    assert 'surge_jobs_ended_total{outcome="FAILED"}' in text
    if obs_stack.prometheus:  # and every rule's expression is valid PromQL to a real Prometheus
        for where, expr in exprs.items():
            r = json.loads(
                _get(
                    f"{obs_stack.prometheus}/api/v1/query?"
                    + urllib.parse.urlencode({"query": expr.replace("$job", ".*")})
                )
            )
            assert r["status"] == "success", (where, r)
