"""One client connection while the lane has it: requests parsed (httptools) and answered in order, by the lane itself
(proxy/front/lane/answers.py) or by the application's handler (proxy/front/lane/handlers.py); a request the lane
does not read (any but `POST /mcp`, or one only aiohttp's reader may judge) hands aiohttp the connection for good."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import time
from typing import TYPE_CHECKING, Any

import httptools

from ...jsonrpc import INVALID_REQUEST, error_object
from .. import boundary
from ..context import MCP_PATH, RequestInfo
from .answers import answer
from .backlog import Backlog
from .handlers import Channel, handle, reframed_fields
from .routing import MAX_FIELD_BYTES, Head, decoded_headers, lane_request
from .writer import LaneWriter

if TYPE_CHECKING:
    from .server import Lane

MAX_HEAD_BYTES = 32 * 1024
"""A longer head is aiohttp's to refuse (its limits are lower): the lane never buffers more of one."""
_NEVER = float("inf")
_LINGER_S = 2.0
_LINGER_BYTES = 1024 * 1024
"""After refusing a request whose body is still coming, the connection reads and drops up to this much for up to
_LINGER_S before it closes: closed at once, the unread bytes make the kernel reset it, and the client may lose
the answer."""


class _HandOver(Exception):
    """This request is aiohttp's: raised out of a parser callback to stop parsing there."""


class _Pipelined(Exception):
    """A second request arrived in the same read as the end of one the lane serves."""


class _TooLarge(Exception):
    """A chunked body grew past limits.max_body_bytes."""


_MAX_CHUNK_FRAMING_BYTES = 64 * 1024
"""What a chunked body's framing (chunk sizes, extensions, trailer fields) may add to its bytes: a body of small
chunks, an endless extension or trailer is refused past it, never held."""


class _Probe:
    """Counts the requests a parser saw complete (split_pipelined)."""

    complete = 0

    def on_message_complete(self) -> None:
        self.complete += 1


def split_pipelined(raw: bytearray, fields: list[tuple[bytes, bytes]]) -> bytes | None:
    """The bytes after the request just read into `raw` (its head's `fields`), when a second one began in the same
    read, cut from `raw`: the first head ends at the first blank line (llhttp takes no bare LF) and its body has the
    Content-Length the lane required, checked by parsing it again. None (and `raw` as it was) when that does not
    hold, a chunked body's among them (its end is llhttp's to know, and llhttp does not say where it is)."""
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0 or any(name.lower() == b"transfer-encoding" for name, _ in fields):
        return None
    lengths = [value for name, value in fields if name.lower() == b"content-length"]
    end = head_end + 4 + (int(lengths[0]) if lengths else 0)
    probe = _Probe()
    try:
        httptools.HttpRequestParser(probe).feed_data(bytes(raw[:end]))
    except (httptools.HttpParserError, httptools.HttpParserUpgrade, ValueError):
        return None
    if probe.complete != 1:
        return None
    rest = bytes(raw[end:])
    del raw[end:]
    return rest


class LaneConnection(asyncio.Protocol):
    """One client connection while the lane has it."""

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        self._transport: asyncio.Transport | None = None
        self.out: LaneWriter | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._raw = bytearray()  # the bytes of the request being read, for aiohttp should it be handed over
        self._channel: Channel | None = None  # for aiohttp's request and writer
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._method = b""
        self._chunked: bytearray | None = None
        """The body of a chunked request the lane reads, while it is read: its bytes in one buffer, and `_raw`
        holds no more of the request (the application's handler gets it re-framed, `reframed_fields`)."""
        self._wire_bytes = 0  # of that body as it came, framing included
        self._head: Head | None = None
        self._trailing = False  # past the head: a field now is a chunked body's trailer, which no request keeps
        self._too_large = False
        self._head_bytes = 0
        self._reading = "head"  # head | body | answering
        self.deadline = lane.loop.time() + lane.header_timeout_s
        """When the head (or, once it is in, the body) being read is late."""
        self.backlog = Backlog()  # received while an answer is owed
        self.running: asyncio.Task[None] | None = None
        self._pipelined = False  # a second request began in the read that ended this one
        self._held = False  # answered, but the client reads none of it: the next request waits until it does
        self._lingering: int | None = None  # refused and answered: the bytes dropped since

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # What each request runs in, a fresh copy per request: a request answered from another task (a bridged call
        # taken over, upstream/bridge.py) starts the next one from there, and must not hand it its span or log ids.
        self._context = contextvars.copy_context()
        self._transport = transport  # type: ignore[assignment]
        self.out = LaneWriter(self._transport, self._lane.loop, self._lane.date)  # type: ignore[arg-type]
        self._channel = Channel(self._lane.loop, self._transport)  # type: ignore[arg-type]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._lane.connections.add(self)
        if not self._lane.admit(self._transport):  # type: ignore[arg-type]
            self._lane.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            self._lingering += len(data)
            if self._lingering > _LINGER_BYTES:
                self.abort()
            return
        if self.running is not None or self._held:  # what comes next waits for the answer
            self.backlog.put(data, self._transport)
            return
        self._feed(data)

    def eof_received(self) -> bool:
        return False  # closes the transport; a call in flight is cancelled by connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane.connections.discard(self)
        if self._channel is not None:
            self._channel.connection_lost(exc)
        if self.running is not None:
            self.running.cancel()  # the client left: the upstream call is closed, as aiohttp's handler_cancellation
        if self.out is not None:
            self.out.lost()
        self._transport = None

    def pause_writing(self) -> None:
        if self._channel is not None and not self._channel.writing_paused:
            self._channel.pause_writing()
        if self.out is not None:
            self.out.pause()

    def resume_writing(self) -> None:
        if self._channel is not None and self._channel.writing_paused:
            self._channel.resume_writing()
        if self.out is not None:
            self.out.resume()
        if self._held:
            self._held = False
            self._next()

    # parsing

    def _feed(self, data: bytes) -> None:
        chunked = self._chunked is not None
        if chunked:
            self._wire_bytes += len(data)
        else:
            self._raw += data
        if self._reading == "head":
            self._head_bytes += len(data)
        hand_over = False
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            if self._too_large:
                self._refuse_too_large()
                return
            rest = split_pipelined(self._raw, self._fields) if self._pipelined else None
            self._pipelined = False
            if rest is not None:
                # Pipelined requests wait, in order, for the answer to this one.
                self.backlog.put(rest, self._transport, first=True)
                self._parser = httptools.HttpRequestParser(self)
            elif self.running is not None:
                # What followed a request the lane serves (or a chunked one) cannot be told apart from it: its
                # answer, then the end.
                self.out.closing = True  # type: ignore[union-attr]
            elif chunked:
                self._refuse(400, error_object(INVALID_REQUEST, "Invalid request: a malformed chunked body"))
                return
            else:
                hand_over = True  # once out of the handler: aiohttp's log must not chain the lane's exception
        if hand_over:
            # A request aiohttp must see as it came (or pipelined ones, or bytes only aiohttp will judge).
            self._hand_over()
            return
        if self._chunked is not None and not chunked:  # the body began in this read: what of it came with the head
            self._wire_bytes = len(self._raw) - (self._raw.find(b"\r\n\r\n") + 4)
        if self._chunked is not None and self._wire_bytes - self._body_bytes > _MAX_CHUNK_FRAMING_BYTES:
            reason = f"Invalid request: a chunked body's framing exceeds {_MAX_CHUNK_FRAMING_BYTES} bytes"
            self._refuse(400, error_object(INVALID_REQUEST, reason))
            return
        if self.running is not None:
            self._raw = bytearray()
        elif self._reading == "head" and self._head_bytes > MAX_HEAD_BYTES:
            # Judged once the read is parsed, so that only a head still unfinished counts (a body that came in the
            # same read as its head does not): the lane holds at most this much of a head, and one read more.
            self._hand_over()
            return
        else:
            return  # a request still being read
        # The request is its answer's now (the body joined into the request): an idle connection, or a bridged call
        # parked after a take-over (which holds its connection), keeps nothing of it. Its head's fields were needed
        # up to here, to split off what was pipelined behind it.
        self._fields, self._url, self._head, self._body = [], b"", None, []

    def on_message_begin(self) -> None:
        if self.running is not None:
            self._pipelined = True
            raise _Pipelined  # parsed after this request's answer, from the backlog
        self._url = b""
        self._fields = []
        self._body = []
        self._body_bytes = 0
        self._chunked = None
        self._trailing = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._trailing:  # a trailer is dropped: aiohttp's parser would make it the next request's header
            self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._trailing = True
        self._method = self._parser.get_method()
        lane = self._lane
        config = lane.policy.config
        raw = self._raw  # this request's bytes so far: its whole head, and what of the body came with it
        self._head = head = Head(
            self._parser,
            self._url,
            self._fields,
            max_body_bytes=config.limits.max_body_bytes,
            rule_for=config.rule_for,
            short_ascii=len(raw) <= MAX_FIELD_BYTES and raw.isascii(),
        )
        if not head.ours:
            raise _HandOver
        self._reading = "body"
        self.deadline = lane.loop.time() + config.listen.body_timeout_s
        if head.chunked:
            self._chunked, self._wire_bytes = bytearray(), 0

    def on_body(self, body: bytes) -> None:
        chunked = self._chunked
        if chunked is None:  # a Content-Length past the limit is aiohttp's to refuse
            self._body.append(body)
            return
        chunked += body
        self._body_bytes += len(body)
        if self._body_bytes > self._lane.policy.config.limits.max_body_bytes:
            self._too_large = True
            raise _TooLarge

    def on_message_complete(self) -> None:
        if self._chunked is not None:
            self._body, self._chunked = [bytes(self._chunked)], None
        head = self._head
        assert head is not None  # (a request the lane reads has its head)
        lane = self._lane
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = lane_request(lane, head, self._url, self._fields, body)
        self.out.head_sent = False  # type: ignore[union-attr]
        self._reading = "answering"
        self.deadline = _NEVER  # the client's own wait: as long as the upstream call takes
        keep_alive = self._parser.should_keep_alive()
        if request is None:
            lane.counts["handled"] += 1
            fields = reframed_fields(self._fields, body, head.chunked)
            assert self._channel is not None
            self.running = lane.loop.create_task(
                handle(
                    lane,
                    self._channel,
                    self._url,
                    fields,
                    decoded_headers(fields),
                    body,
                    keep_alive=keep_alive,
                    then=self._served,
                    closing=self._closing,
                ),
                context=self._context.copy(),
            )
            return
        lane.counts["served" if request.kind == "owned" else "relayed"] += 1
        self.running = lane.loop.create_task(
            answer(lane, self.out, request, keep_alive=keep_alive, then=self._served),  # type: ignore[arg-type]
            context=self._context.copy(),
        )
        if request.rule is not None and self._lane.precedence.counts(request.rule, request.message["params"]):
            # Counted from now, before its answer's first step: task work already waiting to run gives way to it
            # (proxy/tasks/precedence.py). A done callback: the answer's task may be cancelled before it starts.
            self._lane.precedence.begin()
            self.running.add_done_callback(self._lane.precedence.end)

    def _closing(self) -> bool:
        return self.out is None or self.out.closing

    def _served(self, keep_alive: bool) -> None:
        self.running = None
        self._answered(keep_alive)

    def _hand_over(self) -> None:
        self.deadline = _NEVER
        transport, self._transport = self._transport, None
        if transport is None or transport.is_closing():
            return
        self._parser = None  # type: ignore[assignment]  # no cycle back to this protocol
        self.out = self._channel = None
        # (A chunked request handed over ends its connection after its answer: proxy/front/app.py _end_after_chunked.)
        data = bytes(self._raw) + self.backlog.take_all(transport)  # the request, and all that came after it
        # aiohttp's handler task for the connection is made in this context: the connection's, not a request's.
        self._context.copy().run(self._lane.hand_over, self, transport, data)

    def _refuse_too_large(self) -> None:
        """A chunked body past the limit: 413, as aiohttp answers a Content-Length past it, and the end."""
        limit = self._lane.policy.config.limits.max_body_bytes
        reason = f"Request body too large: the limit is {limit} bytes (limits.max_body_bytes)"
        self._refuse(413, error_object(INVALID_REQUEST, reason, {"maxBodyBytes": limit}))

    def _refuse(self, status: int, error: dict[str, Any], *, waited_s: float = 0.0) -> None:
        """Answer the request being read with `error` and end the connection, behind the front door's boundary
        (counted, logged); `waited_s`: how long it was read."""
        lane = self._lane
        info = RequestInfo(mode="local")
        error, status = boundary.refusal(error, status, info, lane.metrics)
        transport = self._transport
        if self.out is not None and transport is not None:
            self.out.error(None, error, status, keep_alive=False)
            self._lingering, self.deadline = 0, lane.loop.time() + _LINGER_S
            if transport.can_write_eof():
                transport.write_eof()  # the answer is all: the client reads it, then the end
        else:
            self.abort()
        http_method = (self._method or b"POST").decode("latin-1")
        started = time.perf_counter() - waited_s
        boundary.done(info, policy=lane.policy, metrics=lane.metrics, identity=lane.identity, headers=None,
                      http_method=http_method, path=MCP_PATH, status=status, started=started)  # fmt: skip

    # deadlines

    def expired(self) -> None:
        """The head or body being read is late (Lane._expire): a late head closes the connection, as aiohttp's
        keep-alive timer does; a late body gets 408, as proxy/front/dispatch.py's read does."""
        self.deadline = _NEVER
        if self._reading == "body" and self._transport is not None and self.out is not None and self._lingering is None:
            body_timeout_s = self._lane.policy.config.listen.body_timeout_s
            reason = f"Request body not received within {body_timeout_s:g} s (listen.body_timeout_s)"
            self._refuse(408, error_object(INVALID_REQUEST, reason), waited_s=body_timeout_s)
            return
        self.abort()

    def _answered(self, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None:
            return
        if not keep_alive or (self.out is not None and self.out.closing):
            transport.close()
            return
        self._reading, self._head_bytes = "head", 0
        if self.out is not None and self.out.paused:
            # The client does not read its answers: nothing more is read or answered until it does, so what it
            # pipelines cannot pile answers up in the transport's buffer (aiohttp's path holds back the same way).
            self._held = True
            self.deadline = _NEVER  # the client's own pace, not a late head
            return
        self._next()

    def _next(self) -> None:
        """Ready for the next request: what came meanwhile is read now, a piece at a time, until a request is whole."""
        self.deadline = self._lane.loop.time() + self._lane.header_timeout_s
        backlog = self.backlog
        while backlog and self.running is None and not self._held:
            if self._transport is None or self._lingering is not None:
                return  # gone, or refused: what waits is dropped
            self._feed(backlog.take())
        backlog.make_room(self._transport)

    # stopping

    def close_when_idle(self) -> None:
        if self.running is None:
            self.abort()
        elif self.out is not None:
            self.out.closing = True

    def abort(self) -> None:
        self.deadline = _NEVER
        if self._transport is not None:
            self._transport.close()
