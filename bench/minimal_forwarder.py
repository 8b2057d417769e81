"""The floor of one aiohttp hop, for comparison: read the request, POST it upstream, return the answer. Nothing else.

Run: python bench/minimal_forwarder.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web


async def forward(request: web.Request) -> web.Response:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length", "connection")}
    async with request.app["session"].post(request.app["upstream"], data=body, headers=headers) as response:
        payload = await response.read()
        return web.Response(body=payload, status=response.status, content_type=response.content_type)


async def session_ctx(app: web.Application):
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app["session"].close()


def main() -> None:
    app = web.Application()
    app["upstream"] = sys.argv[2]
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/mcp", forward)
    try:  # the same event loop as the proxy, so that the comparison is of the code, not of the loop
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
