"""A legacy (2025-11-25) upstream for end-to-end tests, built with the official SDK's 1.x line (`mcp<2`).

It runs in its own virtual environment (the tests build it: tests/.legacy-venv), since `mcp` 1.x and 2.x cannot
share one. An event store makes its streams resumable (priming events, retry, GET + Last-Event-ID), as 2025-11-25
servers may be. Run: tests/.legacy-venv/bin/python tests/legacy_server.py PORT [--plain]

With --stdio (no PORT) it serves the same tools over the stdio transport instead: newline-delimited JSON-RPC on
stdin/stdout, logs on stderr, nothing else on stdout. The event store and `interrupted` (HTTP streams only) are left
out there. Run: tests/.legacy-venv/bin/python tests/legacy_server.py --stdio
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from pathlib import Path

from mcp.server.fastmcp import Context, FastMCP
from mcp.server.streamable_http import EventCallback, EventMessage, EventStore
from mcp.shared.exceptions import McpError
from mcp.shared.message import ServerMessageMetadata
from mcp.types import ListRootsRequest, ListRootsResult, SamplingMessage, ServerRequest, TextContent
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gates  # noqa: E402


class MemoryEventStore(EventStore):
    """Just enough of an event store for resumption: every event of every stream, in order."""

    def __init__(self) -> None:
        self._events: list[tuple[str, str, object]] = []
        self._ids = itertools.count(1)

    async def store_event(self, stream_id, message):
        event_id = str(next(self._ids))
        self._events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback: EventCallback):
        stream_id = next((s for e, s, _ in self._events if e == last_event_id), None)
        if stream_id is None:
            return None
        seen = False
        for event_id, stream, message in list(self._events):
            if seen and stream == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
            seen = seen or event_id == last_event_id
        return stream_id


# --plain: no event store, as most servers run (the SDK's default): a broken stream cannot be resumed.
# --stdio: the stdio transport, where there are no streams to resume: no event store either.
_STDIO = "--stdio" in sys.argv
_PLAIN = "--plain" in sys.argv or _STDIO
server = FastMCP(
    "legacy-example",
    log_level="WARNING",
    event_store=None if _PLAIN else MemoryEventStore(),
    retry_interval=None if _PLAIN else 100,
)


class Name(BaseModel):
    name: str


@server.tool()
async def add(a: int, b: int) -> int:
    """Add two integers at once."""
    return a + b


@server.tool()
async def slow(seconds: float, ctx: Context) -> str:
    """Work in three steps, reporting progress."""
    for step in range(3):
        await ctx.report_progress(step, 3, f"legacy step {step + 1} of 3")
        await asyncio.sleep(seconds / 3)
    return f"slept {seconds:g} s"


@server.tool()
async def quiet(seconds: float) -> str:
    """Work for `seconds` without a word: nothing crosses the connection until the result."""
    await asyncio.sleep(seconds)
    return f"quiet for {seconds:g} s"


@server.tool()
async def broken() -> str:
    """Fail as a tool does: the SDK answers a result with isError true."""
    raise ValueError("the tool broke")


@server.tool()
async def ask_name(ctx: Context) -> str:
    """Elicit a name on the call's stream, then greet after a little work."""
    answer = await ctx.elicit("Your name?", Name)
    await ctx.report_progress(1, 2, "got an answer")
    if answer.action != "accept":
        return f"no name ({answer.action})"
    return f"hello {answer.data.name}"


@server.tool()
async def ask_then_work(seconds: float, ctx: Context) -> str:
    """Elicit a name, then work for `seconds`: the composition of an input round and a long call."""
    answer = await ctx.elicit("Your name?", Name)
    await asyncio.sleep(seconds)
    name = answer.data.name if answer.action == "accept" else answer.action
    return f"hello {name} after {seconds:g} s"


@server.tool()
async def ask_again_and_again(times: int, ctx: Context) -> str:
    """Elicit `times` times in a row (a server that keeps asking); records a cancellation at gate `times`."""
    names = []
    try:
        for _ in range(times):
            answer = await ctx.elicit("Your name?", Name)
            names.append(answer.data.name if answer.action == "accept" else answer.action)
    except asyncio.CancelledError:
        gates.mark(f"asked-{times}", "cancelled")
        raise
    return " ".join(names)


@server.tool()
async def ask_two(ctx: Context) -> str:
    """Two elicitations at once: both are pending together."""
    first, second = await asyncio.gather(ctx.elicit("First?", Name), ctx.elicit("Second?", Name))
    names = [a.data.name if a.action == "accept" else a.action for a in (first, second)]
    return " & ".join(names)


@server.tool()
async def ask_model(ctx: Context) -> str:
    """Sampling on the call's stream."""
    message = SamplingMessage(role="user", content=TextContent(type="text", text="Capital of France?"))
    try:
        result = await ctx.session.create_message(messages=[message], max_tokens=10, related_request_id=ctx.request_id)
    except McpError as exc:
        return f"sampling refused: {exc.error.code}"
    return f"model said {result.content.text}"


@server.tool()
async def ask_roots(ctx: Context) -> str:
    """roots/list on the call's stream (SEP-2260: tied to the call, never on the standalone GET stream)."""
    request = ServerRequest(ListRootsRequest())
    try:
        related = ServerMessageMetadata(related_request_id=ctx.request_id)
        result = await ctx.session.send_request(request, ListRootsResult, metadata=related)
    except McpError as exc:
        return f"roots refused: {exc.error.code}"
    return ", ".join(str(root.uri) for root in result.roots)


@server.tool()
async def ask_roots_standalone(ctx: Context) -> str:
    """roots/list on the session's standalone GET stream (no related request), as server-everything sends it."""
    try:
        result = await ctx.session.send_request(ServerRequest(ListRootsRequest()), ListRootsResult)
    except McpError as exc:
        return f"roots refused: {exc.error.code} {exc.error.message}"
    return ", ".join(str(root.uri) for root in result.roots)


@server.tool()
async def echo_traceparent(ctx: Context) -> str:
    """The W3C traceparent this call arrived with ("<none>" without one)."""
    request = ctx.request_context.request
    headers = request.headers if request is not None else {}
    return headers.get("traceparent", "<none>")


@server.tool()
async def gated(tag: str, ctx: Context) -> str:
    """Report progress, then wait for release(tag); records a cancellation (notifications/cancelled)."""
    await ctx.report_progress(1, 2, f"waiting at gate {tag}")
    await gates.wait_at(tag)
    return f"gate {tag} opened"


@server.tool()
async def ask_gated(tag: str, ctx: Context) -> str:
    """Elicit, then wait at gate `tag`: started while the question is open, cancelled if the call is."""
    asking = asyncio.ensure_future(ctx.elicit("Proceed?", Name))
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(gates.wait_at(tag))
    await asyncio.gather(asking, waiting)
    return f"gate {tag} opened"


@server.tool()
async def release(tag: str) -> str:
    """Open a gate."""
    gates.release(tag)
    return "released"


@server.tool()
async def gate_state(tag: str) -> str:
    """unknown, started, cancelled or released."""
    return gates.state(tag)


@server.tool()
async def gate_arrivals(tag: str) -> str:
    """How many times a gated call with this tag ran."""
    return str(gates.arrivals(tag))


@server.tool()
async def pid() -> str:
    """This server's process id, so that a test can kill it (the child process of a stdio proxy)."""
    return str(os.getpid())


async def interrupted(ctx: Context) -> str:
    """Close the connection mid-call (2025-11-25 polling); the client must resume with GET + Last-Event-ID."""
    await ctx.report_progress(1, 3, "before the break")
    await ctx.close_sse_stream()
    await asyncio.sleep(0.3)
    await ctx.report_progress(2, 3, "after the break")
    return "finished after a reconnect"


# Only over HTTP: closing an SSE stream is meaningless on stdio (the SDK makes it a no-op there).
if not _STDIO:
    server.tool()(interrupted)


@server.resource("note://greeting")
def greeting() -> str:
    return "hello from a legacy resource"


@server.prompt(name="greeting")
def greeting_prompt(name: str) -> str:
    return f"Say hello to {name}."


if __name__ == "__main__":
    if _STDIO:
        server.run(transport="stdio")  # the SDK logs to stderr; stdout carries MCP messages only
    else:
        server.settings.host = "127.0.0.1"
        server.settings.port = int(next(arg for arg in sys.argv[1:] if not arg.startswith("--")))
        server.run(transport="streamable-http")
