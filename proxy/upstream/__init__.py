"""The upstream MCP server, by transport (HTTP: `http_*`, stdio: `stdio_*`) and by era (modern: 2026-07-28, legacy:
2025): `gateway.Gateway` is all the rest of the proxy talks to."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import structlog

from ..clients.sessions2025 import FrontSessions
from .era2025 import LegacyUpstream
from .events import UpstreamStartError, UpstreamUnavailable
from .gateway import Gateway
from .http.endpoint import Upstream
from .http.relay import HttpRelay
from .http.session2025 import HttpLegacyLink
from .stdio.channel import unreadable_counts
from .stdio.child2026 import StdioModern
from .stdio.pool import StdioPool
from .stdio.process import ChildSpec, child_env
from .stdio.relay import StdioRelay
from .stdio.session2025 import StdioLegacyLink

if TYPE_CHECKING:
    from ..config import ProxyConfig
    from ..security import Identity

log = structlog.get_logger(__name__)


@contextlib.asynccontextmanager
async def build_gateway(
    config: ProxyConfig, identity: Identity, *, max_bytes: Callable[[], int] | None = None
) -> AsyncIterator[Gateway]:
    """The gateway to the configured upstream (`upstream.url`, or `upstream.command` over stdio), open until exit.
    `max_bytes` is limits.max_result_bytes as the live policy has it. Raises UpstreamStartError when a stdio
    server cannot be started at all."""
    limit = max_bytes or (lambda: config.limits.max_result_bytes)
    if config.upstream.command is not None:
        async with _stdio_gateway(config, identity, limit) as gateway:
            yield gateway
        return
    tls = config.upstream.tls.ssl_context() if config.upstream_url.startswith("https:") else None
    async with Upstream(config.upstream_url, connect_timeout_s=config.upstream.connect_timeout_s, tls=tls) as upstream:
        legacy = LegacyUpstream(
            lambda spawn: HttpLegacyLink(upstream, spawn),
            max_sessions=config.upstream.max_sessions,
            max_sessions_per_caller=config.upstream.max_sessions_per_caller,
            identity=identity,
        )
        gateway: Gateway | None = None

        async def era() -> str:
            assert gateway is not None
            return await gateway.era()

        relay = HttpRelay(upstream, era)
        # For 2025-era clients of a server that speaks 2026-07-28 only (clients/translated2025.py).
        sessions = FrontSessions(
            config.upstream.stdio.max_sessions, per_caller=config.upstream.stdio.max_sessions_per_principal
        )
        gateway = Gateway(upstream, legacy, relay, config.upstream.protocol, clients=sessions)
        try:
            yield gateway
        finally:
            relay.close()
            await legacy.aclose()


@contextlib.asynccontextmanager
async def _stdio_gateway(config: ProxyConfig, identity: Identity, limit: Callable[[], int]) -> AsyncIterator[Gateway]:
    upstream, stdio = config.upstream, config.upstream.stdio
    assert upstream.command is not None
    spec = ChildSpec(
        argv=tuple(upstream.command),
        env=child_env(stdio.inherit_env, upstream.env),
        cwd=upstream.cwd,
        max_line_bytes=stdio.max_line_bytes or config.limits.max_result_bytes,
        restart_min_s=stdio.restart_min_s,
        restart_max_s=stdio.restart_max_s,
        stop_grace_s=stdio.stop_grace_s,
        term_grace_s=stdio.term_grace_s,
    )
    pool = StdioPool(
        spec,
        children=stdio.children,
        max_children=stdio.max_children or max(stdio.children, 4),
        exclusive=stdio.dispatch == "exclusive",
        max_in_flight=stdio.max_in_flight,
        shared=stdio.share_children,
        wait_s=stdio.start_timeout_s,
    )
    sessions = FrontSessions(stdio.max_sessions, per_caller=stdio.max_sessions_per_principal)
    link = StdioLegacyLink(pool, sessions, start_timeout_s=stdio.start_timeout_s)
    legacy = LegacyUpstream(lambda spawn: link, max_sessions=upstream.max_sessions, identity=identity)
    modern = StdioModern(pool, start_timeout_s=stdio.start_timeout_s)
    gateway: Gateway | None = None

    async def era() -> str:
        assert gateway is not None
        return await gateway.era()

    relay = StdioRelay(
        pool, link, modern, sessions, identity, era, lambda: gateway.known_era if gateway else None, max_bytes=limit
    )
    gateway = Gateway(
        modern, legacy, relay, upstream.protocol, clients=sessions, unreadable=lambda: unreadable_counts(pool.channels),
        round_enders=pool.round_enders, child_states=pool.states,
    )  # fmt: skip
    if upstream.cwd is not None and not os.path.isdir(upstream.cwd):
        raise UpstreamStartError(f"cannot start {spec.name}: upstream.cwd {upstream.cwd} is not a directory")
    try:
        await pool.start()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise UpstreamStartError(f"cannot start {spec.name}: {exc.strerror or exc}{where}") from exc

    async def warm() -> None:
        # The era first (a dual-era child keeps the one its first request shows), then a 2025 child's initialize:
        # ready before the first client asks.
        try:
            if await gateway.era() == "legacy":
                await link.ready()
        except UpstreamUnavailable as exc:
            log.warning("upstream_not_ready", upstream=spec.name, reason=str(exc))

    warming = asyncio.ensure_future(warm())
    try:
        yield gateway
    finally:
        warming.cancel()
        await legacy.aclose()
        await pool.stop()
