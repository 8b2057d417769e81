"""A plain round-robin HTTP balancer for tests: each request to the next backend in turn, no affinity of any kind,
the answer (event streams included) relayed as it comes. Records which backend took each request."""

from __future__ import annotations

import itertools

import aiohttp
from aiohttp import web

_SKIP = {"host", "content-length", "transfer-encoding", "connection"}


class RoundRobin:
    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self.hits: list[tuple[int, str, int]] = []
        """(backend index, HTTP method, status) of every request."""
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, port: int) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        # A client that leaves ends its relay, as it does in nginx: else an event stream nobody reads any more (a
        # session's GET stream) stays open to its backend, and the stop waits for it.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self._client = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        return f"http://127.0.0.1:{port}/mcp"

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        body = await request.read() if request.can_read_body else None
        # A backend that refuses the connection, or does not accept it in time, got nothing: the next one takes the
        # request, as nginx's default proxy_next_upstream (error timeout) does, and as health checks soon would.
        for _ in self.backends:
            index = next(self._next)
            try:
                answer = await self._client.request(
                    request.method, self.backends[index] + request.path_qs, headers=headers, data=body
                )
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                continue
        else:
            return web.Response(status=502)
        async with answer:
            self.hits.append((index, request.method, answer.status))
            response = web.StreamResponse(
                status=answer.status, headers={k: v for k, v in answer.headers.items() if k.lower() not in _SKIP}
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()
