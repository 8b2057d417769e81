"""The real upstream for end-to-end tests: the example server plus tools that let tests observe the upstream side.

Built with the official SDK (`mcp` 2.x, 2026-07-28); it implements no tasks. Run: python tests/upstream_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from mcp.server.mcpserver import Context  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from slow_server import server  # noqa: E402

_gates: dict[str, asyncio.Event] = {}
_states: dict[str, str] = {}


def _gate(tag: str) -> asyncio.Event:
    return _gates.setdefault(tag, asyncio.Event())


@server.tool()
async def gated(tag: str, ctx: Context) -> str:
    """Report progress, then wait until release(tag) is called; records whether it was cancelled instead."""
    _states[tag] = "started"
    await ctx.report_progress(1, 2, f"waiting at gate {tag}")
    try:
        await _gate(tag).wait()
    except asyncio.CancelledError:
        _states[tag] = "cancelled"
        raise
    _states[tag] = "released"
    return f"gate {tag} opened"


@server.tool()
async def release(tag: str) -> str:
    """Open the gate a gated call waits at."""
    _gate(tag).set()
    return "released"


@server.tool()
async def gate_state(tag: str) -> str:
    """What happened to the gated call with this tag: unknown, started, cancelled or released."""
    return _states.get(tag, "unknown")


@server.tool()
async def protocol_error_job() -> str:
    """Fail with a JSON-RPC error rather than a tool error."""
    raise MCPError(code=-32602, message="the job's parameters were rejected", data={"field": "none"})


@server.tool()
async def echo_authorization(ctx: Context) -> str:
    """Return the Authorization header this call arrived with (to prove the proxy forwards credentials)."""
    headers = ctx.headers or {}
    return headers.get("authorization", "<none>")


if __name__ == "__main__":
    server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
