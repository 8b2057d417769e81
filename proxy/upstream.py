"""The upstream MCP server as seen from the proxy: raw forwarding for pass-through, and a tool call as events.

A tool call, whatever the upstream answers with (one JSON body or an event stream with progress first), is read
as an async stream of events: Progress, then Finished or Failed. The task runner consumes only these events.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog
from multidict import CIMultiDict, MultiMapping

from .calls import BodyTooLarge, CallClient, CallError, CallResponse
from .jsonrpc import INTERNAL_ERROR, dumps, error_object, loads
from .sse import SseLimitError, iter_events

log = structlog.get_logger(__name__)

# RFC 9110 §7.6.1 hop-by-hop fields, plus those the proxy recomputes for the body it sends.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length"}
_RESPONSE_SKIP = HOP_BY_HOP | {"content-length"}
TASK_CALL_SKIP = _REQUEST_SKIP | {"accept-encoding", "accept", "content-type", "last-event-id"}


def _connection_listed(headers: MultiMapping[str]) -> set[str]:
    listed: set[str] = set()
    for value in headers.getall("Connection", ()):
        listed.update(token.strip().lower() for token in value.split(",") if token.strip())
    return listed


def end_to_end_headers(headers: MultiMapping[str], skip: frozenset[str] | set[str]) -> CIMultiDict[str]:
    """Copy the headers an intermediary must pass on: all but hop-by-hop ones and those named in Connection."""
    drop = skip | _connection_listed(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def request_headers(headers: MultiMapping[str]) -> CIMultiDict[str]:
    return end_to_end_headers(headers, _REQUEST_SKIP)


def response_headers(headers: MultiMapping[str]) -> CIMultiDict[str]:
    return end_to_end_headers(headers, _RESPONSE_SKIP)


def own_request_headers(client_headers: MultiMapping[str], *, drop_mcp_headers: bool = False) -> CIMultiDict[str]:
    """Headers for a JSON-RPC POST the proxy makes for a client: the client's end-to-end headers (credentials
    included), JSON in, JSON or an event stream out. `drop_mcp_headers` removes every Mcp-* header (MCP-Protocol-
    Version included), for requests whose routing headers the proxy sets itself."""
    headers = end_to_end_headers(client_headers, TASK_CALL_SKIP)
    if drop_mcp_headers:
        for name in {name for name in headers if name.lower().startswith("mcp-")}:
            headers.popall(name, None)
    headers["Content-Type"] = "application/json"
    headers["Accept"] = "application/json, text/event-stream"
    return headers


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or refused the proxy's own handshake."""


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    message: str | None
    progress: float | None = None
    total: float | None = None
    raw: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    """The notification as the upstream sent it, for relaying to a synchronous caller."""

    def describe(self) -> str | None:
        if self.message:
            return self.message
        if self.progress is None:
            return None
        if self.total:
            return f"{self.progress:g} of {self.total:g}"
        return f"{self.progress:g}"


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    result: dict[str, Any]
    size: int = 0
    """Bytes of the message that carried it, as received (what limits.max_result_bytes bounds)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    error: dict[str, Any]
    """A JSON-RPC error object: the upstream's own, or -32603 made by the proxy."""
    status_message: str
    unread: bool = False
    """The proxy could not read the upstream's answer (unreachable, stream cut): the work may go on upstream."""


@dataclasses.dataclass(frozen=True, slots=True)
class InputNeeded:
    """A 2026-07-28 upstream answered `input_required` (MRTR): answer `input_requests`, echo `request_state`."""

    result: dict[str, Any]
    """The upstream's InputRequiredResult as it came (a legacy server's request is put in the same shape)."""
    reply: Callable[[dict[str, Any]], Awaitable[None]] | None = dataclasses.field(default=None, compare=False)
    """Legacy upstreams only: posts the answer back on the open call, which then goes on; modern ones get a retry."""

    @property
    def input_requests(self) -> dict[str, Any]:
        requests = self.result.get("inputRequests")
        return requests if isinstance(requests, dict) else {}

    @property
    def request_state(self) -> str | None:
        state = self.result.get("requestState")
        return state if isinstance(state, str) else None


Event = Progress | Finished | Failed | InputNeeded


def proxy_failure(reason: str, upstream: str) -> Failed:
    return Failed(error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": upstream}), reason, True)


def too_large(limit: int) -> Failed:
    """The upstream's answer (a body, or one event of its stream) is over limits.max_result_bytes: the read stopped
    there, and the call with it."""
    reason = f"the upstream's answer exceeds limits.max_result_bytes ({limit})"
    return Failed(error_object(INTERNAL_ERROR, f"Proxy failure: {reason}"), reason)


class Upstream:
    """The upstream MCP endpoint: a CallClient makes every POST to it (task calls and pass-through); an aiohttp
    session carries the rest (GET streams, DELETE, other paths, legacy sessions, the era probe)."""

    def __init__(self, url: str, *, connect_timeout_s: float) -> None:
        self.url = url
        parts = urlsplit(url)
        self._origin = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._calls = CallClient(url, connect_timeout_s=connect_timeout_s)

    async def __aenter__(self) -> Upstream:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            # Pass-through relays bytes as they are: no decompression, and no headers the client did not send.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
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
        """A POST to the MCP endpoint through the lean client; `relay` keeps the response as sent (see calls.py).

        Not a coroutine of its own on purpose: a frame here would hold `body` for as long as the call waits for its
        answer (the whole run of a working task), where CallClient.post lets go of it once sent.
        """
        return self._calls.post(headers, body, query=query, relay=relay)

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
                    event = self._interpret(_loads(sse.data), request_id, response.status, len(sse.data))
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
        event = self._interpret(message, request_id, response.status, len(body)) if message is not None else None
        if event is None or isinstance(event, Progress):
            detail = f"HTTP {response.status}" + (f" {content_type}" if content_type else "")
            yield proxy_failure(f"the upstream answered {detail} without a JSON-RPC response", self.url)
            return
        yield event

    def _interpret(self, message: Any, request_id: Any, http_status: int, size: int) -> Event | None:
        if not isinstance(message, dict):
            return proxy_failure("the upstream sent something that is not a JSON-RPC message", self.url)
        method = message.get("method")
        if method == "notifications/progress":
            return interpret_progress(message)
        if isinstance(method, str):
            if "id" in message:
                # A server-to-client request (a legacy server's elicitation, sampling, roots) cannot be answered here.
                return proxy_failure(f"the upstream sent a {method} request, which this proxy cannot relay", self.url)
            return None  # other notifications (logging) are not part of a task
        if message.get("id") != request_id:
            return proxy_failure("the upstream answered a different request id", self.url)
        if isinstance(message.get("error"), dict):
            error = message["error"]
            return Failed(error, f"the upstream answered with JSON-RPC error {error.get('code')}")
        result = message.get("result")
        if not isinstance(result, dict):
            return proxy_failure(f"the upstream's HTTP {http_status} response has no result object", self.url)
        if result.get("resultType") == "input_required":
            if not isinstance(result.get("inputRequests", {}), dict) or not (
                result.get("inputRequests") or isinstance(result.get("requestState"), str)
            ):
                return proxy_failure(
                    "the upstream's input_required result has neither inputRequests nor requestState", self.url
                )
            return InputNeeded(result)
        return Finished(result, size)


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """An aiohttp response's body, read no further than `limit` bytes (BodyTooLarge past it)."""
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            response.close()
            raise BodyTooLarge(limit)
    return bytes(body)


def interpret_progress(message: dict[str, Any]) -> Progress:
    params = message.get("params") if isinstance(message.get("params"), dict) else {}
    text = params.get("message")
    return Progress(
        message=text if isinstance(text, str) else None,
        progress=_number(params.get("progress")),
        total=_number(params.get("total")),
        raw=message,
    )


def _loads(data: str | bytes) -> Any:
    try:
        return loads(data)
    except (ValueError, RecursionError):
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
