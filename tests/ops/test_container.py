"""The gateway's image (Dockerfile, .dockerignore) and the docker compose stack."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from scripts.vllm_worker import TINY_LLAMA_HARDWARE
from tests.ops.support import REPO, load_yaml, tool

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multi_stage_slim_non_root_and_healthchecked() -> None:
    steps = _instructions()
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    assert all(f.startswith("python:3.11-slim") for f in froms)
    runtime = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    words = [word for word, _ in runtime]
    users = [args for word, args in runtime if word == "USER"]
    assert users, "the runtime stage must drop root"
    assert users[-1].split(":")[0] not in {"0", "root"}
    assert any(word == "COPY" and "--from=build" in args for word, args in runtime)
    (health,) = [args for word, args in runtime if word == "HEALTHCHECK"]
    assert "/healthz" in health
    assert "urllib" in health
    assert "curl" not in health
    (entrypoint,) = [args for word, args in runtime if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["goodput-gateway"]
    assert "EXPOSE" in words
    build = [args for word, args in steps if word == "RUN" and "pip install" in args]
    assert any(re.search(r"pip install (--\S+ )*\.$", args) for args in build)


def test_dockerignore_keeps_workers_models_tests_and_venvs_out() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # An allow-list: ignore everything, then re-include what `pip install .` needs.
    assert lines[0] == "*"
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert included == {
        "pyproject.toml",
        "README.md",
        "app",
        "scripts/__init__.py",
        "scripts/compile.py",
    }
    for word, args in _instructions():
        if word != "COPY" or "--from" in args:
            continue
        *sources, _destination = [a for a in args.split() if not a.startswith("--")]
        for source in sources:
            assert source.rstrip("/") in included, f"COPY {source} is excluded by .dockerignore"


def _compose(
    *args: str, file: Path = COMPOSE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("docker-compose"), "--project-directory", str(REPO), "-f", str(file), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(REPO), **(env or {})},
    )


@pytest.mark.parametrize("profiles", [[], ["gpu"]], ids=["default", "gpu"])
def test_compose_file_is_valid(profiles: list[str]) -> None:
    args = [arg for p in profiles for arg in ("--profile", p)]
    result = _compose(*args, "config", "-q")
    assert result.returncode == 0, result.stdout + result.stderr


def _config(*profiles: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    args = [arg for p in profiles for arg in ("--profile", p)]
    result = _compose(*args, "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_default_profile_runs_the_cpu_worker() -> None:
    services = _config()["services"]
    assert set(services) == {"gateway", "vllm", "prometheus", "grafana", "redis"}
    vllm = services["vllm"]
    assert "vllm-cpu" in vllm["image"]
    assert vllm["environment"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    command = vllm["command"]
    assert command[command.index("--served-model-name") + 1] == "tiny-llama"
    for flag, value in {
        "--load-format": "dummy",
        "--max-model-len": "1024",
        "--dtype": "bfloat16",
        "--port": "8000",
    }.items():
        assert command[command.index(flag) + 1] == value
    (mount,) = vllm["volumes"]
    assert mount["source"] == str(REPO / "models" / "tiny-llama")
    assert mount["target"] == command[command.index("--model") + 1]
    assert mount["read_only"] is True
    assert services["gateway"]["environment"]["GATEWAY_WORKERS"] == "http://vllm:8000"
    # MFU and MBU: the worker counts its FLOPs and bytes, the gateway knows its (nominal) peaks.
    assert "--enable-mfu-metrics" in command
    # Its waiting requests start in the order of the tier priority the gateway sends.
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    # Each usage tells the prompt tokens found in the prefix cache, counted per worker.
    assert "--enable-prompt-tokens-details" in command
    hardware = json.loads(services["gateway"]["environment"]["GATEWAY_HARDWARE"])
    for key in ("memory_bandwidth_gbs", "peak_tflops"):
        assert hardware[key] == TINY_LLAMA_HARDWARE[key]


def test_compose_cpu_worker_dtype_is_set_by_worker_dtype() -> None:
    # bf16 is emulated, 3.5-5.5x slower, on a host without AVX-512 or AMX.
    command = _config(env={"WORKER_DTYPE": "float32"})["services"]["vllm"]["command"]
    assert command[command.index("--dtype") + 1] == "float32"


def test_compose_gpu_profile_adds_a_gpu_worker() -> None:
    services = _config("gpu")["services"]
    gpu = services["vllm-gpu"]
    assert gpu["image"].startswith("vllm/vllm-openai:")
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    command = gpu["command"]
    assert "/" in command[command.index("--model") + 1], "a real Hugging Face model id"
    assert "--enable-mfu-metrics" in command
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    assert "--enable-prompt-tokens-details" in command
    assert gpu["profiles"] == ["gpu"]


def test_compose_grafana_and_prometheus_are_local_and_grafana_has_no_default_admin() -> None:
    """Grafana: anonymous viewers only, no admin/admin account, on loopback; Prometheus (no
    authentication at all) on loopback too."""
    services = _config()["services"]
    for name, port in (("grafana", 3000), ("prometheus", 9090)):
        (published,) = services[name]["ports"]
        assert published["target"] == port
        assert published["host_ip"] == "127.0.0.1", name
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert env.get("GF_SECURITY_ADMIN_PASSWORD", "") in {"", None}
    assert "admin" not in {env.get("GF_SECURITY_ADMIN_PASSWORD"), env.get("GF_SECURITY_ADMIN_USER")}


def test_compose_services_are_healthchecked_and_wait_for_health() -> None:
    services = _config("gpu")["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    gateway = services["gateway"]["depends_on"]
    assert {name: dep["condition"] for name, dep in gateway.items()} == {
        "vllm": "service_healthy",
        "vllm-gpu": "service_healthy",
        "redis": "service_healthy",
    }
    # Only the worker that runs is waited for: the other one is optional.
    assert gateway["vllm"]["required"] is False
    assert gateway["vllm-gpu"]["required"] is False
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert services["prometheus"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    for name in ("gateway", "prometheus", "grafana", "redis"):
        assert services[name]["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in services[name]["security_opt"], name


def test_compose_gateway_runs_processes_sharing_state_through_an_unpublished_redis() -> None:
    """Several gateway processes share key limits and views through the redis service, which
    only the compose network reaches, runs as its image's unprivileged user on a read-only
    file system and saves nothing."""
    services = _config()["services"]
    env = services["gateway"]["environment"]
    assert int(env["GATEWAY_PROCESSES"]) >= 2
    assert env["GATEWAY_REDIS_URL"] == "redis://redis:6379/0"
    redis = services["redis"]
    assert "ports" not in redis
    assert redis["read_only"] is True
    assert redis["user"] == "10001:10001"
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"
    assert redis["tmpfs"] == ["/data"]


def _seconds(duration: str) -> float:
    """A compose duration (``2m15s``, ``135s``, ``1h``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, duration
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_stops_drain_gateway_and_workers_within_their_grace_periods() -> None:
    """`docker compose stop` kills at stop_grace_period: it must outlast each drain."""
    services = _config("gpu")["services"]
    gateway = services["gateway"]
    env = gateway["environment"]
    drain = float(env["GATEWAY_DRAIN_DELAY_S"]) + float(env["GATEWAY_SHUTDOWN_GRACE_S"])
    assert _seconds(gateway["stop_grace_period"]) > drain
    for name in ("vllm", "vllm-gpu"):
        command = services[name]["command"]
        timeout = float(command[command.index("--shutdown-timeout") + 1])
        assert timeout > 0, name  # vLLM's default of 0 aborts running requests
        assert _seconds(services[name]["stop_grace_period"]) > timeout, name


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator is not vacuous: a dependency on an undefined service is refused."""
    text = COMPOSE.read_text().replace("condition: service_healthy", "condition: service_happy", 1)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text)
    assert _compose("config", "-q", file=broken).returncode != 0
    unknown = load_yaml(COMPOSE.read_text())
    unknown["services"]["gateway"]["depends_on"]["nope"] = {"condition": "service_healthy"}
    broken.write_text(json.dumps(unknown))
    assert _compose("config", "-q", file=broken).returncode != 0
