"""The upstream for the official conformance suite's tasks-* and input-required-result-* scenarios: a 2026-07-28
server with NO tasks.

Built with the official SDK (`mcp` 2.x). It has the fixture tools (and prompt) the scenarios call, each as a plain
synchronous tool (input through MRTR `InputRequiredResult`); every task the suite sees is made by the proxy in
front of it, from `policy.yaml` beside this file. Run: python tests/conformance/fixture_server.py PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.prompts.base import Message, UserMessage
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolResult,
    CreateMessageRequest,
    CreateMessageRequestParams,
    CreateMessageResult,
    ElicitRequest,
    ElicitRequestFormParams,
    ElicitResult,
    InputRequiredResult,
    ListRootsRequest,
    ListRootsResult,
    SamplingMessage,
    TextContent,
)

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


# --- the input-required-result-* scenarios (SEP-2322), tests/test_conformance_mrtr.py ------------------------------
# Their tools ask exactly what each scenario's description in the suite asks, under its keys. The SDK seals every
# requestState a tool returns and refuses an echo it did not seal (-32602), so the plaintext here is the server's own.

_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"


def _elicit(message: str, schema: dict) -> ElicitRequest:
    return ElicitRequest(params=ElicitRequestFormParams(message=message, requested_schema=schema))


def _string(field: str) -> dict:
    return {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}


def _sample(text: str, max_tokens: int) -> CreateMessageRequest:
    message = SamplingMessage(role="user", content=TextContent(text=text))
    return CreateMessageRequest(params=CreateMessageRequestParams(messages=[message], max_tokens=max_tokens))


def _response(ctx: Context, key: str, kind: type) -> Any:
    """The client's answer under `key` when it is of the kind asked (an accepted form, a sampled message, roots);
    anything else counts as not answered, and is asked again (SEP-2322: re-request what is missing)."""
    response = (ctx.input_responses or {}).get(key)
    if not isinstance(response, kind) or (isinstance(response, ElicitResult) and response.action != "accept"):
        return None
    return response


def _text(result: CreateMessageResult) -> str:
    content = result.content
    return content.text if isinstance(content, TextContent) else ""


def _done(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=text)])


@server.tool()
async def test_input_required_result_elicitation(ctx: Context) -> CallToolResult | InputRequiredResult:
    """One question (A1; also missing-input-response, result-type, ignore-extra-params, validate-input)."""
    answer = _response(ctx, "user_name", ElicitResult)
    if answer is None:
        return InputRequiredResult(input_requests={"user_name": _elicit("What is your name?", _string("name"))})
    return _done(f"Hello, {(answer.content or {}).get('name', '')}!")


@server.tool()
async def test_input_required_result_sampling(ctx: Context) -> CallToolResult | InputRequiredResult:
    answer = _response(ctx, "capital_question", CreateMessageResult)
    if answer is None:
        question = _sample("What is the capital of France?", 100)
        return InputRequiredResult(input_requests={"capital_question": question})
    return _done(_text(answer))


@server.tool()
async def test_input_required_result_list_roots(ctx: Context) -> CallToolResult | InputRequiredResult:
    answer = _response(ctx, "client_roots", ListRootsResult)
    if answer is None:
        return InputRequiredResult(input_requests={"client_roots": ListRootsRequest()})
    return _done("roots: " + ", ".join(str(root.uri) for root in answer.roots))


_CONFIRM = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@server.tool()
async def test_input_required_result_request_state(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Round 2 must come with the state round 1 gave: "state-ok" says it did."""
    answer = _response(ctx, "confirm", ElicitResult)
    if answer is None or ctx.request_state != "awaiting-confirmation":
        return InputRequiredResult(
            input_requests={"confirm": _elicit("Please confirm", _CONFIRM)}, request_state="awaiting-confirmation"
        )
    return _done("state-ok")


@server.tool()
async def test_input_required_result_multiple_inputs(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Three questions of three kinds in one round; what is not answered is asked again."""
    name = _response(ctx, "user_name", ElicitResult)
    greeting = _response(ctx, "greeting", CreateMessageResult)
    roots = _response(ctx, "client_roots", ListRootsResult)
    asks = {
        "user_name": (name, lambda: _elicit("What is your name?", _string("name"))),
        "greeting": (greeting, lambda: _sample("Generate a greeting", 50)),
        "client_roots": (roots, ListRootsRequest),
    }
    missing = {key: ask() for key, (answer, ask) in asks.items() if answer is None}
    if missing:
        return InputRequiredResult(input_requests=missing, request_state="multiple-inputs")
    return _done(f"{_text(greeting)} {(name.content or {}).get('name', '')} ({len(roots.roots)} roots)")


@server.tool()
async def test_input_required_result_multi_round(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Two rounds, each with its own state: round 2's carries round 1's answer, which round 3 does not resend."""
    state = ctx.request_state or ""
    step1 = _response(ctx, "step1", ElicitResult)
    if state.startswith("step2:"):
        step2 = _response(ctx, "step2", ElicitResult)
        if step2 is not None:
            return _done(f"{state.removeprefix('step2:')} likes {(step2.content or {}).get('color', '')}")
        name = state.removeprefix("step2:")
    elif step1 is not None:
        name = (step1.content or {}).get("name", "")
    else:
        ask = _elicit("Step 1: What is your name?", _string("name"))
        return InputRequiredResult(input_requests={"step1": ask}, request_state="step1")
    ask = _elicit("Step 2: What is your favorite color?", _string("color"))
    return InputRequiredResult(input_requests={"step2": ask}, request_state=f"step2:{name}")


@server.tool()
async def test_input_required_result_tampered_state(ctx: Context) -> CallToolResult | InputRequiredResult:
    """The SDK's request-state boundary refuses a requestState it did not seal, before this runs."""
    answer = _response(ctx, "confirm", ElicitResult)
    if answer is None or ctx.request_state != "untampered":
        return InputRequiredResult(
            input_requests={"confirm": _elicit("Please confirm", _CONFIRM)}, request_state="untampered"
        )
    return _done("confirmed")


@server.tool()
async def test_input_required_result_capabilities(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask only what this request's client declared it can answer (its envelope's capabilities)."""
    meta = (ctx.request_context.params or {}).get("_meta") or {}
    declared = meta.get(_CLIENT_CAPABILITIES)
    if not isinstance(declared, dict):
        declared = ctx.client_capabilities.model_dump(exclude_none=True) if ctx.client_capabilities else {}
    asks: dict[str, Any] = {}
    if "elicitation" in declared and _response(ctx, "user_name", ElicitResult) is None:
        asks["user_name"] = _elicit("What is your name?", _string("name"))
    if "sampling" in declared and _response(ctx, "capital_question", CreateMessageResult) is None:
        asks["capital_question"] = _sample("What is the capital of France?", 100)
    if asks:
        return InputRequiredResult(input_requests=asks)
    return _done("nothing more to ask")


@server.prompt()
async def test_input_required_result_prompt(ctx: Context) -> list[Message] | InputRequiredResult:
    """A prompt built from the context the client gives when asked."""
    answer = _response(ctx, "user_context", ElicitResult)
    if answer is None:
        ask = _elicit("What context should the prompt use?", _string("context"))
        return InputRequiredResult(input_requests={"user_context": ask})
    return [UserMessage(f"Answer with this context: {(answer.content or {}).get('context', '')}")]


if __name__ == "__main__":
    if sys.argv[1] == "--stdio":  # the same tools over stdio, for a proxy that starts it (upstream.command)
        server.run(transport="stdio")
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
