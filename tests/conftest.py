"""Test-wide settings: nothing may reach the internet; a real redis-server for the modules
that ask for one (``redis_url``, one server per module)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# litellm fetches its model map from the internet on import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.proxyproc import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()
