"""A small HTTP/1.1 client for the proxy's requests to the MCP endpoint: one asyncio protocol per connection.

Every working task holds one upstream request open, for as long as the tool runs. aiohttp's client costs about
12 KB per open request (request, response, connection, parser, stream reader, timers); this client costs under
3 KB and a fraction of the CPU, which is what lets one replica hold ten thousand working tasks. It speaks what the
MCP endpoint needs: POST, GET (event streams) and DELETE to one URL, a JSON or event-stream answer, keep-alive reuse
of finished connections, and closing the connection to cancel. Relayed requests use it too, reading the body as sent
(no decoding) with the headers in their original case and order. It is the only way to the MCP endpoint; aiohttp's
client relays only requests to the upstream's other paths (OAuth metadata and the like).

The bytes are parsed by httptools (llhttp, the parser of Node.js and uvicorn), which is strict where a proxy must
be: Content-Length with chunked, a bad chunk size, bare LF or CR line ends, duplicate lengths are all errors; 1xx,
204 and 304 have no body. A body cut short is an error, never a complete-looking answer. The head is bounded
however its bytes arrive, and a compressed body is inflated only as fast as its reader takes it, in bounded slices,
so a small gzip bomb costs a bounded amount of memory (the reader's own limit ends it).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from ..events import AnswerTooLarge, RequestUnsent
from .headers import RESPONSE_SKIP, connection_listed
from .inflate import Inflater

MAX_HEAD_BYTES = 64 * 1024
"""Status line and headers of one response, whatever pieces they arrive in."""
_MAX_HEADERS = 200
_HIGH_WATER = 1024 * 1024
"""Buffered body bytes above which the socket stops being read until the consumer catches up."""
_IDLE_S = 4.0
"""How long a finished connection waits for reuse: below uvicorn's 5 s keep-alive, the usual MCP server's, so
that a request is rarely sent on a connection the server is closing at that moment."""
_MAX_IDLE = 128
_SENT_AGAIN = frozenset({"GET", "DELETE"})


class CallError(ConnectionError):
    """The call could not be made, or its connection broke before the answer was complete."""


class Unsent(CallError, RequestUnsent):
    """No connection could be made: the request never left."""


class BodyTooLarge(CallError, AnswerTooLarge):
    """The body is longer than the reader's limit (decoded bytes are counted); the connection is closed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the response is longer than {limit} bytes")
        self.limit = limit


class _Connection(asyncio.Protocol):
    """One response at a time off a socket, parsed by httptools; decoded body bytes wait in `_ready`."""

    __slots__ = (
        "_loop",
        "transport",
        "_parser",
        "_head",
        "_head_bytes",
        "_trailer_bytes",
        "_reason",
        "_names",
        "_values",
        "_ready",
        "_state",
        "_until_close",
        "_waiter",
        "_closed",
        "_error",
        "_paused",
        "_inflater",
        "_decode",
        "response",
        "reusable",
        "idle_since",
    )

    def __init__(self) -> None:
        # Asked once: on CPython 3.11 every get_running_loop() is a getpid() syscall (its fork check).
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[None] | None = None
        self._head_bytes = 0
        """Bytes received while the head was incomplete (the parser's own buffers grow with them)."""
        self._trailer_bytes = 0
        self._reason = b""
        self._names: list[bytes] = []
        self._values: list[bytes] = []
        self._ready = bytearray()
        self._state = "idle"  # idle | head | body | complete (parsed to its end) | done (handed over) | failed
        self._until_close = False
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: str | None = None
        self._paused = False
        self._inflater: Inflater | None = None
        """While a compressed body is read (and only when the reader asked for it decoded)."""
        self._decode = True
        self.response: CallResponse | None = None
        self.reusable = False
        self.idle_since = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._state not in ("head", "interim", "body"):
            if self._state in ("idle", "complete", "done"):
                self.reusable = False  # bytes nobody asked for: this connection cannot be trusted again
                self.close()
            return
        parser = self._parser
        if parser is None:
            parser = self._parser = httptools.HttpResponseParser(self)
        in_head = self._state == "head"
        if in_head:
            self._head_bytes += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("the upstream switched protocols (HTTP 101), which an MCP endpoint never does")
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
            if isinstance(cause, _ExtraResponse):
                return  # the response asked for is complete and stands; the connection is not reused
            self._fail(f"the upstream sent a malformed HTTP response ({cause})")
            return
        if self._state == "head" and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(f"the upstream's response head exceeds {MAX_HEAD_BYTES} bytes")

    def eof_received(self) -> bool:
        self._ended()
        self.reusable = False
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.reusable = False
        self._ended()
        self._parser = None  # it refers back to this protocol: no cycle left for the collector
        self._wake()

    def _ended(self) -> None:
        if self._state == "body" and self._until_close:
            self._state = "complete"  # a body delimited by the end of the connection
            self._wake()
        elif self._state in ("head", "body"):
            self._fail("the upstream closed the connection before the response was complete")

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._state != "head":
            # A second response after the one asked for: the connection is out of step; this one stands.
            self.reusable = False
            raise _ExtraResponse
        self._reason = b""
        self._names.clear()
        self._values.clear()
        self._trailer_bytes = 0

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state == "body":
            # A trailer field (after a chunked body): nothing reads them, so they are counted, not kept.
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > MAX_HEAD_BYTES:
                raise ValueError(f"the response's trailer fields exceed {MAX_HEAD_BYTES} bytes")
            return
        names = self._names
        if len(names) >= _MAX_HEADERS:
            raise ValueError(f"more than {_MAX_HEADERS} header fields")
        names.append(name)
        self._values.append(value)

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        # The head's size, once it is whole: a head that does not end is bounded by data_received across reads,
        # and within one read by the read's own size.
        names, values = self._names, self._values
        size = len(self._reason) + sum(map(len, names)) + sum(map(len, values)) + 4 * len(names)
        if size > MAX_HEAD_BYTES:
            raise ValueError(f"the response head exceeds {MAX_HEAD_BYTES} bytes")
        status = parser.get_status_code()
        if status < 100 or status > 599:
            raise ValueError(f"status code {status}")
        if status < 200:
            self._state = "interim"  # 100 Continue, 103 Early Hints: the real answer follows
            return
        response = self.response
        assert response is not None
        headers: dict[str, str] = {}
        relayed: list[tuple[bytes, bytes]] | None = [] if response.relayed_fields is not None else None
        for name_bytes, value_bytes in zip(self._names, self._values, strict=True):
            lower, value = name_bytes.decode("latin-1").lower(), value_bytes.decode("latin-1").strip()
            if relayed is not None and lower not in RESPONSE_SKIP:
                # As received, but for the optional whitespace llhttp leaves after a value (RFC 9110: SP, HTAB).
                relayed.append((name_bytes, value_bytes.rstrip(b" \t")))
            headers[lower] = f"{headers[lower]}, {value}" if lower in headers else value
        # The raw fields are not needed past this point; an open call may wait for hours, so they are not kept.
        self._names.clear()
        self._values.clear()
        response.status, response.headers = status, headers
        response.reason = self._reason.decode("latin-1")
        self._reason = b""
        if relayed is not None:
            listed = connection_listed(headers.get("connection"))
            if listed:
                relayed = [field for field in relayed if field[0].decode("latin-1").lower() not in listed]
                response.dropped = frozenset(listed)
            response.relayed_fields = relayed
        self.reusable = parser.should_keep_alive()
        if self._decode:
            self._inflater = Inflater.for_encoding(headers.get("content-encoding", "identity").strip().lower())
        # llhttp's framing rules, restated to know whether the end of the connection ends the body.
        transfer = headers.get("transfer-encoding")
        if transfer is not None:
            self._until_close = transfer.rsplit(",", 1)[-1].strip().lower() != "chunked"
        else:
            self._until_close = "content-length" not in headers and status not in (204, 304)
        if self._until_close:
            self.reusable = False
        self._state = "body"
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._inflater is None:
            self._ready += body
        else:
            self._inflater.feed(body)
            self._inflater.inflate_into(self._ready, _HIGH_WATER)
        self._flow()
        self._wake()

    def on_message_complete(self) -> None:
        if self._state == "interim":
            self._state = "head"
            return
        self._state = "complete"
        self._wake()

    # body delivery

    def _pending(self) -> bool:
        return self._inflater is not None and self._inflater.pending()

    def _flow(self) -> None:
        buffered = len(self._ready) + (self._inflater.waiting_bytes if self._inflater is not None else 0)
        if buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        self._state = "failed"
        self.reusable = False
        self._inflater = None
        if self._head is not None and not self._head.done():
            self._head.set_exception(CallError(reason))
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # used by CallClient and CallResponse

    @property
    def closed(self) -> bool:
        return self._closed or self.transport is None or self.transport.is_closing()

    def send(self, data: bytes, response: CallResponse, *, decode: bool) -> asyncio.Future[None]:
        """Write one request; the returned future resolves once the response head arrived."""
        assert self.transport is not None
        self.response = response
        self._decode = decode
        self._inflater = None
        self._state, self._error, self._until_close, self._head_bytes = "head", None, False, 0
        self._ready.clear()
        self._parser = None  # made when the first byte arrives: a call that waits holds none (about 1 KB each)
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        self._head = self._loop.create_future()
        self.transport.write(data)
        return self._head

    async def next_chunk(self) -> bytes:
        """Body bytes decoded so far, waiting for some if none is buffered; b"" at the end of the body."""
        while not self._ready:
            if self._error is not None:
                raise CallError(self._error)
            if self._inflater is not None and self._inflater.pending():
                try:
                    self._inflater.inflate_into(self._ready, _HIGH_WATER)
                except ValueError as exc:
                    self._fail(f"the upstream sent a malformed HTTP response ({exc})")
                await asyncio.sleep(0)  # a long compressed body must not hold the event loop
                continue
            if self._state == "complete":
                self._state = "done"
                if self._inflater is not None:
                    inflater, self._inflater = self._inflater, None
                    try:
                        self._ready += inflater.finish()
                    except ValueError as exc:
                        self._fail(str(exc))
                        raise CallError(self._error or "") from None
                continue
            if self._state == "done":
                return b""
            if self._closed:
                raise CallError("the upstream connection was lost before the response was complete")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = bytes(self._ready)
        self._ready.clear()
        if self._paused and self.transport is not None and not self._pending():
            self._paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def heard_nothing(self) -> bool:
        """Not a byte of the response to the last request sent came (the server closed the connection first)."""
        return self._head_bytes == 0 and self._state == "failed"

    @property
    def at_eof(self) -> bool:
        return self._state == "done" and not self._ready

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()


class _ExtraResponse(Exception):
    """Raised from a parser callback to stop parsing bytes that follow the response."""


class CallResponse:
    """The answer to one call: status, headers (lower-case names), then the body read whole or in chunks."""

    __slots__ = ("status", "reason", "headers", "relayed_fields", "dropped", "_connection", "_client")

    def __init__(self, connection: _Connection, client: CallClient, *, relay: bool = False) -> None:
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.relayed_fields: list[tuple[bytes, bytes]] | None = [] if relay else None
        """When asked for: the end-to-end fields as received, in bytes (case, order, repeats; hop-by-hop ones and
        those the Connection header names dropped), what a relay passes on."""
        self.dropped: frozenset[str] = frozenset()
        """The lowercase names the Connection header listed: in `headers`, not in `relayed_fields`."""
        self._connection: _Connection | None = connection
        self._client = client

    @property
    def relayed_headers(self) -> CIMultiDict[str]:
        """`relayed_fields` decoded (latin-1, byte for byte), for aiohttp's response."""
        assert self.relayed_fields is not None, "asked of a response read without relay=True"
        return CIMultiDict((name.decode("latin-1"), value.decode("latin-1")) for name, value in self.relayed_fields)

    def relays(self, lower_name: str) -> bool:
        """Whether the relayed fields hold a field of this (lowercase) name."""
        return lower_name in self.headers and lower_name not in self.dropped and lower_name not in RESPONSE_SKIP

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while self._connection is not None:
            chunk = await self._connection.next_chunk()
            if not chunk:
                break
            yield chunk

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; CallError when the connection breaks, BodyTooLarge past `limit` bytes (decoded)."""
        body = bytearray()
        # next_chunk in a loop, not iter_chunks: an async generator costs every answer a registration with the
        # loop (its asyncgen hooks) and about a microsecond more.
        while (connection := self._connection) is not None and (chunk := await connection.next_chunk()):
            body += chunk
            if limit is not None and len(body) > limit:
                self.close()  # the rest is never read: the connection cannot be reused
                raise BodyTooLarge(limit)
        return bytes(body)

    def close(self) -> None:
        """Give the connection back when the body was read to its end; otherwise close it (this cancels the call)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.at_eof and connection.reusable and not connection.closed:
            self._client.keep(connection)
        else:
            connection.close()

    async def __aenter__(self) -> CallResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class CallClient:
    """Requests to one URL over pooled keep-alive connections."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        tls: ssl.SSLContext | None = None,
        max_idle: int = _MAX_IDLE,
        idle_s: float = _IDLE_S,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        host_header = f"[{self._host}]" if ":" in self._host else self._host
        if parts.port is not None:
            host_header += f":{parts.port}"
        self._path = parts.path or "/"
        self._host_header = host_header
        self._request_lines = {
            method: f"{method} {self._target(parts.query)} HTTP/1.1\r\nHost: {host_header}\r\n".encode()
            for method in ("POST", "GET", "DELETE")
        }
        self._connect_timeout_s = connect_timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._max_idle = max_idle
        self._idle_s = idle_s

    def post(
        self, headers: Mapping[str, str] | bytes, body: bytes, *, query: str = "", relay: bool = False
    ) -> Awaitable[CallResponse]:
        """A POST of `body` (see `request`)."""
        return self.request("POST", headers, body, query=query, relay=relay)

    async def request(
        self,
        method: str,
        headers: Mapping[str, str] | bytes,
        body: bytes | None,
        *,
        query: str = "",
        relay: bool = False,
    ) -> CallResponse:
        """Send the request and wait for the response head; the caller reads the body and closes the response.

        `method` is POST, GET or DELETE; `body` None sends none. `headers` is a mapping, or the header lines already
        serialized and checked (`relayed_request_fields`). `query` replaces the URL's query; `relay` keeps the body
        as sent (no decompression) and the end-to-end headers as received, for passing the response on.
        """
        line = self._request_lines.get(method)
        if line is None:
            raise CallError(f"{method} is not a method this client sends")
        head = [line if not query else self._request_line_with(method, query)]
        if isinstance(headers, bytes):
            head.append(headers)
        else:
            for name, value in headers.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                    raise CallError(f"header {name!r} cannot be sent")
                head.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        if body is not None:
            head.append(b"Content-Length: %d\r\n\r\n" % len(body))
            head.append(body)
        else:
            head.append(b"\r\n")
        request = b"".join(head)
        del head, body, headers  # a working task waits here for the whole call: hold nothing it no longer needs
        connection = self._reuse()
        # A GET or DELETE sent on a kept connection the server closed meanwhile is sent once more on a new one,
        # as aiohttp's client does: it never reached the server.
        again = connection is not None and method in _SENT_AGAIN
        if connection is None:
            connection = await self._connect()
        while True:
            response = CallResponse(connection, self, relay=relay)
            answered = connection.send(request, response, decode=not relay)
            if not again:
                request = b""  # sent: a working task waits below for the whole call, holding none of it
            try:
                await answered
            except CallError:
                response.close()
                if not (again and connection.heard_nothing):
                    raise
                again, connection = False, await self._connect()
                continue
            except BaseException:
                response.close()
                raise
            return response

    def _target(self, query: str) -> str:
        return self._path + (f"?{query}" if query else "")

    def _request_line_with(self, method: str, query: str) -> bytes:
        if any(c in query for c in " \r\n"):
            raise CallError("the query string cannot be sent")
        return f"{method} {self._target(query)} HTTP/1.1\r\nHost: {self._host_header}\r\n".encode()

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used is the least likely to be timed out
            if not connection.closed and now - connection.idle_since < self._idle_s:
                return connection
            connection.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                server_hostname = self._host if self._ssl else None
                _, connection = await loop.create_connection(
                    _Connection, self._host, self._port, ssl=self._ssl, server_hostname=server_hostname
                )
        except TimeoutError as exc:
            raise Unsent(f"no connection within {self._connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise Unsent(exc.strerror or str(exc)) from exc
        return connection

    def keep(self, connection: _Connection) -> None:
        connection.response = None
        connection.idle_since = now = time.monotonic()
        self._idle.append(connection)
        # Oldest first: drop what waited too long, and what exceeds the pool's bound.
        while self._idle and (len(self._idle) > self._max_idle or now - self._idle[0].idle_since >= self._idle_s):
            self._idle.popleft().close()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
