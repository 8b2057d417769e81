"""Byte-faithful forwarding of everything the proxy does not own (HttpRelay): to the MCP endpoint through the lean
client, to other paths through aiohttp's; each answer relayed as it arrives (answer.py), or, for the few the proxy
amends (server/discover), read whole and rewritten. Readiness: the era probe, waited for a moment."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import MultiMapping

from ...jsonrpc import RequestId, UpstreamError, dumps, loads
from ..events import CredentialsNeeded, NotMcp, UpstreamUnavailable
from .answer import READ_WHOLE_BYTES, STREAM_TYPES, ResponseSink, relay_answer, relay_stream
from .client import BodyTooLarge, CallError, CallResponse
from .endpoint import Upstream
from .headers import relayed_request_fields, request_headers, response_headers
from .sse import SseLimitError, SseParser, event_bytes, iter_events, json_message

log = structlog.get_logger(__name__)

READINESS_WAIT_S = 2.0
"""How long /readyz waits for the era probe; a slower probe goes on, and a later /readyz sees how it ended."""


_ENDPOINT_METHODS = frozenset({"POST", "GET", "DELETE"})
"""What the lean client sends the MCP endpoint; any other method there (OPTIONS, HEAD...) goes as to another path."""


async def open_read(
    upstream: Upstream, request: web.Request, body: bytes, own_headers: MultiMapping[str] | None = None
) -> CallResponse:
    """A client's POST to the MCP endpoint whose answer the proxy reads itself (rewrites, or merges into a
    subscription): asked for uncompressed, and kept as sent; with `own_headers`, those (the proxy's request for the
    client) in place of the client's."""
    headers = request_headers(own_headers if own_headers is not None else request.headers)
    headers.popall("Accept-Encoding", None)
    headers["Accept-Encoding"] = "identity"  # without the field, any coding would do (RFC 9110 12.5.3)
    try:
        return await upstream.request("POST", headers, body, query=request.rel_url.raw_query_string, relay=True)
    except (OSError, ValueError) as exc:  # CallError included; ValueError: a header that cannot be sent
        raise UpstreamError(f"upstream unreachable ({exc})", upstream=upstream.url) from exc


async def forward(
    upstream: Upstream,
    request: web.Request,
    body: bytes | None,
    *,
    is_mcp: bool,
    request_id: RequestId = None,
) -> web.StreamResponse:
    """Send the request on unchanged and relay the answer: status, end-to-end headers and body bytes."""
    if is_mcp and request.method in _ENDPOINT_METHODS:
        return await _forward_to_endpoint(upstream, request, body, request_id)
    url = upstream.target(request.path, request.query_string, is_mcp_endpoint=is_mcp)
    try:
        response = await upstream.other_path(request.method, url, request_headers(request.headers), body)
    except (ConnectionError, aiohttp.ClientError, OSError) as exc:
        raise UpstreamError(f"upstream unreachable ({exc})", upstream=upstream.url) from exc
    try:
        content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        length = response.content_length if _may_have_body(request, response) else 0
        if content_type in STREAM_TYPES or length is None or length > READ_WHOLE_BYTES:
            watch_id = request_id if content_type in STREAM_TYPES else None
            relayed = web.StreamResponse(
                status=response.status, reason=response.reason, headers=response_headers(response.headers)
            )
            relayed.content_length = length if content_type not in STREAM_TYPES else None
            sink = ResponseSink(request)
            await sink.begin(relayed)
            await relay_stream(response.content.iter_any(), sink, watch_id, upstream.url)
            return relayed
        try:
            payload = await response.read()
        except (aiohttp.ClientError, OSError) as exc:
            reason = f"the upstream connection broke mid-response ({type(exc).__name__})"
            raise UpstreamError(reason, upstream=upstream.url) from exc
        headers = response_headers(response.headers)
        return web.Response(status=response.status, reason=response.reason, headers=headers, body=payload)
    finally:
        # A stream the client left (or that broke) is closed, not pooled: closing is how 2026 HTTP cancels.
        if response.content.at_eof():
            response.release()
        else:
            response.close()


async def _forward_to_endpoint(
    upstream: Upstream, request: web.Request, body: bytes | None, request_id: RequestId
) -> web.StreamResponse:
    """A request to the MCP endpoint goes through the lean client, its answer relayed as sent."""
    try:
        fields = relayed_request_fields(request.raw_headers, request.headers)
        query = request.rel_url.raw_query_string
        response = await upstream.request(request.method, fields, body, query=query, relay=True)
    except (OSError, ValueError) as exc:  # CallError included; ValueError: a header that cannot be sent
        raise UpstreamError(f"upstream unreachable ({exc})", upstream=upstream.url) from exc
    with contextlib.closing(response):  # pooled when read to its end, else closed: the upstream sees a cancel
        sink = ResponseSink(request)
        await relay_answer(response, sink, request_id, upstream.url)
        assert sink.response is not None
        return sink.response


def _may_have_body(request: web.Request, response: aiohttp.ClientResponse) -> bool:
    return request.method != "HEAD" and response.status not in (204, 304) and response.status >= 200


async def forward_rewritten(
    upstream: Upstream,
    request: web.Request,
    body: bytes,
    request_id: RequestId,
    rewrite: Callable[[dict[str, Any]], None],
    *,
    limit: int,
    on_headers: Callable[[Any], None] | None = None,
) -> web.Response:
    """Forward a request whose answer the proxy amends (server/discover): the whole answer is read (up to `limit`
    bytes), then rewritten; `on_headers` sees the answer's headers first."""
    response = await open_read(upstream, request, body)
    if on_headers is not None:
        on_headers(response.relayed_headers)
    async with response:
        try:
            payload = await response.read(limit)
        except BodyTooLarge as exc:
            raise UpstreamError(f"the upstream's answer exceeds {limit} bytes", upstream=upstream.url) from exc
        except CallError as exc:
            raise UpstreamError(f"the upstream connection broke mid-response ({exc})", upstream=upstream.url) from exc
        content_type = response.content_type
        if content_type == "application/json":
            payload = _rewrite_json(payload, request_id, rewrite)
        elif content_type == "text/event-stream":
            payload = _rewrite_sse(payload, request_id, rewrite)
        return web.Response(
            status=response.status, reason=response.reason or None, headers=response.relayed_headers, body=payload
        )


def _rewrite_message(message: Any, request_id: RequestId, rewrite: Callable[[dict[str, Any]], None]) -> bool:
    if isinstance(message, dict) and message.get("id") == request_id and isinstance(message.get("result"), dict):
        rewrite(message["result"])
        return True
    return False


def _rewrite_json(payload: bytes, request_id: RequestId, rewrite: Callable[[dict[str, Any]], None]) -> bytes:
    try:
        message = loads(payload)
    except ValueError:
        return payload
    return dumps(message) if _rewrite_message(message, request_id, rewrite) else payload


def _rewrite_sse(payload: bytes, request_id: RequestId, rewrite: Callable[[dict[str, Any]], None]) -> bytes:
    out: list[bytes] = []
    try:
        events = SseParser(len(payload) + 1).feed(payload)  # already bounded by the read
    except SseLimitError:  # pragma: no cover - the bound is the whole payload
        return payload
    for event in events:
        data = event.data
        try:
            message = loads(data) if data else None
        except ValueError:
            message = None
        if message is not None and _rewrite_message(message, request_id, rewrite):
            data = dumps(message).decode()
        out.append(event_bytes(data, event=event.event, event_id=event.id))
    return b"".join(out)


class HttpRelay:
    """The relay to a Streamable HTTP server: bytes as they are, every path, every method."""

    def __init__(self, upstream: Upstream, era: Callable[[], Awaitable[str]] | None = None) -> None:
        self.upstream = upstream
        self._era = era
        self._probing: asyncio.Future[str] | None = None

    async def readiness(self) -> str:
        """ "ok" when the upstream accepts connections and answers as an MCP server (its era is known, or it wants
        credentials to say); otherwise why not."""
        reachable = await self.upstream.reachable()
        if reachable != "ok" or self._era is None:
            return reachable
        # Accepting connections is not answering MCP: a wrong path (404), a web page or another API does too, and
        # only the era probe tells them apart. Probed here, not only by requests: a replica that is not ready gets
        # none, and must still see the upstream come right. One probe at a time, which may outlast this check.
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._era())
            self._probing.add_done_callback(_retrieve)
        try:
            await asyncio.wait_for(asyncio.shield(self._probing), READINESS_WAIT_S)
        except TimeoutError:
            return f"the upstream has not answered the era probe yet ({READINESS_WAIT_S:g} s)"
        except NotMcp as exc:
            return str(exc)
        except CredentialsNeeded:
            pass  # an MCP server; a client's request, with its credentials, tells the era
        except UpstreamUnavailable as exc:
            return str(exc)
        return "ok"

    def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()

    async def relay(
        self, request: web.Request, body: bytes, message: Any, *, request_id: RequestId = None
    ) -> web.StreamResponse:
        return await _forward_to_endpoint(self.upstream, request, body, request_id)

    async def relay_rewritten(
        self,
        request: web.Request,
        body: bytes,
        request_id: RequestId,
        rewrite: Callable[[dict[str, Any]], None],
        *,
        limit: int,
        on_headers: Callable[[Any], None] | None = None,
    ) -> web.Response:
        return await forward_rewritten(
            self.upstream, request, body, request_id, rewrite, limit=limit, on_headers=on_headers
        )

    async def relay_other(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        return await forward(self.upstream, request, body, is_mcp=request.path == "/mcp")

    async def open_listen(
        self, request: web.Request, body: bytes, *, limit: int, headers: MultiMapping[str] | None = None
    ) -> AsyncGenerator[dict[str, Any], None] | None:
        """The server's part of a subscriptions/listen, when it grants one: its messages, closed with the stream.
        `headers`: the proxy's own for the request, in place of the client's."""
        response = await open_read(self.upstream, request, body, headers)
        if response.status != 200 or response.content_type != "text/event-stream":
            response.close()  # the upstream offers no subscription: only the task part is granted
            return None
        return _listen_messages(response, limit=limit)


async def _listen_messages(response: CallResponse, *, limit: int) -> AsyncIterator[dict[str, Any]]:
    try:
        async for event in iter_events(response.iter_chunks(), limit):
            message = json_message(event)
            if message is not None:
                yield message
    except (OSError, SseLimitError) as exc:  # CallError included
        log.info("upstream_subscription_ended", reason=str(exc) or type(exc).__name__)
    finally:
        response.close()


def _retrieve(probe: asyncio.Future[str]) -> None:
    # The outcome is read by whichever readiness check waits for it; one that waited no more must not leave it
    # "never retrieved".
    if not probe.cancelled():
        probe.exception()
