"""The upstream MCP server as seen from the proxy: raw forwarding for pass-through, and a tool call as events.

A tool call, whatever the upstream answers with (one JSON body or an event stream with progress first), is read
as an async stream of events: Progress, then Finished or Failed. The task runner consumes only these events.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog
from multidict import MultiMapping

from .. import PROTOCOL_VERSION
from ..jsonrpc import dumps, loads
from .events import Event, Progress, UpstreamUnavailable, proxy_failure, too_large
from .http_client import BodyTooLarge, CallClient, CallError, CallResponse
from .http_headers import own_request_headers
from .http_sse import SseLimitError, SseParser, iter_events
from .modern import PROBE_ID, discover_probe, interpret, is_discover_result

log = structlog.get_logger(__name__)


class Upstream:
    """The upstream MCP endpoint: a CallClient makes every POST to it (task calls and pass-through); an aiohttp
    session carries the rest (GET streams, DELETE, other paths, legacy sessions, the era probe)."""

    def __init__(self, url: str, *, connect_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        self._tls = tls
        parts = urlsplit(url)
        self._origin = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._calls = CallClient(url, connect_timeout_s=connect_timeout_s, tls=tls)

    async def __aenter__(self) -> Upstream:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            # Pass-through relays bytes as they are: no decompression, and no headers the client did not send.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            # One TLS context for both clients: upstream.tls (CA bundle, client certificate) or the system's.
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, ssl=self._tls or True),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._calls.aclose()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream used outside its context"
        return self._session

    async def reachable(self, timeout_s: float = 2.0) -> str:
        """ "ok" when the upstream accepts a TCP connection; otherwise why not (for /readyz)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
        except (OSError, TimeoutError) as exc:
            return f"upstream unreachable ({type(exc).__name__})"
        writer.close()
        return "ok"

    def target(self, path: str, query_string: str, *, is_mcp_endpoint: bool) -> str:
        base = self.url if is_mcp_endpoint else self._origin + path
        return f"{base}?{query_string}" if query_string else base

    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None
    ) -> aiohttp.ClientResponse:
        """Send one request as-is; the caller owns (and must release) the response."""
        try:
            return await self.session.request(method, url, headers=headers, data=body, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionError(f"cannot connect to {self.url}: {exc.os_error.strerror or exc}") from exc

    def post(
        self, headers: Mapping[str, str], body: bytes, *, query: str = "", relay: bool = False
    ) -> Awaitable[CallResponse]:
        """A POST to the MCP endpoint through the lean client; `relay` keeps the response as sent (see http_client.py).

        Not a coroutine of its own on purpose: a frame here would hold `body` for as long as the call waits for its
        answer (the whole run of a working task), where CallClient.post lets go of it once sent.
        """
        return self._calls.post(headers, body, query=query, relay=relay)

    async def probe(self, client_headers: MultiMapping[str]) -> Literal["modern", "legacy"]:
        """The era, by server/discover: a DiscoverResult means 2026-07-28, anything else 2025 (initialize)."""
        headers = own_request_headers(client_headers, drop_mcp_headers=True)
        headers.update({"MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": "server/discover"})
        try:
            response = await self.request("POST", self.url, headers, dumps(discover_probe()))
            async with response:
                answer = await single_answer(response, PROBE_ID)
                status = response.status
        except (ConnectionError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnavailable(f"upstream unreachable ({exc})") from exc
        if is_discover_result(answer):
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
    ) -> AsyncIterator[Event]:
        """POST one tools/call and yield what happens to it; the last event is Finished or Failed.

        Closing the generator early closes the upstream response, which is how 2026-07-28 HTTP cancels. A body or
        event longer than `max_bytes` is not read on: the call fails (limits.max_result_bytes).
        """
        headers = own_request_headers(client_headers)
        try:
            response = await self.post(headers, dumps(message))
        except OSError as exc:  # CallError included
            yield proxy_failure(f"upstream unreachable ({exc})", self.url)
            return
        async with response:  # closing an unfinished response closes its connection: the upstream sees the cancel
            async for event in self._read_call(response, message["id"], max_bytes):
                yield event

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None:
        """Tell a legacy session that a call is cancelled: legacy HTTP does not read a dropped stream as one.

        Only calls made inside a legacy Mcp-Session-Id session need this; 2026-07-28 servers cancel on close.
        """
        if "Mcp-Session-Id" not in client_headers:
            return
        headers = own_request_headers(client_headers)
        headers.popall("Mcp-Method", None)
        headers.popall("Mcp-Name", None)
        message = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": reason},
        }
        try:
            response = await self.request("POST", self.url, headers, dumps(message))
            response.release()
        except (ConnectionError, aiohttp.ClientError, OSError) as exc:
            log.warning("upstream_cancel_not_delivered", reason=str(exc))

    async def _read_call(self, response: CallResponse, request_id: Any, max_bytes: int) -> AsyncIterator[Event]:
        content_type = response.content_type
        try:
            if content_type == "text/event-stream":
                async for sse in iter_events(response.iter_chunks(), max_bytes):
                    if not sse.data:
                        continue  # priming events and keep-alives carry nothing
                    event = interpret(_loads(sse.data), request_id, f"HTTP {response.status}", len(sse.data), self.url)
                    if event is not None:
                        yield event
                        if not isinstance(event, Progress):
                            return
                yield proxy_failure("the upstream closed its event stream before answering the call", self.url)
                return
            body = await response.read(max_bytes)
        except (BodyTooLarge, SseLimitError):
            yield too_large(max_bytes)
            return
        except CallError as exc:
            yield proxy_failure(f"the upstream connection broke mid-call ({exc})", self.url)
            return
        message = _loads(body) if content_type in ("application/json", "") else None
        event = (
            interpret(message, request_id, f"HTTP {response.status}", len(body), self.url)
            if message is not None
            else None
        )
        if event is None or isinstance(event, Progress):
            detail = f"HTTP {response.status}" + (f" {content_type}" if content_type else "")
            yield proxy_failure(f"the upstream answered {detail} without a JSON-RPC response", self.url)
            return
        yield event


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """An aiohttp response's body, read no further than `limit` bytes (BodyTooLarge past it)."""
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            response.close()
            raise BodyTooLarge(limit)
    return bytes(body)


def _loads(data: str | bytes) -> Any:
    try:
        return loads(data)
    except (ValueError, RecursionError):
        return None


HANDSHAKE_MAX_BYTES = 4 * 1024 * 1024
"""The largest answer to a request of the proxy's own (initialize, discover, tools/list, tasks/get) it reads."""


async def single_answer(response: aiohttp.ClientResponse, request_id: Any) -> dict[str, Any] | None:
    """The response to `request_id` in a body that is JSON or an event stream, read only until that answer (a server
    may keep the stream open after it); None when it has none, or past HANDSHAKE_MAX_BYTES."""
    content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
    try:
        if content_type != "text/event-stream":
            return _answer_in(await read_bounded(response, HANDSHAKE_MAX_BYTES), request_id)
        parser, seen = SseParser(HANDSHAKE_MAX_BYTES), 0
        async for chunk in response.content.iter_any():
            seen += len(chunk)
            if seen > HANDSHAKE_MAX_BYTES:
                raise BodyTooLarge(HANDSHAKE_MAX_BYTES)
            for event in parser.feed(chunk):
                message = _answer_in(event.data, request_id) if event.data else None
                if message is not None:
                    return message
        for event in parser.feed(b"\n\n"):  # a last event without its blank line
            message = _answer_in(event.data, request_id) if event.data else None
            if message is not None:
                return message
    except (BodyTooLarge, SseLimitError):
        log.warning("upstream_answer_too_large", limit=HANDSHAKE_MAX_BYTES)
    return None


def _answer_in(data: str | bytes, request_id: Any) -> dict[str, Any] | None:
    try:
        message = loads(data)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) and message.get("id") == request_id else None
