"""``python -m eval.fidelity --upstream URL --model NAME``: the fidelity evaluation.

For each built-in conversation: replay it turn by turn through a real proxy process (inline
compaction, successive compactions), record what the proxy forwards (a relay between the proxy
and the model), then count the planted facts that the last forwarded request still holds,
against "drop the middle" and "keep the last N turns" at the same forwarded token budget. Each
compaction's loss report is checked against the request it was made for: a fact listed as
dropped must be absent from it, every other listed fact present. QA exact-match asks the model
a few planted facts' questions with the full and with the forwarded history. Writes markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

import proxy as proxy_package
from eval import conversations as convs
from eval.baselines import all_text, drop_the_middle, keep_last_turns, present
from eval.relay import Relay
from eval.report import render
from proxy.core.fingerprint import fingerprints
from proxy.core.lossreport import split_summary
from proxy.core.summarizer import strip_summary_header
from proxy.core.summarycheck import check
from proxy.core.tokens import TokenCounter

COMPACTION = {
    # Small enough that a 135M model on a shared CPU compacts each conversation a few times
    # within minutes; the ratios are what matters, not the absolute sizes.
    "trigger_tokens": 1500,
    "verbatim_window_tokens": 350,
    "summary_budget_tokens": 128,
    "min_verbatim_exchanges": 2,
    "mode": "inline",
    "emergency_factor": 1.5,
    "llm_timeout_s": 300,
    "detector_window_messages": 10,
    "detector_chars_per_message": 200,
    # The shipped cooldowns (soft 30 s, hard 300 s): the replay sends its turns faster than
    # any user, so after a failure the following turns are not compacted by the LLM path.
}


@dataclass
class Result:
    name: str
    kind: str
    turns: int
    planted: list[str]
    original_tokens: int = 0
    forwarded_tokens: int = 0
    proxy_kept: list[str] = field(default_factory=list)
    middle_kept: list[str] = field(default_factory=list)
    last_kept: list[str] = field(default_factory=list)
    compactions: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    summary_tokens: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    bad_summaries: list[str] = field(default_factory=list)  # accepted, yet failing a check
    qa: list[dict[str, Any]] = field(default_factory=list)
    cases: list[str] = field(default_factory=list)
    llm_calls: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proxy:
    """``compaction-proxy serve`` in a subprocess with its own config and store."""

    def __init__(self, workdir: Path, upstream: str, compaction: dict[str, Any]) -> None:
        self.port = _free_port()
        self.admin_token = secrets.token_urlsafe(24)
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"base_url": upstream, "timeout_s": 600},
            "store": {"url": f"diskcache://{workdir / 'store'}"},
            "compaction": compaction,
            "admin": {"token": self.admin_token},
        }
        self.config_path = workdir / "proxy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Proxy:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.root}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("proxy did not start")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _check_loss_report(compaction: dict[str, Any], forwarded: list[dict[str, Any]]) -> list[str]:
    """Where the loss report disagrees with the forwarded request it was made for."""
    text = all_text(forwarded)
    wrong = [f"dropped but forwarded: {f}" for f in compaction["facts_dropped"] if f in text]
    for key in ("facts_kept", "facts_appended", "facts_elsewhere"):
        wrong += [f"{key} but absent: {f}" for f in compaction.get(key) or [] if f not in text]
    return wrong


def _ask(
    client: httpx.Client, url: str, model: str, messages: list[dict[str, Any]], question: str
) -> str:
    history = [m for m in messages if m.get("role") != "tool" and not m.get("tool_calls")]
    ask = {"role": "user", "content": f"Answer with the exact value only. {question}"}
    try:
        r = client.post(
            f"{url}/chat/completions",
            json={"model": model, "messages": [*history, ask], "max_tokens": 24, "temperature": 0},
        )
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"] or "")
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        return f"<error {type(exc).__name__}>"


def run_one(
    conv: convs.Conversation,
    relay: Relay,
    proxy: Proxy,
    model: str,
    qa_questions: int,
    qa_client: httpx.Client,
    counter: TokenCounter,
) -> Result:
    started = time.monotonic()
    res = Result(conv.name, conv.kind, len(conv.turns), [f.answer for f in conv.facts])
    first_call = len(relay.llm)
    client = httpx.Client(timeout=900)
    admin = {"authorization": f"Bearer {proxy.admin_token}"}
    conversation_id = ""
    seen = 0
    last_forwarded: list[dict[str, Any]] = []
    last_original: list[dict[str, Any]] = []
    for t in range(len(conv.turns)):
        messages = convs.history(conv, t)
        r = client.post(
            f"{proxy.root}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 16, "temperature": 0},
        )
        r.raise_for_status()
        res.cases.append(r.headers.get("x-compaction-case", "?"))
        res.original_tokens = int(r.headers.get("x-compaction-original-tokens", 0))
        res.forwarded_tokens = int(r.headers.get("x-compaction-forwarded-tokens", 0))
        conversation_id = r.headers.get("x-compaction-conversation", conversation_id)
        last_forwarded = list(relay.main[-1].get("messages") or [])
        last_original = messages
        detail = client.get(
            f"{proxy.root}/admin/api/conversations/{conversation_id}", headers=admin
        ).json()
        compactions = detail.get("compactions") or []
        for c in compactions[seen:]:
            # Inline mode: a compaction made during this request shaped what it forwarded.
            res.mismatches += [f"turn {t}: {w}" for w in _check_loss_report(c, last_forwarded)]
        seen = len(compactions)
        res.compactions = compactions
        res.failures = detail.get("failures") or []
    client.close()
    res.llm_calls = relay.llm[first_call:]
    prompt = (Path(proxy_package.__file__).parent / "prompts" / "summarizer.md").read_text()
    for c in res.compactions:
        if c.get("case") == "summarize" and c.get("summary"):
            own = split_summary(strip_summary_header(c["summary"]))[0]
            why = check(own, "", prompt)  # the span is gone: every check but off-topic
            if why:
                res.bad_summaries.append(why)
        if c.get("summary"):
            res.summary_tokens.append(
                counter.count_message({"role": "system", "content": c["summary"]}, model)
            )
    counts = counter.count_messages(last_original, model, fingerprints(last_original))
    budget = res.forwarded_tokens
    res.proxy_kept = present(res.planted, last_forwarded)
    res.middle_kept = present(res.planted, drop_the_middle(last_original, counts, budget))
    res.last_kept = present(res.planted, keep_last_turns(last_original, counts, budget))
    # All full-history questions first, then the forwarded ones: the model server reuses the
    # shared prefix, so each history is read once.
    step = max(1, len(conv.facts) // max(qa_questions, 1))
    asked = conv.facts[::step][:qa_questions]
    forwarded = last_forwarded[:-1] + convs.full(conv)[len(last_original) - 1 :]
    whole = [_ask(qa_client, relay.upstream, model, convs.full(conv), f.question) for f in asked]
    fwd = [_ask(qa_client, relay.upstream, model, forwarded, f.question) for f in asked]
    for fact, a_full, a_fwd in zip(asked, whole, fwd, strict=True):
        answer = fact.answer.lower()
        res.qa.append(
            {
                "question": fact.question,
                "answer": fact.answer,
                "full": answer in a_full.lower(),
                "forwarded": answer in a_fwd.lower(),
            }
        )
    res.seconds = time.monotonic() - started
    return res


def evaluate(
    upstream: str,
    model: str,
    *,
    api_key: str | None = None,
    scale: float = 1.0,
    qa_questions: int = 3,
    forward_main: bool = False,
    compaction: dict[str, Any] | None = None,
    only: str | None = None,
) -> list[Result]:
    """Run every built-in conversation through a fresh proxy; the results in order."""
    counter = TokenCounter()
    results = []
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with (
        Relay(upstream, api_key, forward_main) as relay,
        httpx.Client(timeout=900, headers=headers) as qa,
    ):
        for conv in convs.builtin(scale):
            if only and conv.name != only:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                with Proxy(Path(tmp), relay.url, {**COMPACTION, **(compaction or {})}) as proxy:
                    results.append(run_one(conv, relay, proxy, model, qa_questions, qa, counter))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.fidelity", description=__doc__)
    parser.add_argument("--upstream", required=True, help="OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--model", required=True, help="model name for requests and the proxy")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("EVAL_API_KEY"),
        help="bearer key for a real endpoint (default: $EVAL_API_KEY)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="conversation length factor")
    parser.add_argument("--qa", type=int, default=3, help="QA questions per conversation")
    parser.add_argument(
        "--forward-main",
        action="store_true",
        help="send the conversation's own requests to the model too",
    )
    parser.add_argument("--out", default="docs/fidelity.md", help="markdown report ('-': stdout)")
    parser.add_argument("--note", default="", help="a line for the report (the model server...)")
    parser.add_argument("--only", help="one conversation: coding-agent, planning or support")
    parser.add_argument("--dump", help="also write every detector/summarizer exchange (JSON)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = evaluate(
        args.upstream,
        args.model,
        api_key=args.api_key,
        scale=args.scale,
        qa_questions=args.qa,
        forward_main=args.forward_main,
        only=args.only,
    )
    text = render(
        results,
        model=args.model,
        upstream=args.upstream,
        compaction=COMPACTION,
        seconds=time.monotonic() - started,
        note=args.note,
        command="python -m eval.fidelity " + shlex.join(argv if argv is not None else sys.argv[1:]),
    )
    if args.dump:
        exchanges = {r.name: {"calls": r.llm_calls, "compactions": r.compactions} for r in results}
        Path(args.dump).write_text(json.dumps(exchanges, indent=1, ensure_ascii=False))
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
