"""Every dashboard query returns data from a real Prometheus scraping a real gateway and worker.

A Prometheus from Debian's package scrapes the gateway's and the vLLM worker's /metrics every
second while a short load of streaming requests (every tier, both endpoints, a few invalid and
cancelled ones) runs through the gateway. Then each panel query of each dashboard, with the
template variables filled in as Grafana would, goes to Prometheus's /api/v1/query; so do the
template variables' own queries and the recording rules' expressions. Every query that errors,
returns nothing or only NaN is reported, all together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from scripts.processes import stop_process
from tests.ops.support import LIVE_API_KEY, REPO, dump_yaml, load_yaml, tool
from tests.servers import free_port

pytestmark = [pytest.mark.worker, pytest.mark.asyncio(loop_scope="session")]

SCRAPE_INTERVAL = "1s"
# What Grafana's interval variables become. The window reaches back over the whole load.
RATE_INTERVAL = "30s"
INTERVAL = "5s"
# The dashboards' default time range (now-1h).
RANGE = "1h"
TIERS = ("interactive", "standard", "batch")
STREAMED_REQUESTS = 36
CONCURRENCY = 4


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


@dataclass
class LiveStack:
    """A running Prometheus and what the load left behind."""

    prometheus: str
    model: str
    load_report: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def prometheus_url(
    live_gateway_url: str, vllm_worker_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A Prometheus on a free port scraping the gateway and the worker every second."""
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "goodput-gateway",
                "static_configs": [{"targets": [_host_port(live_gateway_url)]}],
            },
            {
                # As in prometheus/prometheus.yml: the worker label is the target's host:port,
                # the name the gateway gives a worker configured by URL.
                "job_name": "vllm",
                "static_configs": [{"targets": [_host_port(vllm_worker_url)]}],
                "relabel_configs": [{"source_labels": ["__address__"], "target_label": "worker"}],
            },
        ],
    }
    (workdir / "prometheus.yml").write_text(dump_yaml(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.console.templates=/nonexistent",
            "--web.console.libraries=/nonexistent",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited: {(workdir / 'prometheus.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready in 30 s")
            time.sleep(0.2)
        yield url
    finally:
        stop_process(process, grace=15)
        log.close()


async def _targets_up(client: httpx.AsyncClient, prometheus: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        response = await client.get(f"{prometheus}/api/v1/targets")
        targets = response.json()["data"]["activeTargets"]
        if len(targets) == 2 and all(t["health"] == "up" for t in targets):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"scrape targets not up: {json.dumps(targets, indent=1)[:2000]}")
        await asyncio.sleep(0.5)


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], tier: str, cancel: bool = False
) -> str:
    """One streamed request; with ``cancel``, hang up after the first chunk."""
    async with client.stream(
        "POST", path, json=body, headers={"x-gateway-tier": tier}, timeout=120
    ) as response:
        if response.status_code != 200:
            await response.aread()
            hint = ""
            if response.status_code in {401, 403}:
                hint = " (the live gateway must accept LIVE_API_KEY for tier interactive)"
            return f"{path} {tier}: HTTP {response.status_code} {response.text[:200]}{hint}"
        async for _ in response.aiter_bytes():
            if cancel:
                return ""
    return ""


_SYSTEM = "You are a helpful assistant who answers briefly and politely. " * 30


async def _load(gateway: str, model: str) -> list[str]:
    """Streamed chat and completion requests over every tier, plus invalid and cancelled ones."""
    problems: list[str] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    headers = {"authorization": f"Bearer {LIVE_API_KEY}"}
    async with httpx.AsyncClient(base_url=gateway, headers=headers) as client:

        async def one(i: int) -> None:
            tier = TIERS[i % len(TIERS)]
            if i % 4 == 3:
                path = "/v1/completions"
                body: dict[str, Any] = {"model": model, "prompt": f"Count to {i}:"}
            else:
                path = "/v1/chat/completions"
                # A system prompt of a few hundred tokens, as chat applications send, one per
                # four requests: whole KV blocks the worker caches all through the load, whose
                # events the KV panels show.
                messages = [
                    {"role": "system", "content": f"Session {i // 4}. {_SYSTEM}"},
                    {"role": "user", "content": f"Hi {i}"},
                ]
                body = {"model": model, "messages": messages}
            body.update({"stream": True, "max_tokens": 16, "temperature": 0})
            async with gate:
                problem = await _stream(client, path, body, tier)
            if problem:
                problems.append(problem)

        # Two waves a few scrapes apart: rate() needs a series to grow between two scrapes,
        # and one wave can fall between two scrapes on a fast machine.
        for wave in range(2):
            half = STREAMED_REQUESTS // 2
            await asyncio.gather(*(one(i) for i in range(wave * half, (wave + 1) * half)))
            await asyncio.sleep(2.5)
        # Failures the error panels show: an unknown model and a malformed body (invalid
        # requests), and streams the client abandons (client_cancelled).
        for tier in TIERS[:2]:
            await client.post(
                "/v1/chat/completions",
                json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                headers={"x-gateway-tier": tier},
            )
            await client.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"x-gateway-tier": tier, "content-type": "application/json"},
            )
            chat = {
                "model": model,
                "messages": [{"role": "user", "content": "Tell a long story."}],
                "stream": True,
                "max_tokens": 200,
            }
            await _stream(client, "/v1/chat/completions", chat, tier, cancel=True)
    return problems


@pytest.fixture(scope="module")
async def live(prometheus_url: str, live_gateway_url: str, vllm_worker_url: str) -> LiveStack:
    """Prometheus after a short load through the gateway."""
    async with httpx.AsyncClient(timeout=10) as client:
        await _targets_up(client, prometheus_url, within_s=30)
        models = (await client.get(f"{live_gateway_url}/v1/models")).json()["data"]
        model = str(models[0]["id"])
    report = await _load(live_gateway_url, model)
    # Two more scrapes, so the last requests are in Prometheus.
    await asyncio.sleep(2.5)
    return LiveStack(prometheus_url, model, report)


@dataclass
class Query:
    """One query to check, and where it comes from."""

    where: str
    expr: str


def _dashboard_queries() -> list[tuple[dict[str, Any], list[Query]]]:
    boards = []
    for path in sorted((REPO / "grafana" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        queries = []
        for panel in board["panels"]:
            for inner in panel.get("panels", []) if panel["type"] == "row" else [panel]:
                for target in inner.get("targets", []):
                    where = f"{board['title']} / {inner['title']} [{target['refId']}]"
                    queries.append(Query(where, target["expr"]))
        boards.append((board, queries))
    return boards


async def _label_values(
    client: httpx.AsyncClient, prometheus: str, metric: str, label: str
) -> list[str]:
    response = await client.get(
        f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric}
    )
    values: list[str] = response.json().get("data", [])
    return values


def _regex_of(values: list[str]) -> str:
    """A multi-value variable as Grafana formats it for =~ (regex characters escaped)."""
    escaped = [re.sub(r"([\\.+*?^$()\[\]{}|])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


async def _variables(
    client: httpx.AsyncClient, stack: LiveStack, board: dict[str, Any]
) -> tuple[dict[str, str], list[str]]:
    """Values for the board's variables (every value found, like Grafana's "All")."""
    values = {"__rate_interval": RATE_INTERVAL, "__interval": INTERVAL, "__range": RANGE}
    problems = []
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((\S+), (\w+)\)", var["definition"])
        assert match, var["definition"]
        found = await _label_values(client, stack.prometheus, *match.groups())
        if found:
            values[var["name"]] = _regex_of(found)
        else:
            problems.append(
                f"{board['title']} / variable ${var['name']}: {var['definition']} is empty"
            )
            values[var["name"]] = _regex_of([stack.model]) if var["name"] == "model" else ".*"
    return values, problems


def _substitute(expr: str, values: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        return values.get(match.group(1) or match.group(2), match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


async def _query(client: httpx.AsyncClient, prometheus: str, expr: str) -> dict[str, Any]:
    response = await client.get(f"{prometheus}/api/v1/query", params={"query": expr})
    body: dict[str, Any] = response.json()
    if response.status_code != 200:
        body.setdefault("error", response.text)
    return body


async def _check(client: httpx.AsyncClient, prometheus: str, query: Query) -> str | None:
    """Why ``query`` shows nothing, or None when it shows data."""
    body = await _query(client, prometheus, query.expr)
    if body.get("status") != "success":
        return f"{query.where}: error {body.get('error')!s} in {query.expr}"
    result = body["data"]["result"]
    if not result:
        return f"{query.where}: no data for {query.expr}"
    kind = body["data"]["resultType"]
    # Each gateway replica and each worker is a scrape target (an instance): a query that keeps
    # that label draws one line per replica, all with the same legend. Sum or pick instead.
    for item in result if kind in {"vector", "matrix"} else []:
        kept = {"instance", "job"} & set(item["metric"])
        if kept:
            return f"{query.where}: keeps {sorted(kept)} (one line per replica) in {query.expr}"
    if kind == "scalar":
        samples = [float(result[1])]
    elif kind == "matrix":
        samples = [float(value) for item in result for _, value in item["values"]]
    else:
        samples = [float(item["value"][1]) for item in result]
    if all(math.isnan(v) for v in samples):
        return f"{query.where}: only NaN for {query.expr}"
    return None


async def test_load_went_through_the_gateway(live: LiveStack) -> None:
    assert not live.load_report, "\n".join(live.load_report)


async def test_every_dashboard_query_returns_data(live: LiveStack) -> None:
    problems: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for board, queries in _dashboard_queries():
            values, variable_problems = await _variables(client, live, board)
            problems += variable_problems
            for query in queries:
                filled = Query(query.where, _substitute(query.expr, values))
                problem = await _check(client, live.prometheus, filled)
                if problem:
                    problems.append(problem)
    total = sum(len(queries) for _, queries in _dashboard_queries())
    assert not problems, (
        f"{len(problems)} of {total} dashboard queries (and variables) show no data or keep "
        "a replica's labels:\n" + "\n".join(problems)
    )


async def test_every_recording_rule_returns_data(live: LiveStack) -> None:
    problems: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for path in sorted((REPO / "prometheus" / "rules").glob("*.yml")):
            for group in load_yaml(path.read_text())["groups"]:
                for rule in group["rules"]:
                    if "record" not in rule:
                        continue
                    query = Query(f"{path.name} / {rule['record']}", rule["expr"])
                    problem = await _check(client, live.prometheus, query)
                    if problem:
                        problems.append(problem)
    assert not problems, "\n".join(problems)


async def test_mfu_and_mbu_come_from_the_engines_own_counters(live: LiveStack) -> None:
    """The roofline panels divide vLLM's estimated FLOPs and bytes by the worker's configured
    peaks; MBU falls back to the configured-model estimate only for engines without them."""
    (board,) = [b for b, _ in _dashboard_queries() if b["uid"] == "goodput-gateway-workers"]
    exprs = {
        inner["title"]: inner["targets"][0]["expr"]
        for panel in board["panels"]
        for inner in (panel.get("panels", []) if panel["type"] == "row" else [panel])
        if inner.get("targets")
    }
    async with httpx.AsyncClient(timeout=30) as client:
        values, problems = await _variables(client, live, board)
        assert not problems, problems
        # A window reaching back over the whole load, however long the other checks took.
        values["__rate_interval"] = "10m"
        found = {}
        for title in ("Model FLOPs utilisation (MFU)", "Memory-bandwidth utilisation (MBU)"):
            body = await _query(client, live.prometheus, _substitute(exprs[title], values))
            assert body.get("status") == "success", body
            found[title] = body["data"]["result"]
    (mfu,) = found["Model FLOPs utilisation (MFU)"]
    (mbu,) = found["Memory-bandwidth utilisation (MBU)"]
    assert mbu["metric"]["source"] == "engine", mbu
    assert mfu["metric"]["worker"] == mbu["metric"]["worker"]
    # Nominal peaks of a CPU (GATEWAY_HARDWARE): the tiny model uses a sliver of them, but some.
    assert 0 < float(mfu["value"][1]) < 1, mfu
    assert 0 < float(mbu["value"][1]) < 1, mbu
