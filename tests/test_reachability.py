"""Reachability probes go to the provider (issue #24): Claude Code sends ``HEAD /`` to its
base URL before it starts, and a client's connectivity check must see what the provider
answers, not a 404 of ours."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.adapters.forward import upstream_root
from tests.proxyproc import ProxyProcess
from tests.upstream import ScriptedUpstream


@pytest.mark.parametrize(
    ("method", "path", "upstream_path"),
    [("HEAD", "/", "/"), ("GET", "/", "/"), ("HEAD", "/v1", "/v1"), ("GET", "/v1", "/v1")],
)
def test_probes_are_answered_by_the_upstream(
    tmp_path: Path, method: str, path: str, upstream_path: str
) -> None:
    with ScriptedUpstream() as up, ProxyProcess(tmp_path, up.base_url) as px:
        r = httpx.request(method, px.root + path + "?probe=1", headers={"x-api-key": "sk-x"})
        assert r.status_code == 200  # the scripted upstream's catch-all answers 200
        (seen,) = [rec for rec in up.requests if rec.method == method]
        assert (seen.path, seen.query) == (upstream_path, "probe=1")
        assert seen.headers.get("x-api-key") == "sk-x"
        if method == "GET":
            assert r.json()["path"] == upstream_path


def test_the_root_of_a_base_url() -> None:
    assert str(upstream_root("https://api.openai.com/v1", "")) == "https://api.openai.com/"
    assert str(upstream_root("http://h:8/gw/v1/", "a=1")) == "http://h:8/gw/?a=1"
    assert str(upstream_root("http://h:8/openai", "")) == "http://h:8/openai/"
