"""A TCP middlebox that cuts connections the way real infrastructure does: a load balancer's idle timeout (no byte
either way for `idle_s`), or a gateway's limit on how long one connection may stay open (`max_open_s`), enforced as
gateways do at a quiet moment (nginx's keepalive_time, Envoy's max_connection_duration: between two exchanges, or
in a silence of a long response), not in the middle of a request's few milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import time

QUIET_S = 0.1
"""No byte either way for this long: between exchanges, or a pause in a long response, where a connection past
max_open_s is cut."""


class Middlebox:
    def __init__(self, target_port: int, *, idle_s: float | None = None, max_open_s: float | None = None) -> None:
        self.target_port = target_port
        self.idle_s = idle_s
        self.max_open_s = max_open_s
        self.cuts = 0
        """Connections this middlebox cut."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            self._tasks.discard(task)
            return
        opened = last = time.monotonic()

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal last
            while data := await reader.read(65536):
                last = time.monotonic()
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        pumps = [
            asyncio.ensure_future(pump(client_reader, server_writer)),
            asyncio.ensure_future(pump(server_reader, client_writer)),
        ]
        try:
            while not all(p.done() for p in pumps):
                await asyncio.wait(pumps, timeout=0.05, return_when=asyncio.ALL_COMPLETED)
                now = time.monotonic()
                if (self.idle_s is not None and now - last > self.idle_s) or (
                    self.max_open_s is not None and now - opened > self.max_open_s and now - last > QUIET_S
                ):
                    self.cuts += 1
                    break
        except asyncio.CancelledError:
            pass
        finally:
            for p in pumps:
                p.cancel()
            for writer in (client_writer, server_writer):
                with contextlib.suppress(Exception):
                    writer.transport.abort()  # a reset, as a load balancer's cut looks to both ends
            self._tasks.discard(task)
