"""The real upstream for end-to-end tests: the example server plus tools that let tests observe the upstream side.

Built with the official SDK (`mcp` 2.x, 2026-07-28); it implements no tasks. Run: python tests/upstream_server.py PORT

With --stdio (no PORT) it serves the same tools over the stdio transport: newline-delimited JSON-RPC on stdin/stdout,
logs on stderr (the SDK points fd 1 at stderr while it serves, so a stray print cannot corrupt the wire).
`echo_authorization` has no headers to read there and answers "<none>". Run: python tests/upstream_server.py --stdio

With --2026-only (either transport) it refuses 2025-era clients' initialize: a server that speaks 2026-07-28 only.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gates  # noqa: E402
from mcp.server.mcpserver import Context  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from mcp_types import (  # noqa: E402
    CallToolResult,
    CreateMessageRequest,
    CreateMessageRequestParams,
    ElicitRequest,
    ElicitRequestFormParams,
    ElicitRequestURLParams,
    InputRequiredResult,
    SamplingMessage,
    TextContent,
    ToolAnnotations,
)
from slow_server import server  # noqa: E402


@server.tool()
async def gated(tag: str, ctx: Context) -> str:
    """Report progress, then wait until release(tag) is called; records whether it was cancelled instead."""
    await ctx.report_progress(1, 2, f"waiting at gate {tag}")
    await gates.wait_at(tag)
    return f"gate {tag} opened"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True))
async def gated_idempotent(tag: str) -> str:
    """`gated`, annotated idempotentHint: a proxy that trusts the hint may send it again."""
    await gates.wait_at(tag)
    return f"gate {tag} opened"


@server.tool()
async def gated_then_progress(tag: str, ctx: Context) -> str:
    """Wait at the gate, then report progress and answer: progress that arrives while a test holds the store down."""
    await gates.wait_at(tag)
    await ctx.report_progress(2, 2, f"past gate {tag}")
    return f"gate {tag} opened"


@server.tool()
async def counted(tag: str, seconds: float) -> str:
    """Count the call (its run), then work for `seconds`: the chaos suite's tool that may run again."""
    gates.arrive(tag)
    await asyncio.sleep(seconds)
    return f"counted {tag}"


@server.tool()
async def counted_once(tag: str, seconds: float) -> str:
    """`counted`, for a rule that must never run it twice."""
    gates.arrive(tag)
    await asyncio.sleep(seconds)
    return f"counted {tag}"


@server.tool()
async def arrival_counts(prefix: str) -> dict[str, int]:
    """How many times each tag starting with `prefix` ran (gated or counted calls)."""
    return gates.arrivals_with(prefix)


@server.tool()
async def quiet(seconds: float) -> str:
    """Work for `seconds` without a word: nothing crosses the connection until the result."""
    await asyncio.sleep(seconds)
    return f"quiet for {seconds:g} s"


@server.tool()
async def release(tag: str) -> str:
    """Open the gate a gated call waits at."""
    gates.release(tag)
    return "released"


@server.tool()
async def gate_state(tag: str) -> str:
    """What happened to the gated call with this tag: unknown, started, cancelled or released."""
    return gates.state(tag)


@server.tool()
async def gate_arrivals(tag: str) -> str:
    """How many calls have waited at this gate: how many times the server ran a gated call with this tag."""
    return str(gates.arrivals(tag))


@server.tool()
async def pid() -> str:
    """This server's process id, so that a test can kill it (the child process of a stdio proxy)."""
    return str(os.getpid())


@server.tool()
async def announce_tools_changed(ctx: Context) -> str:
    """Publish notifications/tools/list_changed to subscriptions/listen streams."""
    await ctx.notify_tools_changed()
    return "announced"


@server.tool()
async def protocol_error_job() -> str:
    """Fail with a JSON-RPC error rather than a tool error."""
    raise MCPError(code=-32602, message="the job's parameters were rejected", data={"field": "none"})


@server.tool()
async def echo_authorization(ctx: Context) -> str:
    """Return the Authorization header this call arrived with (to prove the proxy forwards credentials)."""
    headers = ctx.headers or {}
    return headers.get("authorization", "<none>")


@server.tool()
async def echo_traceparent(ctx: Context) -> str:
    """Return the W3C traceparent header this call arrived with (to prove the proxy passes its own trace context)."""
    headers = ctx.headers or {}
    return headers.get("traceparent", "<none>")


# --- MRTR (2026-07-28 input_required) tools: each echoes what its last round received, for the tests to check ---

STATE = '{"round": 1, "note": "ünïcode and  spaces"}'  # the proxy must echo requestState byte for byte


def _ask(message: str) -> ElicitRequest:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    return ElicitRequest(params=ElicitRequestFormParams(message=message, requested_schema=schema))


def _received(ctx: Context) -> dict:
    responses = ctx.input_responses or {}
    capabilities = ctx.client_capabilities
    return {
        "inputResponses": {
            k: v.model_dump(mode="json", by_alias=True, exclude_none=True) for k, v in responses.items()
        },
        "requestState": ctx.request_state,
        "capabilities": capabilities.model_dump(mode="json", by_alias=True, exclude_none=True)
        if capabilities
        else None,
    }


def _done(ctx: Context, text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=text)], structured_content=_received(ctx))


def _answer(ctx: Context, key: str) -> str | None:
    response = (ctx.input_responses or {}).get(key)
    content = getattr(response, "content", None) or {}
    return content.get("answer") if getattr(response, "action", None) == "accept" else None


@server.tool()
async def one_question(ctx: Context) -> CallToolResult | InputRequiredResult:
    """One round: ask, then answer with what was said."""
    answer = _answer(ctx, "q")
    if answer is None:
        return InputRequiredResult(input_requests={"q": _ask("Your answer?")}, request_state=STATE)
    return _done(ctx, f"you said {answer}")


@server.tool()
async def same_key_twice(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Two rounds that both use the key "q"; the state carries the first answer."""
    answer = _answer(ctx, "q")
    if ctx.request_state is None:
        return InputRequiredResult(input_requests={"q": _ask("First?")}, request_state="round-1")
    if ctx.request_state == "round-1":
        return InputRequiredResult(input_requests={"q": _ask("Second?")}, request_state=f"round-2:{answer}")
    first = ctx.request_state.removeprefix("round-2:")
    return _done(ctx, f"{first} then {answer}")


@server.tool()
async def two_at_once(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask two questions in one round."""
    a, b = _answer(ctx, "a"), _answer(ctx, "b")
    if a is None or b is None:
        return InputRequiredResult(input_requests={"a": _ask("A?"), "b": _ask("B?")}, request_state="ab")
    return _done(ctx, f"{a}+{b}")


@server.tool()
async def endless_questions(ctx: Context) -> InputRequiredResult:
    """Never satisfied: asks again on every round."""
    return InputRequiredResult(input_requests={"q": _ask("Again?")}, request_state="again")


@server.tool()
async def state_only_first(ctx: Context) -> CallToolResult | InputRequiredResult:
    """A load-shedding interim with requestState only, then the result."""
    if ctx.request_state is None:
        return InputRequiredResult(request_state=STATE)
    return _done(ctx, "done after a state-only round")


@server.tool()
async def fails_on_retry(ctx: Context) -> InputRequiredResult:
    """Ask, then fail with a JSON-RPC error when answered."""
    if ctx.input_responses is None:
        return InputRequiredResult(input_requests={"q": _ask("Go?")}, request_state="s")
    raise MCPError(code=-32603, message="the retry failed upstream")


@server.tool()
async def asks_sampling(ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask the client's model (sampling), which only clients that declare sampling can answer."""
    if ctx.input_responses is None:
        params = CreateMessageRequestParams(
            messages=[SamplingMessage(role="user", content=TextContent(text="Capital of France?"))], max_tokens=20
        )
        return InputRequiredResult(input_requests={"llm": CreateMessageRequest(params=params)}, request_state="s")
    return _done(ctx, "sampled")


@server.tool()
async def asks_url(ctx: Context) -> CallToolResult | InputRequiredResult:
    """A URL-mode elicitation, which needs elicitation.url."""
    if ctx.input_responses is None:
        params = ElicitRequestURLParams(message="Sign in", url="https://example.test/login")
        return InputRequiredResult(input_requests={"login": ElicitRequest(params=params)}, request_state="s")
    return _done(ctx, "signed in")


@server.tool()
async def ask_then_gated(tag: str, ctx: Context) -> CallToolResult | InputRequiredResult:
    """Ask for a name; once answered, wait at a gate (so it outlasts any sync window), then greet."""
    name = _answer(ctx, "name")
    if name is None:
        return InputRequiredResult(input_requests={"name": _ask("Name?")}, request_state="ask")
    await gates.wait_at(tag)
    return _done(ctx, f"hello {name}")


@server.tool()
async def in_region(
    region: Annotated[str, Field(json_schema_extra={"x-mcp-header": "Region"})],
    shards: Annotated[int, Field(json_schema_extra={"x-mcp-header": "Shards"})] = 1,
) -> str:
    """Parameters a 2026 client mirrors into Mcp-Param-Region / Mcp-Param-Shards headers (SEP-2243), which the SDK
    checks against the body over HTTP."""
    return f"{shards} in {region}"


def serve_tls(port: int, cert: str, key: str, client_ca: str | None) -> None:
    """HTTPS, through uvicorn's own TLS; with `client_ca`, a client certificate signed by it is required (mTLS)."""
    import ssl

    import uvicorn

    uvicorn.run(
        server.streamable_http_app(host="127.0.0.1"), host="127.0.0.1", port=port, log_level="warning",
        ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=client_ca,
        ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
    )  # fmt: skip


def speak_2026_only() -> None:
    """A server of the 2026 SDKs with the 2025 handshake turned off, as a server that dropped 2025 answers it: an
    initialize is refused with -32022 naming the one version it speaks."""
    from mcp.server.runner import ServerRunner

    def refuse(self, params):
        raise MCPError(code=-32022, message="Unsupported protocol version", data={"supported": ["2026-07-28"]})

    ServerRunner._handle_initialize = refuse


if __name__ == "__main__":
    if "--2026-only" in sys.argv:
        speak_2026_only()
    if "--stdio" in sys.argv:
        server.run(transport="stdio")
    elif "--tls" in sys.argv:  # PORT --tls CERT KEY [CLIENT_CA]
        at = sys.argv.index("--tls")
        serve_tls(int(sys.argv[1]), sys.argv[at + 1], sys.argv[at + 2], (sys.argv[at + 3 :] or [None])[0])
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
