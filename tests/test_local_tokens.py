"""Prompts tokenized in the gateway from the model's own files (GATEWAY_TOKENIZERS).

Against the real worker's ``/tokenize``: tests/test_kv_events_real.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from app.fleet.localtokens import LocalTokenizer, TokenizerFilesError
from app.fleet.tokens import Tokenizer
from app.fleet.wire import WireClient
from app.settings import WorkerSpec
from tests.fake_upstream import MODEL
from tests.servers import settings_for
from tests.test_prefix import _chat
from tests.wire_bridge import bridge

TINY = Path(__file__).parent.parent / "models" / "tiny-llama"


@functools.cache
def _plain() -> RustTokenizer:
    return RustTokenizer.from_file(str(TINY / "tokenizer.json"))


def _part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def tiny() -> LocalTokenizer:
    return LocalTokenizer(TINY)


def test_the_chat_template_renders_the_conversation_with_the_generation_prompt(
    tiny: LocalTokenizer,
) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [_part("hi"), _part("there")]},
        ]
    }  # fmt: skip
    # tiny-llama's template loops over a message's parts (vLLM's "openai" content format):
    # the parts are rendered one after the other, as the worker renders them.
    assert (
        tiny.render(body) == "<s><|system|>\nbe brief</s>\n<|user|>\nhithere</s>\n<|assistant|>\n"
    )
    assert (tiny.render({**body, "add_generation_prompt": False}) or "").endswith("there</s>\n")
    ids = tiny.chat(body)
    assert ids is not None
    assert ids[:2] == [1, 3]  # <s> <|system|>: special tokens as the ids the worker holds
    assert ids == tiny.encode(tiny.render(body) or "", special=False)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": [{"role": "tool", "content": "x"}]},  # the template raises: the worker's 400
        {"messages": "x"},
    ],
)
def test_what_cannot_be_rendered_exactly_here_is_left_to_the_worker(
    tiny: LocalTokenizer, body: dict[str, Any]
) -> None:
    assert tiny.chat(body) is None


_TEXT = st.lists(
    st.sampled_from([*"ab \n\t.é日'<", "<s>", "</s>", "<|user|>", "  ", "\r\n", "hello"]),
    max_size=40,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(_TEXT, min_size=1, max_size=6))
def test_a_prompt_cut_between_special_tokens_is_what_the_whole_encodes_to(turns: list[str]) -> None:
    tiny = LocalTokenizer(TINY)  # fresh: its first prompts are checked against the whole
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    body = {"messages": messages}
    for _ in range(6):  # past the checks: from then on only the pieces are encoded
        ids = tiny.chat(body)
        assert ids == tiny.encode(tiny.render(body) or "", special=False)
    assert tiny.pieces


def test_pieces_that_differ_from_the_whole_are_given_up(
    tiny: LocalTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = LocalTokenizer(TINY)
    monkeypatch.setattr(fresh, "_by_pieces", lambda text: [0])
    body = {"messages": [{"role": "user", "content": "hello"}]}
    assert fresh.chat(body) == tiny.chat(body)  # the whole encoding, not the pieces'
    assert not fresh.pieces


def test_the_pieces_cache_keeps_to_its_memory_cap() -> None:
    small = LocalTokenizer(TINY, cache_bytes=4096)
    for i in range(50):
        small.chat({"messages": [{"role": "user", "content": f"question {i} " * 20}]})
    assert 0 < small.cached_bytes <= 4096


def test_missing_files_or_a_broken_template_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=str(tmp_path)):
        LocalTokenizer(tmp_path)
    broken = _model_dir(tmp_path / "broken", {"chat_template": "{% for %}"})
    with pytest.raises(TokenizerFilesError, match="chat template"):
        LocalTokenizer(broken)


def test_the_setting_takes_model_directory_pairs_or_json() -> None:
    made = settings_for("http://w:1", tokenizers="a=/x, b = /y")
    assert made.tokenizers == {"a": Path("/x"), "b": Path("/y")}
    assert settings_for("http://w:1", tokenizers='{"a": "/x"}').tokenizers == {"a": Path("/x")}
    with pytest.raises(ValueError, match="model=directory"):
        settings_for("http://w:1", tokenizers="a")


def _tokenizer(answer: Any, local: dict[str, LocalTokenizer]) -> Tokenizer:
    wire = WireClient(5.0, connector=bridge(httpx.MockTransport(answer)))
    return Tokenizer(wire, 1.0, 2**20, local)


async def _settled(tokenizer: Tokenizer) -> None:
    deadline = time.monotonic() + 5
    while True:
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if not any("_check" in repr(t.get_coro()) for t in pending):
            return
        assert time.monotonic() < deadline, "a check never ended"
        await asyncio.sleep(0.01)


async def test_the_gateway_tokenizes_and_checks_its_first_answers_with_the_worker(
    tiny: LocalTokenizer,
) -> None:
    asked: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        return httpx.Response(200, json={"tokens": tiny.chat(body)})

    mine = LocalTokenizer(TINY)
    tokenizer = _tokenizer(answer, {MODEL: mine})
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    for i in range(5):
        tokens, how = await tokenizer.tokens(_chat(f"question {i}"), {4}, spec)
        assert how == "local"
        assert tokens is not None
        assert tokens.blocks(4)
    long = _chat("word " * 5000)  # over the inline size: tokenized in the helper thread
    tokens, how = await tokenizer.tokens(long, {4}, spec)
    assert how == "local"
    assert tokens is not None
    assert len(tokens) > 5000
    await _settled(tokenizer)
    assert len(asked) == 3  # the first three compared with the worker, no more
    # What is kept (the prompts' keys and the pieces' ids) is counted, for the gauge.
    assert tokenizer.cached_bytes > mine.cached_bytes > 0
    assert (await tokenizer.tokens(_chat("question 1"), {4}, spec))[1] == "cached"
    await tokenizer.close()


async def test_a_gateway_tokenizer_that_differs_from_the_worker_is_given_up() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"tokens": [7] * 12})

    tokenizer = _tokenizer(answer, {MODEL: LocalTokenizer(TINY)})
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    assert (await tokenizer.tokens(_chat("hello"), {4}, spec))[1] == "local"
    await _settled(tokenizer)
    tokens, how = await tokenizer.tokens(_chat("hello again"), {4}, spec)
    assert how == "asked"  # the worker's own answer from now on
    assert tokens is not None
    assert tokens.blocks(4)
    assert len(tokens) == 12
    await tokenizer.close()


_REAL_CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there!"}]},
    {
        "messages": [
            {"role": "system", "content": "You answer in French.\n\nBe  brief."},
            {"role": "user", "content": "Où est la gare? 日本語 </s> <|user|> tab\there"},
            {"role": "assistant", "content": "  Là-bas.\r\n"},
            {"role": "user", "content": [_part("a"), _part(" b")]},
        ]
    },
    {"messages": [{"role": "user", "content": "no prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "with specials"}], "add_special_tokens": True},
]  # fmt: skip


async def test_the_gateways_tokens_are_the_real_workers(vllm_worker_url: str) -> None:
    """The real vLLM worker's /tokenize and the gateway's copy cut prompts into the same ids."""
    from tests.test_real_worker import MODEL as REAL_MODEL

    tiny = LocalTokenizer(TINY)
    async with httpx.AsyncClient(base_url=vllm_worker_url, timeout=30) as client:
        for chat in _REAL_CHATS:
            theirs = await client.post("/tokenize", json={"model": REAL_MODEL, **chat})
            assert theirs.status_code == 200, theirs.text
            assert tiny.chat(chat) == theirs.json()["tokens"], chat
        for prompt, special in (("Once upon a time", True), (" spaced\n", False)):
            body = {"model": REAL_MODEL, "prompt": prompt, "add_special_tokens": special}
            theirs = await client.post("/tokenize", json=body)
            assert theirs.status_code == 200, theirs.text
            assert tiny.completion(prompt, special) == theirs.json()["tokens"], prompt


def _model_dir(tmp_path: Path, config: dict[str, Any], template_file: str | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes((TINY / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_a_template_that_takes_content_as_a_string_gets_the_parts_joined(tmp_path: Path) -> None:
    """vLLM's "string" content format: text parts joined by newlines, as the worker does."""
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    local = LocalTokenizer(_model_dir(tmp_path, {"chat_template": template}))
    body = {"messages": [{"role": "user", "content": [_part("a"), _part("b")]}]}
    assert local.render(body) == "[user]a\nb"


def test_named_templates_and_a_template_file_are_found(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert LocalTokenizer(_model_dir(tmp_path / "a", {"chat_template": named})).render(body) == "D1"
    from_file = LocalTokenizer(_model_dir(tmp_path / "b", {}, "F{{ messages|length }}"))
    assert from_file.render(body) == "F1"
    # No template at all: the worker answers (with its own error or default).
    assert LocalTokenizer(_model_dir(tmp_path / "c", {})).chat(body) is None


def test_a_template_failing_on_the_messages_leaves_them_to_the_worker(tmp_path: Path) -> None:
    local = LocalTokenizer(_model_dir(tmp_path, {"chat_template": "{{ messages[0].content + 1 }}"}))
    assert local.chat({"messages": [{"role": "user", "content": "x"}]}) is None


async def test_what_the_gateway_cannot_render_is_asked_with_an_earlier_turn_leading(
    tiny: LocalTokenizer,
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        body.pop("tools", None)  # this template ignores them
        return httpx.Response(200, json={"tokens": tiny.chat(body)})

    tokenizer = _tokenizer(answer, {MODEL: LocalTokenizer(TINY)})
    spec = WorkerSpec.model_validate({"url": "http://w:1"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    first = await tokenizer.tokens(_chat("hi " * 40, tools=tools), {4}, spec)
    assert first[1] == "asked"
    following = await tokenizer.tokens(_chat("hi " * 40, "yes", "then?", tools=tools), {4}, spec)
    assert following[1] == "partial"  # routed on the first turn's tokens, the whole asked behind
    await tokenizer.close()


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=300), special=st.booleans())
def test_the_encoding_without_offsets_gives_the_tokenizers_own_ids(
    tiny: LocalTokenizer, text: str, special: bool
) -> None:
    # encode() takes the tokenizer's batch call without offsets, for speed: its ids must be
    # the plain encoding's, special tokens (and any text that spells one) included.
    plain = _plain()
    for sample in (text, f"<s>{text}</s>", text * 20):
        assert (
            tiny.encode(sample, special=special)
            == plain.encode(sample, add_special_tokens=special).ids
        )
