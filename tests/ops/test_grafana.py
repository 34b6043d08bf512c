"""Grafana: the dashboards are valid, generated, on the metric contract, and provisioned."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from scripts import gen_dashboards
from tests.ops.support import (
    REPO,
    TARGET_LABELS,
    contract_series,
    contract_violations,
    dump_yaml,
    load_yaml,
    tool,
)

DASHBOARDS = REPO / "grafana" / "dashboards"
PROVISIONING = REPO / "grafana" / "provisioning"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
# Which template variables each dashboard must offer.
REQUIRED_VARIABLES = {
    "goodput-gateway-overview": {"datasource", "model", "tier", "instance"},
    "goodput-gateway-workers": {"datasource", "worker", "model", "instance"},
}


def _boards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves left out."""
    found = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def _exprs(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` for every query of the dashboard."""
    return [
        (panel["title"], target["refId"], target["expr"])
        for panel in _panels(board)
        for target in panel["targets"]
    ]


def _variable_refs(text: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", text))


def test_committed_dashboards_equal_generator_output() -> None:
    built = gen_dashboards.build()
    assert sorted(built) == sorted(p.name for p in DASHBOARDS.glob("*.json"))
    for name, board in built.items():
        committed = (DASHBOARDS / name).read_text()
        assert committed == gen_dashboards.render(board), (
            f"{name} is stale: run `python -m scripts.gen_dashboards`"
        )


def test_dashboards_are_valid_grafana_json() -> None:
    boards = _boards()
    assert set(boards) == {"gateway-overview.json", "gateway-workers.json"}
    for name, board in boards.items():
        for key in ("uid", "title", "panels", "templating", "schemaVersion", "time"):
            assert key in board, f"{name} lacks {key}"
        assert isinstance(board["schemaVersion"], int)
        assert board["schemaVersion"] >= 36
        assert board["panels"], f"{name} has no panels"


def test_uids_and_panel_ids_are_unique() -> None:
    uids = [board["uid"] for board in _boards().values()]
    assert len(uids) == len(set(uids))
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", uid) for uid in uids)
    for name, board in _boards().items():
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name} repeats a panel id"


def test_every_panel_has_a_datasource_and_targets() -> None:
    for name, board in _boards().items():
        for panel in _panels(board):
            where = f"{name}: {panel['title']}"
            assert panel.get("datasource") == DATASOURCE, where
            assert panel.get("targets"), f"{where} has no targets"
            refs = [target["refId"] for target in panel["targets"]]
            assert len(refs) == len(set(refs)), f"{where} repeats a refId"
            for target in panel["targets"]:
                assert target.get("datasource") == DATASOURCE, where
                assert target.get("expr", "").strip(), f"{where} {target['refId']} has no expr"
            assert panel.get("description"), f"{where} has no description"


def test_panels_fit_the_grid_without_overlapping() -> None:
    for name, board in _boards().items():
        taken: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] >= 0, f"{name}: {panel['title']}"
            assert pos["x"] + pos["w"] <= 24, f"{name}: {panel['title']}"
            cells = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & taken, f"{name}: {panel['title']} overlaps another panel"
            taken |= cells


def test_queries_use_only_contract_metrics_and_labels() -> None:
    problems = []
    for name, board in _boards().items():
        allow_vllm = board["uid"] == "goodput-gateway-workers"
        for title, ref, expr in _exprs(board):
            problems += [
                f"{name}: {title} [{ref}]: {p}" for p in contract_violations(expr, allow_vllm)
            ]
    assert not problems, "\n".join(problems)


def test_template_variables_exist_are_used_and_query_the_contract() -> None:
    series = contract_series()
    for name, board in _boards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert REQUIRED_VARIABLES[board["uid"]] <= set(variables), name
        used = set()
        for _, _, expr in _exprs(board):
            refs = _variable_refs(expr)
            unknown = refs - set(variables) - GRAFANA_BUILTINS
            assert not unknown, f"{name}: {expr} uses undefined {unknown}"
            used |= refs
        for panel in _panels(board):
            used |= _variable_refs(json.dumps(panel["datasource"]))
        assert set(variables) <= used, f"{name}: unused variables {set(variables) - used}"
        for var in variables.values():
            if var["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((\S+), (\w+)\)", var["definition"])
            assert match, f"{name}: variable {var['name']} is not a label_values() query"
            metric, label = match.groups()
            if metric.startswith("vllm:"):
                assert board["uid"] == "goodput-gateway-workers"
            else:
                assert metric in series, var["definition"]
                assert label in series[metric] | TARGET_LABELS, var["definition"]
            assert var["datasource"] == DATASOURCE


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool parses every expression (as a recording rule), with Grafana's variables filled."""
    rules = []
    for name, board in _boards().items():
        for title, ref, expr in _exprs(board):
            text = (
                expr.replace("$__rate_interval", "1m")
                .replace("$__range", "1h")
                .replace("$__interval", "15s")
                .replace("$model", "m")
                .replace("$tier", "t")
                .replace("$worker", "w")
            )
            record = re.sub(r"[^a-z0-9_]", "_", f"{name}_{title}_{ref}".lower())
            rules.append({"record": f"check:{record}", "expr": text})
    path = tmp_path / "queries.yml"
    path.write_text(dump_yaml({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_datasource_provisioning_points_at_compose_prometheus() -> None:
    files = list((PROVISIONING / "datasources").glob("*.yml"))
    assert files
    sources = [s for f in files for s in load_yaml(f.read_text())["datasources"]]
    prometheus = [s for s in sources if s["type"] == "prometheus"]
    assert len(prometheus) == 1
    assert prometheus[0]["url"] == "http://prometheus:9090"
    assert prometheus[0]["isDefault"] is True


def test_dashboard_provisioning_matches_compose_mounts() -> None:
    providers = [
        p
        for f in (PROVISIONING / "dashboards").glob("*.yml")
        for p in load_yaml(f.read_text())["providers"]
    ]
    assert len(providers) == 1
    path = providers[0]["options"]["path"]
    compose = load_yaml((REPO / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{path}:ro" in volumes
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    home = compose["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert Path(home).parent == Path(path)
    assert (DASHBOARDS / Path(home).name).exists()


@pytest.mark.parametrize("board", ["gateway-overview.json", "gateway-workers.json"])
def test_dashboard_configmap_lists_every_dashboard(board: str) -> None:
    kustomization = load_yaml((REPO / "grafana" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert f"dashboards/{board}" in generator["files"]
    assert kustomization["generatorOptions"]["labels"]["grafana_dashboard"] == "1"


def test_contract_checker_catches_strays() -> None:
    """The checker the dashboard tests rely on is not vacuous."""
    problems = contract_violations(
        'sum by (foo) (gateway_queue_depth{model="x"}) / on () bogus_metric', allow_vllm=False
    )
    assert "metric bogus_metric is not in the contract" in problems
    assert "gateway_queue_depth has no label model" in problems
    assert any("grouping by foo" in p for p in problems)
    assert contract_violations("vllm:num_requests_running", allow_vllm=False)
    assert not contract_violations(
        'sum by (worker) (vllm:num_requests_running{model_name="m"})', allow_vllm=True
    )


def test_healthy_workers_counts_each_worker_once_across_gateway_replicas(tmp_path: Path) -> None:
    """Two gateway replicas report the same two workers; one replica has ejected worker b.
    The panel must say 1 healthy of 2 known (summing over replicas said 3 of 4)."""
    board = _boards()["gateway-workers.json"]
    (panel,) = [p for p in _panels(board) if p["title"] == "Healthy workers"]
    exprs = {t["legendFormat"]: t["expr"].replace('worker=~"$worker"', 'worker=~".*"')
             for t in panel["targets"]}  # fmt: skip
    series = [
        ("gw-1", "a", "1"),
        ("gw-2", "a", "1"),
        ("gw-1", "b", "1"),
        ("gw-2", "b", "0"),
    ]
    tests = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {
                        "series": f'gateway_worker_up{{instance="{gw}",worker="{worker}"}}',
                        "values": f"{value}x4",
                    }
                    for gw, worker, value in series
                ],
                "promql_expr_test": [
                    {
                        "expr": exprs[legend],
                        "eval_time": "30s",
                        "exp_samples": [{"labels": "{}", "value": expected}],
                    }
                    for legend, expected in (("healthy", 1), ("known", 2))
                ],
            }
        ],
    }
    path = tmp_path / "healthy_test.yml"
    path.write_text(dump_yaml(tests))
    result = subprocess.run(
        [tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_requests_open_on_a_worker_add_up_across_gateway_replicas(tmp_path: Path) -> None:
    """Two gateway replicas (each the sum of its own processes) have 3 and 2 requests open on
    worker a and learnt limits of 8 and 10: the panel shows 5 open (the highest replica's 3
    hid two), against the highest limit, 10; with one replica selected, its own."""
    board = _boards()["gateway-workers.json"]
    (panel,) = [p for p in _panels(board) if p["title"] == "Admission limits"]
    exprs = {t["legendFormat"]: t["expr"].replace('worker=~"$worker"', 'worker=~".*"')
             for t in panel["targets"]}  # fmt: skip
    series = [
        ("gateway_worker_in_flight_requests", "gw-1", "3"),
        ("gateway_worker_in_flight_requests", "gw-2", "2"),
        ("gateway_worker_concurrency_limit", "gw-1", "8"),
        ("gateway_worker_concurrency_limit", "gw-2", "10"),
    ]
    cases = (
        (".*", "open {{worker}}", 5),
        (".*", "limit {{worker}}", 10),
        ("gw-1", "open {{worker}}", 3),
        ("gw-1", "limit {{worker}}", 8),
    )
    tests = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": f'{name}{{instance="{gw}",worker="a"}}', "values": f"{value}x4"}
                    for name, gw, value in series
                ],
                "promql_expr_test": [
                    {
                        "expr": exprs[legend].replace("$instance", instance),
                        "eval_time": "30s",
                        "exp_samples": [{"labels": '{worker="a"}', "value": expected}],
                    }
                    for instance, legend, expected in cases
                ],
            }
        ],
    }
    path = tmp_path / "open_test.yml"
    path.write_text(dump_yaml(tests))
    result = subprocess.run(
        [tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
