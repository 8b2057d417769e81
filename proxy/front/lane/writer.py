"""Writing a lane connection's answers: heads framed as aiohttp frames its own, bodies as they come, and the flow
control of a client that reads slowly."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp.http import SERVER_SOFTWARE

from ...jsonrpc import dumps, error_response
from ...upstream.http.client import CallResponse
from ...upstream.http.sse import message_event

_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()


@functools.lru_cache(maxsize=64)
def _status_line(status: int) -> str:
    return f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"  # the enum lookup costs more than the rest


class LaneWriter:
    """One client connection's write side while the lane answers on it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, date: Callable[[], str]) -> None:
        self.transport: asyncio.Transport | None = transport
        """None once the client has gone."""
        self.closing = False
        """The connection ends after the answer being written (Connection: close)."""
        self.head_sent = False
        """Of the answer being written: past this, an error can only break the connection, not be answered."""
        self._loop = loop
        self._date = date
        self._paused: asyncio.Future[None] | None = None

    def remote(self) -> str | None:
        """The client's address (a syscall on uvloop: asked only where an anonymous caller needs it)."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return peer[0] if isinstance(peer, tuple) else None

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            raise ConnectionResetError("the client closed the connection")
        self.head_sent = True
        transport.write(data)

    async def drain(self) -> None:
        paused = self._paused
        if paused is not None and not paused.done():
            await paused
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")

    @property
    def paused(self) -> bool:
        """The client reads slower than it is written to: the transport's buffer is past its high-water mark."""
        return self._paused is not None and not self._paused.done()

    def pause(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = self._loop.create_future()

    def resume(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def lost(self) -> None:
        self.transport = None
        # A result, not an exception: a drain waiting now raises on the lost transport, and no future is left
        # with an exception nobody retrieves (asyncio would log it).
        self.resume()

    def relayed_head(self, response: CallResponse, keep_alive: bool, length: int | None) -> bytes:
        """The upstream's status line and end-to-end fields as received, framed for this connection."""
        relayed = response.relayed_fields
        assert relayed is not None
        status = response.status
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, response.reason.encode("latin-1"))]
        lines += [b"%s: %s\r\n" % field for field in relayed]  # the bytes as received: nothing decoded
        if not response.relays("date"):
            lines.append(f"Date: {self._date()}\r\n".encode())
        if not response.relays("server"):
            lines.append(_SERVER)
        if length is not None:
            lines.append(b"Content-Length: %d\r\n" % length)
        elif status not in (204, 304):
            lines.append(b"Transfer-Encoding: chunked\r\n")
        if not keep_alive or self.closing:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def own_head(
        self, status: int, content_type: str, keep_alive: bool, length: int | None, retry_after: str | None = None
    ) -> bytes:
        """The head of an answer the proxy makes itself, as aiohttp would write it."""
        head = f"{_status_line(status)}Content-Type: {content_type}\r\n"
        if retry_after is not None:
            head += f"Retry-After: {retry_after}\r\n"
        head += f"Date: {self._date()}\r\nServer: {SERVER_SOFTWARE}\r\n"
        head += f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
        if not keep_alive or self.closing:
            head += "Connection: close\r\n"
        return head.encode() + b"\r\n"

    def json(self, message: dict[str, Any], status: int, *, keep_alive: bool, retry_after: str | None = None) -> None:
        body = dumps(message)
        self.write(self.own_head(status, "application/json", keep_alive, len(body), retry_after) + body)

    def error(
        self, request_id: Any, error: dict[str, Any], status: int, *, keep_alive: bool, retry_after: str | None = None
    ) -> None:
        self.json(error_response(request_id, error), status, keep_alive=keep_alive, retry_after=retry_after)


class RelayedAnswer:
    """An upstream's answer relayed on the lane's connection (proxy/upstream/http/relay.py relay_answer): its head
    fields as received, its body whole or chunk by chunk."""

    __slots__ = ("_out", "_keep_alive", "_chunked")

    def __init__(self, out: LaneWriter, keep_alive: bool) -> None:
        self._out = out
        self._keep_alive = keep_alive
        self._chunked = False

    def whole(self, response: CallResponse, payload: bytes | None) -> None:
        out = self._out
        if payload is None:
            out.write(out.relayed_head(response, self._keep_alive, None))
        else:
            out.write(out.relayed_head(response, self._keep_alive, len(payload)) + payload)

    async def start(self, response: CallResponse, length: int | None) -> None:
        self._chunked = length is None
        self._out.write(self._out.relayed_head(response, self._keep_alive, length))

    async def write(self, chunk: bytes) -> bool:
        out = self._out
        out.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self._chunked else chunk)
        await out.drain()
        return True

    async def end(self) -> None:
        if self._chunked:
            self._out.write(b"0\r\n\r\n")

    def abort(self) -> None:
        self._out.closing = True  # the client sees a broken response, as the proxy did


class LaneReply:
    """A bridged call's answer (proxy/upstream/bridge.py) written by the lane: one JSON body, or an event stream
    once progress came, as bridge.StreamReply writes it on aiohttp."""

    separable = True
    """Another task may answer the client (`take`); the request's own task then reads the call on."""

    def __init__(self, writer: LaneWriter, keep_alive: bool, answered: Callable[[int, bool], None]) -> None:
        self._writer = writer
        self._keep_alive = keep_alive
        self._streaming = False
        self._answered = answered
        self.taken = False
        """Another task answers the client: the request ends when that one says so (`answered_elsewhere`), not
        when the request's own task ends, which may read the call on in the background."""

    def take(self) -> Callable[[int, bool], None]:
        """For the task that answers the client instead of the request's own (bridge.py): the call that ends the
        request with its status and whether the connection may carry another, once."""
        self.taken = True
        return self._answered

    def closing(self) -> None:
        """The connection ends after this answer: its head, when not yet written, says `Connection: close`."""
        self._writer.closing = True

    def remote(self) -> str | None:
        return self._writer.remote()

    async def event(self, message: dict[str, Any]) -> None:
        writer = self._writer
        if not self._streaming:
            self._streaming = True
            head = writer.own_head(200, "text/event-stream", self._keep_alive, None)
            writer.write(head[:-2] + b"Cache-Control: no-cache\r\n\r\n")
        data = message_event(message)
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()

    async def finish(self, message: dict[str, Any], status: int = 200) -> int:
        if not self._streaming:
            self._writer.json(message, status, keep_alive=self._keep_alive)
            return status
        await self.event(message)
        self._writer.write(b"0\r\n\r\n")
        return 200
