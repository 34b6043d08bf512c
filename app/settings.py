"""Gateway configuration, read from ``GATEWAY_*`` environment variables (or a ``.env`` file)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, HttpUrl, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Fine between 5 ms and 1 s (where interactive TTFT and every ITL/TPOT live), then coarser out to
# the long tail of batch work. Every default tier SLO threshold (0.1, 0.2, 1, 5, 60 s) is a bound,
# so SLO attainment computed from the histogram is exact.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04,
    0.045, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5,
    0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    60.0, 120.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class Hardware(BaseModel):
    """A worker's peak figures, for the roofline panels: FLOP/s and memory bandwidth per GPU.

    MFU and MBU are the engine's own estimated FLOPs and bytes (vLLM's
    ``vllm:estimated_*_per_gpu_total``, with ``--enable-mfu-metrics``) over these peaks. The
    model figures (``model_params_billion`` and after) serve only engines without those
    counters: the decode roofline is then estimated from the weights and KV cache read per step.
    """

    memory_bandwidth_gbs: float = Field(gt=0, description="Accelerator memory bandwidth, GB/s.")
    peak_tflops: float | None = Field(
        default=None, gt=0, description="Dense peak of the dtype served, TFLOP/s per GPU."
    )
    model_params_billion: float | None = Field(
        default=None, gt=0, description="Parameters of the served model (fallback estimate)."
    )
    dtype_bytes: float = Field(default=2.0, gt=0, description="Bytes per weight (bf16: 2).")
    kv_bytes_per_token: float = Field(
        default=131072.0,
        ge=0,
        description="KV-cache bytes per token: 2 x layers x kv_heads x head_dim x dtype bytes.",
    )

    @property
    def weight_bytes(self) -> float | None:
        """Bytes of weights read by every decode step (None when the model is not described)."""
        if self.model_params_billion is None:
            return None
        return self.model_params_billion * 1e9 * self.dtype_bytes


class WorkerSpec(BaseModel):
    """One vLLM worker: its base URL (without ``/v1``) and, optionally, what it serves."""

    url: HttpUrl
    name: str | None = Field(
        default=None, description="Label used in metrics and logs; defaults to host:port."
    )
    models: list[str] = Field(
        default_factory=list,
        description="Models to route here before /v1/models has been read from the worker.",
    )
    api_key: str | None = Field(default=None, description="Bearer key the worker requires.")
    hardware: Hardware | None = Field(
        default=None, description="Overrides the gateway-wide roofline figures for this worker."
    )
    kv_events: str | None = Field(
        default=None,
        description="Where the worker publishes its KV cache events (tcp://host:port), if not "
        "as its /kv_event_sources says.",
    )
    kv_replay: str | None = Field(
        default=None, description="With kv_events: the worker's event replay endpoint, if any."
    )

    @functools.cached_property
    def base_url(self) -> str:
        """The URL with no trailing slash (made once: every relayed request asks for it)."""
        return str(self.url).rstrip("/")

    @property
    def label(self) -> str:
        """A bounded, human-readable identifier for metrics and logs."""
        if self.name:
            return self.name
        host = self.url.host or "worker"
        return f"{host}:{self.url.port}" if self.url.port else host


class TierSpec(BaseModel):
    """A priority tier: its service-level objectives and how it is treated under load."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    priority: int = Field(description="Lower is served first.")
    ttft_slo_s: float = Field(gt=0, description="Time-to-first-token target.")
    tpot_slo_s: float | None = Field(
        default=None, gt=0, description="Time-per-output-token target."
    )
    sheddable: bool = Field(default=False, description="Dropped first when capacity is short.")
    max_queue_wait_s: float = Field(gt=0, description="Longest wait in the admission queue.")
    # 99.5%: the loosest objective at which the fast-burn page (14.4x the error budget over 1 h
    # and 5 min) catches a total outage within 5 minutes; see docs/runbooks.md.
    objective: float = Field(
        default=0.995,
        gt=0,
        lt=1,
        description="Share of the tier's requests that must meet every SLO (the goodput "
        "objective the burn-rate alerts read from gateway_slo_objective).",
    )

    def with_targets(self, ttft_s: float | None, tpot_s: float | None) -> TierSpec:
        """The tier for one request that sent its own targets (None: the tier's).

        The name, priority, queue wait, shedding and objective stay the tier's, and so do the
        limits and labels that read the tier by name; only the TTFT and TPOT targets that the
        request's deadline and its goodput verdict are judged by become its own.
        """
        if ttft_s is None and tpot_s is None:
            return self
        update: dict[str, float] = {}
        if ttft_s is not None:
            update["ttft_slo_s"] = ttft_s
        if tpot_s is not None:
            update["tpot_slo_s"] = tpot_s
        return self.model_copy(update=update)


DEFAULT_TIERS = (
    TierSpec(name="interactive", priority=0, ttft_slo_s=1.0, tpot_slo_s=0.1, max_queue_wait_s=1.0),
    TierSpec(name="standard", priority=1, ttft_slo_s=5.0, tpot_slo_s=0.2, max_queue_wait_s=5.0),
    # Batch yields first under overload by design (shed, or turned away to keep room for the
    # tiers above): its looser objective lets admission do that without paging anyone.
    TierSpec(
        name="batch",
        priority=2,
        ttft_slo_s=60.0,
        sheddable=True,
        max_queue_wait_s=60.0,
        objective=0.95,
    ),
)


class ApiKeySpec(BaseModel):
    """A client key, known only by its SHA-256, and what it may do."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the bearer key")
    name: str = Field(default="", description="For the operator's logs; never the key itself.")
    tier: str = "standard"
    max_concurrency: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    weight: float = Field(
        default=1.0, gt=0, le=1000, description="Its share of its tier when requests wait."
    )
    sets_fairness_id: bool = Field(
        default=False,
        description="May send x-gateway-fairness-id (or llm-d's x-llm-d-inference-fairness-id) "
        "to share its tier as several users (a platform serving its own tenants).",
    )


def strictest_tpot_s(tiers: Iterable[TierSpec]) -> float | None:
    """The strictest TPOT target of ``tiers``, if any of them has one."""
    targets = [t.tpot_slo_s for t in tiers if t.tpot_slo_s is not None]
    return min(targets) if targets else None


def _parse_workers(value: Any) -> Any:
    """Accept a JSON list (of URLs or objects) or a comma-separated list of URLs."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):
            value = json.loads(text)
        else:
            value = [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, list):
        return [{"url": item} if isinstance(item, str) else item for item in value]
    return value


class Settings(BaseSettings):
    """Everything the gateway can be told; each field is ``GATEWAY_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_", env_file=".env", extra="ignore", frozen=True
    )

    host: str = Field(default="0.0.0.0", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    workers: Annotated[list[WorkerSpec], NoDecode] = Field(
        default_factory=list,
        description="vLLM workers: comma-separated URLs, or a JSON list of "
        '{"url", "name", "models", "api_key", "kv_events", "kv_replay"} objects.',
    )
    worker_dns: str | None = Field(
        default=None,
        description="host:port of a headless Service; every address it resolves to is a worker.",
    )
    routing: Literal["prefix_aware", "predicted_ttft", "least_outstanding", "round_robin"] = Field(
        default="prefix_aware",
        description="How a worker is chosen among the healthy ones: `prefix_aware` (the "
        "lowest predicted TTFT, counting the prompt prefix each worker likely has cached), "
        "`predicted_ttft` (the same without the prefix), `least_outstanding` or `round_robin`.",
    )
    prefix_index_mb: float = Field(
        default=32.0,
        gt=0,
        description="Memory cap (MiB, all workers together) of prefix_aware's index of the "
        "prompts recently routed to each worker; the least recently used are dropped first.",
    )
    kv_events: bool = Field(
        default=False,
        description="prefix_aware: follow the KV cache events of every worker that publishes "
        "them (vLLM's --kv-events-config, found at /kv_event_sources or set per worker) and route "
        "on what each worker's cache really holds. Give the models' tokenizers "
        "(`GATEWAY_TOKENIZERS`): without them the workers' /tokenize is asked, which on one-core "
        "CPU workers slowed their decode (docs/routing.md).",
    )
    kv_tokenize_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Longest wait for a worker's /tokenize when routing on KV events; past it "
        "the request is routed on the approximate index.",
    )
    kv_tokens_cache_mb: float = Field(
        default=16.0,
        ge=0,
        description="Memory cap (MiB) of the prompts' tokens kept for routing on KV events.",
    )
    tokenizers: Annotated[dict[str, Path], NoDecode] = Field(
        default_factory=dict,
        description="With kv_events: `model=directory` pairs, comma-separated; each directory "
        "holds the model's tokenizer.json and tokenizer_config.json, and the gateway tokenizes "
        "that model's prompts itself instead of asking the workers' /tokenize.",
    )
    affinity_header: str | None = Field(
        default="x-session-id",
        description="Header whose value pins a session to a worker (prefix-cache reuse); the "
        "body's `user` field is used when the header is absent. Empty disables affinity.",
    )
    affinity_slack_s: float = Field(
        default=0.25,
        ge=0,
        description="Predicted TTFTs within this of the fastest count as equal: a session keeps "
        "its pinned worker, a request without one goes to the least loaded of them (prefix_aware: "
        "of those holding the most of its prompt, the one with the least prefill ahead, then the "
        "least loaded; a prefix no worker holds, to the one holding the fewest prefixes, or "
        "following KV events the one that ran the fewest requests of late).",
    )
    load_interval_s: float = Field(
        default=0.5, gt=0, description="How often each worker's /metrics is scraped."
    )
    load_max_age_s: float = Field(
        default=2.0, gt=0, description="Older load signals count as busy, not idle."
    )
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="How often each worker's /health is probed."
    )
    eject_after_failures: int = Field(
        default=3, ge=1, description="Consecutive failures before a worker is ejected."
    )
    eject_base_s: float = Field(
        default=1.0, gt=0, description="First ejection's length; doubles on each repeat."
    )
    eject_max_s: float = Field(default=30.0, gt=0, description="Longest ejection.")
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Workers tried for one request before the first byte reaches the client.",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="Connecting to a worker.")
    first_token_timeout_s: float = Field(
        default=120.0, gt=0, description="Arrival to the first streamed output event."
    )
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest gap between two streamed events."
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Whole-request limit; none by default, so long generations are not cut.",
    )
    nonstream_timeout_s: float = Field(
        default=600.0, gt=0, description="Waiting for a whole non-streamed response."
    )
    client_stall_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A streaming client that reads nothing for this long, once the server's "
        "buffers for it are full, is cut (outcome client_stalled) and its worker request "
        "cancelled; the worker is not blamed.",
    )
    client_send_buffer_bytes: int = Field(
        default=131072,
        ge=0,
        description="Kernel send buffer of each client connection (SO_SNDBUF; Linux doubles "
        "it). With the front end's 64 KiB write buffer it bounds what a client that stops reading "
        "holds, and how soon its stall is seen. 0: the kernel's autotuning (up to "
        "net.ipv4.tcp_wmem's maximum, often 4 MiB).",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection's opening (or a later request's first byte) to the end of "
        "its headers; 408 and close beyond.",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="End of the headers to the end of the body (408 beyond)."
    )
    keep_alive_timeout_s: int = Field(
        default=20,
        ge=1,
        description="An idle keep-alive connection is closed after this long. Keep it above "
        "the clients' pool expiry (httpx: 5 s) and a load balancer's idle timeout.",
    )
    max_header_bytes: int = Field(
        default=32768, ge=1024, description="Request line and headers, in bytes (431 beyond)."
    )
    max_headers: int = Field(
        default=100, ge=8, description="Header fields in one request (431 beyond)."
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Open client connections; a request on one beyond it gets 503 "
        "gateway_saturated at once.",
    )
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0, description="Largest request body accepted (413 above)."
    )
    max_upstream_connections: int = Field(
        default=2048,
        gt=0,
        description="Open connections to all workers at once (8 workers x 256 streams); fewer "
        "if the open-files limit, raised to its hard limit at start-up, holds fewer at two per "
        "stream.",
    )
    discovery_interval_s: float = Field(
        default=5.0, gt=0, description="How often each worker's /v1/models is re-read."
    )
    ttft_buckets: tuple[float, ...] = LATENCY_BUCKETS
    itl_buckets: tuple[float, ...] = LATENCY_BUCKETS
    tpot_buckets: tuple[float, ...] = LATENCY_BUCKETS
    e2e_buckets: tuple[float, ...] = E2E_BUCKETS
    queue_buckets: tuple[float, ...] = LATENCY_BUCKETS
    default_tier: str = Field(
        default="standard", description="Tier of requests when no API keys are configured."
    )
    tiers: tuple[TierSpec, ...] = Field(
        default=DEFAULT_TIERS, description="Priority tiers (JSON list of tier objects)."
    )
    api_keys: tuple[ApiKeySpec, ...] = Field(
        default=(), description="Client keys (JSON list of {sha256, tier, name, limits})."
    )
    api_keys_file: Path | None = Field(
        default=None, description="A JSON file with the same list (e.g. a mounted Secret)."
    )
    tier_header: str = Field(
        default="x-gateway-tier", description="Header a client uses to ask for a lower tier."
    )
    slo_headers: bool = Field(
        default=True,
        description="Honour a request's own targets, `x-slo-ttft-ms` and `x-slo-tpot-ms` (or "
        "llm-d's `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`), in place of its tier's in "
        "admission and goodput; false ignores them.",
    )
    admission: bool = Field(
        default=True, description="SLO-aware admission; false relays everything at once."
    )
    fair_share: bool = Field(
        default=True,
        description="When a tier's requests wait, hand freed slots to its keys (fairness ids) "
        "in turn by weight; false: earliest deadline first, whoever sent it.",
    )
    worker_priority: bool = Field(
        default=True,
        description="Send each request's tier to the worker as vLLM's `priority` (the default "
        "tier's is 0, higher tiers' lower): a worker run with `--scheduling-policy priority` "
        "orders its waiting requests and its preemptions by it; others ignore it.",
    )
    max_queue_length: int = Field(
        default=5000,
        ge=0,
        description="Admission queue bound, all tiers together (the tiers' deadlines bound "
        "each request's wait).",
    )
    ttft_headroom: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="A worker's prefill limit grows while its first tokens come within this "
        "share of the TTFT target; it is cut when one is over the target. A lower tier's prompts "
        "prefill beside others within this share of half a higher tier's TTFT target.",
    )
    tpot_headroom: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="A worker's running limit grows while its streams' TPOT is within this "
        "share of the TPOT target; it is cut when one is over the target.",
    )
    stall_headroom: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="A lower tier's prompt waits while its prefill would stall a higher tier's "
        "running stream past this share of that stream's TPOT target, at its pace so far.",
    )
    max_running_per_worker: int = Field(
        default=256, ge=1, description="Hard cap on a worker's concurrent requests."
    )
    initial_running_per_worker: int | None = Field(
        default=None,
        ge=1,
        description="Concurrency limit a new worker starts with; unset, the hard cap. It comes "
        "down only on evidence: TPOT or the worker's TTFT over target, or the worker holding "
        "requests back for capacity.",
    )
    saturation_waiting: float = Field(
        default=1.0,
        gt=0,
        description="A worker holding back this many requests for capacity "
        "(vllm:num_requests_waiting_by_reason) on two scrapes in a row, with steps run between "
        "them, no more running than before, and running at least 0.8x the most it was seen to "
        "run (or its KV cache full), is saturated: no more are sent to it, and its limit "
        "becomes the most it ran so in the last 10 s.",
    )
    saturation_kv_cache: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="A worker whose KV cache is this full is saturated: no more are sent to it "
        "until it drains.",
    )
    hardware: Hardware | None = Field(
        default=None,
        description="Peak figures per GPU for the roofline panels (JSON: memory_bandwidth_gbs, "
        "peak_tflops; and model_params_billion, dtype_bytes, kv_bytes_per_token for engines "
        "without vLLM's FLOPs and bytes counters); none disables them.",
    )
    drain_delay_s: float = Field(
        default=5.0,
        ge=0,
        description="After SIGTERM, /readyz answers 503 while requests are still accepted for "
        "this long, so load balancers stop sending before the listener closes.",
    )
    shutdown_grace_s: float = Field(
        default=120.0,
        gt=0,
        description="After SIGTERM, requests still running this long are cut with a "
        "gateway_shutdown error (in-band for streams). The default covers the batch tier's "
        "60 s TTFT target and a minute of decoding; keep Kubernetes' "
        "terminationGracePeriodSeconds above drain + grace.",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API (CORS), as a JSON list or "
        "comma-separated, e.g. https://chat.example.com; `*` allows any. Empty: CORS is off "
        "and browsers' preflights get 405.",
    )
    processes: int | Literal["auto"] = Field(
        default=1,
        description="Gateway processes serving the port (one per core with `auto`, within the "
        "container's CPU limit). A dead one is replaced; /metrics shows the pod's totals.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis shared by every process and replica (redis://host:6379/0): per-key "
        "limits, requests in flight per worker, each tier's arrivals and queued requests hold "
        "fleet-wide. Unset: each process keeps its own.",
    )
    redis_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="Budget of every Redis call; past it, or with Redis down, the process uses "
        "its own limits and views until Redis answers again (gateway_shared_state_up 0).",
    )
    redis_sync_interval_s: float = Field(
        default=0.2,
        gt=0,
        description="How often each process publishes its requests in flight per worker, its "
        "arrivals and queued requests per tier to Redis, and reads everybody else's.",
    )
    access_log: bool = Field(
        default=True,
        description="One log line per finished request (to stderr, written in batches within "
        "0.1 s; warnings and errors at once).",
    )
    log_level: str = Field(default="info", description="Python logging level.")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        return _parse_workers(value)

    @field_validator("tokenizers", mode="before")
    @classmethod
    def _tokenizers(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return json.loads(text)
        pairs = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            model, sep, directory = part.partition("=")
            if not sep or not model.strip() or not directory.strip():
                raise ValueError(f"{part!r}: expected model=directory")
            pairs[model.strip()] = directory.strip()
        return pairs

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _cors_origins(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("ttft_buckets", "itl_buckets", "tpot_buckets", "e2e_buckets", "queue_buckets")
    @classmethod
    def _buckets(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(b <= 0 for b in value) or list(value) != sorted(set(value)):
            raise ValueError("buckets must be positive, strictly increasing and non-empty")
        return value

    @field_validator("processes")
    @classmethod
    def _processes(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("processes must be at least 1, or auto")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return value

    def worker_priority_of(self, tier: TierSpec) -> int | None:
        """The ``priority`` vLLM is sent for ``tier``'s requests (None: ``worker_priority`` off).

        Relative to the default tier's, so that without API keys every request keeps vLLM's
        default of 0 and its body goes to the worker as the client sent it.
        """
        if not self.worker_priority:
            return None
        default = next(t for t in self.tiers if t.name == self.default_tier)
        return tier.priority - default.priority

    @property
    def strictest_tpot_s(self) -> float | None:
        """The strictest TPOT target of any tier, if any."""
        return strictest_tpot_s(self.tiers)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"tier names must be unique and non-empty, got {names}")
        known = set(names)
        for tier in [self.default_tier, *(k.tier for k in self.api_keys)]:
            if tier not in known:
                raise ValueError(f"unknown tier {tier!r}; tiers are {sorted(known)}")
        if not self.workers and not self.worker_dns:
            raise ValueError("no workers: set GATEWAY_WORKERS or GATEWAY_WORKER_DNS")
        labels = [w.label for w in self.workers]
        if len(set(labels)) != len(labels):
            raise ValueError(f"worker names must be unique, got {labels}")
        return self
