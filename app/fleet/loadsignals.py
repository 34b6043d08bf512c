"""A worker's load, read from its Prometheus ``/metrics`` page.

vLLM's page is large (dozens of histograms); only the few series routing needs are read, their
sample lines found with one regular expression, so a scrape costs little time on the event loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
_CACHE_CONFIG = "vllm:cache_config_info"
_GENERATED = "vllm:generation_tokens_total"
_NEAR_MOST = 0.8
"""A batch at its cap runs this share of it or more: a step where sequences end together runs
a few fewer (52-60 of 64 seen on simulated workers)."""
# A sample line of one of the series read (``name{labels} value [timestamp]``), found in one
# scan of the page, which is large (dozens of histograms), and read without a general parser:
# prometheus-client's took 0.6 ms of the event loop for vLLM's 54 KB page, this 0.04 ms. The
# pattern starts with a newline, not ``^`` in multi-line mode, so the scan searches for its
# literal start (``^`` is tried at every character: 0.2 ms).
_SAMPLE = re.compile(
    r"\n(vllm:(?:num_requests_running|num_requests_waiting|num_requests_waiting_by_reason|"
    r"kv_cache_usage_perc|gpu_cache_usage_perc|cache_config_info|generation_tokens_total))"
    r"(?:\{(.*)\})?[ \t]+(\S+)",
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r"\\(.)")


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
    generated: float | None = None
    """Tokens the worker has generated since it started (``vllm:generation_tokens_total``):
    when it grew between two samples, the engine ran steps between them. None when absent."""


def parse_load(text: str, at: float) -> LoadSample:
    """Sum running and waiting over the page's label sets; take the fullest KV cache.

    Raises ValueError when the page has no running gauge (not a vLLM worker's) or a value of
    the series read is not a number.
    """
    running = waiting = kv = 0.0
    capacity: float | None = None
    kv_tokens: float | None = None
    block_size: float | None = None
    prefix_caching = True
    generated: float | None = None
    found = False
    for match in _SAMPLE.finditer("\n" + text):
        name, labels, value = match.group(1, 2, 3)
        if name == _RUNNING:
            running += float(value)
            found = True
        elif name == _WAITING:
            waiting += float(value)
        elif name == _WAITING_BY_REASON:
            if _labels(labels).get("reason") == "capacity":
                capacity = (capacity or 0.0) + float(value)
        elif name == _GENERATED:
            generated = (generated or 0.0) + float(value)
        elif name in _KV_CACHE:
            kv = max(kv, float(value))
        elif name == _CACHE_CONFIG:
            info = _labels(labels)
            kv_tokens = _add(kv_tokens, _kv_tokens(info))
            block_size = _number(info.get("block_size")) or block_size
            if info.get("enable_prefix_caching") == "False":
                prefix_caching = False
    if not found:
        raise ValueError(f"no {_RUNNING} on the page: not a vLLM worker?")
    return LoadSample(
        running, waiting, kv, at, capacity, kv_tokens, block_size, prefix_caching, generated
    )


def _labels(text: str | None) -> dict[str, str]:
    """A sample's labels (the text between its braces), values unescaped."""
    if not text:
        return {}
    return {
        name: _ESCAPED.sub(_unescape, value) if "\\" in value else value
        for name, value in _LABEL.findall(text)
    }


def _unescape(match: re.Match[str]) -> str:
    char = match.group(1)
    return "\n" if char == "n" else char


def held_back(
    before: LoadSample | None,
    now: LoadSample,
    waiting: float,
    most_running: float,
    kv_full: float,
) -> bool:
    """Whether the worker holds ``waiting`` or more requests back because it is full.

    Not from one sample: vLLM counts as waiting every request its last schedule did not take,
    and under async scheduling (the default on GPUs) the arrivals since that schedule too, so
    a worker far from its cap shows a step's arrivals waiting, and one whose long prefill step
    is still running shows them for as long as the step lasts. Taking such a page as the
    worker's cap set its limit to the few it ran then (seen on simulated GPU workers at half
    their capacity: limits of 256 cut to 1-3 within 4 s, and requests queued for seconds).
    So: both samples show ``waiting`` or more held back for capacity, the engine ran between
    them (its generated tokens grew, where the page says), and it runs no more than before (a
    worker still taking requests in is not at its cap).

    And it runs near the most it has been read to run (``most_running``, this sample
    included), or its KV cache is at least ``kv_full`` used: those are its caps. Requests
    also wait for a step's token budget (a burst of long prompts), for a step or two, at any
    batch size; two such pages at 0.75x load, with completions matching arrivals, cut
    simulated 64-sequence workers that had run 42-45 to limits of 11-25, and requests queued
    at the gateway for up to 1.5 s.
    """
    if before is None or now.at <= before.at:
        return False
    if now.capacity_waiting is None or before.capacity_waiting is None:
        return False
    if now.capacity_waiting < waiting or before.capacity_waiting < waiting:
        return False
    stepped = now.generated is None or before.generated is None or now.generated > before.generated
    at_cap = now.running >= _NEAR_MOST * most_running or now.kv_cache_usage >= kv_full
    return stepped and now.running <= before.running and at_cap


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
