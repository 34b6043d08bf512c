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
_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
_WANTED = re.compile(
    r"^(?:# (?:HELP|TYPE) )?vllm:(?:num_requests_running|num_requests_waiting|"
    r"kv_cache_usage_perc|gpu_cache_usage_perc)\b.*$",
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


def parse_load(text: str, at: float) -> LoadSample:
    """Sum running and waiting over the page's label sets; take the fullest KV cache."""
    wanted = "\n".join(match.group(0) for match in _WANTED.finditer(text))
    running = waiting = kv = 0.0
    found = False
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            if sample.name == _RUNNING:
                running += sample.value
                found = True
            elif sample.name == _WAITING:
                waiting += sample.value
            elif sample.name in _KV_CACHE:
                kv = max(kv, sample.value)
    if not found:
        raise ValueError(f"no {_RUNNING} on the page: not a vLLM worker?")
    return LoadSample(running, waiting, kv, at)
