"""A `POST /mcp` the lane read but does not serve itself, answered by the application's handler on the lane's own
connection: the request as aiohttp's own reader would make it (aiohttp's request object, from the fields and body the
lane parsed), the application's route and boundary (proxy/front/app.py), and aiohttp's response and payload writer
writing to the lane's transport. The lane knows where the answer ends because it finishes the response itself, as
aiohttp's connection handler does: nothing re-parses it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpVersion11, StreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ..context import MCP_PATH

if TYPE_CHECKING:
    from .server import Lane

log = structlog.get_logger(__name__)


class Channel(BaseProtocol):
    """What aiohttp's request, body reader and payload writer ask of the connection they belong to: its transport
    (None once the client left), the peer, and write flow control. One per lane connection, fed the connection's
    pause_writing, resume_writing and connection_lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        super().__init__(loop)
        self.transport = transport
        self.ssl_context = transport.get_extra_info("sslcontext")
        self.peername = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")

    def pause_reading(self) -> None:
        self._reading_paused = True  # the body is whole when the handler runs: nothing to hold back

    def resume_reading(self, resume_parser: bool = True) -> None:
        self._reading_paused = False


def reframed_fields(fields: list[tuple[bytes, bytes]], body: bytes, chunked: bool) -> list[tuple[bytes, bytes]]:
    """A chunked request's fields as the handler sees it: its body whole, with a Content-Length (and no trailer: the
    lane keeps none)."""
    if not chunked:
        return fields
    kept = [field for field in fields if field[0].lower() != b"transfer-encoding"]
    return [*kept, (b"Content-Length", b"%d" % len(body))]


async def handle(
    lane: Lane,
    channel: Channel,
    url: bytes,
    fields: list[tuple[bytes, bytes]],
    headers: CIMultiDict[str],
    body: bytes,
    *,
    keep_alive: bool,
    then: Callable[[bool], None],
    closing: Callable[[], bool] = lambda: False,
) -> None:
    """Answer the request with the application's handler for `POST /mcp` (routed, guarded, counted and logged by
    it), then call `then` with whether the connection may carry another request. `closing` says whether the lane
    ends the connection after this answer (what was pipelined behind it could not be read): the answer says so."""
    reusable = False
    try:
        request = _request(lane, channel, url, fields, headers, body, keep_alive=keep_alive)
        try:
            response = await lane.handlers.request_handler(request)
        except web.HTTPException as exc:  # as aiohttp's connection handler answers one
            response = exc
        if closing():
            response.force_close()
        await response.prepare(request)
        await response.write_eof()
        reusable = keep_alive and bool(response.keep_alive)
    except ConnectionError:
        pass  # the client left mid-answer (the boundary counted the request)
    except Exception as exc:  # the boundary answers every failure of the handler: this is one of writing it
        log.exception("unhandled_error", exc_info=exc)
    then(reusable)


def _request(
    lane: Lane,
    channel: Channel,
    url: bytes,
    fields: list[tuple[bytes, bytes]],
    headers: CIMultiDict[str],
    body: bytes,
    *,
    keep_alive: bool,
) -> web.BaseRequest:
    loop = lane.loop
    path = url.decode("utf-8", "surrogateescape")
    _, _, query = path.partition("?")
    message = RawRequestMessage(
        "POST",
        path,
        HttpVersion11,
        CIMultiDictProxy(headers),
        tuple(fields),
        not keep_alive,
        None,
        False,
        False,
        URL.build(path=MCP_PATH, query_string=query, encoded=True),
    )
    payload = StreamReader(channel, 2**16, loop=loop)
    if body:
        payload.feed_data(body)
    payload.feed_eof()
    writer = StreamWriter(channel, loop)
    task: Any = asyncio.current_task()
    return lane.handlers.request_factory(message, payload, channel, writer, task)  # type: ignore[arg-type]
