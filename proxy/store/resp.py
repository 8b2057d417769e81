"""A pipelining Redis connection for the task store's hot path: every create, read and update of a task.

redis-py's asyncio client spends about 150 µs of CPU per command (a pool checkout, retry and timeout wrappers, a
stream reader); the store issues three to five commands per task, which capped a replica at some 700 task
creations a second. Here all requests share one connection, each is written at once and answered in order (RESP
guarantees it), so concurrent requests pipeline by themselves and a command costs a few tens of µs. Only commands
that are atomic on their own go through it (SET NX/XX, GET, a compare-and-set script, PUBLISH): WATCH or SUBSCRIBE
would change the connection's state for everyone, so leases, the lost-replica sweep and pub/sub keep redis-py.

Replies are parsed by hiredis, the official C parser (redis-py uses it too). Pipelining by order is only safe while
every reply is matched to exactly one waiting command, so: a command is encoded completely before it takes a reply
slot; a reply nobody waits for, a malformed reply, or a reply larger than the bound ends the connection and fails
only the commands that were waiting on it; the next command opens a new connection.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis

from .redis_target import RedisTarget, parse_store_url

Reply = bytes | int | list[Any] | None
Command = tuple[str | bytes | int, ...]

DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
_TRYAGAIN_S = 0.05


class RespError(Exception):
    """An error reply (-ERR ...) or a connection that failed; the message says which."""


class _Protocol(asyncio.Protocol):
    """Feeds bytes to hiredis and resolves the oldest waiting future with each complete reply."""

    def __init__(self, max_reply_bytes: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._reader = hiredis.Reader(replyError=RespError)
        self._max_reply_bytes = max_reply_bytes
        self._unanswered_bytes = 0
        """Bytes received since the last complete reply: what one reply in progress holds, give or take a read."""
        self.broken: str | None = None
        self.address: tuple[str, int] | None = None
        """The node it talks to (None on a Unix socket)."""
        self.retiring = False
        """Takes no new commands (its node no longer holds the proxy's slot); closed once its replies are in."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.broken is not None:
            return
        self._reader.feed(data)
        self._unanswered_bytes += len(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(f"Redis sent a malformed reply ({exc})")
                return
            if reply is False:
                break
            self._unanswered_bytes = 0
            if not self.waiting:
                # A reply to no command: from here on, every reply would answer the wrong caller.
                self.fail("Redis sent a reply that no command asked for")
                return
            future = self.waiting.popleft()
            if future.done():
                continue  # its caller was cancelled; the reply still had to be consumed, in order
            if isinstance(reply, RespError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
        if self.retiring and not self.waiting and self.transport is not None:
            self.transport.close()
        if self._unanswered_bytes > self._max_reply_bytes:
            self.fail(f"a Redis reply exceeds {self._max_reply_bytes} bytes")

    def retire(self) -> None:
        self.retiring = True
        if not self.waiting and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail("the connection to Redis was lost")

    def fail(self, reason: str) -> None:
        self.broken = self.broken or reason
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(RespError(reason))
        if self.transport is not None:
            self.transport.close()


def encode(commands: list[Command]) -> bytes:
    """The RESP request for `commands`; ValueError (before anything is sent) for an argument that cannot go."""
    out: list[bytes] = []
    for args in commands:
        if not args:
            raise ValueError("an empty Redis command")
        out.append(b"*%d\r\n" % len(args))
        for arg in args:
            if isinstance(arg, bytes):
                data = arg
            elif isinstance(arg, str):
                try:
                    data = arg.encode()  # strict: a lone surrogate is refused here, not half-way through a write
                except UnicodeEncodeError as exc:
                    raise ValueError("a Redis command argument is not valid Unicode text") from exc
            elif isinstance(arg, int) and not isinstance(arg, bool):
                data = b"%d" % arg
            else:
                raise ValueError(f"a Redis command argument of type {type(arg).__name__}")
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RespClient:
    """One shared, lazily (re)connected connection to the Redis that `url` names (redis_target.py), or to the
    address `address()` gives at each connection (a Sentinel's master)."""

    def __init__(
        self,
        url: str | RedisTarget,
        *,
        timeout_s: float,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        address: Callable[[], Awaitable[tuple[str, int]]] | None = None,
    ) -> None:
        target = url if isinstance(url, RedisTarget) else parse_store_url(url)
        self._path = target.path
        self._host, self._port = target.hosts[0]
        self._address = address
        self._ssl = (ssl_context or ssl.create_default_context()) if target.tls else None
        hello: list[Command] = []
        if target.password is not None:
            user = target.username
            hello.append(("AUTH", user, target.password) if user else ("AUTH", target.password))
        if target.db:
            hello.append(("SELECT", target.db))
        self._hello = hello
        self._timeout_s = timeout_s
        self._max_reply_bytes = max_reply_bytes
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()
        self._moved_to: tuple[str, int] | None = None
        """Redis Cluster: the node a MOVED reply named for the proxy's slot, until a connection to it fails or it
        does not answer in time."""

    async def _connection(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.broken is None and not protocol.retiring:
            return protocol
        async with self._connecting:
            if self._protocol is None or self._protocol.broken is not None or self._protocol.retiring:
                self._protocol = await self._connect()
            return self._protocol

    async def _connect(self, address: tuple[str, int] | None = None) -> _Protocol:
        loop = asyncio.get_running_loop()

        def factory() -> _Protocol:
            return _Protocol(self._max_reply_bytes)

        if self._path is not None:
            _, protocol = await loop.create_unix_connection(factory, self._path)
        else:
            if address is None:
                address = self._moved_to or (
                    (self._host, self._port) if self._address is None else await self._address()
                )
            host, port = address
            try:
                _, protocol = await loop.create_connection(
                    factory, host, port, ssl=self._ssl, server_hostname=host if self._ssl else None
                )
            except (OSError, ValueError) as exc:
                if address == self._moved_to:
                    self._moved_to = None  # that node is gone too: the cluster's layout is asked again
                if isinstance(exc, ValueError):  # a host no resolver takes (UnicodeError: a label over 63 bytes)
                    raise RespError(f"cannot connect to Redis (an address that cannot be resolved: {exc})") from exc
                raise
            protocol.address = address
        if self._hello:
            try:
                await self._send(protocol, self._hello, encode(self._hello))
            except BaseException:
                # A refused AUTH or SELECT (or a timeout) must not leave the socket behind.
                protocol.fail("Redis refused the connection's AUTH or SELECT")
                raise
        return protocol

    async def execute(self, *args: str | bytes | int) -> Reply:
        return (await self.pipeline([args]))[0]

    async def pipeline(self, commands: list[Command]) -> list[Reply]:
        """Send the commands in one write; their replies in order. An error reply raises RespError.

        One write keeps a MULTI ... EXEC block contiguous on the shared connection, so it stays atomic. With Redis
        Cluster, a MOVED reply (the proxy's slot lives on another node now; nothing was done) sends the commands
        again there and the connection follows; an ASK reply (the slot is being migrated, and the key is already on
        the other node) sends them there, each after ASKING, on a connection of their own; TRYAGAIN (a script whose
        keys are split between the two nodes meanwhile: nothing was done) sends them again after a moment. While
        a migration ends, the nodes disagree for a moment about who holds the slot and MOVED may bounce between
        them: redirections are followed, with a pause when one comes back to a node already tried, and the whole
        call, every attempt included, stays within the timeout.
        """
        request = encode(commands)  # before any connection or reply slot is involved
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        asked: tuple[str, int] | None = None
        named: set[tuple[str, int]] = set()
        judges = True
        while True:
            try:
                if asked is not None:
                    return await self._asking(asked, commands, deadline)
                return await self._pipeline(commands, request, deadline, judges)
            except RespError as exc:
                redirect = _redirect(exc, self._host)
                if redirect is None and not str(exc).startswith("TRYAGAIN"):
                    raise
                # TRYAGAIN, or a redirection back to a node this call was sent to already (two nodes bouncing it
                # while a migration ends), waits a moment; any other redirection goes at once.
                pause = redirect is None or redirect[1] in named
                if loop.time() + (_TRYAGAIN_S if pause else 0) >= deadline:
                    raise
            asked = None
            if redirect is not None:
                kind, address = redirect
                named.add(address)
                if kind == "ASK":
                    asked = address
                else:
                    self._moved_to = address
                    if self._protocol is not None and self._protocol.address != address:
                        # The replies it still owes (MOVED too) reach their callers first. A MOVED to the node the
                        # connection already follows (a concurrent command's, sent before it moved) leaves it be.
                        self._protocol.retire()
            if pause:
                await asyncio.sleep(_TRYAGAIN_S)
            # A connection is judged stuck only by an attempt that gave it at least half the timeout: a redirected
            # command's last few milliseconds must not end the connection every other caller shares.
            judges = deadline - loop.time() >= self._timeout_s / 2

    async def _asking(self, address: tuple[str, int], commands: list[Command], deadline: float) -> list[Reply]:
        asked: list[Command] = [part for command in commands for part in (("ASKING",), command)]
        async with asyncio.timeout_at(deadline):
            protocol = await self._connect(address)
            try:
                replies = await self._send(protocol, asked, encode(asked))
            finally:
                protocol.fail("the connection for an ASK redirection is done")
        return replies[1::2]

    async def _pipeline(self, commands: list[Command], request: bytes, deadline: float, judges: bool) -> list[Reply]:
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout_at(deadline):
                protocol = await self._connection()
                return await self._send(protocol, commands, request)
        except TimeoutError:
            # A node MOVED named that does not answer (or one not reached in time) is not followed again: the next
            # connection goes to the cluster's seed (or the Sentinel's master), which says where to go.
            abandoned = protocol is not None and self._moved_to is not None and protocol.address == self._moved_to
            if protocol is None or abandoned:
                self._moved_to = None
            if protocol is not None and (judges or abandoned):
                protocol.fail(f"Redis did not answer within {self._timeout_s:g} s")  # reconnect next time
            raise
        except OSError as exc:
            raise RespError(f"cannot connect to Redis ({exc.strerror or exc})") from exc

    def reset(self, reason: str) -> None:
        """Drop the connection (the store saw a reply that cannot be right); waiting commands fail with `reason`."""
        if self._protocol is not None:
            self._protocol.fail(reason)

    async def _send(self, protocol: _Protocol, commands: list[Command], request: bytes) -> list[Reply]:
        if protocol.broken is not None or protocol.transport is None:
            raise RespError(protocol.broken or "the connection to Redis is not open")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        protocol.waiting.extend(futures)
        protocol.transport.write(request)
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
        if self._protocol is not None:
            self._protocol.fail("the client was closed")
            self._protocol = None


def _redirect(error: RespError, default_host: str) -> tuple[str, tuple[str, int]] | None:
    """("MOVED" or "ASK", (host, port)) of a Redis Cluster redirection; None for any other error."""
    parts = str(error).split()
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    if not port.isdigit():
        return None
    return parts[0], (host.strip("[]") or default_host, int(port))
