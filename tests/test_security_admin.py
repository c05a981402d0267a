"""Operators' surfaces are closed by default, and no tenant reads another (issue #13).

No ``admin.token`` configured: the first start generates one (stored 0600 in the store's
folder, printed once), and ``/admin/api``, ``/dashboard`` and ``/metrics`` refuse anyone
without it - a client holding its own API key included.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.proxyproc import ProxyProcess
from tests.rawupstream import RawUpstream

SURFACES = [
    "/admin/api/stats",
    "/admin/api/conversations",
    "/admin/api/conversations/x",
    "/admin/api/conversations/x/original",
    "/metrics",
    "/dashboard",
]
TENANT_MODELS = {"sk-tenant-a": "model-of-tenant-a", "sk-tenant-b": "model-of-tenant-b"}


@pytest.fixture(scope="module")
def upstream() -> Any:
    with RawUpstream() as up:
        yield up


@pytest.fixture(scope="module")
def proxy(upstream: RawUpstream, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("admin")
    px = ProxyProcess(tmp, upstream.url("/v1"))  # no admin section at all
    with px:
        for key, model in TENANT_MODELS.items():
            client = openai.OpenAI(base_url=px.base_url, api_key=key, max_retries=0)
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"secret of {key}"}]
            )
        yield px


def _token(px: ProxyProcess) -> str:
    return (px.tmp / "store" / "admin-token").read_text().strip()


def test_a_token_is_generated_stored_privately_and_printed_once(proxy: ProxyProcess) -> None:
    path = proxy.tmp / "store" / "admin-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = _token(proxy)
    assert len(token) >= 32
    printed = re.findall(r"generated an admin token .*: (\S+)", proxy.logs())
    assert printed == [token]


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize("credential", [None, "sk-tenant-a", "wrong-token"])
def test_operator_surfaces_refuse_without_the_token(
    proxy: ProxyProcess, path: str, credential: str | None
) -> None:
    headers = {"authorization": f"Bearer {credential}"} if credential else {}
    r = httpx.get(f"{proxy.root}{path}", headers=headers, timeout=10)
    assert r.status_code == 401, r.text
    for key, model in TENANT_MODELS.items():
        assert model not in r.text and key not in r.text


@pytest.mark.parametrize("path", SURFACES[:2] + ["/metrics", "/dashboard"])
def test_the_token_opens_them(proxy: ProxyProcess, path: str) -> None:
    r = httpx.get(
        f"{proxy.root}{path}", headers={"authorization": f"Bearer {_token(proxy)}"}, timeout=10
    )
    assert r.status_code == 200, r.text


def test_a_tenants_key_never_shows_another_tenants_data(proxy: ProxyProcess) -> None:
    """Tenant B, holding only its own key, gets nothing of A's: not through the admin API,
    not by claiming A's tenant id, not through a path that climbs out of /v1."""
    auth = {"authorization": f"Bearer {_token(proxy)}"}
    listing = httpx.get(f"{proxy.root}/admin/api/conversations", headers=auth).json()
    assert {r["model"] for r in listing["items"]} == set(TENANT_MODELS.values())
    tenant_a = next(r for r in listing["items"] if r["model"] == "model-of-tenant-a")
    b = {"authorization": "Bearer sk-tenant-b"}
    for path in (
        f"/admin/api/conversations/{tenant_a['id']}",
        f"/admin/api/conversations/{tenant_a['id']}/original",
        f"/admin/api/conversations?tenant={tenant_a['tenant']}",
        f"/dashboard/conversations/{tenant_a['id']}",
    ):
        r = httpx.get(f"{proxy.root}{path}", headers=b, timeout=10)
        assert r.status_code == 401
        assert "model-of-tenant-a" not in r.text and "secret of" not in r.text
    # Claiming A's tenant through the header only makes a different tenant of B's key.
    client = openai.OpenAI(
        base_url=proxy.base_url,
        api_key="sk-tenant-b",
        max_retries=0,
        default_headers={"x-compaction-tenant": tenant_a["tenant"]},
    )
    client.chat.completions.create(model="probe", messages=[{"role": "user", "content": "hi"}])
    listing = httpx.get(f"{proxy.root}/admin/api/conversations", headers=auth).json()
    tenants = {r["tenant"] for r in listing["items"] if r["model"] == "probe"}
    assert tenant_a["tenant"] not in tenants


def test_the_generated_token_survives_a_restart(upstream: RawUpstream, tmp_path: Path) -> None:
    first = ProxyProcess(tmp_path, upstream.url("/v1"))
    with first:
        token = _token(first)
    second = ProxyProcess(tmp_path, upstream.url("/v1"))
    with second:
        assert _token(second) == token
        assert "generated an admin token" not in second.logs()
        r = httpx.get(f"{second.root}/metrics", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200
