"""The upstream for the official conformance suite's tasks-* scenarios: a 2026-07-28 server with NO tasks.

Built with the official SDK (`mcp` 2.x). It has the fixture tools the scenarios call, each as a plain
synchronous tool (input through MRTR `InputRequiredResult`); every task the suite sees is made by the proxy in
front of it, from `policy.yaml` beside this file. Run: python tests/conformance/fixture_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ElicitRequest, ElicitRequestFormParams, InputRequiredResult, TextContent

server = MCPServer("conformance-fixture", log_level="WARNING")


def _ask(message: str, field: str) -> ElicitRequest:
    schema = {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}
    return ElicitRequest(params=ElicitRequestFormParams(message=message, requested_schema=schema))


def _answer(ctx: Context, key: str) -> dict | None:
    responses = ctx.input_responses or {}
    response = responses.get(key)
    if response is None or getattr(response, "action", None) != "accept":
        return None
    return dict(response.content or {})


@server.tool()
async def greet(name: str) -> str:
    """Say hello at once."""
    return f"Hello, {name}!"


@server.tool()
async def slow_compute(seconds: float = 1.0, label: str = "") -> str:
    """Sleep for `seconds`, then answer."""
    await asyncio.sleep(seconds)
    return f"computed {label} after {seconds:g} s"


@server.tool()
async def failing_job() -> str:
    """Fail as a tool (isError: true) after about a second."""
    await asyncio.sleep(1)
    raise ValueError("the job failed")


@server.tool()
async def protocol_error_job() -> str:
    """Fail with a JSON-RPC error."""
    raise MCPError(code=-32603, message="protocol_error_job always fails at the protocol level")


@server.tool()
async def confirm_delete(filename: str, ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask for confirmation (one elicitation), then delete."""
    answer = _answer(ctx, "confirm")
    if answer is None and ctx.input_responses is None:
        return InputRequiredResult(
            input_requests={"confirm": _ask(f"Delete {filename}?", "confirm")}, request_state="confirm-round-1"
        )
    verdict = "deleted" if answer is not None else "kept"
    return CallToolResult(content=[TextContent(text=f"{filename} {verdict}")])


@server.tool()
async def multi_input(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask two questions at once, then answer with both."""
    first, second = _answer(ctx, "first_name"), _answer(ctx, "last_name")
    if first is None or second is None:
        requests = {}
        if first is None:
            requests["first_name"] = _ask("First name?", "first_name")
        if second is None:
            requests["last_name"] = _ask("Last name?", "last_name")
        return InputRequiredResult(input_requests=requests, request_state="multi-input")
    return CallToolResult(content=[TextContent(text=f"Hello, {first['first_name']} {second['last_name']}")])


@server.tool()
async def test_tool_with_task(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Round 1 asks for user_name; round 2 works long enough to become a task, then greets by name."""
    answer = _answer(ctx, "user_name")
    if answer is None:
        return InputRequiredResult(input_requests={"user_name": _ask("Your name?", "name")}, request_state="ask-name")
    await asyncio.sleep(3)
    return CallToolResult(content=[TextContent(text=f"Hello, {answer.get('name', '')}!")])


if __name__ == "__main__":
    if sys.argv[1] == "--stdio":  # the same tools over stdio, for a proxy that starts it (upstream.command)
        server.run(transport="stdio")
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
