"""A deliberately fast 2026-07-28 upstream for benchmarks: every answer is immediate and tiny.

Tools: `echo` answers at once; `hold` answers when POST /release is called (for many concurrently working tasks);
`ask` asks for input (MRTR) until its retry carries an answer. It also answers a legacy `initialize` (with a
session id), so that a proxy told `upstream.protocol: legacy` can use it as a 2025-11-25 server for `hold`.
Run: python bench/fast_upstream.py PORT
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

_released = asyncio.Event()


def _result(message_id, result: dict) -> web.Response:
    body = json.dumps({"jsonrpc": "2.0", "id": message_id, "result": {"resultType": "complete", **result}})
    return web.Response(body=body.encode(), content_type="application/json")


async def mcp(request: web.Request) -> web.Response:
    message = await request.json()
    method = message.get("method")
    params = message.get("params") or {}
    if method == "initialize":
        result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}}, "serverInfo": {"name": "fast"}}
        body = {"jsonrpc": "2.0", "id": message["id"], "result": result}
        return web.json_response(body, headers={"Mcp-Session-Id": "bench-session"})
    if method is not None and "id" not in message:
        return web.Response(status=202)  # notifications (notifications/initialized)
    if method == "server/discover":
        return _result(message["id"], {"supportedVersions": ["2026-07-28"], "capabilities": {"tools": {}}})
    if method == "tools/list":
        return _result(
            message["id"], {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in ("echo", "hold", "ask")]}
        )
    if method == "tools/call":
        name = params.get("name")
        if name == "hold":
            await _released.wait()
        if name == "ask" and not params.get("inputResponses"):
            schema = {"type": "object", "properties": {"a": {"type": "string"}}}
            ask = {
                "method": "elicitation/create",
                "params": {"mode": "form", "message": "?", "requestedSchema": schema},
            }
            result = {"resultType": "input_required", "inputRequests": {"q": ask}, "requestState": "s"}
            body = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            return web.Response(body=json.dumps(body).encode(), content_type="application/json")
        return _result(message["id"], {"content": [{"type": "text", "text": "ok"}], "isError": False})
    return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "error": {"code": -32601, "message": "no"}})


async def release(request: web.Request) -> web.Response:
    """Answer every `hold` call waiting now; later ones wait for the next release."""
    global _released
    waiting, _released = _released, asyncio.Event()
    waiting.set()
    return web.Response(text="released")


def main() -> None:
    app = web.Application()
    app.router.add_post("/mcp", mcp)
    app.router.add_post("/release", release)
    try:  # fast, so that the proxy's cost is what the figures show
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None, backlog=4096, loop=loop)


if __name__ == "__main__":
    main()
