"""Command line: `mcp-tasks-proxy [--config FILE] [--upstream URL] [--host H] [--port P] [--store S] [-- COMMAND ...]`,
`mcp-tasks-proxy check [FILE] [TOOL ...] [--strict]` and `mcp-tasks-proxy health`.

Where a setting comes from, the later winning: the embedded defaults, the defaults file (`--defaults`, a container
image's), the policy file, the environment (MCP_TASKS_PROXY_*), the flags (and a command after --)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence

import structlog
from aiohttp import web

from . import __version__, tracing
from .check import check_main, warn_unmatched_rules
from .config import ENV_PREFIX, ConfigError, ProxyConfig, apply_overrides, load_config
from .front.app import create_app
from .front.context import MCP_PATH, gateway_key, metrics_key, policy_key
from .front.serve import BindError, bind, hold_stop_signals, serve
from .log import configure_logging
from .policy import PolicyReloader, file_stamp
from .upstream.events import UpstreamStartError

# Each operator setting is declared once: (flag, config path, environment variable suffix, type).
OVERRIDES = (
    ("upstream", "upstream.url", "UPSTREAM", str),
    ("host", "listen.host", "HOST", str),
    ("port", "listen.port", "PORT", int),
    ("store", "store", "STORE", str),
    ("advertise_url", "listen.advertise_url", "ADVERTISE_URL", str),
    ("log_level", "logging.level", "LOG_LEVEL", str),
    ("log_format", "logging.format", "LOG_FORMAT", str),
)


_PRECEDENCE = (
    "Precedence, the later winning: embedded defaults < --defaults file < --config file < environment < flags."
)


def build_parser(*, health: bool = False) -> argparse.ArgumentParser:
    """The proxy's options; with `health`, the same options for `mcp-tasks-proxy health` (which reads them to find
    the port of the proxy it asks)."""
    if health:
        parser = argparse.ArgumentParser(
            prog="mcp-tasks-proxy health",
            usage="%(prog)s [options]",
            description="Exit 0 if the proxy this configuration describes answers GET /healthz, 1 if it does not (a "
            "container's health check). The options, files and environment are the proxy's own: they say which port "
            "to ask (on loopback when the proxy listens on every address).",
            epilog=_PRECEDENCE,
        )
    else:
        parser = argparse.ArgumentParser(
            prog="mcp-tasks-proxy",
            usage="%(prog)s [options] [-- COMMAND ARGS...]\n"
            "       %(prog)s check [FILE] [TOOL ...] [--upstream URL] [--strict]\n"
            "       %(prog)s health [options]",
            description="Reverse proxy that adds the MCP tasks extension (SEP-2663) in front of an MCP server: an "
            "HTTP one (--upstream URL) or a stdio one it starts (the command after --).",
            epilog="commands:\n  check   validate a policy file and print the rule each tool gets (check --help)\n"
            "  health  exit 0 if the proxy this configuration describes answers /healthz (health --help)\n\n"
            + _PRECEDENCE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    parser.add_argument("--config", metavar="FILE", help=f"YAML policy file (env {ENV_PREFIX}CONFIG)")
    parser.add_argument(
        "--defaults", metavar="FILE", help=f"YAML defaults under the policy file: an image's (env {ENV_PREFIX}DEFAULTS)"
    )
    parser.add_argument("--upstream", metavar="URL", help=f"upstream MCP endpoint (env {ENV_PREFIX}UPSTREAM)")
    parser.add_argument("--host", help=f"listen address (env {ENV_PREFIX}HOST; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help=f"listen port (env {ENV_PREFIX}PORT; default 8080)")
    parser.add_argument(
        "--store", metavar="memory|redis://...", help=f"task store: memory, or a Redis URL (env {ENV_PREFIX}STORE)"
    )
    parser.add_argument(
        "--advertise-url",
        metavar="URL",
        help=f"where the other replicas reach this one, e.g. http://10.0.0.5:8080 (env {ENV_PREFIX}ADVERTISE_URL)",
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help=f"env {ENV_PREFIX}LOG_LEVEL")
    parser.add_argument("--log-format", choices=["auto", "json", "console"], help=f"env {ENV_PREFIX}LOG_FORMAT")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """The proxy's own arguments, and the stdio server's command after `--` (None without one)."""
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    if not argv[at + 1 :]:
        raise ConfigError("nothing after --: give the stdio server's command there, or leave -- out")
    return argv[:at], argv[at + 1 :]


def _overridden(config: ProxyConfig, path: str, value: object, name: str) -> ProxyConfig:
    """`config` with one operator setting applied; a value it refuses is said with the flag or variable that gave
    it (`--store: ...`), not the config path it became."""
    try:
        return apply_overrides(config, {path: value})
    except ConfigError as exc:
        detail = re.sub(r"^overrides: (?:[\w.]+: )?", "", str(exc))
        shown = re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", str(value))  # a URL's password is not repeated
        raise ConfigError(f"{name} {shown!r}: {detail}") from None


def resolve_config(
    args: argparse.Namespace,
    environ: os._Environ[str] | dict[str, str],
    command: list[str] | None = None,
    *,
    needs_upstream: bool = True,
) -> ProxyConfig:
    """File, then environment, then flags (and a command after --): the later one wins."""
    config = load_config(
        args.config or environ.get(f"{ENV_PREFIX}CONFIG") or None,
        defaults=args.defaults or environ.get(f"{ENV_PREFIX}DEFAULTS") or None,
    )
    from_env = {path: environ.get(ENV_PREFIX + suffix) for _, path, suffix, _ in OVERRIDES}
    for _, path, suffix, kind in OVERRIDES:
        raw = from_env[path]
        if raw is not None and kind is int:
            try:
                from_env[path] = int(raw)
            except ValueError:
                raise ConfigError(f"{ENV_PREFIX}{suffix}: expected an integer, got {raw!r}") from None
    for _, path, suffix, _ in OVERRIDES:  # the environment's, then the flags': the later wins
        config = _overridden(config, path, from_env[path], f"{ENV_PREFIX}{suffix}")
    for flag, path, _, _ in OVERRIDES:
        config = _overridden(config, path, getattr(args, flag), "--" + flag.replace("_", "-"))
    config = apply_overrides(config, {"upstream.command": command})
    if needs_upstream and config.upstream.command is None:
        _ = config.upstream_url  # fail now, with the way to fix it, if no upstream is set anywhere
    return config


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:
        raise SystemExit(check_main(argv[1:]))
    health = argv[:1] == ["health"]
    if health:
        argv = argv[1:]
    try:
        argv, command = split_command(argv)
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args = build_parser(health=health).parse_args(argv)
    config_path = args.config or os.environ.get(f"{ENV_PREFIX}CONFIG")
    defaults_path = args.defaults or os.environ.get(f"{ENV_PREFIX}DEFAULTS") or None
    loaded_stamp = file_stamp(config_path) if config_path else None  # before reading: see PolicyReloader
    try:
        config = resolve_config(args, os.environ, command, needs_upstream=not health)
        defaults = load_config(None, defaults=defaults_path) if defaults_path else None
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if health:
        raise SystemExit(health_main(config))
    configure_logging(level=config.logging.level, format=config.logging.format)
    log = structlog.get_logger("proxy")
    traces = tracing.configure()
    try:
        app = create_app(config)
        hold_stop_signals()  # the socket takes connections from bind() on: a SIGTERM then is a graceful stop
        sock = bind(config.listen.host, config.listen.port)  # before anything starts: a port in use is one line
    except (ConfigError, BindError) as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    def announce() -> None:
        log.info(
            "proxy_started",
            listen=f"http://{config.listen.host}:{config.listen.port}{MCP_PATH}",
            upstream=config.upstream_name,
            upstream_protocol=config.upstream.protocol,
            store=config.store.backend,
            rules=len(config.tools),
            policy=config_path,
            tracing=traces,
            version=__version__,
        )
        if defaults is not None and config.listen.is_loopback and not defaults.listen.is_loopback:
            # An image's defaults file listens where other hosts can connect; a policy file (or the environment)
            # narrowed that to loopback: nothing outside this container can connect, and its HEALTHCHECK, which
            # asks from inside, still says healthy. Legitimate in a pod whose other containers are the clients,
            # so a warning, not a refusal.
            log.warning(
                "listen_loopback_only",
                listen=f"{config.listen.host}:{config.listen.port}",
                defaults=defaults_path,
                defaults_host=defaults.listen.host,
                reason="only this container can connect: listen.host in the policy file, MCP_TASKS_PROXY_HOST "
                "or --host overrides the defaults file's",
            )

    async def reload_ctx(app: web.Application) -> AsyncIterator[None]:
        reloader = PolicyReloader(
            app[policy_key], config_path, lambda: resolve_config(args, os.environ, command), loaded_stamp=loaded_stamp
        )
        reloader.start()
        yield
        await reloader.stop()

    async def rules_ctx(app: web.Application) -> AsyncIterator[None]:
        # In the background: start-up and readiness never wait for the upstream's tools.
        policy = app[policy_key]
        checking = asyncio.ensure_future(
            warn_unmatched_rules(
                app[gateway_key], lambda: policy.config.tools, max_bytes=config.limits.max_result_bytes
            )
        )
        yield
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking

    app.on_startup.append(_quieter_gc)
    if config_path:
        app.cleanup_ctx.append(reload_ctx)
    if config.tools:
        app.cleanup_ctx.append(rules_ctx)
    refused = app[metrics_key].connections_refused
    # asyncio.Runner, as asyncio.run: at the end, what still runs is cancelled and given the loop to finish (a
    # stream's pending wait, an async generator), rather than destroyed with a closed loop.
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(app, sock, config.listen, on_refused=refused.inc, announce=announce))
    except UpstreamStartError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        sock.close()
        if tracing.TRACER.enabled:
            tracing.TRACER.shutdown()  # type: ignore[union-attr]  # exports the spans still batched


def health_main(config: ProxyConfig) -> int:
    """GET /healthz of the proxy this configuration describes (on loopback when it listens on every address)."""
    host = config.listen.host
    host = "127.0.0.1" if host in ("0.0.0.0", "", "*") else "[::1]" if host == "::" else host
    url = f"http://{host}:{config.listen.port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            if response.status == 200:
                return 0
            print(f"mcp-tasks-proxy health: {url} answered {response.status}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"mcp-tasks-proxy health: {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
    return 1


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop where it is installed (most of the proxy's time is spent in socket I/O), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def _quieter_gc(app: web.Application) -> None:
    # What start-up made lives as long as the process: keep it out of the collector's way. Requests make many
    # short-lived objects; collecting the young generation less often spares latency without growing memory much.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


if __name__ == "__main__":
    main()
