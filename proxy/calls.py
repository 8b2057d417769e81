"""A small HTTP/1.1 client for the proxy's POSTs to the MCP endpoint: one asyncio protocol per connection.

Every working task holds one upstream request open, for as long as the tool runs. aiohttp's client costs about
12 KB per open request (request, response, connection, parser, stream reader, timers); this client costs under
3 KB and a fraction of the CPU, which is what lets one replica hold ten thousand working tasks. It speaks only what
a task call needs: one POST to one origin, a JSON or event-stream answer (Content-Length, chunked, or until
close; gzip/deflate if the server compresses anyway), keep-alive reuse of finished connections, and closing the
connection to cancel. Pass-through POSTs use it too, reading the body as sent (no decoding) with the headers in
their original case and order; aiohttp relays everything else (GET streams, DELETE, other paths).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from multidict import CIMultiDict

_MAX_HEAD_BYTES = 64 * 1024
_HIGH_WATER = 1024 * 1024
"""Buffered body bytes above which the socket stops being read until the consumer catches up."""
_IDLE_S = 4.0
"""How long a finished connection waits for reuse: below uvicorn's 5 s keep-alive, the usual MCP server's, so
that a request is rarely sent on a connection the server is closing at that moment."""
_MAX_IDLE = 128


class CallError(ConnectionError):
    """The call could not be made, or its connection broke before the answer was complete."""


class _Connection(asyncio.Protocol):
    """Parses one response at a time off a socket; decoded body bytes wait in `_ready` for the reader."""

    __slots__ = (
        "transport",
        "_head",
        "_raw",
        "_ready",
        "_state",
        "_remaining",
        "_waiter",
        "_closed",
        "_error",
        "_paused",
        "_decoder",
        "_decode",
        "response",
        "reusable",
        "idle_since",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._head: asyncio.Future[None] | None = None
        self._raw = bytearray()
        self._ready = bytearray()
        self._state = "idle"  # idle | head | length | chunk-size | chunk-data | chunk-end | trailer | close | done
        self._remaining = 0
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: str | None = None
        self._paused = False
        self._decoder: zlib._Decompress | None = None
        self._decode = True
        self.response: CallResponse | None = None
        self.reusable = False
        self.idle_since = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._state in ("idle", "done"):
            self.reusable = False  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        self._raw += data
        try:
            self._parse()
        except ValueError as exc:
            self._fail(f"the upstream sent a malformed HTTP response ({exc})")

    def eof_received(self) -> bool:
        if self._state == "close":
            self._finish()
        elif self._state not in ("idle", "done"):
            self._fail("the upstream closed the connection before the response was complete")
        self.reusable = False
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.reusable = False
        if self._state == "close":
            self._finish()
        elif self._state not in ("idle", "done"):
            self._fail("the upstream connection was lost before the response was complete")
        self._wake()

    # parsing

    def _parse(self) -> None:
        while self._raw:
            state = self._state
            if state == "head":
                end = self._raw.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._raw) > _MAX_HEAD_BYTES:
                        raise ValueError("response head too large")
                    return
                head = bytes(self._raw[:end])
                del self._raw[: end + 4]
                self._on_head(head)
            elif state == "length":
                if self._take_body():
                    self._finish()
            elif state == "close":
                self._deliver(self._raw)
                self._raw.clear()
            elif state == "chunk-size":
                end = self._raw.find(b"\r\n")
                if end < 0:
                    if len(self._raw) > 1024:
                        raise ValueError("chunk size line too long")
                    return
                size = int(bytes(self._raw[:end]).split(b";", 1)[0].strip(), 16)
                del self._raw[: end + 2]
                if size < 0:
                    raise ValueError("negative chunk size")
                self._remaining, self._state = size, ("chunk-data" if size else "trailer")
            elif state == "chunk-data":
                if self._take_body():
                    self._state = "chunk-end"
            elif state == "chunk-end":
                if len(self._raw) < 2:
                    return
                if self._raw[:2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                del self._raw[:2]
                self._state = "chunk-size"
            elif state == "trailer":
                end = self._raw.find(b"\r\n")
                if end < 0:
                    return
                del self._raw[: end + 2]
                if end == 0:
                    self._finish()
            else:  # done, yet bytes follow the response
                self.reusable = False
                self._raw.clear()
                return

    def _take_body(self) -> bool:
        """Deliver what has arrived of the `_remaining` body bytes; True once all of them have."""
        take = min(self._remaining, len(self._raw))
        self._deliver(self._raw[:take])
        del self._raw[:take]
        self._remaining -= take
        return self._remaining == 0

    def _on_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the real one follows
        response = self.response
        assert response is not None
        headers: dict[str, str] = {}
        raw: CIMultiDict[str] | None = CIMultiDict() if response.raw_headers is not None else None
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError("header line without a colon")
            value = value.strip()
            if raw is not None:
                raw.add(name.strip(), value)
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        response.status, response.headers = status, headers
        response.reason = parts[2] if len(parts) > 2 else ""
        if raw is not None:
            response.raw_headers = raw
        self.reusable = parts[0] == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        encoding = headers.get("content-encoding", "identity").strip().lower() if self._decode else "identity"
        if encoding in ("gzip", "x-gzip"):
            self._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._decoder = zlib.decompressobj()
        elif encoding != "identity":
            raise ValueError(f"unsupported content-encoding {encoding!r}")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "chunk-size"
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise ValueError(f"bad content-length {length!r}")
            self._remaining = int(length)
            self._state = "length" if self._remaining else "done"
        elif status in (204, 304):
            self._state = "done"
        else:
            self._state = "close"
            self.reusable = False
        if self._head is not None and not self._head.done():
            self._head.set_result(None)
        if self._state == "done":
            self._finish()

    def _deliver(self, data: bytes | bytearray) -> None:
        if not data:
            return
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
            except zlib.error as exc:
                raise ValueError(f"undecodable compressed body ({exc})") from exc
        self._ready += data
        if len(self._ready) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        if self._decoder is not None:
            self._ready += self._decoder.flush()
            self._decoder = None
        self._state = "done"
        if self._raw:
            self.reusable = False
        self._wake()

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        self.reusable = False
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
        self._state, self._error, self._remaining = "head", None, 0
        self._ready.clear()
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._head

    async def next_chunk(self) -> bytes:
        """Body bytes decoded so far, waiting for some if none is buffered; b"" at the end of the body."""
        while not self._ready:
            if self._state == "done":
                return b""
            if self._error is not None:
                raise CallError(self._error)
            if self._closed:
                raise CallError("the upstream connection was lost before the response was complete")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = bytes(self._ready)
        self._ready.clear()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def at_eof(self) -> bool:
        return self._state == "done" and not self._ready

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()


class CallResponse:
    """The answer to one call: status, headers (lower-case names), then the body read whole or in chunks."""

    __slots__ = ("status", "reason", "headers", "raw_headers", "_connection", "_client")

    def __init__(self, connection: _Connection, client: CallClient, *, raw_headers: bool = False) -> None:
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.raw_headers: CIMultiDict[str] | None = CIMultiDict() if raw_headers else None
        """As received (case, order, repeats), when asked for: what a relay passes on."""
        self._connection: _Connection | None = connection
        self._client = client

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
        """The whole body; CallError when the connection breaks, or when it is longer than `limit` bytes."""
        body = bytearray()
        async for chunk in self.iter_chunks():
            body += chunk
            if limit is not None and len(body) > limit:
                raise CallError(f"the response is longer than {limit} bytes")
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
    """POSTs to one URL over pooled keep-alive connections."""

    def __init__(self, url: str, *, connect_timeout_s: float, max_idle: int = _MAX_IDLE, idle_s: float = _IDLE_S):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = f"[{self._host}]" if ":" in self._host else self._host
        if parts.port is not None:
            host_header += f":{parts.port}"
        self._path = parts.path or "/"
        self._host_header = host_header
        path = self._path + (f"?{parts.query}" if parts.query else "")
        self._request_line = f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\n".encode()
        self._connect_timeout_s = connect_timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._max_idle = max_idle
        self._idle_s = idle_s

    async def post(
        self, headers: Mapping[str, str], body: bytes, *, query: str = "", relay: bool = False
    ) -> CallResponse:
        """Send the request and wait for the response head; the caller reads the body and closes the response.

        `query` is appended to the URL's path; `relay` keeps the body as sent (no decompression) and the headers as
        received, for passing the response on.
        """
        head = [self._request_line if not query else self._request_line_with(query)]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise CallError(f"header {name!r} cannot be sent")
            head.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        head.append(body)
        request = b"".join(head)
        del head, body  # a working task waits here for the whole call: hold nothing it no longer needs
        connection = self._reuse() or await self._connect()
        response = CallResponse(connection, self, raw_headers=relay)
        answered = connection.send(request, response, decode=not relay)
        del request
        try:
            await answered
        except BaseException:
            response.close()
            raise
        return response

    def _request_line_with(self, query: str) -> bytes:
        if any(c in query for c in " \r\n"):
            raise CallError("the query string cannot be sent")
        return f"POST {self._path}?{query} HTTP/1.1\r\nHost: {self._host_header}\r\n".encode()

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
            raise CallError(f"no connection within {self._connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise CallError(exc.strerror or str(exc)) from exc
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
