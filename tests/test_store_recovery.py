"""A diskcache store deleted or replaced under a running proxy comes back (issue #29 item 2):
the proxy notices, opens it again (creating it if gone), says so once in the log and on
``/readyz``, records again from then on without a restart, and counts every write that
failed in between."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from proxy.adapters.store import DiskStore
from proxy.core.errors import StoreError
from tests.proxyproc import ProxyProcess, delete_folder
from tests.rawupstream import RawUpstream

ADMIN_TOKEN = "test-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def chat(tag: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"conversation {tag}"}]}


# ---- the store itself ----------------------------------------------------------------------


def test_a_write_after_the_folder_is_deleted_lands_in_a_new_folder(tmp_path: Path) -> None:
    """Without the check SQLite would write into the deleted files: no error, nothing kept."""
    store = DiskStore(tmp_path / "store")
    store.set("before", 1)
    shutil.rmtree(tmp_path / "store")
    store.set("after", 2)
    store.zadd("z", {"m": 1.0})
    reader = DiskStore(tmp_path / "store")  # another process would see the same files
    assert reader.get("after") == 2 and reader.zrange("z") == [("m", 1.0)]
    assert reader.get("before") is None  # deleted with its folder
    assert store.recreated is not None and "gone" in store.recreated[1]
    assert store.write_failures == 0


def test_a_worker_follows_a_store_another_worker_recreated(tmp_path: Path) -> None:
    one, two = DiskStore(tmp_path / "store"), DiskStore(tmp_path / "store")
    shutil.rmtree(tmp_path / "store")
    one.set("from-one", 1)  # recreates the folder
    two.set("from-two", 2)  # finds files that are not the ones it has open: follows them
    assert one.get("from-two") == 2 and two.get("from-one") == 1
    assert two.recreated is not None and "replaced" in two.recreated[1]


def test_a_store_that_cannot_be_recreated_counts_each_failed_write(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "store")
    failures: list[int] = []
    store.on_write_failure = lambda: failures.append(1)
    shutil.rmtree(tmp_path / "store")
    (tmp_path / "store").write_text("a file where the folder was")
    writes = (lambda: store.set("k", 1), lambda: store.incr("n"), lambda: store.zadd("z", {"m": 1}))
    for write in writes:
        with pytest.raises(StoreError):
            write()
    assert store.write_failures == 3 and len(failures) == 3
    (tmp_path / "store").unlink()
    store.set("k", 1)  # the path is usable again: recording resumes
    assert DiskStore(tmp_path / "store").get("k") == 1


# ---- through a real proxy process ----------------------------------------------------------


def _requests(px: ProxyProcess) -> int:
    stats = httpx.get(f"{px.root}/admin/api/stats", headers=AUTH, timeout=30)
    assert stats.status_code == 200, stats.text[:300]
    return int(stats.json()["totals"]["requests"])


def _metric(px: ProxyProcess, name: str) -> float:
    text = httpx.get(f"{px.root}/metrics", headers=AUTH, timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def _post(px: ProxyProcess, tag: str) -> None:
    reply = httpx.post(f"{px.base_url}/chat/completions", json=chat(tag), timeout=30)
    assert reply.status_code == 200, reply.text


def test_a_store_deleted_while_running_is_recreated_and_records_again(tmp_path: Path) -> None:
    with RawUpstream() as upstream:
        with ProxyProcess(tmp_path, upstream.url("/v1"), admin={"token": ADMIN_TOKEN}) as px:
            _post(px, "a")
            assert _requests(px) == 1
            delete_folder(tmp_path / "store")
            _post(px, "b")  # its ledger entry is the first write after the deletion
            assert _requests(px) == 1  # the new store holds it (the old one is gone)
            ready = httpx.get(f"{px.root}/readyz", timeout=30)
            assert ready.status_code == 200, ready.text
            assert "gone" in ready.json()["store_recreated"]["reason"]
            assert (tmp_path / "store" / "cache.db").exists()
            _post(px, "c")
            assert _requests(px) == 2  # recording goes on, no restart
            assert _metric(px, "compaction_proxy_store_write_failures_total") == 0
            assert px.logs().count("store reopened") == 1  # said once


def test_a_store_unusable_for_a_while_counts_its_failed_writes_then_recovers(
    tmp_path: Path,
) -> None:
    """The folder is replaced by a file (nothing can be created there): requests are still
    answered, ``/readyz`` says unavailable, every failed write is counted. Once the path is
    usable again the proxy records again without a restart."""
    with RawUpstream() as upstream:
        with ProxyProcess(tmp_path, upstream.url("/v1"), admin={"token": ADMIN_TOKEN}) as px:
            _post(px, "a")
            assert _requests(px) == 1
            delete_folder(tmp_path / "store")
            (tmp_path / "store").write_text("not a folder")
            _post(px, "b")
            # The admin API flushes this worker's queued ledger writes first: b's fails.
            httpx.get(f"{px.root}/admin/api/stats", headers=AUTH, timeout=30)
            assert _metric(px, "compaction_proxy_store_write_failures_total") >= 1
            ready = httpx.get(f"{px.root}/readyz", timeout=30)
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
            assert _metric(px, "compaction_proxy_store_up") == 0
            (tmp_path / "store").unlink()
            ready = httpx.get(f"{px.root}/readyz", timeout=30)
            assert ready.status_code == 200, ready.text
            assert _metric(px, "compaction_proxy_store_up") == 1
            _post(px, "c")
            assert _requests(px) == 1  # the entry written after recovery
            _post(px, "d")
            assert _requests(px) == 2
