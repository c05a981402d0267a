"""Fault runs on the LiteLLM hook's LLM path and the Redis store (issue #13 item 10):
a hanging summarizer is cut off at its deadline; Redis going down and coming back mid-run
leaves no stuck lock and loses no request.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from hooks.litellm_llm import LiteLLMRouterLLM  # noqa: E402
from proxy.adapters.store import RedisStore  # noqa: E402
from proxy.core.errors import CompactionFailed  # noqa: E402
from tests.checks import INLINE  # noqa: E402
from tests.proxyproc import ProxyProcess, RedisServer  # noqa: E402
from tests.rawupstream import RawUpstream  # noqa: E402
from tests.upstream import ScriptedUpstream  # noqa: E402

ADMIN = {"token": "test-admin-token"}


class _HangingRouter:
    """A LiteLLM router whose provider never finishes answering (a drip, a stall)."""

    def __init__(self) -> None:
        self.calls = 0

    def get_model_names(self) -> list[str]:
        return ["summary-model"]

    async def acompletion(self, **request: Any) -> Any:
        self.calls += 1
        await asyncio.sleep(3600)


def test_the_hooks_llm_calls_are_bounded_as_a_whole() -> None:
    router = _HangingRouter()
    llm = LiteLLMRouterLLM(timeout_s=0.5, router=router)

    async def call() -> None:
        await asyncio.wait_for(
            llm.complete(
                "summary-model",
                [{"role": "user", "content": "summarize"}],
                max_tokens=10,
                purpose="summarizer",
                credential=None,
            ),
            timeout=60,  # a backstop far beyond the deadline under test
        )

    with pytest.raises(CompactionFailed, match="timed out after 0.5 s"):
        asyncio.run(call())
    assert router.calls == 1


# ---- Redis down and back mid-run ----------------------------------------------------------


@pytest.fixture()
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def _conversation(turns: int, tag: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help."}]
    for i in range(turns):
        fact = f"FACT: the {tag} code number {i} is {1000 + i}."
        messages.append({"role": "user", "content": f"{fact} {tag} question {i}: " + "word " * 60})
        messages.append({"role": "assistant", "content": f"{tag} answer {i}: " + "text " * 60})
    messages.append({"role": "user", "content": f"{tag}: and now?"})
    return messages


def test_redis_restarted_mid_compaction_leaves_no_stuck_lock(
    redis: RedisServer, tmp_path: Path
) -> None:
    """Redis dies (a crash: nothing kept) between compactions and comes back empty. Every
    request is answered meanwhile, readiness follows Redis, and afterwards conversations
    compact again (no lock left behind)."""
    with ScriptedUpstream() as upstream:
        px = ProxyProcess(
            tmp_path,
            upstream.base_url,
            store={"url": redis.url},
            compaction={**INLINE, "llm_timeout_s": 5},
            admin=ADMIN,
        )
        with px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-a", max_retries=0)

            def send(messages: list[dict[str, Any]]) -> Any:
                create = client.chat.completions.with_raw_response.create
                return create(model="gpt-4o-mini", messages=messages)

            long = _conversation(40, "before")
            first = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=long
            )
            assert first.headers["x-compaction-case"] == "summarize"
            redis.stop()
            answered = 0
            for i in range(5):
                during = _conversation(40, f"during-{i}")
                reply = client.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini", messages=during
                )
                assert reply.parse().choices[0].message.content
                answered += 1
            assert answered == 5
            assert httpx.get(f"{px.root}/readyz", timeout=30).status_code == 503
            redis.start()  # same port, empty: the crash lost everything Redis held
            assert httpx.get(f"{px.root}/readyz", timeout=30).status_code == 200
            again = _conversation(40, "after")
            reply = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=again
            )
            assert reply.headers["x-compaction-case"] == "summarize", reply.headers
            # And the conversation compacted while Redis was down compacts now too.
            during = _conversation(40, "during-0")
            reply = client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini", messages=during
            )
            assert reply.headers["x-compaction-case"] == "summarize", reply.headers


def test_a_lock_left_by_a_store_crash_mid_compaction_is_released(tmp_path: Path) -> None:
    """Redis (persistent: it keeps the compaction lock across the crash) dies while the
    summarizer is answering. The request is still answered; once Redis is back, the same
    conversation compacts at once instead of waiting out the lock's TTL."""
    redis = RedisServer(tmp_path, persistent=True)
    redis.start()
    try:
        with ScriptedUpstream(slow_seconds=3.0) as upstream:
            upstream.summarizer_mode = "slow"
            with ProxyProcess(
                tmp_path,
                upstream.base_url,
                store={"url": redis.url},
                # A lock outlives this test by far: TTL = 2 x 60 + 30 s.
                compaction={**INLINE, "llm_timeout_s": 60},
                admin=ADMIN,
            ) as px:
                client = openai.OpenAI(
                    base_url=px.base_url, api_key="sk-a", max_retries=0, timeout=300
                )

                def send(messages: list[dict[str, Any]]) -> Any:
                    create = client.chat.completions.with_raw_response.create
                    return create(model="gpt-4o-mini", messages=messages)

                history = _conversation(40, "crash")
                result: dict[str, Any] = {}
                worker = threading.Thread(target=lambda: result.update(reply=send(history)))
                worker.start()
                deadline = time.monotonic() + 120
                while not upstream.chat_requests("summarizer"):
                    assert time.monotonic() < deadline, "no summarizer call"
                    time.sleep(0.05)
                redis.stop()  # the lock is held and persisted; the summarizer is mid-answer
                worker.join()
                assert result["reply"].parse().choices[0].message.content  # answered
                redis.start()
                assert httpx.get(f"{px.root}/readyz", timeout=30).status_code == 200
                upstream.summarizer_mode = "ok"
                again = send(history)
                assert again.headers["x-compaction-case"] == "summarize", again.headers
    finally:
        redis.stop()


@pytest.mark.parametrize("fault", ["garbage", "hang"])
def test_summarizer_faults_with_redis_lose_nothing_and_leave_no_lock(
    redis: RedisServer, tmp_path: Path, fault: str
) -> None:
    """The detector/summarizer answers garbage, or hangs (a byte at a time, each read inside
    the timeout): every request is answered and recorded, and no compaction lock is left in
    Redis."""
    if fault == "garbage":
        server: Any = ScriptedUpstream(detector_mode="garbage", summarizer_mode="garbage")
        base = lambda s: s.base_url  # noqa: E731
    else:
        server = RawUpstream(llm_mode="drip", drip_s=120.0)
        base = lambda s: s.url("/v1")  # noqa: E731
    with server as up:
        with ProxyProcess(
            tmp_path,
            base(up),
            store={"url": redis.url},
            compaction={**INLINE, "llm_timeout_s": 1},
            admin=ADMIN,
        ) as px:
            client = openai.OpenAI(base_url=px.base_url, api_key="sk-f", max_retries=0)
            for i in range(3):
                history = _conversation(40, f"{fault}-{i}")
                reply = client.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini", messages=history
                )
                assert reply.parse().choices[0].message.content
                if fault == "hang":
                    assert reply.headers["x-compaction-case"] != "summarize"
            stats = httpx.get(
                f"{px.root}/admin/api/stats",
                headers={"authorization": f"Bearer {ADMIN['token']}"},
                timeout=30,
            ).json()
            assert stats["totals"]["requests"] == 3  # nothing lost
            assert list(RedisStore(redis.url).keys("lock:")) == []
            if fault == "hang":
                assert up.drips_finished == 0  # cut off at the deadline, never waited out
