"""Prometheus: configuration, recording and alerting rules, and a unit test for every alert."""

from __future__ import annotations

import subprocess
from typing import Any

from tests.ops.support import (
    REPO,
    RULE_FILES,
    TARGET_LABELS,
    contract_series,
    load_yaml,
    metric_names,
    selector_labels,
    tool,
)

PROMETHEUS = REPO / "prometheus"
TEST_FILES = sorted((PROMETHEUS / "tests").glob("*.yml"))


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def _rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULE_FILES
        for group in load_yaml(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def test_config_is_valid() -> None:
    result = _promtool("check", "config", "prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_are_valid() -> None:
    assert RULE_FILES
    result = _promtool("check", "rules", *(str(p.relative_to(REPO)) for p in RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    assert TEST_FILES
    result = _promtool("test", "rules", *(str(p.relative_to(REPO)) for p in TEST_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test_and_a_quiet_one() -> None:
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for case in load_yaml(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alerts, "no alerts found"
    assert alerts - fired == set(), "alerts with no test that fires them"
    assert alerts - quiet == set(), "alerts with no test that they stay quiet"
    assert fired <= alerts, "tests of alerts that do not exist"


def test_unit_tests_load_the_real_rule_files() -> None:
    for path in TEST_FILES:
        listed = {(path.parent / f).resolve() for f in load_yaml(path.read_text())["rule_files"]}
        assert listed == {p.resolve() for p in RULE_FILES}, path.name


def test_alerts_carry_severity_and_explanations() -> None:
    for rule in _rules():
        if "alert" not in rule:
            continue
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]
        assert rule.get("for"), f"{rule['alert']} fires on a single evaluation"


def test_rules_use_only_contract_metrics_and_labels() -> None:
    series = contract_series()
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    problems = []
    for rule in _rules():
        name = rule.get("record") or rule.get("alert")
        expr = rule["expr"]
        # Besides the contract: recorded series and Prometheus's own `up`.
        for metric in sorted(metric_names(expr) - set(series) - recorded - {"up"}):
            problems.append(f"{name}: metric {metric} is not in the contract")
        for metric, labels in selector_labels(expr):
            known = series.get(metric, labels) | TARGET_LABELS
            problems += [f"{name}: {metric} has no label {label}" for label in labels - known]
    assert not problems, "\n".join(problems)


def test_compose_prometheus_mounts_what_the_config_reads() -> None:
    config = load_yaml((PROMETHEUS / "prometheus.yml").read_text())
    compose = load_yaml((REPO / "docker-compose.yml").read_text())
    service = compose["services"]["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in service["volumes"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in service["volumes"]
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {
        job: [t for sc in spec["static_configs"] for t in sc["targets"]]
        for job, spec in jobs.items()
    }
    # GatewayDown selects job="goodput-gateway"; the ServiceMonitor's job is the Service name.
    assert targets["goodput-gateway"] == ["gateway:8000"]
    assert set(targets["vllm"]) == {"vllm:8000", "vllm-gpu:8000"}
    for target in targets["goodput-gateway"] + targets["vllm"]:
        assert target.split(":")[0] in compose["services"], target
    relabel = jobs["vllm"]["relabel_configs"]
    assert {"source_labels": ["__address__"], "target_label": "worker"} in relabel


def test_prometheus_server_is_installed() -> None:
    """The live dashboard check runs Prometheus itself, installed with promtool."""
    result = subprocess.run(
        [tool("prometheus"), "--version"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert "prometheus, version" in result.stdout + result.stderr
