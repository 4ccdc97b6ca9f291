"""deploy/: docker-compose.yml is valid (`docker-compose config -q`, Debian's package) and runs
the local stack's entry points and flags with health checks and named volumes;
deploy/prometheus.yml passes `promtool check config` and scrapes every compose service; its
alert rules (deploy/rules/) pass `promtool check rules` and their runbooks name surgectl
commands and flags that exist; the Grafana dashboard and its provisioning parse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import yaml

from tests.conftest import REPO
from tests.observability.conftest import require_tool

COMPOSE = REPO / "docker-compose.yml"
SURGE = {"control", "store", "data", "worker-0", "worker-1"}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_docker_compose_config_is_valid():
    binary = require_tool("docker-compose", "docker-compose")
    for args in ([], ["--profile", "grafana", "--profile", "cli", "--profile", "dashboard"]):
        r = subprocess.run(
            [binary, "-f", str(COMPOSE), *args, "config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr


def test_compose_runs_the_local_stacks_entry_points_with_health_checks_and_named_volumes():
    c = compose()
    services = c["services"]
    assert SURGE | {"prometheus"} <= set(services)
    assert {"datasets", "checkpoints"} <= set(c["volumes"])
    for name in SURGE:
        s = services[name]
        module = "services.worker" if name.startswith("worker") else f"services.{name}"
        assert s["command"][:3] == ["python", "-m", module], name
        flags = s["command"][3:]
        assert flags[flags.index("--metrics-port") + 1] == "9100", name
        port = flags[flags.index("--port") + 1]
        assert s["healthcheck"]["test"] == ["CMD", "python", "-m", "services.common.healthcheck", f"127.0.0.1:{port}"]
        mounts = {v.split(":")[0] for v in s["volumes"]}
        assert {"datasets", "checkpoints"} <= mounts, name
        assert s["build"]["dockerfile"] == "deploy/Dockerfile" and "BASE" in s["build"]["args"], name
    for worker in ("worker-0", "worker-1"):
        flags = services[worker]["command"]
        assert flags[flags.index("--control") + 1] == "control:50051"
        assert services[worker]["depends_on"]["control"]["condition"] == "service_healthy"
    assert "ARG BASE" in (REPO / "deploy" / "Dockerfile").read_text()


def test_compose_flags_are_accepted_by_each_service():
    """Every flag a compose command passes is one the service's parser knows (its --help)."""
    c = compose()
    for name in SURGE:
        cmd = c["services"][name]["command"]
        module = cmd[2]
        r = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        for flag in (a for a in cmd[3:] if a.startswith("--")):
            assert flag in r.stdout, f"{name}: {module} has no {flag}"


def test_the_compose_dashboard_reads_control_and_the_store_with_flags_its_parser_knows():
    cmd = compose()["services"]["dashboard"]["command"]
    assert cmd[:3] == ["python", "-m", "services.dashboard"]
    assert cmd[cmd.index("--control") + 1] == "control:50051" and cmd[cmd.index("--store") + 1] == "store:50052"
    r = subprocess.run(
        [sys.executable, "-m", "services.dashboard", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert [f for f in cmd[3:] if f.startswith("--") and f not in r.stdout] == []


def test_deploy_prometheus_config_passes_promtool_and_scrapes_every_compose_service():
    promtool = require_tool("promtool", "prometheus")
    config = REPO / "deploy" / "prometheus.yml"
    r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    scrape = yaml.safe_load(config.read_text())["scrape_configs"]
    targets = {t for job in scrape for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:9100" for name in SURGE}
    assert all(job.get("honor_labels") for job in scrape)  # Surge's `job` label is the training job
    volumes = compose()["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes
    # its rule files (promtool check config above checks them too), mounted where it reads them
    assert yaml.safe_load(config.read_text())["rule_files"] == ["rules/*.yml"]
    assert "./deploy/rules:/etc/prometheus/rules:ro" in volumes


def test_the_alert_rules_pass_promtool_and_each_runbook_names_surgectl_commands_that_exist():
    promtool = require_tool("promtool", "prometheus")
    rules_file = REPO / "deploy" / "rules" / "surge-alerts.yml"
    r = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = [rule for g in yaml.safe_load(rules_file.read_text())["groups"] for rule in g["rules"]]
    names = {rule["alert"] for rule in rules}
    for wanted in (
        "SurgeFaultSevere",
        "SurgeJobFailed",
        "SurgeCheckpointStale",
        "SurgeCheckpointSavesFailing",
        "SurgeTargetDown",
        "SurgeControlApplierBehind",
        "SurgeControlLoopLagging",
        "SurgeSilenceVerdictsHeld",
    ):
        assert wanted in names
    help_text = subprocess.run(
        [sys.executable, "-m", "services.cli.surgectl", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    commands = set(re.findall(r"^│ ([a-z][a-z-]+) ", help_text, re.MULTILINE))
    assert {"status", "events", "checkpoints", "restart", "up"} <= commands, commands
    for rule in rules:
        said = re.findall(r"`surgectl ([a-z-]+)([^`]*)`", rule["annotations"]["runbook"])
        assert said, rule["alert"]  # each says what to run
        for command, args in said:
            assert command in commands, (rule["alert"], command)
            for flag in re.findall(r"(--[a-z-]+)", args):
                sub = subprocess.run(
                    [sys.executable, "-m", "services.cli.surgectl", command, "--help"],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    env={**os.environ, "COLUMNS": "200"},
                ).stdout
                assert flag in sub, (rule["alert"], command, flag)


def test_the_grafana_dashboard_and_provisioning_parse():
    dash = json.loads((REPO / "deploy" / "grafana" / "dashboards" / "surge.json").read_text())
    assert dash["uid"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    ds = yaml.safe_load((REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == uid and t["expr"], p["title"]
    provider = yaml.safe_load((REPO / "deploy" / "grafana" / "provisioning" / "dashboards" / "surge.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_surge_fault_severe_pages_once_per_incident_for_its_cause_not_for_its_consequences(tmp_path):
    # One incident: rank 1's SEVERE rank_exit (its cause) and rank 0's comm_error, its collective
    # broken under it (a consequence: control counts it role="consequence"). The rule paged for
    # both (session 36's trial: two alerts of one rule for one incident).
    promtool = require_tool("promtool", "prometheus")
    rules_file = REPO / "deploy" / "rules" / "surge-alerts.yml"
    rules = [r for g in yaml.safe_load(rules_file.read_text())["groups"] for r in g["rules"]]
    (expr,) = [r["expr"] for r in rules if r["alert"] == "SurgeFaultSevere"]
    series = 'surge_faults_total{{class="{c}",grade="SEVERE",role="{r}"}}'
    case = {
        "interval": "1m",
        "input_series": [
            {"series": series.format(c="rank_exit", r="cause"), "values": "0 0 1 1 1"},
            {"series": series.format(c="rank_exit", r="consequence"), "values": "0 0 0 0 0"},
            {"series": series.format(c="comm_error", r="cause"), "values": "0 0 0 0 0"},
            {"series": series.format(c="comm_error", r="consequence"), "values": "0 0 1 1 1"},
        ],
        # (what the alert fires for: one series per (class, grade) its expression keeps)
        "promql_expr_test": [
            {
                "expr": f"count by (class, grade) ({expr})",
                "eval_time": "3m",
                "exp_samples": [{"labels": '{class="rank_exit",grade="SEVERE"}', "value": 1}],
            }
        ],
    }
    path = tmp_path / "surge-alerts.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "tests": [case]}, sort_keys=False))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
