"""Shared by the ops tests: the gateway's metric contract, PromQL reading, tools, kustomize.

Dashboards, recording rules and alerts may use only these metric names (and, on the Workers
dashboard, vLLM's own ``vllm:*`` series) with only these labels.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

# PyYAML (installed with uvicorn[standard]) ships no type hints; importing it by name keeps the
# strict type check free of a types-PyYAML dependency.
_yaml: Any = importlib.import_module("yaml")

REPO = Path(__file__).resolve().parents[2]
OPS_BIN = REPO / ".venv-ops" / "bin"
# The rule files compose's Prometheus loads, promtool checks and the PrometheusRule carries.
RULE_FILES = sorted((REPO / "prometheus" / "rules").glob("*.yml"))

# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})

_BY_TIER = ("model", "tier")
_WORKER = ("worker",)

COUNTERS: dict[str, tuple[str, ...]] = {
    "gateway_requests_total": ("model", "tier", "endpoint", "status_class", "outcome"),
    "gateway_prompt_tokens_total": _BY_TIER,
    "gateway_completion_tokens_total": _BY_TIER,
    "gateway_worker_routed_requests_total": _WORKER,
    "gateway_worker_failovers_total": _WORKER,
    "gateway_worker_ejections_total": _WORKER,
    "gateway_worker_limit_cuts_total": ("worker", "cause"),
    "gateway_worker_completion_tokens_total": _WORKER,
    "gateway_worker_prefix_query_tokens_total": _WORKER,
    "gateway_worker_predicted_prefix_hit_tokens_total": _WORKER,
    "gateway_worker_cached_prompt_tokens_total": _WORKER,
    "gateway_worker_cache_told_prompt_tokens_total": _WORKER,
    "gateway_worker_prefix_missed_tokens_total": _WORKER,
    "gateway_worker_kv_events_total": _WORKER,
    "gateway_worker_kv_event_batches_lost_total": _WORKER,
    "gateway_prompt_tokenizations_total": ("result",),
    "gateway_admission_decisions_total": ("tier", "decision", "reason"),
    "gateway_slo_requests_total": ("model", "tier", "result"),
    "gateway_goodput_tokens_total": _BY_TIER,
    "gateway_saturated_total": ("resource",),
}
GAUGES: dict[str, tuple[str, ...]] = {
    "gateway_in_flight_requests": _BY_TIER,
    "gateway_worker_up": _WORKER,
    "gateway_worker_ejected": _WORKER,
    "gateway_worker_running_requests": _WORKER,
    "gateway_worker_waiting_requests": _WORKER,
    "gateway_worker_kv_cache_usage_ratio": _WORKER,
    "gateway_worker_load_age_seconds": _WORKER,
    "gateway_worker_in_flight_requests": _WORKER,
    "gateway_worker_decode_roofline_tokens_per_second": _WORKER,
    "gateway_worker_memory_bandwidth_bytes_per_second": _WORKER,
    "gateway_worker_peak_flops_per_second": _WORKER,
    "gateway_worker_concurrency_limit": _WORKER,
    "gateway_worker_proven_concurrency": _WORKER,
    "gateway_worker_decode_pace_seconds": _WORKER,
    "gateway_worker_prefill_concurrency_limit": _WORKER,
    "gateway_worker_prefilling_requests": _WORKER,
    "gateway_worker_prefill_tokens_per_second": _WORKER,
    "gateway_worker_decode_step_seconds": _WORKER,
    "gateway_worker_decode_seconds_per_sequence": _WORKER,
    "gateway_worker_prefix_index_blocks": _WORKER,
    "gateway_prefix_index_bytes": (),
    "gateway_prompt_tokens_cache_bytes": (),
    "gateway_worker_kv_index_blocks": _WORKER,
    "gateway_worker_kv_index_complete": _WORKER,
    "gateway_queue_depth": ("tier",),
    "gateway_fairness_waiting_ids": ("tier",),
    "gateway_fairness_top_share": ("tier",),
    "gateway_goodput_ratio": ("tier",),
    "gateway_tier_slo_ttft_seconds": ("tier",),
    "gateway_slo_objective": ("tier",),
    "gateway_workers_known": (),
    "gateway_workers_healthy": (),
    "gateway_shared_state_up": (),
    "gateway_tier_slo_tpot_seconds": ("tier",),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "gateway_time_to_first_token_seconds": _BY_TIER,
    "gateway_inter_token_latency_seconds": _BY_TIER,
    "gateway_time_per_output_token_seconds": _BY_TIER,
    "gateway_e2e_request_latency_seconds": _BY_TIER,
    "gateway_queue_time_seconds": _BY_TIER,
    "gateway_overhead_seconds": ("model",),
    "gateway_failover_seconds": ("model",),
    "gateway_worker_time_to_first_token_seconds": _WORKER,
    "gateway_worker_inter_token_latency_seconds": _WORKER,
    "gateway_queue_wait_seconds": ("tier",),
    "gateway_ttft_prediction_error_seconds": ("tier",),
    "gateway_event_loop_lag_seconds": (),
    "gateway_worker_kv_event_lag_seconds": _WORKER,
}
# vLLM's series carry model_name and engine (and, on vllm:num_requests_waiting_by_reason,
# reason); Prometheus adds `worker` (see prometheus.yml).
VLLM_LABELS = frozenset({"model_name", "engine", "worker", "reason"})


def contract_series() -> dict[str, frozenset[str]]:
    """Every series name the gateway exports, with the labels it may carry."""
    series: dict[str, frozenset[str]] = {}
    for name, labels in {**COUNTERS, **GAUGES}.items():
        series[name] = frozenset(labels)
    for name, labels in HISTOGRAMS.items():
        series[f"{name}_bucket"] = frozenset({*labels, "le"})
        series[f"{name}_sum"] = frozenset(labels)
        series[f"{name}_count"] = frozenset(labels)
    return series


_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"and", "or", "unless", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords and labels left out)."""
    text = _STRING.sub('""', expr)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """``(metric, label names matched)`` for every selector with braces in the expression."""
    text = _STRING.sub('""', expr)
    return [
        (match.group(1) or "", set(_MATCHER.findall(match.group(2))))
        for match in _SELECTOR.finditer(text)
    ]


def grouping_labels(expr: str) -> set[str]:
    """Label names in by/without/on/ignoring/group_* clauses."""
    text = _STRING.sub('""', expr)
    labels: set[str] = set()
    for match in _GROUPING.finditer(text):
        labels.update(part.strip() for part in match.group(2).split(",") if part.strip())
    return labels


def contract_violations(expr: str, allow_vllm: bool) -> list[str]:
    """Why ``expr`` steps outside the metric contract (empty when it does not)."""
    series = contract_series()
    problems = []
    names = metric_names(expr)
    allowed_labels = set(TARGET_LABELS)
    for name in sorted(names):
        if name in series:
            allowed_labels |= series[name]
        elif allow_vllm and name.startswith("vllm:"):
            allowed_labels |= VLLM_LABELS | {"le"}
        else:
            problems.append(f"metric {name} is not in the contract")
    for name, labels in selector_labels(expr):
        if name in series:
            known = series[name] | TARGET_LABELS
        elif name.startswith("vllm:") and allow_vllm:
            known = VLLM_LABELS | TARGET_LABELS | {"le"}
        else:
            continue
        for label in sorted(labels - known):
            problems.append(f"{name} has no label {label}")
    for label in sorted(grouping_labels(expr) - allowed_labels):
        problems.append(f"grouping by {label}, which none of {sorted(names)} carries")
    return problems


def load_yaml(text: str) -> Any:
    """Parse one YAML document."""
    return _yaml.safe_load(text)


def load_yaml_all(text: str) -> list[Any]:
    """Parse a YAML stream of documents, empty ones left out."""
    return [doc for doc in _yaml.safe_load_all(text) if doc is not None]


def dump_yaml(data: Any) -> str:
    """Serialise to YAML."""
    text: str = _yaml.safe_dump(data, sort_keys=False)
    return text


def tool(name: str) -> str:
    """Path of an ops tool; fails (never skips) the test when it is missing."""
    local = OPS_BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/install_ops_tools.sh`")
    return found


OVERLAYS = ("cpu-demo", "gpu")

# The live dashboard check sends this key so it can use every tier (the tier header only lowers
# the key's tier). The live gateway must know it, e.g. with
# GATEWAY_API_KEYS='[{"sha256": "<LIVE_API_KEY_SHA256>", "tier": "interactive"}]'.
LIVE_API_KEY = "ops-live-dashboards-interactive"
LIVE_API_KEY_SHA256 = hashlib.sha256(LIVE_API_KEY.encode()).hexdigest()


def kustomize_build(overlay: str) -> str:
    """``kubectl kustomize`` of an overlay. The cpu-demo overlay reads the tiny model's files
    from models/, outside its directory, hence the relaxed load restrictor."""
    if overlay == "cpu-demo" and not (REPO / "models" / "tiny-llama" / "config.json").exists():
        pytest.fail("models/tiny-llama is missing: run `bash scripts/install_worker.sh`")
    result = subprocess.run(
        [
            tool("kubectl"),
            "kustomize",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(REPO / "deploy" / "overlays" / overlay),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
