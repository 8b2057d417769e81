"""One relay for every upstream answer to a client's request to the MCP endpoint: `relay_answer` writes it through an
`AnswerSink`, the lane's connection (proxy/front/lane/writer.py) or aiohttp's response (`ResponseSink`).

A small body is read whole (one write is cheaper) and its id checked; a large one, or one of unknown length, or an
event stream, is relayed chunk by chunk, so memory never grows with what the upstream sends. A body cut short
upstream is cut short for the client too (its connection is closed mid-body), never ended cleanly; a stream that
breaks before its answer went by ends with an error event for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import structlog
from aiohttp import web

from ...jsonrpc import INTERNAL_ERROR, RequestId, UpstreamError, error_object, error_response, loads
from .answer_id import StreamedIdCheck, check_answer_id
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
    once its id is checked (answer_id.py); a stream, or a large body, chunk by chunk as it comes (a JSON one checked
    as it goes, its last piece held back until the check ends)."""
    status = response.status
    empty = status in (204, 304)
    length = response.headers.get("content-length")  # the parser refused a malformed or repeated one
    stream = response.content_type in STREAM_TYPES
    encoding = response.headers.get("content-encoding", "")
    checked = request_id is not None and response.content_type == "application/json"
    if not empty and (stream or length is None or int(length) > READ_WHOLE_BYTES):
        chunks = response.iter_chunks()
        if checked and length is None:  # of unknown length: a small one is read whole and checked as such
            first, ended = await _read_up_to(chunks, READ_WHOLE_BYTES, upstream_url)
            if ended:
                check_answer_id(first, request_id, upstream_url, encoding)
                sink.whole(response, first)
                return
            chunks = _after(first, chunks)
        await sink.start(response, None if stream or length is None else int(length))
        if checked:
            await _relay_checked(chunks, sink, StreamedIdCheck(request_id, encoding))
        else:
            await relay_stream(chunks, sink, request_id if stream else None, upstream_url)
        return
    try:
        payload = await response.read() if not empty else None
    except CallError as exc:
        raise UpstreamError(f"the upstream connection broke mid-response ({exc})", upstream=upstream_url) from exc
    if checked and payload is not None:
        check_answer_id(payload, request_id, upstream_url, encoding)
    sink.whole(response, payload)


async def _read_up_to(chunks: AsyncIterator[bytes], limit: int, upstream_url: str) -> tuple[bytes, bool]:
    """The body's first bytes, past `limit` at most by a chunk, and whether that is all of it."""
    body = bytearray()
    try:
        while len(body) <= limit:
            chunk = await anext(chunks, b"")
            if not chunk:
                return bytes(body), True
            body += chunk
    except (aiohttp.ClientError, OSError) as exc:  # CallError included: before the head, a 502
        raise UpstreamError(f"the upstream connection broke mid-response ({exc})", upstream=upstream_url) from exc
    return bytes(body), False


async def _after(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in chunks:
        yield chunk


async def _relay_checked(chunks: AsyncIterator[bytes], sink: AnswerSink, check: StreamedIdCheck) -> None:
    """A large JSON answer, chunk by chunk, its id checked as it goes: the last chunk waits for the verdict, so a
    client is never given the whole of another request's answer (it sees the body broken instead)."""
    held = b""
    while True:
        try:
            chunk = await anext(chunks, b"")
        except (aiohttp.ClientError, OSError) as exc:  # CallError included
            log.warning("upstream_stream_broken", reason=str(exc) or type(exc).__name__)
            sink.abort()
            return
        if not chunk:
            break
        check.feed(chunk)
        if check.refused is not None:
            break
        if held and not await sink.write(held):
            return
        held = chunk
    refused = check.end()
    if refused is not None:
        log.warning("upstream_answer_refused", reason=refused)
        sink.abort()
        return
    if held and not await sink.write(held):
        return
    await sink.end()


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
                if await sink.write(watcher.closing_bytes() + broken_stream_event(request_id, upstream_url)):
                    await sink.end()
                return
            sink.abort()
            return
        if not chunk:
            break
        if watcher is not None:
            watcher.feed(chunk)
            if watcher.refused is not None:  # a response to another request: it goes no further, nor the stream
                log.warning("upstream_answer_refused", reason=watcher.refused)
                if await sink.write(watcher.closing_bytes() + _error_event(request_id, watcher.refused, upstream_url)):
                    await sink.end()
                return
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


def broken_stream_event(request_id: RequestId, upstream_url: str) -> bytes:
    """The event that answers `request_id` when the upstream's stream broke before its answer went by."""
    return _error_event(request_id, "the upstream connection broke before the response was sent", upstream_url)


def _error_event(request_id: RequestId, reason: str, upstream_url: str) -> bytes:
    error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": upstream_url})
    return message_event(error_response(request_id, error))


class AnswerWatcher:
    """Follows a relayed event stream just enough to know whether the response to one id has gone by."""

    def __init__(self, request_id: RequestId) -> None:
        self._request_id = request_id
        self._parser = SseParser(DEFAULT_MAX_EVENT_BYTES)
        self.answered = False
        self.refused: str | None = None
        """Set when the stream carries a response to another request, which goes no further."""
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk[-4:])[-4:]
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
            response_id = _response_id(event)
            if response_id is _NOT_A_RESPONSE:
                continue
            if response_id not in (self._request_id, None):  # (null: an error the server could not tie to an id)
                self.refused = "the upstream answered a different request id"
            self.answered = True
            return

    def closing_bytes(self) -> bytes:
        """What ends an event the stream left half-written, so that an event written next is read as one."""
        at_boundary = not self._tail or self._tail.endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))
        return b"" if at_boundary else b"\r\n\r\n"


_NOT_A_RESPONSE = object()


def _response_id(event: SseEvent) -> Any:
    """The id of the JSON-RPC response an event carries; _NOT_A_RESPONSE for a request, a notification or
    anything else."""
    if '"method"' in event.data and '"result"' not in event.data and '"error"' not in event.data:
        return _NOT_A_RESPONSE  # fast path for the many progress notifications
    try:
        message = loads(event.data)
    except ValueError:
        return _NOT_A_RESPONSE
    if not isinstance(message, dict) or "method" in message or ("result" not in message and "error" not in message):
        return _NOT_A_RESPONSE
    return message.get("id")
