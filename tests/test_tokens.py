"""proxy.tokens: offline, model-aware token counting."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import tiktoken.model

from proxy.core import tokens
from proxy.core.modelmap import litellm_package_dir
from proxy.core.tokens import TokenCounter, encoding_for_model

REPO = Path(__file__).resolve().parents[1]

# Prepended to subprocess scripts: any attempt to open a network connection fails loudly.
NO_NETWORK = """
import socket
def _forbidden(*args, **kwargs):
    raise RuntimeError("network access attempted")
socket.socket.connect = _forbidden
socket.socket.connect_ex = _forbidden
socket.create_connection = _forbidden
socket.getaddrinfo = _forbidden
"""

SAMPLES = [
    "hello world",
    "tiktoken is great!",
    "Ünïcödé, emoji 🚀 and 日本語のテキスト",
    "def f(x):\n    return x ** 2  # tabs\tand   spaces\n\n",
    "text with <|endoftext|> inside",
]


def _run(script: str, env_extra: dict[str, str] | None = None) -> Any:
    """Run ``script`` in a fresh interpreter with the network blocked; return its JSON output."""
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "")}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", NO_NETWORK + script],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, list[int]]]:
    """Official ``tiktoken.get_encoding`` token ids, computed offline in a subprocess.

    tiktoken is pointed at litellm's copies through TIKTOKEN_CACHE_DIR (only in the child),
    so it checks their hashes itself and never downloads.
    """
    pkg = litellm_package_dir()
    assert pkg is not None
    script = f"""
import json, tiktoken
samples = {SAMPLES!r}
print(json.dumps({{
    name: {{s: tiktoken.get_encoding(name).encode(s, disallowed_special=()) for s in samples}}
    for name in ("cl100k_base", "o200k_base", "p50k_base")
}}))
"""
    tok_dir = pkg / "litellm_core_utils" / "tokenizers"
    result: dict[str, dict[str, list[int]]] = _run(script, {"TIKTOKEN_CACHE_DIR": str(tok_dir)})
    return result


def test_counting_never_touches_the_network(tmp_path: Path) -> None:
    # A fresh, empty tiktoken cache: if anything fell back to tiktoken's downloader it would
    # have nothing cached, hit the blocked socket, and leave files behind.
    script = """
import json, sys
import tiktoken.load
def _no_download(*a, **k):
    raise RuntimeError("tiktoken loader used")
tiktoken.load.read_file_cached = _no_download
from proxy.core.tokens import TokenCounter
c = TokenCounter()
msgs = [{"role": "user", "content": "hello world"}]
out = {m: [c.count_text("hello world", m), c.count_total(msgs, m)]
       for m in ("gpt-4o", "gpt-3.5-turbo", "claude-3-5-sonnet-20241022", "my-local-llama")}
out["litellm_imported"] = "litellm" in sys.modules
print(json.dumps(out))
"""
    out = _run(script, {"TIKTOKEN_CACHE_DIR": str(tmp_path)})
    # message = 3 framing + "user" (1) + "hello world" (2); total adds 3 reply priming.
    assert out["gpt-4o"] == [2, 9]
    assert out["gpt-3.5-turbo"] == [2, 9]
    assert out["claude-3-5-sonnet-20241022"] == [2, 9]
    # ~4 chars per token: "hello world" -> 3, "user" -> 1.
    assert out["my-local-llama"] == [3, 10]
    assert out["litellm_imported"] is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-3.5-turbo"])
def test_hello_world_is_two_tokens(model: str) -> None:
    assert TokenCounter().count_text("hello world", model) == 2


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "p50k_base"])
def test_encodings_match_official_tiktoken(name: str, reference: dict) -> None:
    enc = tokens._encoding(name)
    assert enc.name == name
    for text in SAMPLES:
        assert enc.encode(text, disallowed_special=()) == reference[name][text], text


def test_an_encoding_round_trips_with_its_python_ranks_released() -> None:
    # The built encoding lets go of its Python copy of the ranks (memory); the Rust core
    # has its own, so encoding and decoding are unaffected.
    enc = tokens._encoding("o200k_base")
    assert enc._mergeable_ranks == {}
    for text in SAMPLES:
        ids = enc.encode(text, disallowed_special=())
        assert enc.decode(ids) == text
    assert enc.n_vocab > 200_000


def test_verifying_the_files_checks_presence_and_hash(tmp_path: Path, monkeypatch) -> None:
    pkg = litellm_package_dir()
    assert pkg is not None
    for name in ("o200k_base", "cl100k_base", "p50k_base"):
        tokens.verify_encoding_files(name)
    files = tmp_path / "litellm_core_utils" / "tokenizers"
    files.mkdir(parents=True)
    monkeypatch.setattr(tokens, "litellm_package_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError):
        tokens.verify_encoding_files("p50k_base")
    for real in (pkg / "litellm_core_utils" / "tokenizers").iterdir():
        if real.is_file() and len(real.name) == 40:  # named by the sha1 of tiktoken's URL
            (files / real.name).write_bytes(real.read_bytes()[:-10])  # truncated: damaged
    with pytest.raises(ValueError, match="expected hash"):
        tokens.verify_encoding_files("p50k_base")


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-2024-08-06", "o200k_base"),
        ("openai/gpt-4o", "o200k_base"),
        ("azure/gpt-4.1", "o200k_base"),
        ("gpt-4.1-mini", "o200k_base"),
        ("o1", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("claude-3-5-sonnet-20241022", "cl100k_base"),
        ("anthropic/claude-sonnet-4-5", "cl100k_base"),
        ("bedrock/anthropic.claude-v2:1", "cl100k_base"),
        ("text-davinci-003", "p50k_base"),
    ],
)
def test_encoding_for_model(model: str, encoding: str) -> None:
    enc = encoding_for_model(model)
    assert enc is not None and enc.name == encoding


def test_openai_model_unknown_to_tiktoken_uses_o200k() -> None:
    # In LiteLLM's map with provider "openai", but no tiktoken prefix matches it.
    with pytest.raises(KeyError):
        tiktoken.model.encoding_name_for_model("computer-use-preview")
    enc = encoding_for_model("computer-use-preview")
    assert enc is not None and enc.name == "o200k_base"


@pytest.mark.parametrize("model", ["my-local-llama", "ollama/llama3", "gemini/gemini-1.5-pro"])
def test_unknown_models_have_no_encoding(model: str) -> None:
    assert encoding_for_model(model) is None


def test_special_token_text_is_plain_text() -> None:
    counter = TokenCounter()
    for model in ("gpt-4o", "gpt-3.5-turbo", "claude-3-5-sonnet-20241022"):
        n = counter.count_text("a <|endoftext|> b <|fim_prefix|>", model)
        assert n > 3  # split into ordinary tokens, not one special id


def test_openai_cookbook_example() -> None:
    # OpenAI cookbook "How to count tokens with tiktoken": 129 prompt tokens for gpt-4 and
    # gpt-3.5-turbo, 124 for gpt-4o.
    messages = [
        {
            "role": "system",
            "content": "You are a helpful, pattern-following assistant that translates "
            "corporate jargon into plain English.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "New synergies will help drive top-line growth.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Things working well together will increase revenue.",
        },
        {
            "role": "system",
            "name": "example_user",
            "content": "Let's circle back when we have more bandwidth to touch base on "
            "opportunities for increased leverage.",
        },
        {
            "role": "system",
            "name": "example_assistant",
            "content": "Let's talk later when we're less busy about how to do better.",
        },
        {
            "role": "user",
            "content": "This late pivot means we don't have time to boil the ocean for the "
            "client deliverable.",
        },
    ]
    counter = TokenCounter()
    assert counter.count_total(messages, "gpt-4") == 129
    assert counter.count_total(messages, "gpt-3.5-turbo") == 129
    assert counter.count_total(messages, "gpt-4o") == 124


@pytest.mark.parametrize("model", ["gpt-4o", "claude-3-5-sonnet-20241022", "my-local-llama"])
def test_string_and_single_text_part_count_the_same(model: str) -> None:
    counter = TokenCounter()
    text = "Summarise the design document, please."
    as_str = {"role": "user", "content": text}
    as_parts = {"role": "user", "content": [{"type": "text", "text": text}]}
    assert counter.count_message(as_str, model) == counter.count_message(as_parts, model)


def test_none_and_empty_content() -> None:
    counter = TokenCounter()
    role = counter.count_text("assistant", "gpt-4o")
    assert counter.count_message({"role": "assistant", "content": None}, "gpt-4o") == 3 + role
    assert counter.count_message({"role": "assistant", "content": ""}, "gpt-4o") == 3 + role
    assert counter.count_message({"role": "assistant", "content": []}, "gpt-4o") == 3 + role


def test_tool_calls_are_counted() -> None:
    counter = TokenCounter()
    model = "gpt-4o"
    t = lambda s: counter.count_text(s, model)  # noqa: E731
    args = '{"city": "Paris", "unit": "celsius"}'
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    expected = 3 + t("assistant") + (3 + t("get_weather") + t(args)) + (3 + t("get_time") + t("{}"))
    assert counter.count_message(call, model) == expected

    result = {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}
    assert counter.count_message(result, model) == 3 + t("tool") + t("call_1") + t("18C, sunny")

    legacy = {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "f", "arguments": args},
    }
    assert counter.count_message(legacy, model) == 3 + t("assistant") + 3 + t("f") + t(args)


def test_name_costs_one_extra_token() -> None:
    counter = TokenCounter()
    plain = {"role": "user", "content": "hi"}
    named = {"role": "user", "content": "hi", "name": "alice"}
    extra = counter.count_text("alice", "gpt-4o") + 1
    assert counter.count_message(named, "gpt-4o") == counter.count_message(plain, "gpt-4o") + extra


def test_image_and_other_parts() -> None:
    counter = TokenCounter()
    base = counter.count_message({"role": "user", "content": None}, "gpt-4o")

    def with_part(part: dict) -> int:
        return counter.count_message({"role": "user", "content": [part]}, "gpt-4o") - base

    url = "https://example.com/cat.png"
    assert with_part({"type": "image_url", "image_url": {"url": url, "detail": "low"}}) == 85
    assert with_part({"type": "image_url", "image_url": {"url": url, "detail": "high"}}) == 765
    assert with_part({"type": "image_url", "image_url": {"url": url}}) == 765
    audio = {"type": "input_audio", "input_audio": {"data": "QUJD" * 100, "format": "wav"}}
    assert with_part(audio) == len(json.dumps(audio, separators=(",", ":"))) // 4


def test_memo_hit_path() -> None:
    counter = TokenCounter()
    fp = b"\x01" * 16
    first = counter.count_message({"role": "user", "content": "hello world"}, "gpt-4o", fp)
    # Same fingerprint: the memoised count is returned without looking at the message.
    other = {"role": "user", "content": "a much longer message " * 50}
    assert counter.count_message(other, "gpt-4o", fp) == first
    assert counter.count_messages([other], "gpt-4o", [fp]) == [first]
    # The memo is per encoding: another tokenizer recounts.
    assert counter.count_message(other, "gpt-3.5-turbo", fp) > first


def test_memo_is_bounded() -> None:
    counter = TokenCounter(memo_size=2)
    for i in range(5):
        counter.count_message({"role": "user", "content": str(i)}, "gpt-4o", bytes([i]))
        assert counter.memoised() <= 2
    counter.count_message({"role": "user", "content": "x"}, "gpt-4", b"x")
    assert 1 <= counter.memoised() <= 2  # across encodings too
    with pytest.raises(ValueError):
        TokenCounter(memo_size=0)


def test_count_messages_and_total() -> None:
    counter = TokenCounter()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    counts = counter.count_messages(msgs, "gpt-4o")
    assert counts == [counter.count_message(m, "gpt-4o") for m in msgs]
    fps = [b"a", b"b"]
    assert counter.count_messages(msgs, "gpt-4o", fps) == counts
    assert counter.count_total(msgs, "gpt-4o", fps) == sum(counts) + 3
    with pytest.raises(ValueError):
        counter.count_messages(msgs, "gpt-4o", [b"a"])


def test_unknown_model_estimate_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    model = f"my-local-llama-{uuid.uuid4().hex}"
    counter = TokenCounter()
    with caplog.at_level(logging.WARNING, logger="compaction_proxy.tokens"):
        assert counter.count_text("abcde", model) == 2  # ceil(5 / 4)
        assert counter.count_text("", model) == 0
        counter.count_messages([{"role": "user", "content": "hi"}] * 3, model)
        tokens._text_counter.cache_clear()  # even a cold lookup must not warn again
        counter.count_total([{"role": "user", "content": "hi"}], model)
        TokenCounter().count_text("x", model)
        counter.count_text("x", f"{model}-other")
    warned = [r.args for r in caplog.records if r.name == "compaction_proxy.tokens"]
    assert warned == [(model,), (f"{model}-other",)]


def test_warm_count_of_1000_messages_uses_the_memo_only(monkeypatch) -> None:
    # Speed is measured in bench/; here we pin that a warm count never re-encodes.
    counter = TokenCounter()
    msgs = [
        {"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 40}
        for i in range(1000)
    ]
    fps = [i.to_bytes(16, "big") for i in range(1000)]
    cold = counter.count_total(msgs, "gpt-4o", fps)

    def boom(*args: object, **kwargs: object) -> int:
        raise AssertionError("re-counted a memoised message")

    monkeypatch.setattr(tokens, "_count_message", boom)
    assert counter.count_total(msgs, "gpt-4o", fps) == cold
