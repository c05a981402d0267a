"""proxy.fingerprint: canonical form, fingerprints, the prefix chain, tenants, conversation ids."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.core.fingerprint import (
    canonical_form,
    chain_of,
    chain_prints,
    chain_root,
    conversation_id,
    earlier_conversation_id,
    fingerprint,
    fingerprints,
    prefix_chain,
    tenant_id,
)

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'},
}


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Read src/app.py please."},
        {"role": "assistant", "content": None, "tool_calls": [copy.deepcopy(TOOL_CALL)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
        {"role": "assistant", "content": "It prints hi."},
        {"role": "user", "content": "Thanks."},
    ]


# ---- benign variations hash the same -------------------------------------------------------

BENIGN_PAIRS = [
    pytest.param(
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        id="string-vs-one-text-part",
    ),
    pytest.param(
        {"role": "user", "content": "hello"},
        {"role": "user", "content": "hello", "name": None, "tool_calls": None},
        id="absent-vs-null-fields",
    ),
    pytest.param(
        {"role": "user", "content": "hello", "name": "ann"},
        {"name": "ann", "content": "hello", "role": "user"},
        id="top-level-key-order",
    ),
    pytest.param(
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {
            "tool_calls": [
                {
                    "function": {
                        "arguments": TOOL_CALL["function"]["arguments"],
                        "name": "read_file",
                    },
                    "type": "function",
                    "id": "call_1",
                }
            ],
            "role": "assistant",
        },
        id="nested-key-order-and-absent-content",
    ),
    pytest.param(
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        },
        id="cache-control-on-single-part",
    ),
    pytest.param(
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
            ],
        },
        id="cache-control-on-one-of-two-parts",
    ),
    pytest.param(
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        id="empty-vs-null-content-on-tool-call-turn",
    ),
    pytest.param(
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "assistant", "tool_calls": [TOOL_CALL]},
        id="empty-vs-absent-content-on-tool-call-turn",
    ),
    pytest.param(
        {"role": "user", "content": "hello"},
        {"role": "user", "content": "hello", "id": "msg_123", "extra_provider_field": {"x": 1}},
        id="non-meaning-fields-ignored",
    ),
]


@pytest.mark.parametrize(("a", "b"), BENIGN_PAIRS)
def test_benign_variations_hash_the_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert canonical_form(a) == canonical_form(b)
    assert fingerprint(a) == fingerprint(b)


# ---- changes of meaning hash differently ---------------------------------------------------


def _with(message: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(message)
    out.update(changes)
    return out


def _call(**fn_changes: Any) -> dict[str, Any]:
    call = copy.deepcopy(TOOL_CALL)
    for key, value in fn_changes.items():
        if key == "id":
            call["id"] = value
        else:
            call["function"][key] = value
    return call


USER = {"role": "user", "content": "hello", "name": "ann"}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "42"}

MEANING_CHANGES = [
    pytest.param(USER, _with(USER, role="assistant"), id="role"),
    pytest.param(USER, _with(USER, role="system"), id="role-system"),
    pytest.param(USER, _with(USER, content="hello!"), id="content"),
    pytest.param(USER, _with(USER, content="Hello"), id="content-case"),
    pytest.param(USER, _with(USER, content="hello "), id="content-whitespace"),
    pytest.param(USER, _with(USER, name="bob"), id="name"),
    pytest.param(USER, {"role": "user", "content": "hello"}, id="name-removed"),
    pytest.param(
        {"role": "user", "content": "hello"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
        },
        id="two-parts-are-not-one-string",
    ),
    pytest.param(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "a"}]},
        id="part-order",
    ),
    pytest.param(
        ASSISTANT_CALL,
        _with(ASSISTANT_CALL, tool_calls=[_call(arguments='{"path": "src/other.py"}')]),
        id="tool-call-arguments",
    ),
    pytest.param(
        ASSISTANT_CALL, _with(ASSISTANT_CALL, tool_calls=[_call(id="call_2")]), id="tool-call-id"
    ),
    pytest.param(
        ASSISTANT_CALL, _with(ASSISTANT_CALL, tool_calls=[_call(name="grep")]), id="tool-call-name"
    ),
    pytest.param(
        ASSISTANT_CALL,
        _with(ASSISTANT_CALL, tool_calls=[TOOL_CALL, _call(id="call_2")]),
        id="extra-tool-call",
    ),
    pytest.param(
        ASSISTANT_CALL,
        _with(ASSISTANT_CALL, content="Let me look."),
        id="text-next-to-tool-call",
    ),
    pytest.param(
        TOOL_RESULT, _with(TOOL_RESULT, tool_call_id="call_2"), id="tool-call-id-of-result"
    ),
    pytest.param(TOOL_RESULT, _with(TOOL_RESULT, content="43"), id="tool-result-content"),
    pytest.param(
        {"role": "user", "content": ""}, {"role": "user", "content": None}, id="empty-user-not-null"
    ),
]


@pytest.mark.parametrize(("a", "b"), MEANING_CHANGES)
def test_changes_of_meaning_hash_differently(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_is_128_bits_and_deterministic() -> None:
    m = {"role": "user", "content": "hello"}
    assert len(fingerprint(m)) == 16
    assert fingerprint(m) == fingerprint(copy.deepcopy(m))


def test_canonical_form_does_not_mutate_the_message() -> None:
    m = {
        "role": "user",
        "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
        "name": None,
    }
    before = copy.deepcopy(m)
    fingerprint(m)
    assert m == before


# ---- the prefix chain -----------------------------------------------------------------------


def test_chain_has_one_hash_per_prefix() -> None:
    msgs = conversation()
    chain = prefix_chain("t", fingerprints(msgs))
    assert len(chain) == len(msgs) + 1
    assert chain[0] == chain_root("t")
    assert len(set(chain)) == len(chain)


def test_chain_h_k_depends_on_exactly_the_first_k_messages() -> None:
    msgs = conversation()
    base = prefix_chain("t", fingerprints(msgs))
    for i in range(len(msgs)):
        edited = copy.deepcopy(msgs)
        edited[i]["content"] = f"edited {i}"
        chain = prefix_chain("t", fingerprints(edited))
        # h[0..i] only see messages before i: unchanged. h[i+1..] include message i: changed.
        assert chain[: i + 1] == base[: i + 1]
        for k in range(i + 1, len(msgs) + 1):
            assert chain[k] != base[k], (i, k)


def test_chain_is_stable_when_messages_are_appended() -> None:
    msgs = conversation()
    short = prefix_chain("t", fingerprints(msgs[:3]))
    full = prefix_chain("t", fingerprints(msgs))
    assert full[:4] == short


def test_chain_is_order_sensitive() -> None:
    msgs = conversation()
    swapped = [msgs[0], msgs[5], *msgs[2:5], msgs[1]]
    a = prefix_chain("t", fingerprints(msgs))
    b = prefix_chain("t", fingerprints(swapped))
    assert a[1] == b[1]
    assert a[2:] != b[2:]
    assert a[-1] != b[-1]


def test_different_tenants_have_disjoint_chains() -> None:
    fps = fingerprints(conversation())
    a = prefix_chain(tenant_id("sk-one"), fps)
    b = prefix_chain(tenant_id("sk-two"), fps)
    assert not set(a) & set(b)


def test_benign_variation_gives_the_same_chain() -> None:
    msgs = conversation()
    variant = copy.deepcopy(msgs)
    variant[1]["content"] = [
        {"type": "text", "text": msgs[1]["content"], "cache_control": {"type": "ephemeral"}}
    ]
    variant[2]["content"] = ""
    variant[4] = {"content": msgs[4]["content"], "role": "assistant", "name": None}
    assert prefix_chain("t", fingerprints(msgs)) == prefix_chain("t", fingerprints(variant))


def test_the_chain_takes_the_head_by_role_alone() -> None:
    """A client whose system prompt changes on every request (a clock in it) keeps its chain
    and conversation id; everything after the head still counts word for word."""
    msgs = conversation()
    base = chain_of("t", msgs)
    assert base == chain_of("t", msgs, fingerprints(msgs))
    clocked = copy.deepcopy(msgs)
    clocked[0]["content"] = "You are a helpful assistant. It is 12:03:55."
    assert chain_of("t", clocked) == base
    assert conversation_id(chain_of("t", clocked), clocked) == conversation_id(base, msgs)
    # The head's roles and length count, and so does every message after it.
    developer = [{"role": "developer", "content": msgs[0]["content"]}, *msgs[1:]]
    assert chain_of("t", developer)[1] != base[1]
    two = [msgs[0], {"role": "system", "content": "Also: be brief."}, *msgs[1:]]
    assert chain_of("t", two)[2:] != base[1:]
    edited = copy.deepcopy(msgs)
    edited[1]["content"] = "Read src/other.py please."
    assert chain_of("t", edited)[2] != base[2]
    # A system message inside the conversation (Claude Code's reminders) is no head.
    inside = [*msgs[:2], {"role": "system", "content": "Reminder A."}, *msgs[2:]]
    other = [*msgs[:2], {"role": "system", "content": "Reminder B."}, *msgs[2:]]
    assert chain_of("t", inside)[3] != chain_of("t", other)[3]
    # The plain chain of fingerprints is still the exact one (what ``chain_of`` hashes is
    # the fingerprints with the head's replaced).
    assert prefix_chain("t", fingerprints(clocked))[1] != prefix_chain("t", fingerprints(msgs))[1]
    assert chain_prints(msgs, fingerprints(msgs))[1:] == fingerprints(msgs)[1:]


# ---- tenants ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "credential",
    ["sk-live-abcdef0123456789", "Bearer sk-proj-XYZ", "0123456789abcdef0123456789abcdef", "k"],
)
def test_tenant_id_never_contains_the_key(credential: str) -> None:
    tid = tenant_id(credential)
    assert credential not in tid
    bare = credential.removeprefix("Bearer ")
    assert bare not in tid
    assert credential.encode().hex() not in tid
    assert len(tid) == 32 and int(tid, 16) >= 0


def test_tenant_id_is_stable_and_distinguishes_credentials_and_headers() -> None:
    assert tenant_id("sk-a") == tenant_id("sk-a")
    assert tenant_id("sk-a") != tenant_id("sk-b")
    assert tenant_id("sk-a", "team-1") != tenant_id("sk-a", "team-2")
    assert tenant_id("sk-a", "team-1") != tenant_id("sk-a")
    assert tenant_id(None) == tenant_id("")
    # The separator keeps "ab"+"c" apart from "a"+"bc".
    assert tenant_id("ab", "c") != tenant_id("a", "bc")


# ---- conversation ids ------------------------------------------------------------------------


def test_conversation_id_from_header_wins() -> None:
    msgs = conversation()
    chain = prefix_chain("t", fingerprints(msgs))
    assert conversation_id(chain, msgs, "  my-conv-7 ") == "c:my-conv-7"
    assert conversation_id(chain, msgs, "x" * 500) == "c:" + "x" * 200


def test_conversation_id_is_the_hash_through_the_first_reply() -> None:
    msgs = conversation()
    chain = prefix_chain("t", fingerprints(msgs))
    cid = conversation_id(chain, msgs)
    assert cid == chain[3].hex()  # system + first user message + first reply
    assert earlier_conversation_id(chain, msgs) == chain[2].hex()
    # Later turns do not change it; the first exchange and the tenant do.
    longer = [*msgs, {"role": "assistant", "content": "You're welcome."}]
    assert conversation_id(prefix_chain("t", fingerprints(longer)), longer) == cid
    edited = copy.deepcopy(msgs)
    edited[1]["content"] = "Read src/other.py please."
    assert conversation_id(prefix_chain("t", fingerprints(edited)), edited) != cid
    assert conversation_id(prefix_chain("u", fingerprints(msgs)), msgs) != cid


def test_sessions_with_the_same_opening_separate_at_their_first_reply() -> None:
    opening = conversation()[:2]
    a = [*opening, {"role": "assistant", "content": "Reading it now (session A)."}]
    b = [*opening, {"role": "assistant", "content": "On it (session B)."}]
    ida = conversation_id(prefix_chain("t", fingerprints(a)), a)
    idb = conversation_id(prefix_chain("t", fingerprints(b)), b)
    assert ida != idb
    # Before any reply both are the same history: one id, which each session's later
    # requests know as their earlier id (where records of the first request live).
    first = conversation_id(prefix_chain("t", fingerprints(opening)), opening)
    assert earlier_conversation_id(prefix_chain("t", fingerprints(a)), a) == first
    assert earlier_conversation_id(prefix_chain("t", fingerprints(b)), b) == first
    assert earlier_conversation_id(prefix_chain("t", fingerprints(opening)), opening) is None
    # An assistant greeting before the first user message does not name the session.
    greeted = [{"role": "assistant", "content": "Hi!"}, *a[1:]]
    gid = conversation_id(prefix_chain("t", fingerprints(greeted)), greeted)
    assert gid == prefix_chain("t", fingerprints(greeted))[len(greeted)].hex()
    # The client's id wins, and there is no earlier one then.
    assert earlier_conversation_id(prefix_chain("t", fingerprints(a)), a, "mine") is None


def test_conversation_id_without_a_user_message_uses_the_whole_chain() -> None:
    msgs = [{"role": "system", "content": "s"}]
    chain = prefix_chain("t", fingerprints(msgs))
    assert conversation_id(chain, msgs) == chain[1].hex()
    assert conversation_id(chain, msgs, "") == chain[1].hex()
