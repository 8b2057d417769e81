"""The upstream MCP server, by transport (HTTP: `http_*`, stdio: `stdio_*`) and by era (modern: 2026-07-28, legacy:
2025): `gateway.Gateway` is all the rest of the proxy talks to."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .gateway import Gateway
from .http_legacy import HttpLegacyLink
from .http_modern import Upstream
from .http_relay import HttpRelay
from .legacy import LegacyUpstream

if TYPE_CHECKING:
    from ..config import ProxyConfig
    from ..security import Identity


@contextlib.asynccontextmanager
async def build_gateway(config: ProxyConfig, identity: Identity) -> AsyncIterator[Gateway]:
    """The gateway to the configured upstream (`upstream.url`, or `upstream.command` over stdio), open until exit."""
    async with Upstream(config.upstream_url, connect_timeout_s=config.upstream.connect_timeout_s) as upstream:
        legacy = LegacyUpstream(
            lambda spawn: HttpLegacyLink(upstream, spawn),
            max_sessions=config.upstream.max_sessions,
            identity=identity,
        )
        try:
            yield Gateway(upstream, legacy, HttpRelay(upstream), config.upstream.protocol)
        finally:
            await legacy.aclose()
