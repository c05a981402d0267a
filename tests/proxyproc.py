"""Start ``compaction-proxy serve --config`` as a real process on a free port (and a private
``redis-server`` for the store it can share)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from proxy.adapters.store import RedisStore
from proxy.core.errors import StoreError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_path() -> str:
    found = Path(sys.executable).parent / "compaction-proxy"
    if found.exists():
        return str(found)
    which = shutil.which("compaction-proxy")
    assert which, "compaction-proxy is not installed (pip install -e '.[dev]')"
    return which


def delete_folder(path: Path) -> None:
    """Delete a store folder under a running proxy as an operator would, in one step: moved
    aside, then removed (``rmtree`` in place races SQLite, which may remove its ``-wal``
    file meanwhile or write one back)."""
    aside = path.with_name(path.name + ".deleted")
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


class ProxyProcess:
    """A proxy process with its own config file, store folder and log file."""

    def __init__(self, tmp: Path, upstream_url: str, **sections: Any) -> None:
        self.port = free_port()
        self.tmp = tmp
        store_dir = tmp / "store"
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"base_url": upstream_url, "timeout_s": 10},
            "store": {"url": f"diskcache://{store_dir}"},
        }
        for name, values in sections.items():
            config.setdefault(name, {}).update(values)
        self.config_path = tmp / "proxy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(
        self,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        **popen: Any,
    ) -> ProxyProcess:
        """Start and wait for ``/healthz``; ``popen`` goes to ``subprocess.Popen`` (``user``)."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [cli_path(), "serve", "--config", str(self.config_path), *(extra_args or [])],
            stdout=log,
            stderr=subprocess.STDOUT,
            # A generated admin token for a Redis store lands in $XDG_CONFIG_HOME: keep it here.
            env={**os.environ, "XDG_CONFIG_HOME": str(self.tmp / "config"), **(env or {})},
            **popen,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.root}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"proxy did not start: {self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def logs(self) -> str:
        return self.log_path.read_text()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer:
    """A private ``redis-server`` on a free port (the Redis tests, the benchmark's Redis row);
    ``stop`` kills it, as a crash would."""

    def __init__(self, work: Path, persistent: bool = False) -> None:
        self.persistent = persistent  # every write kept across a crash (AOF, fsync always)
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (apt-get install -y redis-server)"
        self.binary, self.work, self.port = binary, work, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, *args, "--dir", str(self.work)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                RedisStore(self.url).get("ping")
                return
            except StoreError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash: nothing flushed, nothing kept (no persistence)
            self.proc.wait(10)
