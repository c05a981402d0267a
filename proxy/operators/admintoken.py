"""The admin token: the operators' surfaces (``/admin/api``, ``/dashboard``, ``/metrics``)
are never open to whoever can reach the proxy (issue #13).

With ``admin.token`` configured, that is the token. Without one, the first start generates a
random token, stores it in ``admin-token`` (mode 0600) inside the store's folder (private,
0700) - or in ``~/.config/compaction-proxy/`` with a Redis store - and prints it once to
stderr; later starts (and every worker) read the same file. When no file can be written (a
read-only store folder) the token is generated for this process only and printed.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

from proxy.config import Config

log = logging.getLogger("compaction_proxy.admin")

FILE_NAME = "admin-token"


def token_path(store_url: str) -> Path:
    """Where a generated token lives for this store."""
    parsed = urlparse(store_url)
    if parsed.scheme == "diskcache":
        raw = store_url[len("diskcache://") :] or "~/.cache/compaction-proxy"
        return Path(os.path.expanduser(raw)) / FILE_NAME
    home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(home) / "compaction-proxy" / FILE_NAME


def _read(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def _create(path: Path, token: str) -> str:
    """Write ``token`` to ``path`` unless another process did first; the token in the file.

    Written to a private temporary file and linked into place, so a reader never sees a
    half-written token and two workers starting at once agree on one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        os.link(tmp, path)
    except FileExistsError:
        return _read(path) or token
    finally:
        tmp.unlink(missing_ok=True)
    return token


def resolve(config: Config) -> Config:
    """``config`` with ``admin.token`` set: the configured one, the stored one, or a new one."""
    if config.admin.token:
        return config
    path = token_path(config.store.url)
    token = _read(path)
    if token is None:
        fresh = secrets.token_urlsafe(32)
        try:
            token = _create(path, fresh)
            if token == fresh:
                _announce(f"generated an admin token (stored in {path}, mode 0600): {token}")
        except OSError as exc:
            token = fresh
            log.error(
                "cannot store the admin token; this process uses a temporary one",
                extra={"path": str(path), "error": str(exc)},
            )
            _announce(f"temporary admin token for this process (pid {os.getpid()}): {token}")
    return replace(config, admin=replace(config.admin, token=token))


def _announce(line: str) -> None:
    # Straight to stderr, once: the structured log may be shipped elsewhere; this is for the
    # operator starting the proxy.
    print(f"compaction-proxy: {line}", file=sys.stderr, flush=True)
