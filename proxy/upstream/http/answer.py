"""One relay for every upstream answer to a client's request to the MCP endpoint: `relay_answer` writes it through an
`AnswerSink`, the lane's connection (proxy/front/lane/writer.py) or aiohttp's response (`ResponseSink`).

A small body is read whole (one write is cheaper) and its id checked; a large one, or one of unknown length, or an
event stream, is relayed chunk by chunk, so memory never grows with what the upstream sends. A body cut short
upstream is cut short for the client too (its connection is closed mid-body), never ended cleanly; a stream that
breaks before its answer went by ends with an error event for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
import structlog
from aiohttp import web

from ...jsonrpc import INTERNAL_ERROR, RequestId, UpstreamError, dumps, error_object, error_response, loads
from .client import CallError, CallResponse
from .sse import DEFAULT_MAX_EVENT_BYTES, SseEvent, SseLimitError, SseParser, message_event

log = structlog.get_logger(__name__)

STREAM_TYPES = ("text/event-stream",)
client_gone_key = web.RequestKey("client_gone_key", bool)
"""Set on a request whose client went away before its answer was written: logged and counted as 499, not 500."""
READ_WHOLE_BYTES = 256 * 1024
"""Bodies up to this size (by Content-Length) are read whole and sent in one write; larger ones are streamed."""


class AnswerSink(Protocol):
    """Where `relay_answer` writes an upstream's answer: the lane's connection (proxy/front/lane/writer.py) or
    aiohttp's response (`ResponseSink`)."""

    def whole(self, response: CallResponse, payload: bytes | None) -> None:
        """The answer at once, with its body (None: a 204 or 304, which has none)."""

    async def start(self, response: CallResponse, length: int | None) -> None:
        """The answer's head; its body follows (`length` bytes, or chunks of a stream of unknown length)."""

    async def write(self, chunk: bytes) -> bool:
        """A piece of the body; False (or ConnectionResetError) when the client has gone: the relay stops reading
        the upstream."""

    async def end(self) -> None: ...

    def abort(self) -> None:
        """The answer broke upstream: the client's connection is closed before its end, so it sees it broken."""


async def relay_answer(response: CallResponse, sink: AnswerSink, request_id: RequestId, upstream_url: str) -> None:
    """Relay the upstream's answer to a client's request, as the upstream sent it: a small body whole, in one write,
    once its id is checked (`check_answer_id`); a stream, or a large or unknown length, chunk by chunk as it comes."""
    status = response.status
    empty = status in (204, 304)
    length = response.headers.get("content-length")  # the parser refused a malformed or repeated one
    stream = response.content_type in STREAM_TYPES
    if not empty and (stream or length is None or int(length) > READ_WHOLE_BYTES):
        await sink.start(response, None if stream or length is None else int(length))
        await relay_stream(response.iter_chunks(), sink, request_id if stream else None, upstream_url)
        return
    try:
        payload = await response.read() if not empty else None
    except CallError as exc:
        raise UpstreamError(f"the upstream connection broke mid-response ({exc})", upstream=upstream_url) from exc
    if request_id is not None and payload is not None and response.content_type == "application/json":
        check_answer_id(payload, request_id, upstream_url)
    sink.whole(response, payload)


async def relay_stream(
    chunks: AsyncIterator[bytes], sink: AnswerSink, request_id: RequestId, upstream_url: str
) -> None:
    """Write each chunk as soon as it arrives; never buffer a stream to its end.

    When the upstream connection breaks before the answer to `request_id` went by (an event stream's), the client
    gets a JSON-RPC error event instead of a stream that just stops, so no caller waits forever. Any other break is
    passed on as a break: the client's connection is closed before the body's end.
    """
    watcher = AnswerWatcher(request_id) if request_id is not None else None
    while True:
        try:
            chunk = await anext(chunks, b"")
        except (aiohttp.ClientError, OSError) as exc:  # CallError included
            log.warning("upstream_stream_broken", reason=str(exc) or type(exc).__name__)
            if watcher is not None and not watcher.answered:
                if await sink.write(broken_stream_event(request_id, upstream_url)):
                    await sink.end()
                return
            sink.abort()
            return
        if not chunk:
            break
        if watcher is not None:
            watcher.feed(chunk)
        if not await sink.write(chunk):
            return
    await sink.end()


class ResponseSink:
    """`relay_answer` and `relay_stream` writing to aiohttp's response for `request`."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        """The handler's to return: prepared and written to its end, or (`whole`) for aiohttp to write."""

    def whole(self, response: CallResponse, payload: bytes | None) -> None:
        self.response = web.Response(
            status=response.status, reason=response.reason or None, headers=response.relayed_headers, body=payload
        )

    async def start(self, response: CallResponse, length: int | None) -> None:
        relayed = web.StreamResponse(status=response.status, reason=response.reason or None,
                                     headers=response.relayed_headers)  # fmt: skip
        relayed.content_length = length
        await self.begin(relayed)

    async def begin(self, relayed: web.StreamResponse) -> None:
        self.response = relayed
        await relayed.prepare(self._request)

    async def write(self, chunk: bytes) -> bool:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except ConnectionResetError:
            self._request[client_gone_key] = True
            return False
        return True

    async def end(self) -> None:
        assert self.response is not None
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            self._request[client_gone_key] = True

    def abort(self) -> None:
        if self._request.transport is not None:
            self._request.transport.close()


def check_answer_id(payload: bytes, request_id: RequestId, upstream_url: str) -> None:
    """Refuse a JSON answer to another request (a late duplicate on a pooled connection, a confused server) as an
    upstream failure, as a task's call does: relayed, it would answer this client with someone else's result. An
    answer that opens with this request's id, as the SDKs write it, is known to be its own without parsing."""
    encoded = dumps(request_id)
    if payload.startswith(b'{"jsonrpc":"2.0","id":%s,' % encoded) or payload.startswith(
        b'{"jsonrpc": "2.0", "id": %s, ' % encoded  # Python's json.dumps as it is called by default
    ):
        return
    try:
        message = loads(payload)
    except ValueError:
        return  # not JSON: the client sees what the upstream sent, as for any answer that is not JSON-RPC
    if isinstance(message, dict) and message.get("id", request_id) not in (request_id, None):
        raise UpstreamError("the upstream answered a different request id", upstream=upstream_url)


def broken_stream_event(request_id: RequestId, upstream_url: str) -> bytes:
    """The event that answers `request_id` when the upstream's stream broke before its answer went by."""
    error = error_object(
        INTERNAL_ERROR,
        "Upstream failure: the upstream connection broke before the response was sent",
        {"upstream": upstream_url},
    )
    return message_event(error_response(request_id, error))


class AnswerWatcher:
    """Follows a relayed event stream just enough to know whether the response to one id has gone by."""

    def __init__(self, request_id: RequestId) -> None:
        self._request_id = request_id
        self._parser = SseParser(DEFAULT_MAX_EVENT_BYTES)
        self.answered = False

    def feed(self, chunk: bytes) -> None:
        if self.answered:
            return
        try:
            events = self._parser.feed(chunk)
        except SseLimitError:
            # An event too large to follow (the relay itself goes on untouched): it may be the answer, so the
            # proxy stops watching rather than risk sending a second one.
            self.answered = True
            return
        for event in events:
            if _answers(event, self._request_id):
                self.answered = True
                return


def _answers(event: SseEvent, request_id: RequestId) -> bool:
    if '"method"' in event.data and '"result"' not in event.data and '"error"' not in event.data:
        return False  # fast path for the many progress notifications
    try:
        message = loads(event.data)
    except ValueError:
        return False
    return isinstance(message, dict) and "method" not in message and message.get("id") == request_id
