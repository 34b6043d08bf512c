"""Record a real vLLM worker's streams for the byte-for-byte relay test (tests/test_relay_bytes.py).

For each case, the worker is sent two requests: the client's own body (what the client would
get from vLLM directly) and the body the gateway sends in its place
(:meth:`app.api.protocol.ParsedRequest.upstream_body`). Both streams are stored as the exact bytes
received. vLLM merges the deltas of consecutive tokens when its server process falls behind, so
the pair is recorded again until both have their events at the same places::

    python -m scripts.vllm_worker --port 8100 &
    python -m scripts.record_streams --worker http://127.0.0.1:8100 \\
        --out tests/data/vllm_streams/streams.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from app.api.protocol import Endpoint, parse_request

MODEL = "tiny-llama"
# Seeded sampling is deterministic in vLLM; temperature 1 gives this random model's varied text
# (tokens that end inside a UTF-8 character, sent as "content":"").
_COMMON: dict[str, Any] = {"model": MODEL, "stream": True, "seed": 7, "temperature": 1.0}
_CHAT: dict[str, Any] = {**_COMMON, "messages": [{"role": "user", "content": "Say hello"}]}
_TEXT: dict[str, Any] = {**_COMMON, "prompt": "The quick brown fox"}
_LENGTH: dict[str, Any] = {"max_tokens": 6, "ignore_eos": True}
# EOS (id 2 in the tiny tokenizer) forced as soon as min_tokens allows: finish_reason "stop".
_STOP: dict[str, Any] = {"max_tokens": 8, "min_tokens": 3, "logit_bias": {"2": 100}}

_OPTIONS: dict[str, dict[str, Any] | None] = {
    "absent": None,
    "empty": {},
    "usage": {"include_usage": True},
    "usage_false": {"include_usage": False},
    "continuous": {"continuous_usage_stats": True},
    "usage_false_continuous": {"include_usage": False, "continuous_usage_stats": True},
    "usage_continuous": {"include_usage": True, "continuous_usage_stats": True},
    "usage_continuous_false": {"include_usage": True, "continuous_usage_stats": False},
    "usage_yes": {"include_usage": "yes"},
}


def _with(base: dict[str, Any], options: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    body = {**base, **extra}
    if options is not None:
        body["stream_options"] = options
    return body


def cases() -> list[tuple[str, Endpoint, dict[str, Any]]]:
    """``(name, endpoint, client body)`` of every recorded case."""
    out: list[tuple[str, Endpoint, dict[str, Any]]] = []
    for prefix, endpoint, base in (
        ("chat", Endpoint.CHAT, _CHAT),
        ("text", Endpoint.COMPLETIONS, _TEXT),
    ):
        for name, options in _OPTIONS.items():
            out.append((f"{prefix}_length_{name}", endpoint, _with(base, options, **_LENGTH)))
        for name in ("absent", "usage", "usage_false_continuous", "usage_continuous"):
            options = _OPTIONS[name]
            out.append((f"{prefix}_stop_{name}", endpoint, _with(base, options, **_STOP)))
            out.append(
                (f"{prefix}_n2_{name}", endpoint, _with(base, options, **{**_LENGTH, "n": 2}))
            )
            logprobs = (
                {"logprobs": True, "top_logprobs": 2}
                if endpoint is Endpoint.CHAT
                else {"logprobs": 2}
            )
            out.append(
                (f"{prefix}_logprobs_{name}", endpoint, _with(base, options, **_LENGTH, **logprobs))
            )
        out.append((f"{prefix}_stop_n2_absent", endpoint, _with(base, None, **{**_STOP, "n": 2})))
    return out


def _events(raw: bytes) -> list[bytes]:
    return [event for event in raw.split(b"\n\n") if event]


def _shape(raw: bytes) -> list[int]:
    """Where the events are: the choice index and text length of each, usage chunks left out."""
    shape = []
    for event in _events(raw):
        if event.startswith(b"data: {"):
            payload = json.loads(event[6:])
            if not payload.get("choices"):
                continue
            choice = payload["choices"][0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            shape.append(choice["index"] * 10_000 + len(text))
        else:
            shape.append(-1)
    return shape


def record(client: httpx.Client, path: str, body: bytes) -> bytes:
    """The worker's raw response body to ``body``."""
    with client.stream(
        "POST", path, content=body, headers={"content-type": "application/json"}
    ) as response:
        response.raise_for_status()
        return b"".join(response.iter_raw())


def main(argv: Sequence[str] | None = None) -> int:
    """Record every case; write them as one JSON file."""
    parser = argparse.ArgumentParser(prog="python -m scripts.record_streams")
    parser.add_argument("--worker", required=True, help="base URL of a vLLM worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tries", type=int, default=10)
    args = parser.parse_args(argv)
    recorded = []
    with httpx.Client(base_url=args.worker, timeout=60) as client:
        version = client.get("/version").json()["version"]
        for name, endpoint, body in cases():
            raw = json.dumps(body, separators=(",", ":")).encode()
            upstream_body = parse_request(endpoint, raw).upstream_body()
            for _ in range(args.tries):
                direct = record(client, endpoint.path, raw)
                upstream = record(client, endpoint.path, upstream_body)
                if _shape(direct) == _shape(upstream):
                    break
            else:
                print(
                    f"{name}: no pair with the same events in {args.tries} tries", file=sys.stderr
                )
                return 1
            print(
                f"{name}: {len(_events(direct))} events direct, {len(_events(upstream))} upstream"
            )
            recorded.append(
                {
                    "name": name,
                    "path": endpoint.path,
                    "request": raw.decode(),
                    "upstream_request": upstream_body.decode(),
                    "direct": direct.decode(),
                    "upstream": upstream.decode(),
                }
            )
    with open(args.out, "w", encoding="utf-8") as file:
        json.dump({"vllm": version, "cases": recorded}, file, indent=1, ensure_ascii=False)
        file.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
