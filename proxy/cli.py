"""``compaction-proxy`` command line: ``serve`` and ``stats``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from .config import ENV_VAR, Config, ConfigError, Listen, Upstream, load_config

OVERRIDES_VAR = "COMPACTION_PROXY_OVERRIDES"


def _apply_overrides(config: Config, overrides: dict[str, Any]) -> Config:
    listen: Listen = config.listen
    upstream: Upstream = config.upstream
    if overrides.get("host"):
        listen = replace(listen, host=overrides["host"])
    if overrides.get("port"):
        listen = replace(listen, port=int(overrides["port"]))
    if overrides.get("upstream"):
        url = overrides["upstream"]
        if not url.startswith(("http://", "https://")):
            raise ConfigError("--upstream: must start with http:// or https://")
        upstream = replace(upstream, base_url=url)
    return replace(config, listen=listen, upstream=upstream)


def config_from_env() -> Config:
    """The config a worker process uses: the file named by the env plus CLI overrides."""
    config = load_config()
    raw = os.environ.get(OVERRIDES_VAR)
    return _apply_overrides(config, json.loads(raw)) if raw else config


def app_factory() -> Any:
    """uvicorn ``--factory`` entry point, used for every worker."""
    from .logs import setup_logging
    from .server import create_app

    setup_logging(os.environ.get("COMPACTION_PROXY_LOG_LEVEL", "INFO"))
    return create_app(config_from_env())


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    if args.config:
        os.environ[ENV_VAR] = os.path.abspath(args.config)
    overrides = {"host": args.host, "port": args.port, "upstream": args.upstream}
    os.environ[OVERRIDES_VAR] = json.dumps({k: v for k, v in overrides.items() if v})
    try:
        config = config_from_env()
    except ConfigError as exc:
        print(f"compaction-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several workers: /metrics must sum them all, which prometheus-client does through
        # a shared folder. A fresh private one per run, so old counts never leak in.
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
            prefix="compaction-proxy-metrics-"
        )
    print(
        f"compaction-proxy listening on http://{config.listen.host}:{config.listen.port}/v1 "
        f"-> {config.upstream.base_url}",
        file=sys.stderr,
    )
    uvicorn.run(
        "proxy.cli:app_factory",
        factory=True,
        host=config.listen.host,
        port=config.listen.port,
        workers=args.workers,
        loop="auto",
        http="auto",
        access_log=False,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=30,
    )
    return 0


def _stats(args: argparse.Namespace) -> int:
    from .stats_cli import print_stats

    if args.config:
        os.environ[ENV_VAR] = os.path.abspath(args.config)
    try:
        config = config_from_env()
    except ConfigError as exc:
        print(f"compaction-proxy: configuration error: {exc}", file=sys.stderr)
        return 2
    return print_stats(config, top=args.top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compaction-proxy",
        description="OpenAI-compatible reverse proxy that compacts long conversations.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help=f"YAML config file (default: ${ENV_VAR})")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 4000)")
    serve.add_argument("--upstream", help="upstream base URL, e.g. https://api.openai.com/v1")
    serve.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    serve.add_argument("--log-level", default="INFO", help="log level (default INFO)")
    serve.set_defaults(func=_serve)
    stats = sub.add_parser("stats", help="print totals and top conversations")
    stats.add_argument("--config", help=f"YAML config file (default: ${ENV_VAR})")
    stats.add_argument("--top", type=int, default=10, help="conversations to list")
    stats.set_defaults(func=_stats)
    args = parser.parse_args(argv)
    if getattr(args, "log_level", None):
        os.environ["COMPACTION_PROXY_LOG_LEVEL"] = args.log_level
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
