"""The upstream for the official conformance suite's tasks-* scenarios, legacy edition: a 2025-11-25 server, NO tasks.

Built with the official SDK's 1.x line (`mcp<2`, FastMCP, Streamable HTTP), so it runs in the legacy environment
the tests build (tests/.legacy-venv). It has the same fixture tools as fixture_server.py beside it, with the same
names, arguments and answers; where that one asks for input with an MRTR `InputRequiredResult`, this one sends a
real `elicitation/create` on the call's stream and waits for the answer. Every task the suite sees is made by the
proxy in front of it, from `policy.yaml` beside this file.
Run: tests/.legacy-venv/bin/python tests/conformance/legacy_fixture_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys

from mcp.server.fastmcp import Context, FastMCP
from mcp.shared.exceptions import McpError
from mcp.types import CallToolRequest, CallToolResult, ErrorData, ServerResult, TextContent

server = FastMCP("conformance-fixture-legacy", log_level="WARNING")


async def _ask(ctx: Context, message: str, field: str) -> dict | None:
    """One form elicitation on the call's stream; the content if accepted, else None (as `_answer` there).

    The request is the one `ctx.elicit` sends (same message, the modern fixture's schema, tied to this call), but
    the answer is read as sent, like the modern fixture reads `inputResponses`: `ctx.elicit` validates the content
    against a Pydantic model and raises on a mismatch, and the suite answers `{"confirm": true}` to a string field
    and `{"name", "confirm"}` to `first_name` / `last_name`. Raising there would end multi_input at its first
    answer, with the second question still pending, where the modern fixture waits for both.
    """
    schema = {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}
    result = await ctx.session.elicit_form(message=message, requestedSchema=schema, related_request_id=ctx.request_id)
    if result.action != "accept":
        return None
    return dict(result.content or {})


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


_PROTOCOL_ERROR = ErrorData(code=-32603, message="protocol_error_job always fails at the protocol level")


@server.tool()
async def protocol_error_job() -> str:
    """Fail with a JSON-RPC error."""
    # Never reached: FastMCP 1.x turns whatever a tool raises (McpError included) into an isError result, so the
    # JSON-RPC error comes from the request handler below, as the modern fixture's MCPError does.
    raise McpError(_PROTOCOL_ERROR)


_call_tool = server._mcp_server.request_handlers[CallToolRequest]


async def _call_tool_or_protocol_error(request: CallToolRequest) -> ServerResult:
    # Only an McpError that leaves the request handler becomes a JSON-RPC error response in the 1.x server.
    if request.params.name == "protocol_error_job":
        raise McpError(_PROTOCOL_ERROR)
    return await _call_tool(request)


server._mcp_server.request_handlers[CallToolRequest] = _call_tool_or_protocol_error


@server.tool()
async def confirm_delete(filename: str, ctx: Context) -> CallToolResult:
    """Ask for confirmation (one elicitation), then delete."""
    answer = await _ask(ctx, f"Delete {filename}?", "confirm")
    verdict = "deleted" if answer is not None else "kept"
    return CallToolResult(content=[TextContent(type="text", text=f"{filename} {verdict}")])


@server.tool()
async def multi_input(ctx: Context) -> CallToolResult:
    """Ask two questions at once, then answer with both."""
    # Both elicitations are pending together (two keys in the task's inputRequests); what is not accepted is asked
    # again, as the modern fixture asks again for what its round did not get.
    questions = {"first_name": "First name?", "last_name": "Last name?"}
    answers: dict[str, dict | None] = dict.fromkeys(questions)
    while pending := [field for field, answer in answers.items() if answer is None]:
        asked = await asyncio.gather(*(_ask(ctx, questions[field], field) for field in pending))
        answers.update(zip(pending, asked, strict=True))
    first, second = answers["first_name"], answers["last_name"]
    return CallToolResult(
        content=[TextContent(type="text", text=f"Hello, {first['first_name']} {second['last_name']}")]
    )


@server.tool()
async def test_tool_with_task(ctx: Context) -> CallToolResult:
    """Round 1 asks for user_name; round 2 works long enough to become a task, then greets by name."""
    # One legacy call does both rounds: the elicitation is round 1, and the call goes on after the answer.
    answer = None
    while answer is None:
        answer = await _ask(ctx, "Your name?", "name")
    await asyncio.sleep(3)
    return CallToolResult(content=[TextContent(type="text", text=f"Hello, {answer.get('name', '')}!")])


if __name__ == "__main__":
    if sys.argv[1] == "--stdio":  # the same tools over stdio, for a proxy that starts it (upstream.command)
        server.run(transport="stdio")
    else:
        server.settings.host = "127.0.0.1"
        server.settings.port = int(sys.argv[1])
        server.run(transport="streamable-http")
