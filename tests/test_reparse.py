"""A body that resends a recent one's history is parsed only past what they share (#28).

``proxy.core.reparse`` must give exactly ``orjson.loads``'s value, or nothing (then the body
is parsed whole, with the error a whole parse gives). Checked on every recorded agent run in
each client's shape, on the bytes the official SDKs write, on every way the rest of a body
can differ, and through the real app on a socket with the official client: what the upstream
receives is what the client sent, and the next requests were parsed from the remembered ones.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest
import uvicorn

from proxy.config import ConfigError, parse_config
from proxy.core import byteruns
from proxy.core.fingerprint import chain_of, fingerprints, prefix_chain
from proxy.core.reparse import FIRST_PROBE, Reparser
from proxy.core.reprint import (
    FRESH_ON_LOOP_BYTES,
    NOTHING_YET,
    Prints,
    Reuse,
    counted,
    fingerprinted,
)
from proxy.core.surfaces import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES
from proxy.core.tokens import TokenCounter
from proxy.core.validation import SLICED_BYTES
from proxy.server.app import OFFLOAD_BYTES, create_app
from proxy.server.incoming import parse_and_validate
from proxy.server.onewrite import OneWriteHttpToolsProtocol
from tests.replay import shapes
from tests.replay.fixtures import load_runs
from tests.upstream import ScriptedUpstream

FILLER = "lorem ipsum dolor sit amet " * 40  # ~1 KB a message
COUNTER = TokenCounter()


def _body(n: int, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 30}]
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"{i} {FILLER}"})
    return {"model": "gpt-4o", "messages": messages, **extra}


def _parse(rp: Reparser, raw: bytes, name: str = "messages") -> tuple[dict[str, Any], int]:
    """What the chat route does: the reparse or the whole parse, then remembered."""
    found = rp.parse(raw, name)
    if found is not None:
        rp.accept(found)
        return found.body, found.shared
    body = orjson.loads(raw)
    rp.remember(raw, body, name)
    return body, 0


SHAPES = [
    (shapes.messages_body, ANTHROPIC_MESSAGES),
    (shapes.responses_body, OPENAI_RESPONSES),
    (shapes.chat_body, OPENAI_CHAT),
]


@pytest.mark.parametrize(("render", "surface"), SHAPES)
def test_every_recorded_run_is_fingerprinted_as_from_scratch(render: Any, surface: Any) -> None:
    """Through the route's parse and the surface's view, the fingerprints and chain taken
    from the body each request resends are the ones computed from scratch: every request of
    every recorded run, with the tenant changing now and then (the chain is per tenant)."""
    taken = counts_taken = 0
    for run in load_runs():
        rp = Reparser(min_bytes=0)
        turns = run["turns"]
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant" or i == 0:
                continue
            # The system prompt changes now and then (a clock in it): the chain takes it by
            # role alone, the fingerprints and counts by what it says.
            clocked = {**run, "system": f"{run.get('system') or 'Agent.'} [{i // 20}]"}
            raw = orjson.dumps(render(clocked, turns[:i], "model-x"))
            body, reuse = parse_and_validate(raw, surface, rp)
            # (A chat body whose system prompt changed extends no remembered body, and may
            # not be remembered itself: the reparser samples after misses.)
            assert reuse is not None or surface is OPENAI_CHAT
            tenant = f"tenant-{i // 7}"
            view = surface.to_view(body)
            fps, chain, exact = fingerprinted(tenant, view, reuse)
            assert fps == fingerprints(view)
            assert chain == chain_of(tenant, view, fps)
            # The exact digests too (the ledger names the history's segments by them).
            afresh: list[bytes | None] = []
            assert fingerprints(view, None, afresh) == fps and exact == afresh
            assert all(d is not None for d in exact)
            # The token counts too (the model changing now and then: counted afresh). The
            # same counter: its counts are remembered by fingerprint, which leaves out cache
            # marks, so a message first counted with one keeps that count.
            model = ("gpt-4o", "claude-sonnet-4-5")[i // 11 % 2]
            counts = counted(COUNTER, view, model, fps, reuse)
            assert counts == COUNTER.count_messages(view, model, fps)
            if reuse is not None:
                taken += reuse.shared > 0 and reuse.earlier.offset >= 0
                counts_taken += reuse.earlier.counted_as == model and reuse.shared > 0
    assert taken > 500 and counts_taken > 300


def test_prints_not_yet_left_or_another_head_are_computed_afresh() -> None:
    rp, body = _remembered()
    longer = dict(body)
    longer["messages"] = [*body["messages"], {"role": "user", "content": "next"}]
    found = rp.parse(orjson.dumps(longer), "messages")
    assert found is not None
    # The earlier request never got as far as its fingerprints (it failed, or is in flight).
    view = OPENAI_CHAT.to_view(found.body)
    fps, chain, exact = fingerprinted("t", view, found.reuse)
    assert fps == fingerprints(view) and chain == chain_of("t", view, fps)
    assert found.reuse.mine.fps == fps and found.reuse.mine.chain == chain
    assert found.reuse.mine.exact == exact and len(exact) == len(view)
    # The earlier view had a message before the history (a system prompt) this one has not.
    earlier = Prints(1, [b"s" * 16, *fps], prefix_chain("t", [b"s" * 16, *fps]))
    reuse = Reuse(earlier, len(view) - 1, len(view), Prints(), 100)
    fps2, chain2, exact2 = fingerprinted("t", view, reuse)
    assert fps2 == fingerprints(view) and chain2 == chain_of("t", view, fps2)
    assert exact2 == exact


@pytest.mark.parametrize(("render", "surface"), SHAPES)
def test_every_recorded_run_parses_to_orjsons_value(render: Any, surface: Any) -> None:
    name = surface.history_key
    runs = load_runs()
    assert runs, "the recorded runs are part of the repository"
    for run in runs:
        rp = Reparser(min_bytes=0)
        requests = 0
        turns = run["turns"]
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant" or i == 0:
                continue
            raw = orjson.dumps(render(run, turns[:i], "model-x"))
            body, _ = _parse(rp, raw, name)
            whole = orjson.loads(raw)
            assert body == whole and list(body) == list(whole)
            assert list(body[name]) == list(whole[name])
            requests += 1
        # Every request after the first two extends a remembered one (Claude Code's moving
        # cache mark included: the shape puts it on the last user block).
        assert rp.reused >= requests - 2, (run.get("agent"), requests, rp.reused)


def _sdk_bytes() -> list[bytes]:
    """What the official OpenAI and Anthropic SDKs write for a request (not sent anywhere)."""
    sent: list[bytes] = []

    def keep(request: Any) -> Any:
        sent.append(request.content)
        module = httpx2 if isinstance(request, httpx2.Request) else httpx
        return module.Response(400, json={"error": {"message": "recorded"}})

    messages = [{"role": "user", "content": f'h\u00e9llo \x1b \u2028 "quoted" </x> {FILLER}'}]
    oa = openai.OpenAI(
        api_key="sk-test",
        base_url="http://127.0.0.1:9/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(keep)),
        max_retries=0,
    )
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="gpt-4o", messages=messages, temperature=1.0)  # type: ignore[arg-type]
    an = anthropic.Anthropic(
        api_key="sk-test",
        base_url="http://127.0.0.1:9",
        http_client=httpx2.Client(transport=httpx2.MockTransport(keep)),
        max_retries=0,
    )
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=messages)  # type: ignore[arg-type]
    return sent


def test_the_official_sdks_write_bodies_it_remembers() -> None:
    for raw in _sdk_bytes():
        rp = Reparser(min_bytes=0)
        body = orjson.loads(raw)
        rp.remember(raw, body, "messages")
        assert len(rp) == 1, raw[:80]
        longer = dict(body)
        longer["messages"] = [*body["messages"], {"role": "assistant", "content": "ok"}]
        found = rp.parse(orjson.dumps(longer), "messages")
        assert found is not None and found.body == longer and found.shared == 1


def test_a_body_written_otherwise_is_not_remembered() -> None:
    body = _body(12)
    rp = Reparser(min_bytes=0)
    import json

    for raw in (
        json.dumps(body).encode(),  # the standard library's spaces
        json.dumps(body, separators=(",", ":"), ensure_ascii=True)
        .encode()
        .replace(b"lorem", b"\\u006corem"),  # an escape orjson would not write
        orjson.dumps(body, option=orjson.OPT_INDENT_2),
    ):
        rp.remember(raw, orjson.loads(raw), "messages")
    assert len(rp) == 0


def _remembered(n: int = 12, **extra: Any) -> tuple[Reparser, dict[str, Any]]:
    rp = Reparser(min_bytes=0)
    body = _body(n, **extra)
    rp.remember(orjson.dumps(body), body, "messages")
    assert len(rp) == 1
    return rp, body


def _rest(rp: Reparser, body: dict[str, Any], rest: bytes, drop: int = 0) -> Any:
    """``body``'s bytes up to the end of its messages (without the last ``drop``), then
    ``rest``: what the reparser makes of it, and what orjson makes of it (or its error)."""
    raw = orjson.dumps(body)
    keep = body["messages"][: len(body["messages"]) - drop]
    cut = raw.index(orjson.dumps(keep)[:-1]) + len(orjson.dumps(keep)) - 1
    new = raw[:cut] + rest
    try:
        whole: Any = orjson.loads(new)
    except orjson.JSONDecodeError as exc:
        whole = exc
    return rp.parse(new, "messages"), whole


def test_what_extends_a_remembered_body_parses_as_a_whole_body_would() -> None:
    rp, body = _remembered(max_tokens=50, stream=False)
    cases = [
        b'],"max_tokens":50,"stream":false}',  # the same body again
        b',{"role":"user","content":"next"}],"max_tokens":50,"stream":false}',
        b',{"role":"user","content":"next"},{"role":"assistant","content":null,'
        b'"tool_calls":[{"id":"c1","type":"function","function":{"name":"f",'
        b'"arguments":"{}"}}]}],"max_tokens":9,"stream":true,"tools":[]}',
        b"]}",  # the members after the array left out
    ]
    for rest in cases:
        found, whole = _rest(rp, body, rest)
        assert found is not None, rest
        assert found.body == whole and list(found.body) == list(whole)
        assert found.shared == len(body["messages"])
    # The last element changed (a cache mark moved): the one before is where they agree.
    found, whole = _rest(
        rp, body, b',{"role":"assistant","content":"changed"}],"max_tokens":50}', drop=1
    )
    assert found is not None and found.body == whole
    assert found.shared == len(body["messages"]) - 1


@pytest.mark.parametrize(
    "rest",
    [
        b',{"role":"user","content":"x"}],"max_tokens":50,"max_tokens":60}',  # repeated
        b',{"role":"user","content":"x"}],"model":"other"}',  # a member before the array
        b',{"role":"user","content":"x"}],"messages":[]}',  # the array again
        b',{"role":"user","content":"x"}],"\\u0000":1}',  # the parse's own key
        b',{"role":"user", "content":"x"}]}',  # a space orjson would not write
        b',{"role":"user","content":"\\u0078"}]}',  # an escape orjson would not write
        b',{"role":"user","content":"x"}],"n":1.50}',  # a number written otherwise
        b',{"role":"user","content":"x"}',  # cut short
        b',{"role":"user","content":"x"}]}garbage',
        b",]}",
        b'.5],"max_tokens":50}',
        b'],"n":123456789012345678901234567890}',  # past 64 bits: orjson refuses it
        b',"\\ud800"]}',  # a lone surrogate
        b"," + b"[" * 220 + b"]" * 220 + b"]}",  # deeper than the proxy allows
    ],
)
def test_anything_else_is_left_to_the_whole_parse(rest: bytes) -> None:
    rp, body = _remembered()
    found, _ = _rest(rp, body, rest)
    assert found is None


def test_the_whole_parse_gives_the_errors() -> None:
    rp, body = _remembered()
    raw = orjson.dumps(body)
    cut = raw.rindex(b"]")
    for bad in (raw[:cut] + b',{"role":"user"', raw[:cut] + b"," + b"[" * 220 + b"]" * 220 + b"]}"):
        with pytest.raises(Exception) as whole:
            parse_and_validate(bad, OPENAI_CHAT)
        with pytest.raises(type(whole.value)) as reparsed:
            parse_and_validate(bad, OPENAI_CHAT, rp)
        assert str(reparsed.value) == str(whole.value)
    # A body the surface refuses is refused the same, and not remembered.
    refused = raw[:cut] + b',{"role":"nobody","content":"x"}]}'
    with pytest.raises(Exception) as whole:
        parse_and_validate(refused, OPENAI_CHAT)
    before = rp.reused
    with pytest.raises(type(whole.value)) as reparsed:
        parse_and_validate(refused, OPENAI_CHAT, rp)
    assert str(reparsed.value) == str(whole.value)
    assert rp.reused == before


def test_an_earlier_change_or_another_array_is_not_reused() -> None:
    rp, body = _remembered()
    edited = dict(body)
    edited["messages"] = [dict(m) for m in body["messages"]]
    edited["messages"][1]["content"] = "edited early"
    assert rp.parse(orjson.dumps(edited), "messages") is None
    assert rp.parse(orjson.dumps(body), "input") is None


def test_a_huge_new_part_is_parsed_whole() -> None:
    rp, body = _remembered()
    big = dict(body)
    big["messages"] = [*body["messages"], {"role": "user", "content": "x" * SLICED_BYTES}]
    assert rp.parse(orjson.dumps(big), "messages") is None


def test_a_new_part_over_max_fresh_is_left_to_the_caller_and_is_no_miss() -> None:
    tools = [{"type": "function", "function": {"name": "Read", "description": FILLER}}]
    rp, body = _remembered(tools=tools)
    added = {"role": "user", "content": "a new turn " + FILLER}
    longer = {**body, "messages": [*body["messages"], added]}
    raw = orjson.dumps(longer)
    new_part = len(b"," + orjson.dumps(added))
    missed = rp._missed
    assert rp.parse(raw, "messages", max_fresh=new_part - 1) is None
    assert rp._missed == missed  # (not a miss: the caller parses it elsewhere)
    found = rp.parse(raw, "messages", max_fresh=new_part)
    assert found is not None and found.body == longer
    # Only the new element was parsed: the tools after it are the remembered ones.
    assert found.fresh == new_part and found.reuse.fresh_bytes == new_part
    # Tools changed too: the whole rest is parsed, and counted.
    other = {**longer, "tools": [{"type": "function", "function": {"name": "Edit"}}]}
    raw = orjson.dumps(other)
    rest = len(raw) - len(orjson.dumps({**body, "tools": []}).split(b'],"tools"')[0])
    found = rp.parse(raw, "messages")
    assert found is not None and found.body == other and found.fresh == rest
    assert rp.parse(raw, "messages", max_fresh=rest - 1) is None
    # A body that extends none, looked up on the loop and again where it is parsed whole:
    # one miss.
    unrelated = _body(12)
    unrelated["messages"][0]["content"] = "Another conversation. " + FILLER
    raw = orjson.dumps(unrelated)
    missed = rp._missed
    assert rp.parse(raw, "messages", max_fresh=1 << 20) is None
    assert rp.parse(raw, "messages") is None
    assert rp._missed == missed + 1


def test_identifying_on_the_loop_takes_a_small_new_part_and_the_earlier_prints() -> None:
    filled = Prints(1, [b"x"] * 3, [b"c"] * 4)
    assert Reuse(filled, 2, 3, Prints(), 1000).light
    assert not Reuse(filled, 2, 3, Prints(), FRESH_ON_LOOP_BYTES).light  # a big new part
    assert not Reuse(Prints(), 2, 3, Prints(), 1000).light  # the earlier prints not made
    assert not Reuse(NOTHING_YET, 0, 3, Prints(), 1000).light  # extends nothing


def test_a_run_of_pieces_compares_and_cuts_as_its_bytes_would() -> None:
    rng = random.Random(7)
    for _ in range(300):
        run = tuple(
            bytes(rng.choices(b"ab", k=rng.randint(0, 9))) for _ in range(rng.randint(1, 6))
        )
        whole = b"".join(run)
        size = len(whole)
        raw = whole[: rng.randint(0, size)] + bytes(rng.choices(b"ab", k=rng.randint(0, 9)))
        upto = rng.randint(0, size)
        assert byteruns.starts_with(raw, run, upto) == raw.startswith(whole[:upto])
        start = rng.randint(0, size)
        end = rng.randint(start, size)
        assert byteruns.between(run, start, end) == whole[start:end]
        more = bytes(rng.choices(b"ab", k=rng.randint(0, 5)))
        assert b"".join(byteruns.extended(run, upto, more)) == whole[:upto] + more
    many: byteruns.Run = ()
    for i in range(byteruns.MAX_PIECES + 5):
        many = byteruns.extended(many, len(b"".join(many)), b"%d," % i)
        assert len(many) <= byteruns.MAX_PIECES
    assert b"".join(many) == b"".join(b"%d," % i for i in range(byteruns.MAX_PIECES + 5))


def test_the_remembered_prefix_is_not_copied_from_each_body() -> None:
    """A body that extends the last one leaves the pieces of its prefix as they were and
    adds its new elements: nothing the size of the body is copied per request."""
    rp, body = _remembered(40)
    (first,) = (e.prefix for e in rp._order.values())
    for n in range(3):
        body = {**body, "messages": [*body["messages"], {"role": "user", "content": f"turn {n}"}]}
        got, shared = _parse(rp, orjson.dumps(body))
        assert got == body and shared == len(body["messages"]) - 1
    (entry,) = rp._order.values()
    assert entry.prefix[0] is first[0] and len(entry.prefix) == 4
    assert b"".join(entry.prefix) == orjson.dumps(body)[: entry.cuts[-1]]


def test_small_bodies_are_not_remembered_and_the_bounds_hold() -> None:
    small = _body(1)
    raw = orjson.dumps(small)
    rp = Reparser(min_bytes=len(raw) + 1)
    rp.remember(raw, small, "messages")
    assert len(rp) == 0 and rp.parse(raw, "messages") is None

    rp = Reparser(min_bytes=0, max_entries=3)
    for n in range(6):
        body = _body(4)
        body["messages"][0]["content"] = f"conversation {n} " + FILLER  # another anchor
        rp.remember(orjson.dumps(body), body, "messages")
    assert len(rp) == 3

    bodies = []
    for n in range(5):
        body = _body(8)
        body["messages"][0]["content"] = f"conversation {n} " + FILLER
        bodies.append(body)
    size = len(orjson.dumps(bodies[0]))
    rp = Reparser(min_bytes=0, max_bytes=size * 2 - 1)  # a body over half of it: not kept
    rp.remember(orjson.dumps(bodies[0]), bodies[0], "messages")
    assert len(rp) == 0
    rp = Reparser(min_bytes=0, max_bytes=size * 2)
    for body in bodies:
        rp.remember(orjson.dumps(body), body, "messages")
    assert len(rp) == 2

    # Many conversations that agree on their first bytes: the newest are kept for them.
    rp = Reparser(min_bytes=0)
    for n in range(40):
        body = _body(6)
        body["messages"][-1]["content"] = f"conversation {n} " + FILLER
        assert orjson.dumps(body)[:FIRST_PROBE] == orjson.dumps(_body(6))[:FIRST_PROBE]
        rp.remember(orjson.dumps(body), body, "messages")
    assert len(rp) <= 16


def test_sessions_alike_but_for_their_first_message_are_each_found() -> None:
    """One agent's sessions: the same system prompt and message endings, another first user
    message. They are filed together; a lookup rules out the others by their first bytes
    and goes on to its own (it gave up after the first it looked at: one found in 12)."""
    rp = Reparser(min_bytes=0)
    sessions = []
    for n in range(12):
        body = _body(10)
        body["messages"][1]["content"] = f"task {n}: " + FILLER
        sessions.append(body)
    for body in sessions:
        _parse(rp, orjson.dumps(body))
    for turn in range(2):
        for body in sessions:
            body["messages"] += [
                {"role": "assistant", "content": f"step {turn} " + FILLER},
                {"role": "user", "content": f"result {turn} " + FILLER},
            ]
            raw = orjson.dumps(body)
            found = rp.parse(raw, "messages")
            assert found is not None and found.body == orjson.loads(raw)
            rp.accept(found)
    assert rp.reused == 24


def test_the_body_it_extends_is_replaced() -> None:
    rp, body = _remembered()
    for n in range(5):
        body = dict(body)
        body["messages"] = [*body["messages"], {"role": "user", "content": f"turn {n}"}]
        got, shared = _parse(rp, orjson.dumps(body))
        assert got == body and shared == len(body["messages"]) - 1
    assert len(rp) == 1 and rp.reused == 5


# ---- through the app, on a socket, with the official client --------------------------------


class _Served:
    """The proxy's app (``create_app``, its lifespan run) served by uvicorn in a thread, as
    the CLI serves it (its one-write protocol)."""

    def __init__(self, tmp: Path, upstream: str, limits: dict[str, Any] | None = None) -> None:
        config = parse_config(
            {
                "upstream": {"base_url": upstream},
                "store": {"url": f"diskcache://{tmp / 'store'}"},
                "compaction": {"trigger_tokens": 10_000_000},
                "limits": limits or {},
            }
        )
        self.app = create_app(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", access_log=False, http=OneWriteHttpToolsProtocol
            )
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[_Served, ScriptedUpstream]]:
    with ScriptedUpstream() as up:
        proxy = _Served(tmp_path, up.base_url)
        try:
            yield proxy, up
        finally:
            proxy.stop()


def _converse(port: int, turns: int) -> list[dict[str, Any]]:
    """``turns`` requests of one conversation with the official client, each resending the
    last; the history with the last reply."""
    client = openai.OpenAI(
        api_key="sk-reparse", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0
    )
    messages: list[dict[str, Any]] = _body(10)["messages"]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} {FILLER}"})
        reply = client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return messages


def test_through_the_proxy_the_upstream_gets_what_the_client_sent(
    served: tuple[_Served, ScriptedUpstream],
) -> None:
    proxy, up = served
    messages = _converse(proxy.port, 6)
    sent = [orjson.loads(r.body) for r in up.chat_requests()]
    assert len(sent) == 6
    assert [len(b["messages"]) for b in sent] == [12 + 2 * t for t in range(6)]
    assert sent[-1]["messages"] == messages[:-1]
    reparser: Reparser = proxy.app.state.reparser
    assert reparser.reused == 5  # every request after the first, from the one before

    # A body that extends the last one but breaks off: the whole parse's 400, in OpenAI's shape.
    raw = orjson.dumps({"model": "gpt-4o", "messages": messages})
    broken = raw[: raw.rindex(b"]")] + b',{"role":"user","content":"x"'
    answer = httpx.post(
        f"http://127.0.0.1:{proxy.port}/v1/chat/completions",
        content=broken,
        headers={"content-type": "application/json", "authorization": "Bearer sk-reparse"},
    )
    assert answer.status_code == 400
    assert "not valid JSON" in answer.json()["error"]["message"]
    assert reparser.reused == 5


@pytest.mark.parametrize("memory_mb", [0, 64])
def test_the_memory_for_recent_bodies_is_the_operators(tmp_path: Path, memory_mb: int) -> None:
    """``limits.reparse_memory_mb``: 0 keeps no body (each is parsed whole), more keeps more
    bodies; the upstream gets what the client sent either way."""
    with ScriptedUpstream() as up:
        proxy = _Served(tmp_path, up.base_url, {"reparse_memory_mb": memory_mb})
        try:
            messages = _converse(proxy.port, 3)
            sent = [orjson.loads(r.body) for r in up.chat_requests()]
            assert sent[-1]["messages"] == messages[:-1]
            reparser: Reparser = proxy.app.state.reparser
            assert reparser.max_bytes == memory_mb * 2**20
            assert reparser.max_entries == max(128, memory_mb * 16)
            assert reparser.reused == (2 if memory_mb else 0)
        finally:
            proxy.stop()


def test_a_negative_memory_for_recent_bodies_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"limits\.reparse_memory_mb: must not be negative"):
        parse_config({"limits": {"reparse_memory_mb": -1}})


def test_a_big_body_with_a_small_new_part_is_handled_on_the_loop(
    served: tuple[_Served, ScriptedUpstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over ``OFFLOAD_BYTES`` goes to a worker thread for its parse and its
    fingerprints and counts, unless it resends a recent one with a small new part: a thread's
    round trip costs more than that part's work. What the upstream gets is unchanged."""
    proxy, up = served
    offloaded: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        work = getattr(fn, "__self__", None)  # a ``Compute`` command's ``run``
        offloaded.append(getattr(getattr(work, "fn", fn), "__name__", "?"))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    client = openai.OpenAI(
        api_key="sk-reparse-big", base_url=f"http://127.0.0.1:{proxy.port}/v1", max_retries=0
    )
    messages: list[dict[str, Any]] = _body(300)["messages"]
    assert len(orjson.dumps({"model": "gpt-4o", "messages": messages})) > OFFLOAD_BYTES
    seen = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn}"})
        reply = client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        seen.append(list(offloaded))
        offloaded.clear()
    # The first: parsed and identified in worker threads; the next two: neither.
    assert {"parse_and_validate", "identify"} <= set(seen[0])
    assert not {"parse_and_validate", "identify"} & {*seen[1], *seen[2]}
    assert proxy.app.state.reparser.reused == 2
    sent = [r.body for r in up.chat_requests()]
    assert orjson.loads(sent[-1])["messages"] == messages[:-1]

    # A new part over the bound: in a thread again (and still parsed from the last one).
    messages.append({"role": "user", "content": "y" * OFFLOAD_BYTES})
    client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
    assert {"parse_and_validate", "identify"} <= set(offloaded)
    assert proxy.app.state.reparser.reused == 3
    assert orjson.loads(up.chat_requests()[-1].body)["messages"] == messages


@pytest.mark.parametrize("surface", [ANTHROPIC_MESSAGES, OPENAI_RESPONSES])
def test_each_surface_names_its_history(surface: Any) -> None:
    assert surface.history_key == ("input" if surface is OPENAI_RESPONSES else "messages")


@pytest.mark.parametrize(
    ("middle", "taken"),
    [
        (b',{"role":"user","content":"x"}', True),
        (b',{"role":"user","content":"x"},{"role":"user","content":"y"}', True),
        # The array closed early and a member of its own: not whole elements, but the rest
        # as a whole is canonical, so it is taken that way (the same value as orjson's).
        (b',{"role":"user","content":"x"}],"x":[1', True),
        (b', {"role":"user","content":"x"}', False),  # a space orjson would not write
        (b',{"role":"user","content":"\\u0078"}', False),  # an escape orjson would not write
        (b',{"role":"user","content":"x"},', False),
        (b'{"role":"user","content":"x"}', False),  # no comma
        (b',{"role":"user","content":"x","content":"y"}', False),  # a member repeated
    ],
)
def test_between_the_same_bytes_only_whole_elements_are_taken(middle: bytes, taken: bool) -> None:
    """The members after the array as remembered, byte for byte: only what lies between is
    parsed, and it must be whole elements written as orjson writes them."""
    rp, body = _remembered(max_tokens=50, tools=[{"type": "function", "name": "f"}])
    raw = orjson.dumps(body)
    end = raw.rindex(b'],"max_tokens"')
    new = raw[:end] + middle + raw[end:]
    found = rp.parse(new, "messages")
    if taken:
        assert found is not None and found.body == orjson.loads(new)
        assert list(found.body) == list(orjson.loads(new))
    else:
        assert found is None


def test_the_depth_limit_is_where_the_whole_parse_puts_it() -> None:
    """Elements nested around the proxy's depth limit: the reparse accepts exactly what the
    whole parse accepts, through both of its paths (the same members after the array or
    others)."""
    rp = Reparser(min_bytes=0)
    base = orjson.dumps(_body(12, max_tokens=50))
    parse_and_validate(base, OPENAI_CHAT, rp)
    for depth in range(190, 210):
        nested: Any = "x"
        for _ in range(depth):
            nested = [nested]
        for extra in (b"", b',"stream":false'):
            added = orjson.dumps({"role": "user", "content": "x", "extra": nested})
            end = base.rindex(b"]")
            raw = base[:end] + b"," + added + b'],"max_tokens":50' + extra + b"}"
            outcomes = []
            for reparser in (None, rp):
                try:
                    outcomes.append(parse_and_validate(raw, OPENAI_CHAT, reparser)[0])
                except Exception as exc:  # the verdict, whichever it is
                    outcomes.append(f"{type(exc).__name__}: {exc}")
            assert outcomes[0] == outcomes[1], (depth, extra)
    assert rp.reused > 0
