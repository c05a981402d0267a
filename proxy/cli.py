"""``compaction-proxy`` command line: ``serve``, ``check`` and ``stats``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from proxy.adapters.reach import safe_url
from proxy.config import ENV_VAR, Config, ConfigError, load_config

OVERRIDES_VAR = "COMPACTION_PROXY_OVERRIDES"
# Command-line flag -> (config section, key): a flag is validated exactly as that YAML key.
FLAGS: dict[str, tuple[str, str]] = {
    "host": ("listen", "host"),
    "port": ("listen", "port"),
    "upstream": ("upstream", "base_url"),
}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _as_sections(flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {}
    for flag, value in flags.items():
        if value is not None and flag in FLAGS:
            section, key = FLAGS[flag]
            sections.setdefault(section, {})[key] = value
    return sections


def config_from_env() -> Config:
    """The config a worker process uses: the file named by the env plus CLI overrides."""
    raw = os.environ.get(OVERRIDES_VAR)
    return load_config(overrides=_as_sections(json.loads(raw)) if raw else None)


def app_factory() -> Any:
    """uvicorn ``--factory`` entry point, used for every worker."""
    from proxy.logs import setup_logging
    from proxy.server.app import create_app

    setup_logging(os.environ.get("COMPACTION_PROXY_LOG_LEVEL", "INFO"))
    return create_app(config_from_env())


def _flag_note(message: str, flags: dict[str, Any]) -> str:
    """Say which flag set the bad value, when it was a flag rather than the file."""
    for flag, value in flags.items():
        section, key = FLAGS[flag]
        if value is not None and message.startswith(f"{section}.{key}:"):
            return f"{message} (from --{flag} {value})"
    return message


def _load(args: argparse.Namespace) -> Config | None:
    """The validated config with the command line's overrides, or None after printing why."""
    if args.config:
        os.environ[ENV_VAR] = os.path.abspath(args.config)
    flags = {k: getattr(args, k, None) for k in FLAGS}
    flags = {k: v for k, v in flags.items() if v is not None}
    os.environ[OVERRIDES_VAR] = json.dumps(flags)
    try:
        return config_from_env()
    except ConfigError as exc:
        print(
            f"compaction-proxy: configuration error: {_flag_note(str(exc), flags)}", file=sys.stderr
        )
        return None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.preflight import startup_problems
    from proxy.server.onewrite import OneWriteHttpToolsProtocol

    config = _load(args)
    if config is None:
        return 2
    if args.workers < 1:
        print(
            "compaction-proxy: configuration error: --workers: must be at least 1", file=sys.stderr
        )
        return 2
    problems = startup_problems(config)
    if problems:
        for problem in problems:
            print(f"compaction-proxy: cannot start: {problem}", file=sys.stderr)
        return 2
    metrics_dir = None
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several workers: /metrics must sum them all, which prometheus-client does through
        # a shared folder. A fresh private one per run, so old counts never leak in; removed
        # when the server stops.
        import tempfile

        metrics_dir = tempfile.mkdtemp(prefix="compaction-proxy-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    compaction_to = config.compaction.summary_base_url
    print(
        f"compaction-proxy listening on http://{config.listen.host}:{config.listen.port}/v1 "
        f"-> {safe_url(config.upstream.base_url)}"
        + (f" (compaction calls -> {safe_url(compaction_to)})" if compaction_to else ""),
        file=sys.stderr,
    )
    try:
        uvicorn.run(
            "proxy.cli:app_factory",
            factory=True,
            host=config.listen.host,
            port=config.listen.port,
            workers=args.workers,
            loop="auto",
            # uvicorn's httptools protocol, a response's head and body in one write (#28).
            http=OneWriteHttpToolsProtocol,
            access_log=False,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=30,
        )
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _check(args: argparse.Namespace) -> int:
    from proxy.preflight import check

    config = _load(args)
    if config is None:
        print("config        FAILED (see above)")
        return 1
    findings = check(config)
    for finding in findings:
        status = "ok" if finding.ok else "FAILED"
        print(f"{finding.what:<30} {status:<6}  {finding.detail}")
    return 0 if all(f.ok for f in findings) else 1


def _stats(args: argparse.Namespace) -> int:
    from proxy.operators.stats_cli import print_stats

    config = _load(args)
    if config is None:
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
    serve.add_argument(
        "--log-level", default="info", help=f"one of {', '.join(LOG_LEVELS)} (default info)"
    )
    serve.set_defaults(func=_serve)
    check = sub.add_parser(
        "check", help="verify config, store, tokenizer files and the upstream; print findings"
    )
    check.add_argument("--config", help=f"YAML config file (default: ${ENV_VAR})")
    check.add_argument("--upstream", help="upstream base URL to check instead of the config's")
    check.set_defaults(func=_check)
    stats = sub.add_parser("stats", help="print totals and top conversations")
    stats.add_argument("--config", help=f"YAML config file (default: ${ENV_VAR})")
    stats.add_argument("--top", type=int, default=10, help="conversations to list")
    stats.set_defaults(func=_stats)
    args = parser.parse_args(argv)
    if getattr(args, "log_level", None):
        level = args.log_level.strip().lower()
        if level not in LOG_LEVELS:
            print(
                f"compaction-proxy: configuration error: --log-level: must be one of "
                f"{list(LOG_LEVELS)}, not {args.log_level!r}",
                file=sys.stderr,
            )
            return 2
        args.log_level = level
        os.environ["COMPACTION_PROXY_LOG_LEVEL"] = level.upper()
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
