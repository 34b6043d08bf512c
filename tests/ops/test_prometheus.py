"""Prometheus: configuration, recording and alerting rules, and a unit test for every alert."""

from __future__ import annotations

import re
import subprocess
from typing import Any

from scripts import gen_dashboards
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
RUNBOOKS = REPO / "docs" / "runbooks.md"
# Where the alerts' runbook_url annotations point: docs/runbooks.md of this repository.
RUNBOOK_URL = "https://github.com/example/goodput-gateway/blob/main/docs/runbooks.md"


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


def _windows(expr: str) -> set[str]:
    """The windows of the SLO ratio rules an expression reads (``1h``, ``5m``, ...)."""
    return set(re.findall(r"_per_gateway_slo_requests:ratio_rate(\w+)", expr))


def test_alerts_carry_severity_explanations_and_a_runbook() -> None:
    runbooks = _runbook_sections()
    for rule in _rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_URL}#{name.lower()}", name
        assert name in runbooks, f"docs/runbooks.md has no section ## {name}"
        # A burn-rate alert needs no `for`: its short window keeps one evaluation from firing
        # it, and `for` would only delay the page.
        multiwindow = len(_windows(rule["expr"])) >= 2
        assert rule.get("for") or multiwindow, f"{name} fires on a single evaluation"


def _runbook_sections() -> dict[str, str]:
    """The runbook's ``## Name`` sections, by name."""
    text = RUNBOOKS.read_text()
    parts = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_runbook_is_an_alerts_and_points_at_panels_that_exist() -> None:
    """Each section names the dashboard panels to look at (*Overview › Title*), and they exist."""
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    sections = _runbook_sections()
    assert set(sections) == alerts, "docs/runbooks.md sections and alerts differ"
    titles = {
        board["title"].split(" / ")[-1]: {
            inner["title"]
            for panel in board["panels"]
            for inner in (panel.get("panels", []) if panel["type"] == "row" else [panel])
        }
        for board in gen_dashboards.build().values()
    }
    for name, text in sections.items():
        named = re.findall(r"\*(Overview|Workers) › ([^*]+)\*", text)
        assert named, f"the runbook of {name} names no dashboard panel"
        for board, wrapped in named:
            title = " ".join(wrapped.split())
            assert title in titles[board], f"{name}: no panel {title!r} on {board}"


RECORD_NAME = re.compile(r"(?P<level>[a-z_]+):(?P<metric>[a-z_]+):(?P<ops>[a-z0-9_]+)")
OPERATIONS = re.compile(r"(?:ratio_|p\d\d_)?rate(?P<window>\d+[smhd])|max|sum")


def test_recording_rules_are_named_level_metric_operations() -> None:
    """Prometheus's naming convention: the labels kept, the metric's own name (or
    numerator_per_denominator for a ratio), then the operations, newest first."""
    problems = []
    for rule in _rules():
        name = rule.get("record")
        if name is None:
            continue
        match = RECORD_NAME.fullmatch(name)
        if match is None:
            problems.append(f"{name}: not level:metric:operations")
            continue
        expr = rule["expr"]
        kept = set(re.findall(r"\bby \(([^)]*)\)", expr))
        levels = {frozenset(p.strip() for p in k.split(",")) - {"le"} for k in kept}
        if levels != {frozenset(match["level"].split("_"))}:
            problems.append(f"{name}: level {match['level']} but the rule keeps {levels}")
        metrics = {re.sub(r"(_total|_bucket)$", "", metric) for metric in metric_names(expr)}
        ops = OPERATIONS.fullmatch(match["ops"])
        if ops is None:
            problems.append(f"{name}: unknown operations {match['ops']}")
            continue

        def named(part: str, metrics: set[str] = metrics) -> bool:
            return any(part == m or part.startswith(f"{m}_") for m in metrics)

        metric = match["metric"]
        if match["ops"].startswith("ratio_"):
            # numerator_per_denominator, where a metric's own name may hold "_per_" too.
            cuts = [m.start() for m in re.finditer("_per_", metric)]
            if not any(named(metric[:i]) and named(metric[i + 5 :]) for i in cuts):
                problems.append(f"{name}: not <numerator>_per_<denominator> of {sorted(metrics)}")
        elif not named(metric):
            problems.append(f"{name}: {metric} is none of the metrics {sorted(metrics)}")
        windows = set(re.findall(r"\[(\w+)\]", expr))
        if ops["window"] is not None and windows != {ops["window"]}:
            problems.append(f"{name}: says {ops['window']} but reads {windows}")
    assert not problems, "\n".join(problems)


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
    # The target alerts select these job names (the ServiceMonitors' in test_kubernetes.py).
    exprs = {rule["alert"]: rule["expr"] for rule in _rules() if "alert" in rule}
    assert 'up{job="goodput-gateway"}' in exprs["GatewayTargetMissing"]
    for alert in ("GatewayWorkerTargetDown", "GatewayWorkerTargetsMissing"):
        (regex,) = re.findall(r'up\{job=~"([^"]+)"\}', exprs[alert])
        assert re.fullmatch(regex, "vllm"), alert


def test_prometheus_server_is_installed() -> None:
    """The live dashboard check runs Prometheus itself, installed with promtool."""
    result = subprocess.run(
        [tool("prometheus"), "--version"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert "prometheus, version" in result.stdout + result.stderr
