"""Both front doors run one request lifecycle: the same conversation sent through the
standalone proxy and through a LiteLLM proxy with the hook leaves the same ledger and the
same metrics (issue #14). Real processes, the official openai client, and a fresh scripted
upstream behind each door (so the upstream's prompt-cache simulation starts equal).

The hook's metrics are read where an operator reads them: LiteLLM's own ``/metrics`` with
its ``prometheus`` callback on (the hook shows its collectors on the default registry;
this LiteLLM asks for a key there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from proxy.adapters.store import DiskStore
from tests.checks import INLINE
from tests.conversations import user_turns
from tests.litellmproc import MODEL, running
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream

SYSTEM = "You are a careful coding assistant for the billing service."
TOKEN = "front-doors-admin-token-0123456789"
TURNS = 14
PREFIX = "compaction_proxy_"
LEDGER_KEYS = (
    "requests",
    "original_tokens",
    "forwarded_tokens",
    "saved_tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "errors",
    "cancelled",
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# The LiteLLM hook does not own the forwarding, so it makes no summarizer call in the
# client's shape (proxy.core.sharedcall): the two doors are compared with it off on both.
BOTH_DOORS = {**INLINE, "summary_reads_cache": "off"}


def converse(client: openai.OpenAI) -> list[list[dict[str, Any]]]:
    """A plain chat (no tools) past the inline trigger, every other turn streamed."""
    texts = [t for t in user_turns(2 * TURNS) if "[[tool:" not in t][:TURNS]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    sent = []
    for i, text in enumerate(texts):
        messages.append({"role": "user", "content": text})
        sent.append(list(messages))
        if i % 2:
            stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True)
            reply = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            answer = client.chat.completions.create(model=MODEL, messages=messages)
            reply = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
    return sent


def ledger_totals(store_dir: Path) -> dict[str, Any]:
    store = DiskStore(store_dir)
    try:
        totals = store.get("totals")
        return {k: totals.get(k, 0) for k in LEDGER_KEYS} if isinstance(totals, dict) else {}
    finally:
        store.close()


def scrape(url: str, token: str | None = None) -> Samples:
    """Our samples by name and labels, the ``route`` and ``model`` labels left out (they name
    the door and, in LiteLLM, the provider model behind the group)."""
    auth = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(url, headers=auth, timeout=10)
    r.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.startswith(PREFIX) or s.name.endswith(("_created", "_bucket")):
                continue
            kept = {k: v for k, v in s.labels.items() if k not in ("route", "model")}
            labels = tuple(sorted(kept.items()))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def comparable(samples: Samples) -> Samples:
    """Counts only: durations (latency, overhead, compaction time) differ between runs."""
    return {
        key: value
        for key, value in samples.items()
        if key[0].endswith("_total") and value and "usd" not in key[0]
    }


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_both_front_doors_record_the_same_ledger_and_metrics(tmp_path: Path) -> None:
    # Through the standalone proxy.
    (tmp_path / "server").mkdir()
    with (
        ScriptedUpstream() as up,
        ProxyProcess(
            tmp_path / "server", up.base_url, compaction=BOTH_DOORS, admin={"token": TOKEN}
        ) as px,
    ):
        client = openai.OpenAI(base_url=px.base_url, api_key="sk-client", max_retries=0)
        sent = converse(client)
        store = tmp_path / "server" / "store"
        assert wait_for(lambda: ledger_totals(store).get("requests") == TURNS)
        server_ledger = ledger_totals(store)
        server_metrics = scrape(f"{px.root}/metrics", TOKEN)
        assert up.chat_requests("summarizer"), "the conversation was never compacted"

    # The same conversation through LiteLLM with the hook.
    (tmp_path / "litellm").mkdir()
    store_dir = tmp_path / "litellm" / "store"
    with (
        ScriptedUpstream() as up,
        running(
            tmp_path / "litellm", up, BOTH_DOORS, f"diskcache://{store_dir}", "env", prometheus=True
        ) as proc,
        proc.logs_on_failure(),
    ):
        assert converse(proc.client(tenant="front-doors")) == sent
        metrics_url = f"http://127.0.0.1:{proc.port}/metrics/"

        def hook_done() -> bool:
            requests = comparable(scrape(metrics_url, proc.master_key)).items()
            counted = sum(v for (name, _), v in requests if name == f"{PREFIX}requests_total")
            return ledger_totals(store_dir).get("requests") == TURNS and counted == TURNS

        assert wait_for(hook_done)
        hook_ledger = ledger_totals(store_dir)
        hook_metrics = scrape(metrics_url, proc.master_key)
        auth = {"authorization": f"Bearer {proc.master_key}"}
        routes = httpx.get(metrics_url, headers=auth, timeout=10).text
        assert 'route="litellm.chat.completions"' in routes

    assert hook_ledger == server_ledger
    assert server_ledger["saved_tokens"] > 0
    assert comparable(hook_metrics) == comparable(server_metrics)
    cases = {dict(labels).get("case") for (name, labels) in comparable(server_metrics)}
    assert "summarize" in cases
