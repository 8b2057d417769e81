"""A deliberately fast 2026-07-28 MCP server over stdio for benchmarks: bench/fast_upstream.py's tools, on stdin/stdout.

One JSON-RPC message per line each way (stdlib only). Requests are answered as they are read, so a held one blocks
nothing: `plain` and `echo` answer at once; `hold` answers when a tools/call of `release` arrives (for many
concurrently working tasks on one child); `ask` asks for input (MRTR) until its retry carries an answer. It also
answers a legacy `initialize`, for a proxy told `upstream.protocol: legacy`. Notifications are ignored (a cancelled
`hold` stays held until the next release).
Run: the proxy starts it (upstream.command: [python, bench/fast_stdio.py]).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys

TOOLS = ("plain", "echo", "hold", "ask", "release")
OK = {"resultType": "complete", "content": [{"type": "text", "text": "ok"}], "isError": False}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
ASK = {
    "resultType": "input_required",
    "inputRequests": {"q": {"method": "elicitation/create",
                            "params": {"mode": "form", "message": "?", "requestedSchema": _SCHEMA}}},
    "requestState": "s",
}  # fmt: skip


class Server:
    def __init__(self, out: asyncio.WriteTransport) -> None:
        self.out = out
        self.held: list[object] = []

    def send(self, message_id: object, result: dict) -> None:
        self.out.write(json.dumps({"jsonrpc": "2.0", "id": message_id, "result": result}).encode() + b"\n")

    def handle(self, message: dict) -> None:
        method = message.get("method")
        if method is None or "id" not in message:
            return  # notifications (notifications/initialized, notifications/cancelled), or a stray response
        message_id = message["id"]
        params = message.get("params") or {}
        if method == "initialize":
            self.send(message_id, {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                                   "serverInfo": {"name": "fast-stdio"}})  # fmt: skip
        elif method == "server/discover":
            self.send(message_id, {"resultType": "complete", "supportedVersions": ["2026-07-28"],
                                   "capabilities": {"tools": {}}})  # fmt: skip
        elif method == "tools/list":
            tools = [{"name": name, "inputSchema": {"type": "object"}} for name in TOOLS]
            self.send(message_id, {"resultType": "complete", "tools": tools})
        elif method == "tools/call":
            name = params.get("name")
            if name == "hold":
                self.held.append(message_id)
            elif name == "release":
                held, self.held = self.held, []
                for held_id in held:
                    self.send(held_id, OK)
                self.send(message_id, OK)
            elif name == "ask" and not params.get("inputResponses"):
                self.send(message_id, ASK)
            else:
                self.send(message_id, OK)
        else:
            error = {"code": -32601, "message": f"method not found: {method}"}
            self.out.write(json.dumps({"jsonrpc": "2.0", "id": message_id, "error": error}).encode() + b"\n")


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, sys.stdout.buffer)
    server = Server(transport)
    while line := await reader.readline():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict):
            server.handle(message)
    transport.close()  # stdin closed: the proxy is stopping us


def main() -> None:
    for stream in (sys.stdin, sys.stdout):  # pipe transports take pipes only (uvloop aborts on a file)
        mode = os.fstat(stream.fileno()).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise SystemExit("fast_stdio.py speaks over pipes: the proxy starts it (or: ... | fast_stdio.py | cat)")
    try:  # fast, so that the proxy's cost is what the figures show
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    loop.run_until_complete(serve())


if __name__ == "__main__":
    main()
