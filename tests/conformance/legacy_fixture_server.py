"""The upstream for the official conformance suite's tasks-* and input-required-result-* scenarios, legacy edition:
a 2025-11-25 server, NO tasks.

Built with the official SDK's 1.x line (`mcp<2`, FastMCP, Streamable HTTP), so it runs in the legacy environment
the tests build (tests/.legacy-venv). It has the same fixture tools (and prompt) as fixture_server.py beside it, with
the same names, arguments and answers; where that one asks for input with an MRTR `InputRequiredResult`, this one
sends a real `elicitation/create` (or `sampling/createMessage`, `roots/list`) on the call's stream and waits for the
answer. Every task the suite sees is made by the proxy in front of it, from `policy.yaml` beside this file.
Run: tests/.legacy-venv/bin/python tests/conformance/legacy_fixture_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys

from mcp.server.fastmcp import Context, FastMCP
from mcp.server.fastmcp.prompts.base import Message, UserMessage
from mcp.shared.exceptions import McpError
from mcp.shared.message import ServerMessageMetadata
from mcp.types import (
    CallToolRequest,
    CallToolResult,
    ClientCapabilities,
    ElicitationCapability,
    ErrorData,
    ListRootsRequest,
    ListRootsResult,
    SamplingCapability,
    SamplingMessage,
    ServerRequest,
    ServerResult,
    TextContent,
)

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


# --- the input-required-result-* scenarios (SEP-2322), tests/test_conformance_mrtr.py ------------------------------
# The same tools (and prompt) as the modern fixture's, asking the same things the 2025 way: each question is a request
# of the server's on the call's stream, and the call waits for its answer, so the server's state between rounds is
# the call itself. The keys of the rounds the suite sees, and their requestState, are the proxy's (a handle to the
# parked call), which is what the request-state and tampered-state scenarios check here.


async def _form(ctx: Context, message: str, schema: dict) -> dict | None:
    """One form elicitation tied to the call; the content if accepted (read as sent, as in `_ask`), else None."""
    result = await ctx.session.elicit_form(message=message, requestedSchema=schema, related_request_id=ctx.request_id)
    return dict(result.content or {}) if result.action == "accept" else None


def _string(field: str) -> dict:
    return {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}


async def _sample(ctx: Context, text: str, max_tokens: int) -> str:
    message = SamplingMessage(role="user", content=TextContent(type="text", text=text))
    result = await ctx.session.create_message([message], max_tokens=max_tokens, related_request_id=ctx.request_id)
    return result.content.text if isinstance(result.content, TextContent) else ""


async def _roots(ctx: Context) -> list[str]:
    # Tied to the call, as ctx.session.list_roots() cannot be (1.x sends it on the session's standalone stream,
    # where the proxy can tell its call only while the session has no other call in flight).
    result = await ctx.session.send_request(
        ServerRequest(ListRootsRequest()),
        ListRootsResult,
        metadata=ServerMessageMetadata(related_request_id=ctx.request_id),
    )
    return [str(root.uri) for root in result.roots]


def _done(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)])


@server.tool()
async def test_input_required_result_elicitation(ctx: Context) -> CallToolResult:
    """One question (A1; also missing-input-response, result-type, ignore-extra-params, validate-input)."""
    answer = await _form(ctx, "What is your name?", _string("name"))
    return _done(f"Hello, {(answer or {}).get('name', 'stranger')}!")


@server.tool()
async def test_input_required_result_sampling(ctx: Context) -> CallToolResult:
    return _done(await _sample(ctx, "What is the capital of France?", 100))


@server.tool()
async def test_input_required_result_list_roots(ctx: Context) -> CallToolResult:
    return _done("roots: " + ", ".join(await _roots(ctx)))


_CONFIRM = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@server.tool()
async def test_input_required_result_request_state(ctx: Context) -> CallToolResult:
    """The answer comes back to the very call that asked: that is a 2025 server's "state-ok"."""
    answer = await _form(ctx, "Please confirm", _CONFIRM)
    return _done("state-ok" if answer is not None else "not confirmed")


@server.tool()
async def test_input_required_result_multiple_inputs(ctx: Context) -> CallToolResult:
    """Three questions of three kinds at once: the proxy gathers them into one round."""
    name, greeting, roots = await asyncio.gather(
        _form(ctx, "What is your name?", _string("name")),
        _sample(ctx, "Generate a greeting", 50),
        _roots(ctx),
    )
    return _done(f"{greeting} {(name or {}).get('name', '')} ({len(roots)} roots)")


@server.tool()
async def test_input_required_result_multi_round(ctx: Context) -> CallToolResult:
    """Two questions one after the other: two rounds, each with its own requestState (the proxy's)."""
    name = await _form(ctx, "Step 1: What is your name?", _string("name"))
    color = await _form(ctx, "Step 2: What is your favorite color?", _string("color"))
    return _done(f"{(name or {}).get('name', '')} likes {(color or {}).get('color', '')}")


@server.tool()
async def test_input_required_result_tampered_state(ctx: Context) -> CallToolResult:
    """The state a client could tamper with is the proxy's handle; this server never sees it."""
    answer = await _form(ctx, "Please confirm", _CONFIRM)
    return _done("confirmed" if answer is not None else "not confirmed")


@server.tool()
async def test_input_required_result_capabilities(ctx: Context) -> CallToolResult:
    """Asks what the session's client declared. The proxy declares all for its session, and declines itself what
    this request's client did not declare: the client sees only the rest."""
    asks = []
    if ctx.session.check_client_capability(ClientCapabilities(elicitation=ElicitationCapability())):
        asks.append(_form(ctx, "What is your name?", _string("name")))
    if ctx.session.check_client_capability(ClientCapabilities(sampling=SamplingCapability())):
        asks.append(_sample(ctx, "What is the capital of France?", 100))
    answers = await asyncio.gather(*asks)
    return _done(f"{len(answers)} answers")


@server.prompt()
async def test_input_required_result_prompt(ctx: Context) -> list[Message]:
    """A prompt built from the context the client gives when asked."""
    # Asked on prompts/get's own stream: the proxy makes it an MRTR round of prompts/get.
    answer = await _form(ctx, "What context should the prompt use?", _string("context"))
    return [UserMessage(f"Answer with this context: {(answer or {}).get('context', '')}")]


if __name__ == "__main__":
    if sys.argv[1] == "--stdio":  # the same tools over stdio, for a proxy that starts it (upstream.command)
        server.run(transport="stdio")
    else:
        server.settings.host = "127.0.0.1"
        server.settings.port = int(sys.argv[1])
        server.run(transport="streamable-http")
