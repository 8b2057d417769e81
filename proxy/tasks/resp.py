"""A pipelining Redis connection for the task store's hot path: every create, read and update of a task.

redis-py's asyncio client spends about 150 µs of CPU per command (a pool checkout, retry and timeout wrappers, a
stream reader); the store issues three to five commands per task, which capped a replica at some 700 task
creations a second. Here all requests share one connection, each is written at once and answered in order (RESP
guarantees it), so concurrent requests pipeline by themselves and a command costs a few tens of µs. Only commands
that are atomic on their own go through it (SET NX/XX, GET, a compare-and-set script, PUBLISH): WATCH or SUBSCRIBE
would change the connection's state for everyone, so leases, the lost-replica sweep and pub/sub keep redis-py.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import Any

from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

Reply = bytes | int | list[Any] | None


class RespError(Exception):
    """An error reply (-ERR ...) or a connection that failed; the message says which."""


class _Protocol(asyncio.Protocol):
    """Parses RESP2 replies and resolves the oldest waiting future with each."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._buffer = bytearray()
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.broken: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        position = 0
        try:
            while self.waiting:
                parsed = _parse(self._buffer, position)
                if parsed is None:
                    break
                reply, position = parsed
                future = self.waiting.popleft()
                if future.done():
                    continue  # its caller was cancelled; the reply still had to be consumed, in order
                if isinstance(reply, RespError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except ValueError as exc:
            self.fail(f"Redis sent a malformed reply ({exc})")
        del self._buffer[:position]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail("the connection to Redis was lost")
        if not self._lost.done():
            self._lost.set_result(None)

    def fail(self, reason: str) -> None:
        self.broken = self.broken or reason
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(RespError(reason))
        if self.transport is not None:
            self.transport.close()


def _parse(buffer: bytearray, position: int) -> tuple[Reply | RespError, int] | None:
    """One reply starting at `position`: (reply, position after it), or None while it is incomplete."""
    end = buffer.find(b"\r\n", position)
    if end < 0:
        return None
    kind, line = buffer[position : position + 1], bytes(buffer[position + 1 : end])
    after = end + 2
    if kind == b"+":
        return line, after
    if kind == b"-":
        return RespError(line.decode("utf-8", "replace")), after
    if kind == b":":
        return int(line), after
    if kind == b"$":
        length = int(line)
        if length < 0:
            return None, after
        if len(buffer) < after + length + 2:
            return None
        return bytes(buffer[after : after + length]), after + length + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, after
        items: list[Any] = []
        for _ in range(count):
            parsed = _parse(buffer, after)
            if parsed is None:
                return None
            item, after = parsed
            items.append(item)
        return items, after
    raise ValueError(f"unknown reply type {bytes(kind)!r}")


def _encode(args: tuple[str | bytes | int, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n" % len(data))
        out.append(data)
        out.append(b"\r\n")
    return b"".join(out)


class RespClient:
    """One shared, lazily (re)connected connection to the Redis that `url` names (redis-py's URL rules)."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        options = parse_url(url)
        self._path: str | None = options.get("path")
        self._host = options.get("host", "localhost")
        self._port = int(options.get("port", 6379))
        self._ssl = ssl.create_default_context() if options.get("connection_class") is SSLConnection else None
        if options.get("connection_class") is UnixDomainSocketConnection and self._path is None:
            raise ValueError(f"no socket path in {url!r}")
        self._hello: list[tuple[str | bytes | int, ...]] = []
        if options.get("password") is not None:
            user = options.get("username")
            self._hello.append(("AUTH", user, options["password"]) if user else ("AUTH", options["password"]))
        if options.get("db"):
            self._hello.append(("SELECT", int(options["db"])))
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()

    async def _connection(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.broken is None:
            return protocol
        async with self._connecting:
            if self._protocol is None or self._protocol.broken is not None:
                loop = asyncio.get_running_loop()
                if self._path is not None:
                    _, protocol = await loop.create_unix_connection(_Protocol, self._path)
                else:
                    server_hostname = self._host if self._ssl else None
                    _, protocol = await loop.create_connection(
                        _Protocol, self._host, self._port, ssl=self._ssl, server_hostname=server_hostname
                    )
                for command in self._hello:
                    await self._send(protocol, [command])
                self._protocol = protocol
            return self._protocol

    async def execute(self, *args: str | bytes | int) -> Reply:
        return (await self.pipeline([args]))[0]

    async def pipeline(self, commands: list[tuple[str | bytes | int, ...]]) -> list[Reply]:
        """Send the commands in one write; their replies in order. An error reply raises RespError.

        One write keeps a MULTI ... EXEC block contiguous on the shared connection, so it stays atomic.
        """
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                protocol = await self._connection()
                return await self._send(protocol, commands)
        except TimeoutError:
            if protocol is not None:
                protocol.fail(f"Redis did not answer within {self._timeout_s:g} s")  # reconnect next time
            raise
        except OSError as exc:
            raise RespError(f"cannot connect to Redis ({exc.strerror or exc})") from exc

    async def _send(self, protocol: _Protocol, commands: list[tuple[str | bytes | int, ...]]) -> list[Reply]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        protocol.waiting.extend(futures)
        assert protocol.transport is not None
        protocol.transport.write(b"".join(_encode(command) for command in commands))
        replies: list[Reply] = []
        error: RespError | None = None
        try:
            for future in futures:  # every reply is awaited, so that no error goes unretrieved
                try:
                    replies.append(await future)
                except RespError as exc:
                    error = error or exc
                    replies.append(None)
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()  # their replies are still read off the connection, in order, and dropped
            raise
        if error is not None:
            raise error
        return replies

    async def aclose(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
            self._protocol = None
