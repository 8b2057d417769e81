"""The upstream as the rest of the proxy sees it: which era it speaks, and a call read as events either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import aiohttp
import structlog
from multidict import CIMultiDict, MultiMapping

from .. import PROTOCOL_VERSION, __version__
from ..jsonrpc import dumps
from .events import Event, InputNeeded, UpstreamUnavailable, proxy_failure
from .http_headers import own_request_headers
from .http_modern import Upstream
from .legacy import LegacySession, LegacyUpstream, single_answer

log = structlog.get_logger(__name__)

Era = Literal["modern", "legacy"]


class Gateway:
    """Knows the upstream's era (configured, or probed once) and sends each call the way that era expects."""

    def __init__(self, upstream: Upstream, legacy: LegacyUpstream, protocol: str) -> None:
        self.upstream = upstream
        self.legacy = legacy
        self._era: Era | None = protocol if protocol in ("modern", "legacy") else None  # type: ignore[assignment]
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return self.upstream.url

    @property
    def known_era(self) -> Era | None:
        return self._era

    async def era(self, client_headers: MultiMapping[str] | None = None) -> Era:
        """The era, probing once: server/discover first; anything but a 2026 answer means initialize (legacy).

        Raises UpstreamUnavailable while the upstream cannot be reached; the next request probes again.
        """
        if self._era is not None:
            return self._era
        async with self._lock:
            if self._era is None:
                self._era = await self._probe(client_headers or CIMultiDict())
                log.info("upstream_era", era=self._era, upstream=self.url)
        return self._era

    async def _probe(self, client_headers: MultiMapping[str]) -> Era:
        headers = own_request_headers(client_headers, drop_mcp_headers=True)
        headers.update({"MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": "server/discover"})
        meta = {
            "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "mcp-tasks-proxy", "version": __version__},
        }
        probe = {"jsonrpc": "2.0", "id": "mtp-discover", "method": "server/discover", "params": {"_meta": meta}}
        try:
            response = await self.upstream.request("POST", self.url, headers, dumps(probe))
            async with response:
                answer = await single_answer(response, "mtp-discover")
                status = response.status
        except (ConnectionError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnavailable(f"upstream unreachable ({exc})") from exc
        result = answer.get("result") if answer else None
        if isinstance(result, dict) and "supportedVersions" in result:
            return "modern"
        if status in (401, 403):
            # Credentials are needed even to ask; the era stays unknown until a client's request carries them.
            raise UpstreamUnavailable(f"the upstream refused the era probe (HTTP {status})")
        return "legacy"

    async def call_tool(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        on_request: Callable[[InputNeeded], Awaitable[None]] | None = None,
        session: LegacySession | None = None,
    ) -> AsyncIterator[Event]:
        """The call's events; a legacy server's request for it outside its stream goes to `on_request`.

        With `session` (a 2025-era client's own), the 2025 request goes there as it is, whatever the era."""
        if session is not None:
            events = self.legacy.exchange(message, client_headers, capabilities, max_bytes=max_bytes, session=session)
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()
            return
        try:
            era = await self.era(client_headers)
        except UpstreamUnavailable as exc:
            yield proxy_failure(str(exc), self.url)
            return
        if era == "legacy":
            events = self.legacy.call(message, client_headers, capabilities, max_bytes=max_bytes, on_request=on_request)
        else:
            events = self.upstream.call_tool(message, client_headers, capabilities, max_bytes=max_bytes)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None:
        # A legacy-era call posts its own cancellation when its event stream is closed early.
        if self._era == "modern":
            await self.upstream.notify_cancelled(request_id, client_headers, reason)
