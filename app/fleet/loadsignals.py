"""A worker's load, read from its Prometheus ``/metrics`` page.

vLLM's page is large (dozens of histograms); only the few gauges routing needs are cut out with
one regular expression before prometheus-client's parser sees them, so a scrape costs little
time on the event loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
_CACHE_CONFIG = "vllm:cache_config_info"
_WANTED = re.compile(
    r"^(?:# (?:HELP|TYPE) )?vllm:(?:num_requests_running|num_requests_waiting|"
    r"num_requests_waiting_by_reason|kv_cache_usage_perc|gpu_cache_usage_perc|"
    r"cache_config_info)\b.*$",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class LoadSample:
    """A worker's own view of its load at ``at`` (gateway clock)."""

    running: float
    waiting: float
    kv_cache_usage: float
    """Fraction of the KV cache in use, 0..1."""
    at: float
    capacity_waiting: float | None = None
    """Of ``waiting``, those held back because the worker is full (its running-sequence cap or
    its KV cache): vLLM's ``num_requests_waiting_by_reason{reason="capacity"}``. None when the
    engine does not say (older vLLM): then waiting may be only arrivals not yet scheduled."""
    kv_tokens: float | None = None
    """Tokens the worker's KV cache holds (``cache_config_info``'s ``kv_cache_size_tokens``, or
    ``num_gpu_blocks`` x ``block_size``); None when not exported."""
    block_size: float | None = None
    """Tokens per KV-cache block (``cache_config_info``'s ``block_size``): the worker's prefix
    cache reuses whole blocks only. None when not exported."""
    prefix_caching: bool = True
    """False when the worker says its prefix caching is off (``cache_config_info``'s
    ``enable_prefix_caching``): then it reuses no prefix, whatever it was sent before."""


def parse_load(text: str, at: float) -> LoadSample:
    """Sum running and waiting over the page's label sets; take the fullest KV cache."""
    wanted = "\n".join(match.group(0) for match in _WANTED.finditer(text))
    running = waiting = kv = 0.0
    capacity: float | None = None
    kv_tokens: float | None = None
    block_size: float | None = None
    prefix_caching = True
    found = False
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            if sample.name == _RUNNING:
                running += sample.value
                found = True
            elif sample.name == _WAITING:
                waiting += sample.value
            elif sample.name == _WAITING_BY_REASON:
                if sample.labels.get("reason") == "capacity":
                    capacity = (capacity or 0.0) + sample.value
            elif sample.name in _KV_CACHE:
                kv = max(kv, sample.value)
            elif sample.name == _CACHE_CONFIG:
                kv_tokens = _add(kv_tokens, _kv_tokens(sample.labels))
                block_size = _number(sample.labels.get("block_size")) or block_size
                if sample.labels.get("enable_prefix_caching") == "False":
                    prefix_caching = False
    if not found:
        raise ValueError(f"no {_RUNNING} on the page: not a vLLM worker?")
    return LoadSample(running, waiting, kv, at, capacity, kv_tokens, block_size, prefix_caching)


def _kv_tokens(labels: dict[str, str]) -> float | None:
    """An engine's KV-cache size in tokens, from its ``cache_config_info`` labels."""
    try:
        return float(labels["kv_cache_size_tokens"])
    except (KeyError, ValueError):
        pass
    try:
        return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):
        return None


def _number(text: str | None) -> float | None:
    """A positive label value as a number; None when absent or not one."""
    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        return None
    return value if value > 0 else None


def _add(total: float | None, value: float | None) -> float | None:
    """Sum over engines (data-parallel ranks each export their own cache)."""
    if value is None:
        return total
    return value if total is None else total + value
