"""Kubernetes: each kustomize overlay renders, validates against Kubernetes' schemas, and says
what the gateway and the workers need (probes, hardening, DNS discovery, GPUs, dashboards)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from app.admission.auth import Authenticator
from app.settings import Settings
from scripts import gen_prometheusrule
from scripts.vllm_worker import TINY_LLAMA_HARDWARE
from tests.ops.support import (
    OPS_BIN,
    OVERLAYS,
    REPO,
    RULE_FILES,
    dump_yaml,
    kustomize_build,
    load_yaml,
    load_yaml_all,
    tool,
)

# Kubernetes versions validated against: the oldest still commonly run and the newest known.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
NAMESPACE = "goodput"


@cache
def _rendered(overlay: str) -> str:
    return kustomize_build(overlay)


def _objects(overlay: str) -> list[dict[str, Any]]:
    return load_yaml_all(_rendered(overlay))


def _one(overlay: str, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in _objects(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_overlay_validates_strictly(overlay: str, version: str, tmp_path: Path) -> None:
    """Every object but the Prometheus Operator's (CRDs, checked below) against Kubernetes'
    schema, rejecting unknown fields."""
    builtin = [o for o in _objects(overlay) if o["kind"] not in OPERATOR_KINDS]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text("---\n".join(dump_yaml(o) for o in builtin))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Couldn't find schema" not in output, output


OPERATOR_KINDS = ("ServiceMonitor", "PrometheusRule")

# Runs in .venv-ops (which has the prometheus-operator models): reads {case: [object]} as JSON
# on stdin (ServiceMonitors and PrometheusRules), prints {case: [problem]} as JSON.
OPERATOR_CHECK = """
import json, sys
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

MODELS = {"ServiceMonitor": ServiceMonitor, "PrometheusRule": PrometheusRule}

def unknown(given, kept, path):
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(kept, dict) or key not in kept:
                yield path + key
            else:
                yield from unknown(value, kept[key], path + key + ".")
    elif isinstance(given, list):
        for i, (a, b) in enumerate(zip(given, kept)):
            yield from unknown(a, b, path + str(i) + ".")

def problems(doc):
    name = doc["metadata"]["name"]
    try:
        model = MODELS[doc["kind"]].model_validate(doc)
    except Exception as exc:
        return [f"{name}: {exc}"]
    kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return [f"{name}: unknown field {field}" for field in unknown(doc, kept, "")]

cases = json.load(sys.stdin)
print(json.dumps({case: [p for d in docs for p in problems(d)] for case, docs in cases.items()}))
"""


@pytest.fixture(scope="module")
def operator_problems() -> dict[str, list[str]]:
    """ServiceMonitor and PrometheusRule are CRDs kubernetes-validate has no schema for: they
    are validated with the prometheus-operator's models (generated from the CRDs' OpenAPI
    schemas, patterns and enums included), and fields the schema does not know are refused
    (strict). One run for all overlays plus a deliberately broken monitor and rule, as loading
    the models takes seconds."""
    cases = {
        overlay: [o for o in _objects(overlay) if o["kind"] in OPERATOR_KINDS]
        for overlay in OVERLAYS
    }
    broken = _one("gpu", "ServiceMonitor", "goodput-gateway")
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    broken_rule = _one("gpu", "PrometheusRule", "goodput-gateway")
    broken_rule["spec"]["groups"][0]["rules"][0]["recrod"] = "x"
    cases["broken"] = [broken, broken_rule]
    result = subprocess.run(
        [str(OPS_BIN / "python"), "-c", OPERATOR_CHECK],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, list[str]] = json.loads(result.stdout)
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_objects_validate_against_the_operator_schema(
    overlay: str, operator_problems: dict[str, list[str]]
) -> None:
    monitors = {o["metadata"]["name"] for o in _objects(overlay) if o["kind"] == "ServiceMonitor"}
    assert monitors == {"goodput-gateway", "vllm-workers"}
    rules = {o["metadata"]["name"] for o in _objects(overlay) if o["kind"] == "PrometheusRule"}
    assert rules == {"goodput-gateway"}
    assert operator_problems[overlay] == []


def test_operator_check_refuses_unknown_fields(operator_problems: dict[str, list[str]]) -> None:
    """The strict ServiceMonitor and PrometheusRule check is not vacuous."""
    assert operator_problems["broken"] == [
        "goodput-gateway: unknown field spec.endpoints.0.intervall",
        "goodput-gateway: unknown field spec.groups.0.rules.0.recrod",
    ]


def test_prometheusrule_is_generated_from_the_rule_files() -> None:
    """deploy/base/prometheusrule.yaml is what scripts.gen_prometheusrule writes now."""
    committed = (REPO / "deploy" / "base" / "prometheusrule.yaml").read_text()
    assert committed == gen_prometheusrule.render(), (
        "deploy/base/prometheusrule.yaml is stale: run `python -m scripts.gen_prometheusrule`"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheusrule_carries_every_rule_promtool_checks(overlay: str) -> None:
    """The cluster gets the same groups as compose's Prometheus: every record and alert."""
    rule = _one(overlay, "PrometheusRule", "goodput-gateway")
    files = [load_yaml(path.read_text()) for path in RULE_FILES]
    assert rule["spec"]["groups"] == [g for f in files for g in f["groups"]]
    names = [r.get("alert") or r.get("record") for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "GatewayDown" in names
    assert "tier_model:gateway_slo_requests_unmet_per_gateway_slo_requests:ratio_rate1h" in names
    assert "GatewayErrorBudgetBurn" in names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lands_in_one_namespace(overlay: str) -> None:
    for obj in _objects(overlay):
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == NAMESPACE
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_deployment_is_probed_bounded_and_hardened(overlay: str) -> None:
    deployment = _one(overlay, "Deployment", "goodput-gateway")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert {e["configMapRef"]["name"] for e in container["envFrom"]} == {"goodput-gateway"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_processes_share_state_through_a_hardened_redis(overlay: str) -> None:
    """Every replica runs one process per core of its CPU limit, and all of them share key
    limits and views through the Redis Service, which only the gateway may reach."""
    config = _one(overlay, "ConfigMap", "goodput-gateway")["data"]
    assert config["GATEWAY_PROCESSES"] == "auto"
    service = _one(overlay, "Service", "goodput-redis")
    (port,) = service["spec"]["ports"]
    assert config["GATEWAY_REDIS_URL"] == f"redis://goodput-redis:{port['port']}/0"
    redis = _one(overlay, "Deployment", "goodput-redis")
    pod = redis["spec"]["template"]["spec"]
    assert (
        service["spec"]["selector"].items()
        <= redis["spec"]["template"]["metadata"]["labels"].items()
    )
    container = _container(redis)
    (container_port,) = container["ports"]
    assert container_port["name"] == port["targetPort"]
    assert container_port["containerPort"] == port["port"]
    assert container["image"].startswith("docker.io/library/redis:")
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert container["args"][container["args"].index("--save") + 1] == ""
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    policy = _one(overlay, "NetworkPolicy", "goodput-redis")
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "goodput-redis"
    }
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "goodput-gateway"}}}
    ]
    assert rule["ports"] == [{"port": port["port"], "protocol": "TCP"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_finds_workers_through_the_headless_service(overlay: str) -> None:
    config = _one(overlay, "ConfigMap", "goodput-gateway")["data"]
    service = _one(overlay, "Service", "vllm-workers")
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    assert config["GATEWAY_WORKER_DNS"] == (
        f"vllm-workers.{NAMESPACE}.svc.cluster.local:{port['port']}"
    )
    assert config["GATEWAY_WORKERS"] == ""
    workers = _one(overlay, "Deployment", "vllm-worker")
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in _container(workers)["ports"]}
    assert ports[port["targetPort"]] == port["port"]
    # The KV cache events the gateway follows: published on the ports the container opens.
    args = _container(workers)["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert events["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    # ... and follows them: several replicas and processes each guess alone otherwise.
    assert config["GATEWAY_KV_EVENTS"] == "true"


def _gateway_settings(
    overlay: str, keys: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The gateway's settings as its pod would read them: the ConfigMap's environment, and
    ``keys`` as the mounted keys file."""
    config = _one(overlay, "ConfigMap", "goodput-gateway")["data"]
    keys_file = tmp_path / Path(config["GATEWAY_API_KEYS_FILE"]).name
    keys_file.write_text(keys)
    for name, value in {**config, "GATEWAY_API_KEYS_FILE": str(keys_file)}.items():
        monkeypatch.setenv(name, value)
    return Settings()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_secret_is_mounted_as_the_keys_file(overlay: str) -> None:
    config = _one(overlay, "ConfigMap", "goodput-gateway")["data"]
    secret = _one(overlay, "Secret", "goodput-gateway-api-keys")
    deployment = _one(overlay, "Deployment", "goodput-gateway")
    keys_file = Path(config["GATEWAY_API_KEYS_FILE"])
    (mount,) = [
        m for m in _container(deployment)["volumeMounts"] if m["mountPath"] == str(keys_file.parent)
    ]
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert volume["secret"]["secretName"] == "goodput-gateway-api-keys"
    assert keys_file.name in secret["stringData"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_deployment_that_keeps_the_shipped_keys_secret_fails_closed(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committed Secret holds no key (none whose token anyone could know), and a gateway
    started with it refuses to start, saying why, rather than serve without keys."""
    secret = _one(overlay, "Secret", "goodput-gateway-api-keys")
    shipped = secret["stringData"]["api-keys.json"]
    assert json.loads(shipped) == []
    assert "sha256" not in (REPO / "deploy" / "base" / "gateway-api-keys.yaml").read_text()
    settings = _gateway_settings(overlay, shipped, tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="lists no API keys, so the gateway refuses to start"):
        Authenticator(settings, time.monotonic)


def test_an_overlay_that_replaces_the_keys_secret_starts_with_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The way docs/deploy.md gives: a secretGenerator with behavior: replace."""
    overlay = tmp_path / "mine"
    overlay.mkdir()
    digest = hashlib.sha256(b"sk-my-key").hexdigest()
    keys = json.dumps([{"sha256": digest, "name": "mine", "tier": "interactive"}])
    (overlay / "api-keys.json").write_text(keys)
    (overlay / "kustomization.yaml").write_text(
        dump_yaml(
            {
                # kustomize takes only relative paths.
                "resources": [os.path.relpath(REPO / "deploy" / "overlays" / "gpu", overlay)],
                "secretGenerator": [
                    {
                        "name": "goodput-gateway-api-keys",
                        "behavior": "replace",
                        "files": ["api-keys.json"],
                        "options": {"disableNameSuffixHash": True},
                    }
                ],
            }
        )
    )
    rendered = subprocess.run(
        [tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    (secret,) = [
        o
        for o in load_yaml_all(rendered.stdout)
        if o["kind"] == "Secret" and o["metadata"]["name"] == "goodput-gateway-api-keys"
    ]
    mounted = base64.b64decode(secret["data"]["api-keys.json"]).decode()
    settings = _gateway_settings("gpu", mounted, tmp_path, monkeypatch)
    auth = Authenticator(settings, time.monotonic)
    assert auth.identify("Bearer sk-my-key", None).tier.name == "interactive"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_has_a_disruption_budget_and_an_autoscaler(overlay: str) -> None:
    pdb = _one(overlay, "PodDisruptionBudget", "goodput-gateway")
    deployment = _one(overlay, "Deployment", "goodput-gateway")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    hpa = _one(overlay, "HorizontalPodAutoscaler", "goodput-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "goodput-gateway"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_drain_gateways_and_workers_within_their_grace_periods(overlay: str) -> None:
    """Kubernetes kills a pod at its grace period: it must outlast the drain it is given."""
    config = _one(overlay, "ConfigMap", "goodput-gateway")["data"]
    drain = float(config["GATEWAY_DRAIN_DELAY_S"]) + float(config["GATEWAY_SHUTDOWN_GRACE_S"])
    gateway = _one(overlay, "Deployment", "goodput-gateway")["spec"]["template"]["spec"]
    assert gateway["terminationGracePeriodSeconds"] > drain
    workers = _one(overlay, "Deployment", "vllm-worker")
    args = _container(workers)["args"]
    timeout = float(args[args.index("--shutdown-timeout") + 1])
    assert timeout > 0  # vLLM's default of 0 aborts running requests
    assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout
    pdb = _one(overlay, "PodDisruptionBudget", "vllm-worker")
    assert pdb["spec"]["selector"]["matchLabels"] == workers["spec"]["selector"]["matchLabels"]


def test_gpu_overlay_asks_for_gpus_and_a_real_model() -> None:
    workers = _one("gpu", "Deployment", "vllm-worker")
    container = _container(workers)
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = container["args"]
    assert "/" in args[args.index("--model") + 1]
    assert "--load-format" not in args


def test_cpu_demo_overlay_serves_the_tiny_model_on_cpu() -> None:
    workers = _one("cpu-demo", "Deployment", "vllm-worker")
    container = _container(workers)
    assert "vllm-cpu" in container["image"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    args = container["args"]
    for flag, value in {
        "--served-model-name": "tiny-llama",
        "--load-format": "dummy",
        "--max-model-len": "1024",
        "--dtype": "bfloat16",
    }.items():
        assert args[args.index(flag) + 1] == value
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"
    model_dir = args[args.index("--model") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == model_dir]
    (volume,) = [
        v for v in workers["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    config_map = _one("cpu-demo", "ConfigMap", volume["configMap"]["name"])
    shipped = {**config_map.get("data", {}), **config_map.get("binaryData", {})}
    on_disk = {p.name for p in (REPO / "models" / "tiny-llama").iterdir() if p.is_file()}
    assert set(shipped) == on_disk, "the ConfigMap must carry every file of models/tiny-llama"
    # The API server refuses ConfigMaps over 1 MiB.
    assert len(json.dumps(config_map).encode()) < 1024 * 1024


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboards_configmap_carries_the_committed_dashboards(overlay: str) -> None:
    config_map = _one(overlay, "ConfigMap", "goodput-gateway-dashboards")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    for path in (REPO / "grafana" / "dashboards").glob("*.json"):
        assert config_map["data"][path.name] == path.read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servicemonitors_scrape_gateway_and_workers(overlay: str) -> None:
    gateway = _one(overlay, "ServiceMonitor", "goodput-gateway")
    service = _one(overlay, "Service", "goodput-gateway")
    assert (
        gateway["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    workers = _one(overlay, "ServiceMonitor", "vllm-workers")
    headless = _one(overlay, "Service", "vllm-workers")
    assert (
        workers["spec"]["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items()
    )
    (endpoint,) = workers["spec"]["endpoints"]
    assert {"sourceLabels": ["__address__"], "targetLabel": "worker"} in endpoint["relabelings"]


def _monitoring_namespace(objects: list[dict[str, Any]]) -> str:
    (policy,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "vllm-workers"
    ]
    selectors = [
        peer for peer in policy["spec"]["ingress"][0]["from"] if "namespaceSelector" in peer
    ]
    (peer,) = selectors
    name: str = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    return name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_monitoring_namespace_is_a_kustomize_parameter(overlay: str, tmp_path: Path) -> None:
    """The workers' NetworkPolicy admits the namespace the overlay's monitoringNamespace names,
    and the parameter itself is not applied to the cluster."""
    objects = _objects(overlay)
    assert _monitoring_namespace(objects) == "monitoring"
    assert not [o for o in objects if o["metadata"]["name"] == "goodput-deploy-params"]
    # The same overlay with the parameter changed, in a copy of the tree.
    for part in ("deploy", "grafana", "models"):
        shutil.copytree(REPO / part, tmp_path / part)
    kustomization = tmp_path / "deploy" / "overlays" / overlay / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("monitoringNamespace=monitoring") == 1
    kustomization.write_text(
        text.replace("monitoringNamespace=monitoring", "monitoringNamespace=obs")
    )
    rendered = subprocess.run(
        [
            tool("kubectl"),
            "kustomize",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(kustomization.parent),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert _monitoring_namespace(load_yaml_all(rendered.stdout)) == "obs"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_count_flops_and_bytes_for_the_roofline(overlay: str) -> None:
    args = _container(_one(overlay, "Deployment", "vllm-worker"))["args"]
    assert "--enable-mfu-metrics" in args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_start_waiting_requests_by_the_tier_priority_sent(overlay: str) -> None:
    args = _container(_one(overlay, "Deployment", "vllm-worker"))["args"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_tell_the_cached_prompt_tokens_in_each_usage(overlay: str) -> None:
    args = _container(_one(overlay, "Deployment", "vllm-worker"))["args"]
    assert "--enable-prompt-tokens-details" in args


def test_cpu_demo_gateway_has_the_tiny_models_nominal_peaks() -> None:
    config = _one("cpu-demo", "ConfigMap", "goodput-gateway")["data"]
    hardware = json.loads(config["GATEWAY_HARDWARE"])
    for key in ("memory_bandwidth_gbs", "peak_tflops"):
        assert hardware[key] == TINY_LLAMA_HARDWARE[key]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_target_alerts_select_the_servicemonitors_job_names(overlay: str) -> None:
    """A ServiceMonitor's job label is its Service's name: the alerts must select those."""
    rule = _one(overlay, "PrometheusRule", "goodput-gateway")
    exprs = {
        r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    }
    services = {o["metadata"]["name"] for o in _objects(overlay) if o["kind"] == "Service"}
    assert {"goodput-gateway", "vllm-workers"} <= services
    for monitor in ("goodput-gateway", "vllm-workers"):
        assert "jobLabel" not in _one(overlay, "ServiceMonitor", monitor)["spec"]
    assert 'up{job="goodput-gateway"}' in exprs["GatewayDown"]
    assert 'up{job="goodput-gateway"}' in exprs["GatewayTargetMissing"]
    for alert in ("GatewayWorkerTargetDown", "GatewayWorkerTargetsMissing"):
        (regex,) = re.findall(r'up\{job=~"([^"]+)"\}', exprs[alert])
        assert re.fullmatch(regex, "vllm-workers"), alert
