"""Generate the Grafana dashboards in grafana/dashboards/ from the definitions below.

Run ``python -m scripts.gen_dashboards`` after changing a panel and commit the JSON it writes;
``python -m scripts.gen_dashboards --check`` exits non-zero when the committed JSON is stale
(tests/ops/test_grafana.py checks the same).

Every query uses only the gateway's metric contract (``gateway_*``) and, on the Workers
dashboard, vLLM's own ``vllm:*`` series. Panels reach Prometheus through the ``$datasource``
variable, so the same JSON works with the provisioned data source (docker compose) and with
whatever Prometheus data source a cluster's Grafana has (Kubernetes ConfigMap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Json = dict[str, Any]

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)

# Label filters driven by the template variables.
MT = 'model=~"$model",tier=~"$tier"'
T = 'tier=~"$tier"'
M = 'model=~"$model"'
W = 'worker=~"$worker"'
# One gateway replica (or several), where one matters: limits each replica learns for itself.
INST = 'instance=~"$instance"'
WI = f"{W},{INST}"
VW = 'worker=~"$worker",model_name=~"$model"'
SLO = "gateway_slo_requests_total"

# The roofline, per worker. vLLM's estimated FLOPs and bytes are per GPU (an average over the
# engines of a data-parallel worker); the peaks are GATEWAY_HARDWARE's, per GPU too.
ENGINE_FLOPS = f"avg by (worker) (rate(vllm:estimated_flops_per_gpu_total{{{VW}}}[{RATE}]))"
ENGINE_BYTES = (
    f"avg by (worker) (rate(vllm:estimated_read_bytes_per_gpu_total{{{VW}}}[{RATE}]) "
    f"+ rate(vllm:estimated_write_bytes_per_gpu_total{{{VW}}}[{RATE}]))"
)
PEAK_FLOPS = f"max by (worker) (gateway_worker_peak_flops_per_second{{{W}}})"
BANDWIDTH = f"max by (worker) (gateway_worker_memory_bandwidth_bytes_per_second{{{W}}})"
# An engine started without --enable-mfu-metrics exports the counters but never moves them:
# only one whose counter has moved counts as having them.
COUNTING = f"(max by (worker) (vllm:estimated_read_bytes_per_gpu_total{{{VW}}}) > 0)"
# MBU from the engine's counters where it has them ("engine"), else the estimate from the
# configured model: decode tokens/s over the roofline for the batch it ran ("estimate").
MBU = (
    f"label_replace(({ENGINE_BYTES} / on (worker) {BANDWIDTH}) and on (worker) {COUNTING}, "
    '"source", "engine", "", "")'
    " or on (worker) "
    "label_replace(sum by (worker) "
    f"(rate(gateway_worker_completion_tokens_total{{{W}}}[{RATE}])) / (max by (worker) "
    f"(avg_over_time(gateway_worker_decode_roofline_tokens_per_second{{{W}}}[{RATE}])) > 0), "
    '"source", "estimate", "", "")'
)


def target(ref: str, expr: str, legend: str, instant: bool = False) -> Json:
    """One Prometheus query of a panel."""
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "refId": ref,
    }


def refs(exprs: list[tuple[str, str]], instant: bool = False) -> list[Json]:
    """Targets A, B, C, ... from ``(expr, legend)`` pairs."""
    return [
        target(chr(ord("A") + i), expr, legend, instant) for i, (expr, legend) in enumerate(exprs)
    ]


def quantiles(
    metric: str, matchers: str, by: str, legend: str, qs: tuple[float, ...] = QUANTILES
) -> list[tuple[str, str]]:
    """``histogram_quantile`` of a histogram for each quantile in ``qs``."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{{{matchers}}}[{RATE}])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in qs
    ]


def share(metric: str, part: str, matchers: str, by: str, window: str = RATE) -> str:
    """The share of ``metric``'s rate whose series match ``part``, per ``by``.

    The ``or ... * 0`` arm gives 0 (not "no value") when no series matches ``part`` yet.
    """
    whole = f"sum by ({by}) (rate({metric}{{{matchers}}}[{window}]))"
    return (
        f"(sum by ({by}) (rate({metric}{{{matchers},{part}}}[{window}])) or {whole} * 0) / {whole}"
    )


def panel(
    kind: str,
    title: str,
    description: str,
    targets: list[Json],
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    stack: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
    overrides: list[Json] | None = None,
) -> Json:
    """A panel without position; ``layout`` places it."""
    defaults: Json = {"unit": unit}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for color, value in thresholds],
        }
    options: Json
    if kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if thresholds else "off"},
        }
        options = {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "value_and_name",
            "colorMode": "background" if thresholds else "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
        }
    elif kind == "state-timeline":
        defaults["color"] = {"mode": "thresholds"}
        options = {"showValue": "auto", "mergeValues": True, "rowHeight": 0.9}
    else:
        raise ValueError(f"unknown panel kind {kind}")
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options,
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
    }


def unit_of(legend: str, unit: str) -> Json:
    """A panel override: the series whose legend starts with ``legend`` are in ``unit``."""
    return {
        "matcher": {"id": "byRegexp", "options": f"^{legend} .*"},
        "properties": [{"id": "unit", "value": unit}],
    }


def row(title: str) -> Json:
    """A row header."""
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
    }


def layout(panels: list[Json]) -> list[Json]:
    """Number the panels and flow them left to right, top to bottom, on Grafana's 24 columns."""
    x = y = line_height = 0
    for number, item in enumerate(panels, start=1):
        pos = item["gridPos"]
        if item["type"] == "row" or x + pos["w"] > 24:
            y += line_height
            x = line_height = 0
        pos["x"], pos["y"] = x, y
        item["id"] = number
        x += pos["w"]
        line_height = max(line_height, pos["h"])
        if item["type"] == "row":
            y += pos["h"]
            x = line_height = 0
    return panels


def datasource_variable() -> Json:
    """The Prometheus data source every panel uses."""
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
    }


def query_variable(name: str, label: str, metric: str, label_name: str) -> Json:
    """A multi-value variable listing ``label_name``'s values on ``metric``, with "All"."""
    definition = f"label_values({metric}, {label_name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": {"qryType": 1, "query": definition, "refId": "PrometheusVariableQueryEditor"},
        "current": {},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
    }


def dashboard(
    uid: str, title: str, description: str, variables: list[Json], panels: list[Json]
) -> Json:
    """A whole dashboard."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["goodput-gateway", "vllm", "llm-serving"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "type": "dashboards",
                "tags": ["goodput-gateway"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "title": "Goodput Gateway",
            }
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout(panels),
    }


# Error-budget burn rate: 1 spends a 30-day budget in 30 days; the pages fire at 6 and 14.4.
BURN_COLORS: list[tuple[str, float | None]] = [("green", None), ("orange", 1), ("red", 6)]
OBJECTIVE = "max by (tier) (gateway_slo_objective)"


def burn_rate(matchers: str, window: str) -> str:
    """The error budget's burn rate per tier and model over ``window``.

    The share of requests that missed their SLO over the share the tier's objective allows
    (1 - objective): 1 spends a 30-day budget in exactly 30 days.
    """
    unmet = share(SLO, 'result!="met"', matchers, "tier, model", window)
    return f"({unmet}) / on (tier) group_left () (1 - {OBJECTIVE})"


def overview() -> Json:
    """Gateway overview: goodput and SLOs first, then latency, traffic, admission, errors."""
    finished = 'result=~"met|missed_ttft|missed_tpot|missed_both"'
    slo = SLO
    panels = [
        row("Goodput and SLO attainment"),
        panel(
            "stat",
            "Goodput over the range",
            "Share of requests that met every SLO of their tier (TTFT and, where the tier has "
            "one, TPOT) over the dashboard's whole time range, per tier and model, from the "
            "gateway's counters. Rejected and errored requests count as misses. No requests in "
            "the range: no value.",
            refs(
                [(share(slo, 'result="met"', MT, "tier, model", "$__range"), "{{tier}} {{model}}")],
                instant=True,
            ),
            unit="percentunit",
            width=6,
            minimum=0,
            maximum=1,
        ),
        panel(
            "stat",
            "Error budget burn rate over the range",
            "The share of requests that missed their SLO over the dashboard's range, divided by "
            "the share the tier's objective allows (1 - gateway_slo_objective). 1 spends a "
            "30-day error budget in exactly 30 days; green below 1, orange from 1 (the budget "
            "will not last the month), red from 6 (the 6-hour page's pace).",
            refs([(burn_rate(MT, "$__range"), "{{tier}} {{model}}")], instant=True),
            unit="x",
            width=6,
            thresholds=BURN_COLORS,
        ),
        panel(
            "timeseries",
            "Goodput per tier and model",
            "Share of requests that met every SLO, per tier and model, over each point's rate "
            "interval, from the gateway's counters (gateway_slo_requests_total): a window with "
            "no requests shows a gap, never an old figure.",
            refs([(share(slo, 'result="met"', MT, "tier, model"), "{{tier}} {{model}}")]),
            unit="percentunit",
            width=12,
            maximum=1,
        ),
        panel(
            "timeseries",
            "Error budget burn rate (alert windows)",
            "The burn rate the SLO alerts see, per tier and model, over their long windows: "
            "1 hour (pages at 14.4 when the last 5 minutes agree) and 6 hours (pages at 6 when "
            "the last 30 minutes agree). Dashed: 6 and 14.4.",
            refs(
                [
                    (burn_rate(MT, "1h"), "1h {{tier}} {{model}}"),
                    (burn_rate(MT, "6h"), "6h {{tier}} {{model}}"),
                ]
            ),
            unit="x",
            width=12,
            thresholds=[("green", None), ("orange", 6), ("red", 14.4)],
        ),
        panel(
            "timeseries",
            "SLO results per tier",
            "Requests per second by SLO result, per tier and model: met, missed_ttft, "
            "missed_tpot, missed_both, missed_e2e, rejected (by admission) and errored.",
            refs(
                [
                    (
                        f"sum by (tier, model, result) (rate({slo}{{{MT}}}[{RATE}]))",
                        "{{tier}} {{model}} {{result}}",
                    )
                ]
            ),
            unit="reqps",
            width=12,
            stack=True,
        ),
        panel(
            "timeseries",
            "TTFT SLO attainment per tier",
            "Share of finished requests whose time to first token met the tier's TTFT target "
            "(results met or missed_tpot over all finished requests), per tier and model.",
            refs(
                [
                    (
                        share(slo, 'result=~"met|missed_tpot"', f"{MT},{finished}", "tier, model"),
                        "{{tier}} {{model}}",
                    )
                ]
            ),
            unit="percentunit",
            width=8,
            maximum=1,
        ),
        panel(
            "timeseries",
            "TPOT SLO attainment per tier",
            "Share of finished requests whose time per output token met the tier's TPOT target "
            "(results met or missed_ttft over all finished requests), per tier and model. A tier "
            "without a TPOT target (batch) always attains it.",
            refs(
                [
                    (
                        share(slo, 'result=~"met|missed_ttft"', f"{MT},{finished}", "tier, model"),
                        "{{tier}} {{model}}",
                    )
                ]
            ),
            unit="percentunit",
            width=8,
            maximum=1,
        ),
        panel(
            "stat",
            "Tier SLO targets and objectives",
            "The TTFT and TPOT targets and the goodput objective the gateway is configured "
            "with, per tier (GATEWAY_TIERS). Batch has no TPOT target.",
            refs(
                [
                    (f"max by (tier) (gateway_tier_slo_ttft_seconds{{{T}}})", "TTFT {{tier}}"),
                    (f"max by (tier) (gateway_tier_slo_tpot_seconds{{{T}}})", "TPOT {{tier}}"),
                    (f"max by (tier) (gateway_slo_objective{{{T}}})", "objective {{tier}}"),
                ],
                instant=True,
            ),
            unit="s",
            width=8,
            overrides=[unit_of("objective", "percentunit")],
        ),
        row("Latency per tier and model"),
        panel(
            "timeseries",
            "Time to first token",
            "Arrival at the gateway to the first streamed event carrying output: p50, p95, p99 "
            "per tier and model, and the tier's TTFT target.",
            refs(
                [
                    *quantiles(
                        "gateway_time_to_first_token_seconds",
                        MT,
                        "tier, model",
                        "{{tier}} {{model}}",
                    ),
                    (f"max by (tier) (gateway_tier_slo_ttft_seconds{{{T}}})", "SLO {{tier}}"),
                ]
            ),
            unit="s",
        ),
        panel(
            "timeseries",
            "Time per output token",
            "(E2E - TTFT) / (completion tokens - 1) of streamed requests: p50, p95, p99 per tier "
            "and model, and the tier's TPOT target.",
            refs(
                [
                    *quantiles(
                        "gateway_time_per_output_token_seconds",
                        MT,
                        "tier, model",
                        "{{tier}} {{model}}",
                    ),
                    (f"max by (tier) (gateway_tier_slo_tpot_seconds{{{T}}})", "SLO {{tier}}"),
                ]
            ),
            unit="s",
        ),
        panel(
            "timeseries",
            "Inter-token latency",
            "Gap between consecutive streamed output events, per token: p50, p95, p99 per tier "
            "and model.",
            refs(
                quantiles(
                    "gateway_inter_token_latency_seconds", MT, "tier, model", "{{tier}} {{model}}"
                )
            ),
            unit="s",
        ),
        panel(
            "timeseries",
            "End-to-end latency",
            "Arrival to the last output event (streamed) or the whole response: p50, p95, p99 "
            "per tier and model.",
            refs(
                quantiles(
                    "gateway_e2e_request_latency_seconds", MT, "tier, model", "{{tier}} {{model}}"
                )
            ),
            unit="s",
        ),
        panel(
            "timeseries",
            "Queue time (arrival to dispatch)",
            "Time from arrival to the request being sent to a worker, admission queueing "
            "included: p50, p95, p99 per tier and model.",
            refs(quantiles("gateway_queue_time_seconds", MT, "tier, model", "{{tier}} {{model}}")),
            unit="s",
            width=24,
        ),
        row("Traffic"),
        panel(
            "timeseries",
            "Request rate",
            "Finished requests per second by tier and endpoint (chat, completions), every outcome.",
            refs(
                [
                    (
                        f"sum by (tier, endpoint) (rate(gateway_requests_total{{{MT}}}[{RATE}]))",
                        "{{tier}} {{endpoint}}",
                    )
                ]
            ),
            unit="reqps",
            width=8,
            stack=True,
        ),
        panel(
            "timeseries",
            "Tokens per second in and out",
            "Prompt tokens (in) and completion tokens (out) per second by model, from the "
            "workers' usage reports.",
            refs(
                [
                    (
                        f"sum by (model) (rate(gateway_prompt_tokens_total{{{MT}}}[{RATE}]))",
                        "in {{model}}",
                    ),
                    (
                        f"sum by (model) (rate(gateway_completion_tokens_total{{{MT}}}[{RATE}]))",
                        "out {{model}}",
                    ),
                ]
            ),
            unit="short",
            width=8,
        ),
        panel(
            "timeseries",
            "Goodput tokens per second",
            "Completion tokens per second of requests that met their SLOs (goodput), against all "
            "completion tokens per second, per tier.",
            refs(
                [
                    (
                        f"sum by (tier) (rate(gateway_goodput_tokens_total{{{MT}}}[{RATE}]))",
                        "goodput {{tier}}",
                    ),
                    (
                        f"sum by (tier) (rate(gateway_completion_tokens_total{{{MT}}}[{RATE}]))",
                        "all {{tier}}",
                    ),
                ]
            ),
            unit="short",
            width=8,
        ),
        panel(
            "timeseries",
            "Requests in flight",
            "Requests being served now (dispatched or streaming), per tier, by every replica and "
            "process together.",
            refs([(f"sum by (tier) (gateway_in_flight_requests{{{MT}}})", "{{tier}}")]),
            width=16,
            height=6,
        ),
        panel(
            "state-timeline",
            "Shared state (Redis)",
            "gateway_shared_state_up: 1 while Redis (GATEWAY_REDIS_URL) answers and key limits "
            "and admission's views are the fleet's, 0 while a process of one of the gateway "
            "instances selected runs on its own (select one instance to see which). No data: "
            "the gateway runs without Redis.",
            refs([(f"min(gateway_shared_state_up{{{INST}}})", "shared state")]),
            unit="bool",
            width=8,
            height=6,
            thresholds=[("red", None), ("green", 1)],
        ),
        row("Admission"),
        panel(
            "timeseries",
            "Admission decisions",
            "Decisions per second: admitted at once, queued, rejected up front, shed from the "
            "queue, expired in the queue, cancelled by the client while queued.",
            refs(
                [
                    (
                        "sum by (decision) "
                        f"(rate(gateway_admission_decisions_total{{{T}}}[{RATE}]))",
                        "{{decision}}",
                    )
                ]
            ),
            unit="reqps",
            width=8,
            stack=True,
        ),
        panel(
            "timeseries",
            "Turned away per tier",
            "Share of admission decisions that rejected or shed the request, per tier.",
            refs(
                [
                    (
                        share(
                            "gateway_admission_decisions_total",
                            'decision=~"rejected|shed"',
                            T,
                            "tier",
                        ),
                        "{{tier}}",
                    )
                ]
            ),
            unit="percentunit",
            width=8,
            maximum=1,
        ),
        panel(
            "timeseries",
            "Turned away by reason",
            "Requests turned away per second, by why: deadline_unreachable (the queue ahead "
            "would not drain in time for the TTFT target), queue_full, prompt_too_long (over "
            "the tier's TTFT target even on an idle worker), key_quota (the client's own key "
            "limit), no_worker, queue_timeout (waited to its deadline), shed (made room for a "
            "more urgent request); and gateway_saturated (503: the gateway's own connections "
            "ran out, or its event loop was too busy to connect in time; every tier).",
            refs(
                [
                    (
                        "sum by (reason) (rate(gateway_admission_decisions_total"
                        f'{{{T},decision=~"rejected|expired|shed"}}[{RATE}]))',
                        "{{reason}}",
                    ),
                    (
                        f"sum by (resource) (rate(gateway_saturated_total[{RATE}]))",
                        "gateway_saturated: {{resource}}",
                    ),
                ]
            ),
            unit="reqps",
            width=8,
            stack=True,
        ),
        panel(
            "timeseries",
            "Queue depth",
            "Requests waiting in the admission queue, per tier.",
            refs([(f"sum by (tier) (gateway_queue_depth{{{T}}})", "{{tier}}")]),
            width=8,
        ),
        panel(
            "timeseries",
            "Queue wait",
            "Time spent waiting in the admission queue: p50, p95, p99 per tier.",
            refs(quantiles("gateway_queue_wait_seconds", T, "tier", "{{tier}}")),
            unit="s",
        ),
        panel(
            "timeseries",
            "Fair share within a tier",
            "Under saturation, freed slots go round a tier's fairness ids (API keys, or ids a "
            "key may set) by weight: how many ids wait per tier, and the share of the tier's "
            "running requests held by the waiting id holding most (0-1; near 1 while one id "
            "floods and others wait).",
            refs(
                [
                    (f"max by (tier) (gateway_fairness_waiting_ids{{{T}}})", "{{tier}} ids"),
                    (f"max by (tier) (gateway_fairness_top_share{{{T}}})", "{{tier}} top share"),
                ]
            ),
        ),
        panel(
            "timeseries",
            "TTFT prediction error",
            "|actual - predicted| time to first token, the error of the predictor routing ranks "
            "workers by: p50, p95, p99 per tier.",
            refs(quantiles("gateway_ttft_prediction_error_seconds", T, "tier", "{{tier}}")),
            unit="s",
        ),
        row("Errors and gateway overhead"),
        panel(
            "timeseries",
            "Errors by kind",
            "Requests per second that did not end ok, by outcome (client_cancelled, "
            "upstream_error, timeout, rejected, invalid_request) and HTTP status class.",
            refs(
                [
                    (
                        "sum by (outcome, status_class) "
                        f'(rate(gateway_requests_total{{{MT},outcome!="ok"}}[{RATE}]))',
                        "{{outcome}} {{status_class}}",
                    )
                ]
            ),
            unit="reqps",
            width=8,
            stack=True,
        ),
        panel(
            "timeseries",
            "Failed share per tier",
            "Share of requests per tier that failed for a reason other than the client "
            "cancelling (upstream errors, timeouts, rejections, invalid requests).",
            refs(
                [
                    (
                        share(
                            "gateway_requests_total",
                            'outcome!~"ok|client_cancelled"',
                            MT,
                            "tier",
                        ),
                        "{{tier}}",
                    )
                ]
            ),
            unit="percentunit",
            width=8,
            maximum=1,
        ),
        panel(
            "timeseries",
            "Gateway overhead",
            "Time spent in the gateway's own code per request (not waiting on worker or client): "
            "p50, p99 and mean per model.",
            refs(
                [
                    *quantiles("gateway_overhead_seconds", M, "model", "{{model}}", (0.5, 0.99)),
                    (
                        f"sum by (model) (rate(gateway_overhead_seconds_sum{{{M}}}[{RATE}])) / "
                        f"sum by (model) (rate(gateway_overhead_seconds_count{{{M}}}[{RATE}]))",
                        "mean {{model}}",
                    ),
                ]
            ),
            unit="s",
            width=8,
        ),
    ]
    return dashboard(
        "goodput-gateway-overview",
        "Goodput Gateway / Overview",
        "Goodput and SLO attainment per tier, latency, traffic, admission, errors and the "
        "gateway's own overhead.",
        [
            query_variable("model", "Model", "gateway_requests_total", "model"),
            query_variable("tier", "Tier", "gateway_requests_total", "tier"),
            query_variable("instance", "Gateway", "gateway_workers_known", "instance"),
        ],
        panels,
    )


def workers() -> Json:
    """Workers: health, routing, load, saturation, measured latency and the roofline."""
    achieved = f"sum by (worker) (rate(gateway_worker_completion_tokens_total{{{W}}}[{RATE}]))"
    panels = [
        row("Health and routing"),
        panel(
            "state-timeline",
            "Worker up and ejected",
            "gateway_worker_up: 1 while the worker answers its probe and is not ejected. "
            "gateway_worker_ejected: 1 while passive health keeps it out of rotation.",
            refs(
                [
                    (f"max by (worker) (gateway_worker_up{{{W}}})", "up {{worker}}"),
                    (f"max by (worker) (gateway_worker_ejected{{{W}}})", "ejected {{worker}}"),
                ]
            ),
            unit="bool",
            width=12,
            thresholds=[("red", None), ("green", 1)],
            overrides=[
                {
                    # Ejected is the bad state: red when 1.
                    "matcher": {"id": "byRegexp", "options": "^ejected .*"},
                    "properties": [
                        {
                            "id": "thresholds",
                            "value": {
                                "mode": "absolute",
                                "steps": [
                                    {"color": "green", "value": None},
                                    {"color": "red", "value": 1},
                                ],
                            },
                        }
                    ],
                }
            ],
        ),
        panel(
            "stat",
            "Healthy workers",
            "Workers up and not ejected, out of all workers the gateway knows (0 of 0 when it "
            "knows none). With several gateway replicas a worker counts once, as healthy only if "
            "every replica sees it so.",
            refs(
                [
                    (f"sum(min by (worker) (gateway_worker_up{{{W}}})) or vector(0)", "healthy"),
                    (f"count(max by (worker) (gateway_worker_up{{{W}}})) or vector(0)", "known"),
                ],
                instant=True,
            ),
            width=4,
        ),
        panel(
            "timeseries",
            "Routed share",
            "Share of request attempts the gateway sent to each worker.",
            refs(
                [
                    (
                        "sum by (worker) "
                        f"(rate(gateway_worker_routed_requests_total{{{W}}}[{RATE}]))"
                        " / ignoring (worker) group_left () "
                        f"sum (rate(gateway_worker_routed_requests_total{{{W}}}[{RATE}]))",
                        "{{worker}}",
                    )
                ]
            ),
            unit="percentunit",
            width=8,
            maximum=1,
            stack=True,
        ),
        panel(
            "timeseries",
            "Failovers and ejections",
            "Requests moved to another worker after failing here before their first byte, and "
            "ejections of the worker, per second.",
            refs(
                [
                    (
                        f"sum by (worker) (rate(gateway_worker_failovers_total{{{W}}}[{RATE}]))",
                        "failovers {{worker}}",
                    ),
                    (
                        f"sum by (worker) (rate(gateway_worker_ejections_total{{{W}}}[{RATE}]))",
                        "ejections {{worker}}",
                    ),
                ]
            ),
            unit="ops",
            width=24,
            height=6,
        ),
        row("Load"),
        panel(
            "timeseries",
            "Running and waiting requests (gateway's view)",
            "The worker's running and waiting requests as the gateway last scraped them (the "
            "routing and admission inputs), and the requests the gateway has open on it (every "
            "replica and process of the gateway instances selected together).",
            refs(
                [
                    (
                        f"max by (worker) (gateway_worker_running_requests{{{W}}})",
                        "running {{worker}}",
                    ),
                    (
                        f"max by (worker) (gateway_worker_waiting_requests{{{W}}})",
                        "waiting {{worker}}",
                    ),
                    (
                        f"sum by (worker) (gateway_worker_in_flight_requests{{{WI}}})",
                        "gateway in flight {{worker}}",
                    ),
                ]
            ),
        ),
        panel(
            "timeseries",
            "Running and waiting requests (vLLM's view)",
            "vllm:num_requests_running and vllm:num_requests_waiting from the worker's own "
            "/metrics, scraped by Prometheus.",
            refs(
                [
                    (f"sum by (worker) (vllm:num_requests_running{{{VW}}})", "running {{worker}}"),
                    (f"sum by (worker) (vllm:num_requests_waiting{{{VW}}})", "waiting {{worker}}"),
                ]
            ),
        ),
        panel(
            "timeseries",
            "Load signal age",
            "Age of the worker's load figures at export time; above a few seconds routing ranks "
            "the worker behind every fresh one.",
            refs([(f"max by (worker) (gateway_worker_load_age_seconds{{{W}}})", "{{worker}}")]),
            unit="s",
            width=8,
        ),
        panel(
            "timeseries",
            "Admission limits",
            "Requests the gateway has open on the worker, and those still prefilling, against "
            "the limits admission steers from measured latency: the concurrency limit (follows "
            "TPOT against the strictest TPOT target) and the prefill limit (follows the worker's "
            "time to first token). While the concurrency limit is unmeasured, 'seen to serve' "
            "is the most the worker ran with streams within the TPOT aim (0 once measured or "
            "before any such load): slots kept for higher tiers come out of it. Open requests "
            "at the limit mean the gateway's queue, not the worker's, holds the backlog. Open "
            "and prefilling requests add up over the gateway instances selected; each instance "
            "learns its own limits (the highest is shown): select one instance to see its own.",
            refs(
                [
                    (
                        f"sum by (worker) (gateway_worker_in_flight_requests{{{WI}}})",
                        "open {{worker}}",
                    ),
                    (
                        f"max by (worker) (gateway_worker_concurrency_limit{{{WI}}})",
                        "limit {{worker}}",
                    ),
                    (
                        f"sum by (worker) (gateway_worker_prefilling_requests{{{WI}}})",
                        "prefilling {{worker}}",
                    ),
                    (
                        f"max by (worker) (gateway_worker_prefill_concurrency_limit{{{WI}}})",
                        "prefill limit {{worker}}",
                    ),
                    (
                        f"max by (worker) (gateway_worker_proven_concurrency{{{WI}}})",
                        "seen to serve {{worker}}",
                    ),
                ]
            ),
            width=8,
        ),
        panel(
            "timeseries",
            "Decode pace vs TPOT target",
            "Per token, how fast the worker's running streams advanced over the last few seconds "
            "(mean gap between their output events), against the strictest TPOT target. Above "
            "the target, the batch has outgrown it and admission cuts the worker's concurrency "
            "limit at once, without waiting for the streams to finish.",
            refs(
                [
                    (
                        f"max by (worker) (gateway_worker_decode_pace_seconds{{{WI}}})",
                        "pace {{worker}}",
                    ),
                    ("min(gateway_tier_slo_tpot_seconds)", "TPOT target"),
                ]
            ),
            unit="s",
            width=8,
        ),
        panel(
            "timeseries",
            "Admission limit cuts by cause",
            "Times admission lowered the worker's limits, per second. Running limit: tpot_miss "
            "(a finished stream over the strictest TPOT target), decode_pace (the running "
            "streams together slower than it), decode_line (the learnt decode line puts the "
            "TPOT aim below the limit), worker_queueing (vLLM held requests back for capacity). "
            "Prefill limit: ttft_miss (the worker's own time to first token over its share of "
            "the TTFT target).",
            refs(
                [
                    (
                        "sum by (worker, cause) "
                        f"(rate(gateway_worker_limit_cuts_total{{{WI}}}[{RATE}]))",
                        "{{cause}} {{worker}}",
                    ),
                ]
            ),
            unit="ops",
            width=24,
            height=6,
        ),
        row("Saturation (vLLM's own figures)"),
        panel(
            "timeseries",
            "KV-cache use",
            "Share of the worker's KV-cache blocks in use: the gateway's scraped copy and vLLM's "
            "own vllm:kv_cache_usage_perc (a 0..1 ratio despite its name).",
            refs(
                [
                    (
                        f"max by (worker) (gateway_worker_kv_cache_usage_ratio{{{W}}})",
                        "gateway {{worker}}",
                    ),
                    (f"max by (worker) (vllm:kv_cache_usage_perc{{{VW}}})", "vLLM {{worker}}"),
                ]
            ),
            unit="percentunit",
            maximum=1,
            thresholds=[("green", None), ("red", 0.95)],
        ),
        panel(
            "timeseries",
            "Waiting requests by reason",
            "vllm:num_requests_waiting_by_reason: requests the worker holds back, by why: "
            "capacity (no room in the running batch or KV cache: the worker is full; admission "
            "stops sending to it) or deferred (transient: LoRA budget, KV transfer).",
            refs(
                [
                    (
                        f"sum by (worker, reason) (vllm:num_requests_waiting_by_reason{{{VW}}})",
                        "{{reason}} {{worker}}",
                    )
                ]
            ),
        ),
        panel(
            "timeseries",
            "Preemptions",
            "vllm:num_preemptions_total per second: running requests the worker evicted to free "
            "KV-cache blocks (they are recomputed later, so their tokens stall). Any steady rate "
            "means the KV cache is too small for the batch admission lets run.",
            refs(
                [
                    (
                        f"sum by (worker) (rate(vllm:num_preemptions_total{{{VW}}}[{RATE}]))",
                        "{{worker}}",
                    )
                ]
            ),
            unit="ops",
        ),
        panel(
            "timeseries",
            "Prefix-cache hit rate",
            "Share of prompt tokens the worker found in its prefix cache "
            "(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total): what session "
            "affinity (x-session-id) earns. Only whole KV blocks are cached, so prompts shorter "
            "than a block never hit.",
            refs(
                [
                    (
                        f"sum by (worker) (rate(vllm:prefix_cache_hits_total{{{VW}}}[{RATE}])) / "
                        "(sum by (worker) "
                        f"(rate(vllm:prefix_cache_queries_total{{{VW}}}[{RATE}])) > 0)",
                        "{{worker}}",
                    )
                ]
            ),
            unit="percentunit",
            maximum=1,
        ),
        row("Measured latency per worker"),
        panel(
            "timeseries",
            "Time to first token per worker",
            "Dispatch to first output event as the gateway measured it (p50, p99), and vLLM's own "
            "p99 TTFT (excludes the network and the gateway).",
            refs(
                [
                    *quantiles(
                        "gateway_worker_time_to_first_token_seconds",
                        W,
                        "worker",
                        "{{worker}}",
                        (0.5, 0.99),
                    ),
                    *quantiles(
                        "vllm:time_to_first_token_seconds",
                        VW,
                        "worker",
                        "vLLM {{worker}}",
                        (0.99,),
                    ),
                ]
            ),
            unit="s",
        ),
        panel(
            "timeseries",
            "Inter-token latency per worker",
            "Gap between output events per token as the gateway measured it (p50, p99), and "
            "vLLM's own p99 inter-token latency.",
            refs(
                [
                    *quantiles(
                        "gateway_worker_inter_token_latency_seconds",
                        W,
                        "worker",
                        "{{worker}}",
                        (0.5, 0.99),
                    ),
                    *quantiles(
                        "vllm:inter_token_latency_seconds",
                        VW,
                        "worker",
                        "vLLM {{worker}}",
                        (0.99,),
                    ),
                ]
            ),
            unit="s",
        ),
        row("Roofline (engine counters)"),
        panel(
            "timeseries",
            "Model FLOPs utilisation (MFU)",
            "FLOP/s the engine estimates it performs per GPU (vllm:estimated_flops_per_gpu_total, "
            "vLLM's --enable-mfu-metrics) over the worker's configured peak "
            "(gateway_worker_peak_flops_per_second, from GATEWAY_HARDWARE's peak_tflops). Decode "
            "is memory-bound: expect MFU far below MBU unless batches are large or prefill "
            "dominates.",
            refs([(f"{ENGINE_FLOPS} / on (worker) {PEAK_FLOPS}", "{{worker}}")]),
            unit="percentunit",
            width=8,
        ),
        panel(
            "timeseries",
            "Memory-bandwidth utilisation (MBU)",
            "Bytes per second the engine estimates it reads and writes per GPU "
            "(vllm:estimated_read_bytes_per_gpu_total + _write_bytes_per_gpu_total) over the "
            "worker's configured bandwidth (source engine). For an engine that does not count "
            "them, the estimate from GATEWAY_HARDWARE's model figures instead: decode tokens/s "
            "over the memory-bandwidth roofline of the batch it runs (source estimate).",
            refs([(MBU, "{{worker}} ({{source}})")]),
            unit="percentunit",
            width=8,
            thresholds=[("green", None), ("orange", 0.8)],
        ),
        panel(
            "timeseries",
            "Arithmetic intensity vs ridge point",
            "FLOPs per byte of memory traffic the engine estimates, against the worker's ridge "
            "point (peak FLOP/s / bandwidth). Below the ridge the work is memory-bound, and MBU "
            "is the utilisation to read; above it compute-bound, and MFU is.",
            refs(
                [
                    (f"{ENGINE_FLOPS} / {ENGINE_BYTES}", "intensity {{worker}}"),
                    (f"{PEAK_FLOPS} / on (worker) {BANDWIDTH}", "ridge {{worker}}"),
                ]
            ),
            unit="none",
            width=8,
        ),
        panel(
            "timeseries",
            "Decode tokens per second",
            "Completion tokens per second the worker produced for the gateway, and vLLM's own "
            "generation tokens per second (all its clients).",
            refs(
                [
                    (achieved, "gateway {{worker}}"),
                    (
                        f"sum by (worker) (rate(vllm:generation_tokens_total{{{VW}}}[{RATE}]))",
                        "vLLM {{worker}}",
                    ),
                ]
            ),
            unit="short",
            width=24,
            height=6,
        ),
        *prefix_cache_panels(),
        *kv_event_panels(),
    ]
    return dashboard(
        "goodput-gateway-workers",
        "Goodput Gateway / Workers",
        "Per vLLM worker: health, routed share, load, saturation, measured latency and the "
        "roofline (MFU and MBU from the engine's own FLOPs and bytes counters).",
        [
            query_variable("worker", "Worker", "gateway_worker_up", "worker"),
            query_variable("instance", "Gateway", "gateway_workers_known", "instance"),
            query_variable("model", "Model", "vllm:num_requests_running", "model_name"),
        ],
        panels,
    )


def prefix_cache_panels() -> list[Json]:
    """Workers dashboard, its own row: the router's predicted prefix-cache hits beside vLLM's."""

    def hit_rate(hits: str, queries: str, matchers: str) -> str:
        return (
            f"sum by (worker) (rate({hits}{{{matchers}}}[{RATE}])) / "
            f"(sum by (worker) (rate({queries}{{{matchers}}}[{RATE}])) > 0)"
        )

    return [
        row("Prefix cache"),
        panel(
            "timeseries",
            "Prefix-cache hit rate: predicted vs vLLM",
            "Share of prompt tokens found in the worker's prefix cache: as prefix_aware routing "
            "predicted it when it chose the worker (gateway_worker_predicted_prefix_hit_tokens "
            "over gateway_worker_prefix_query_tokens, summed over gateway replicas), and as the "
            "worker counted it (vllm:prefix_cache_hits over vllm:prefix_cache_queries, all "
            "clients), and as each usage told it for the gateway's own requests "
            "(gateway_worker_cached_prompt_tokens over gateway_worker_cache_told_prompt_tokens; "
            "vLLM started with --enable-prompt-tokens-details). Predicted well above found: the "
            "index remembers prefixes the worker has evicted "
            "(gateway_worker_prefix_missed_tokens counts that credit), or another client fills "
            "its cache; well below: traffic from elsewhere (other replicas, other tenants) warms "
            "the cache. Predicted empty for the gateway under other policies.",
            refs(
                [
                    (
                        hit_rate(
                            "gateway_worker_predicted_prefix_hit_tokens_total",
                            "gateway_worker_prefix_query_tokens_total",
                            W,
                        ),
                        "predicted {{worker}}",
                    ),
                    (
                        hit_rate(
                            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", VW
                        ),
                        "vLLM {{worker}}",
                    ),
                    (
                        hit_rate(
                            "gateway_worker_cached_prompt_tokens_total",
                            "gateway_worker_cache_told_prompt_tokens_total",
                            W,
                        ),
                        "found {{worker}}",
                    ),
                ]
            ),
            unit="percentunit",
            maximum=1,
            width=16,
        ),
        panel(
            "timeseries",
            "Prefix index memory",
            "Memory of prefix_aware routing's index of recent prompts in the gateway replica "
            "holding the most (each is capped by GATEWAY_PREFIX_INDEX_MB), and the blocks of "
            "256 characters it remembers per worker (also held to what the worker's KV cache "
            "can keep); with KV events followed, the prompts' tokens kept (capped by "
            "GATEWAY_KV_TOKENS_CACHE_MB).",
            refs(
                [
                    ("max(gateway_prefix_index_bytes)", "bytes, largest replica"),
                    ("max(gateway_prompt_tokens_cache_bytes)", "bytes of tokens, largest replica"),
                    (
                        f"sum by (worker) (gateway_worker_prefix_index_blocks{{{W}}})",
                        "blocks {{worker}}",
                    ),
                ]
            ),
            width=8,
            overrides=[unit_of("bytes", "bytes")],
        ),
    ]


def kv_event_panels() -> list[Json]:
    """Workers dashboard, after the prefix cache: following the workers' KV cache events."""
    return [
        panel(
            "timeseries",
            "KV cache events",
            "prefix_aware routing on the workers' KV cache events (GATEWAY_KV_EVENTS): event "
            "batches applied per second per worker, summed over gateway processes, and batches "
            "lost (a gap the worker's replay could not fill: that index is incomplete until the "
            "worker's cache is emptied). Empty when no worker's events are followed.",
            refs(
                [
                    (
                        f"sum by (worker) (rate(gateway_worker_kv_events_total{{{W}}}[{RATE}]))",
                        "batches/s {{worker}}",
                    ),
                    (
                        f"sum by (worker) "
                        f"(increase(gateway_worker_kv_event_batches_lost_total{{{W}}}[{RATE}]))",
                        "lost {{worker}}",
                    ),
                ]
            ),
            width=8,
        ),
        panel(
            "timeseries",
            "KV event lag and index",
            "p99 of the time from the worker stamping a batch to the gateway applying it (two "
            "machines' wall clocks), the blocks each worker's index holds (largest gateway "
            "process), and 1 while every process's index of the worker is complete.",
            refs(
                [
                    (
                        "histogram_quantile(0.99, sum by (worker, le) "
                        f"(rate(gateway_worker_kv_event_lag_seconds_bucket{{{W}}}[{RATE}])))",
                        "lag p99 {{worker}}",
                    ),
                    (
                        f"max by (worker) (gateway_worker_kv_index_blocks{{{W}}})",
                        "blocks {{worker}}",
                    ),
                    (
                        f"min by (worker) (gateway_worker_kv_index_complete{{{W}}})",
                        "complete {{worker}}",
                    ),
                ]
            ),
            width=8,
            overrides=[unit_of("lag", "s")],
        ),
        panel(
            "timeseries",
            "Prompts mapped to tokens",
            "How each prompt routed on KV events got its tokens, per second: `local` (the "
            "gateway's copy of the tokenizer, GATEWAY_TOKENIZERS), `cached` (seen before), "
            "`partial` (an earlier turn's, the whole asked behind), `asked` (waited for a "
            "worker's /tokenize, which costs that worker CPU), `failed` (the approximate index).",
            refs(
                [
                    (
                        f"sum by (result) (rate(gateway_prompt_tokenizations_total[{RATE}]))",
                        "{{result}}",
                    )
                ]
            ),
            unit="reqps",
            width=8,
        ),
    ]


def build() -> dict[str, Json]:
    """Every dashboard, by file name."""
    return {"gateway-overview.json": overview(), "gateway-workers.json": workers()}


def render(board: Json) -> str:
    """The JSON text committed for a dashboard."""
    return json.dumps(board, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with ``--check`` report the stale ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    parser.add_argument("--out", type=Path, default=DASHBOARD_DIR, help="output directory")
    args = parser.parse_args(argv)
    stale = []
    for name, board in build().items():
        path = args.out / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python -m scripts.gen_dashboards):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
