"""Offline, model-aware token counting for chat messages.

Nothing is ever downloaded. ``tiktoken.get_encoding`` fetches its BPE files from the
internet on first use, so instead the encodings are built from the copies that ``litellm``
ships in ``litellm/litellm_core_utils/tokenizers/``. Those files are named exactly as
tiktoken names its cache files (sha1 of the download URL), which is how we find them, and
their sha256 is checked against the hash tiktoken itself expects.

Counts follow OpenAI's published recipe for chat messages; for non-OpenAI models they are
an approximation (see ``encoding_for_model``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import tiktoken
import tiktoken.model
import tiktoken_ext.openai_public as openai_public
import xxhash

from proxy.core.modelmap import litellm_package_dir, model_info

logger = logging.getLogger("compaction_proxy.tokens")

# OpenAI's recipe: every message costs 3 tokens of framing, a name 1 more, and every reply is
# primed with 3 tokens (<|start|>assistant<|message|>).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_PER_TOOL_CALL = 3
REPLY_PRIMING_TOKENS = 3
# Fixed image estimates: the real cost depends on the image's size, which we cannot know
# without fetching it. 85 is OpenAI's low-detail cost, 765 a 1024x1024 high-detail image.
IMAGE_LOW_DETAIL_TOKENS = 85
IMAGE_TOKENS = 765

# Encodings built from litellm's files. Others tiktoken knows are mapped to the nearest one
# we have: p50k_edit and o200k_harmony share their base's ranks and pattern and differ only
# in special tokens, which we never encode as specials; r50k/gpt2 (retired GPT-3 models) are
# p50k without its extra whitespace-run tokens, so p50k is a close approximation.
_SUBSTITUTE = {
    "o200k_harmony": "o200k_base",
    "p50k_edit": "p50k_base",
    "r50k_base": "p50k_base",
    "gpt2": "p50k_base",
}
_HEURISTIC = "chars/4"  # memo key for models without a known encoding
_MAX_WARNED = 1024  # stop warning (rather than forget and re-warn) past this many names

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _local_bpe_file(url: str, expected_hash: str | None = None) -> bytes:
    """The bytes of LiteLLM's copy of ``url``, checked against tiktoken's expected hash."""
    pkg = litellm_package_dir()
    if pkg is None:
        raise FileNotFoundError("litellm is not installed; no local tokenizer files")
    path = pkg / "litellm_core_utils" / "tokenizers" / hashlib.sha1(url.encode()).hexdigest()
    data = path.read_bytes()  # FileNotFoundError if litellm does not ship this encoding
    if expected_hash and hashlib.sha256(data).hexdigest() != expected_hash:
        raise ValueError(f"{path} does not match the expected hash of {url}")
    return data


def _load_local_bpe(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
    """Stand-in for ``tiktoken.load.load_tiktoken_bpe`` that reads litellm's copy of ``url``.

    Parsed here rather than via ``load_tiktoken_bpe(path)`` because that copies the file into
    tiktoken's cache directory (and raises if a configured one is not writable).
    """
    ranks: dict[bytes, int] = {}
    for line in _local_bpe_file(url, expected_hash).splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _verify_local_bpe(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
    """Stand-in loader that only checks the file is there and intact; builds nothing."""
    _local_bpe_file(url, expected_hash)
    return {}


def _constructor(name: str, loader: Callable[..., dict[bytes, int]]) -> Callable[[], Any]:
    """tiktoken's own constructor of ``name`` (pattern, special tokens, vocabulary size)
    through a copy of the function whose global ``load_tiktoken_bpe`` is ``loader``, so
    nothing shared is mutated and no download can happen."""
    ctor = openai_public.ENCODING_CONSTRUCTORS[name]
    return types.FunctionType(
        ctor.__code__, {**ctor.__globals__, "load_tiktoken_bpe": loader}, ctor.__name__
    )


@functools.cache
def _encoding(name: str) -> tiktoken.Encoding:
    """Build encoding ``name`` from local files, once (see ``_constructor``)."""
    spec = _constructor(name, _load_local_bpe)()
    ranks = spec["mergeable_ranks"]
    encoding = tiktoken.Encoding(**spec)
    # tiktoken's Rust core keeps its own copy of the ranks; the Encoding holds on to this
    # Python dict only to be pickled (Encoding.__getstate__), which the proxy never does.
    # Emptying it returns 27 MiB (o200k_base) and 14 MiB (cl100k_base) to the serving
    # process; encode and decode are unchanged (tests/test_tokens.py).
    ranks.clear()
    return encoding


def encoding_by_name(name: str) -> tiktoken.Encoding:
    """Encoding ``name`` built from LiteLLM's files (``FileNotFoundError`` if they are missing,
    ``ValueError`` if they are damaged)."""
    return _encoding(name)


def verify_encoding_files(name: str) -> None:
    """Check that LiteLLM ships encoding ``name``'s file intact (tiktoken's expected sha256),
    without building it: ``serve`` checks this before it listens, and builds only the
    encodings it counts with (``FileNotFoundError`` or ``ValueError`` as above)."""
    _constructor(name, _verify_local_bpe)()


def _is_openai_model(*names: str) -> bool:
    return any((info := model_info(n)) is not None and info.provider == "openai" for n in names)


@functools.lru_cache(maxsize=4096)
def _encoding_name_for_model(model: str) -> str | None:
    name = model.strip()
    bare = name.rsplit("/", 1)[-1]  # openai/gpt-4o, azure/gpt-4o, openrouter/openai/gpt-4o
    lowered = name.lower()
    if "claude" in lowered or lowered.startswith("anthropic/"):
        # Anthropic's tokenizer for Claude 3+ is not public; cl100k is a fair approximation.
        return "cl100k_base"
    try:
        enc_name = tiktoken.model.encoding_name_for_model(bare)
    except KeyError:
        # Newer OpenAI models the installed tiktoken does not list yet use o200k.
        return "o200k_base" if _is_openai_model(name, bare) else None
    return _SUBSTITUTE.get(enc_name, enc_name)


def encoding_for_model(model: str) -> tiktoken.Encoding | None:
    """The tiktoken encoding used to count ``model``'s tokens, or None if unknown.

    Provider prefixes are ignored. OpenAI models get their real encoding (gpt-4o, gpt-4.1,
    gpt-5 and o-series: o200k_base; gpt-4 and gpt-3.5: cl100k_base); OpenAI models in the
    LiteLLM map that tiktoken does not know yet get o200k_base. Claude models (name contains
    "claude" or starts with ``anthropic/``) get cl100k_base as an approximation, since
    Anthropic's tokenizer for Claude 3+ is not public. Never downloads anything.
    """
    name = _encoding_name_for_model(model)
    return _encoding(name) if name is not None else None


def _warn_unknown(model: str) -> None:
    if model in _warned:
        return
    with _warned_lock:
        if model in _warned or len(_warned) >= _MAX_WARNED:
            return
        _warned.add(model)
    logger.warning("no tokenizer known for model %r; estimating ~4 characters per token", model)


def _approx_tokens(text: str) -> int:
    return -(-len(text) // 4)  # ceil(len / 4)


@functools.lru_cache(maxsize=4096)
def _text_counter(model: str) -> tuple[str, Callable[[str], int]]:
    """(memo key, text -> token count) for ``model``; warns once if the model is unknown."""
    enc = encoding_for_model(model)
    if enc is None:
        _warn_unknown(model)
        return _HEURISTIC, _approx_tokens
    encode = enc.encode

    def count(text: str) -> int:
        # disallowed_special=(): text such as "<|endoftext|>" is counted as plain text.
        return len(encode(text, disallowed_special=())) if text else 0

    return enc.name, count


def _count_part(part: Any, count: Callable[[str], int]) -> int:
    if isinstance(part, str):
        return count(part)
    if not isinstance(part, dict):
        return 0
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        return count(text) if isinstance(text, str) else 0
    if kind == "image_url":
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, dict) else None
        return IMAGE_LOW_DETAIL_TOKENS if detail == "low" else IMAGE_TOKENS
    # Audio, files, ...: no tokenizer applies; size of the payload / 4 is a rough bound.
    as_json = json.dumps(part, ensure_ascii=False, separators=(",", ":"), default=str)
    return len(as_json) // 4


def _count_call(call: Any, count: Callable[[str], int]) -> int:
    if not isinstance(call, dict):
        return 0
    n = TOKENS_PER_TOOL_CALL
    for key in ("name", "arguments"):
        value = call.get(key)
        if isinstance(value, str):
            n += count(value)
    return n


def _count_message(message: dict[str, Any], count: Callable[[str], int]) -> int:
    n = TOKENS_PER_MESSAGE
    role = message.get("role")
    if isinstance(role, str):
        n += count(role)
    content = message.get("content")
    if isinstance(content, str):
        n += count(content)
    elif isinstance(content, list):
        n += sum(_count_part(part, count) for part in content)
    elif content is not None:
        n += count(str(content))
    name = message.get("name")
    if isinstance(name, str):
        n += count(name) + TOKENS_PER_NAME
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            n += _count_call(fn, count)
    function_call = message.get("function_call")
    if function_call is not None:
        n += _count_call(function_call, count)
    tool_call_id = message.get("tool_call_id")
    if isinstance(tool_call_id, str):
        n += count(tool_call_id)
    return n


_TEXT_MEMO = 1024  # distinct tool-schema sets whose counts ``count_json`` keeps


class TokenCounter:
    """Counts chat-message tokens per OpenAI's recipe, memoising per message fingerprint.

    Per message: 3 framing tokens + role + content + name (+1) + tool calls (name and
    arguments, +3 each; a legacy ``function_call`` likewise) + ``tool_call_id``.
    Content parts: "text" parts as text; "image_url" parts a fixed 85 tokens when
    ``detail`` is "low", else 765 (the image's size is unknown without fetching it); any
    other part (input_audio, file, ...) len(its JSON) // 4.
    Models without a known encoding are estimated at ceil(characters / 4), with one logged
    warning per distinct model name. Safe to share between threads.
    """

    def __init__(self, memo_size: int = 262_144) -> None:
        """``memo_size``: at most this many memoised counts; the memo is cleared when full."""
        if memo_size < 1:
            raise ValueError("memo_size must be at least 1")
        self._memo_size = memo_size
        # One memo per encoding, keyed by fingerprint alone: a (encoding, fingerprint) tuple
        # per entry cost 56 more bytes each, a third of the memo (14 MiB of a full one).
        self._memos: dict[str, dict[bytes, int]] = {}
        self._texts: dict[tuple[str, bytes], int] = {}  # ``count_json``'s, by encoding

    def _memo(self, key: str) -> dict[bytes, int]:
        memo = self._memos.get(key)
        return memo if memo is not None else self._memos.setdefault(key, {})

    def memoised(self) -> int:
        """How many counts are memoised now (at most ``memo_size``)."""
        return sum(len(memo) for memo in list(self._memos.values()))

    def count_text(self, text: str, model: str) -> int:
        """Tokens in ``text`` alone, without any message framing."""
        return _text_counter(model)[1](text)

    def count_json(self, raw: bytes, model: str) -> int:
        """Tokens in the JSON text ``raw`` (a request's tool schemas), remembered by its hash.

        An agent sends the same tool schemas with every request: Claude Code's ~60 KB took
        4-9 ms to encode each time, more than everything else the proxy does (#28). A hit
        costs the hash (~1 us); at most ``_TEXT_MEMO`` counts are kept (cleared when full).
        """
        key, count = _text_counter(model)
        memo_key = (key, xxhash.xxh3_128_digest(raw))
        n = self._texts.get(memo_key)
        if n is None:
            n = count(raw.decode())
            if len(self._texts) >= _TEXT_MEMO:
                self._texts.clear()
            self._texts[memo_key] = n
        return n

    def count_message(
        self, message: dict[str, Any], model: str, fingerprint: bytes | None = None
    ) -> int:
        """Tokens ``message`` costs in a prompt, excluding reply priming.

        With a ``fingerprint`` the count is memoised per (encoding, fingerprint); the
        fingerprint must identify the message's meaning exactly (see proxy.fingerprint).
        """
        key, count = _text_counter(model)
        return self._count(message, key, count, fingerprint)

    def count_messages(
        self,
        messages: list[dict[str, Any]],
        model: str,
        fingerprints: list[bytes] | None = None,
    ) -> list[int]:
        """Per-message counts, in order; ``fingerprints`` (if given) aligns with ``messages``."""
        key, count = _text_counter(model)
        if fingerprints is None:
            return [_count_message(m, count) for m in messages]
        if len(fingerprints) != len(messages):
            raise ValueError("fingerprints must align with messages")
        memo_get = self._memo(key).get
        out: list[int] = []
        for message, fp in zip(messages, fingerprints, strict=True):
            n = memo_get(fp)
            out.append(n if n is not None else self._count(message, key, count, fp))
        return out

    def count_total(
        self,
        messages: list[dict[str, Any]],
        model: str,
        fingerprints: list[bytes] | None = None,
    ) -> int:
        """Prompt tokens for the whole request: all messages plus 3 reply-priming tokens."""
        return sum(self.count_messages(messages, model, fingerprints)) + REPLY_PRIMING_TOKENS

    def _count(
        self,
        message: dict[str, Any],
        key: str,
        count: Callable[[str], int],
        fingerprint: bytes | None,
    ) -> int:
        if fingerprint is None:
            return _count_message(message, count)
        memo = self._memo(key)
        n = memo.get(fingerprint)
        if n is None:
            n = _count_message(message, count)
            if self.memoised() >= self._memo_size:
                # Cheap and bounded; a cold start only costs a recount.
                for full in list(self._memos.values()):
                    full.clear()
            memo[fingerprint] = n
        return n


# The encodings start-up builds: OpenAI's current models and the Claude approximation.
WARM_MODELS = ("gpt-4o", "gpt-4", "claude-sonnet-4-5")


def warm_tokenizers(models: tuple[str, ...] = WARM_MODELS) -> list[str]:
    """Build the encodings and load the model map now, so that the first request does not
    pay for it; returns the names of the encodings built. Never raises: a tokenizer that
    cannot be built now is built (or estimated) on first use instead, as before."""
    built = []
    for model in models:
        try:
            name, count = _text_counter(model)
            count("warm up")
            model_info(model)  # LiteLLM's model map, read on a request's first lookup
            built.append(name)
        except Exception:
            logger.warning("could not build the tokenizer for %r at start-up", model)
    return sorted(set(built))
