"""An MCP server that knows nothing of tasks, built with the official SDK (`mcp` 2.x, protocol 2026-07-28).

Run: python examples/slow_server.py [PORT]   (serves http://127.0.0.1:PORT/mcp, default 9000)
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Annotated

from mcp.server.mcpserver import Context, Elicit, MCPServer, Resolve
from pydantic import BaseModel

server = MCPServer(
    "slow-example",
    instructions="A deliberately slow server for trying mcp-tasks-proxy.",
    log_level="WARNING",
)


async def _work(ctx: Context | None, seconds: float, steps: int, describe: Callable[[int], str]) -> None:
    """Spend `seconds` in `steps` equal steps, reporting progress before each."""
    for step in range(steps):
        if ctx is not None:
            await ctx.report_progress(step, steps, describe(step + 1))
        await asyncio.sleep(seconds / steps)


@server.tool()
async def slow_report(topic: str, seconds: float = 6.0, ctx: Context | None = None) -> str:
    """Write a report on a topic, slowly, reporting progress as it goes."""
    steps = 5
    await _work(ctx, seconds, steps, lambda step: f"researching {topic}: step {step} of {steps}")
    return f"Report on {topic}: all {steps} steps done in {seconds:g} s."


class Person(BaseModel):
    name: str


async def ask_name() -> Elicit[Person]:
    # On 2026-07-28 the SDK turns this into an MRTR input_required round; mcp-tasks-proxy turns that into the
    # task's inputRequests, and the client answers with tasks/update.
    return Elicit("Who is this report for?", Person)


@server.tool()
async def personal_report(
    topic: str, person: Annotated[Person, Resolve(ask_name)], seconds: float = 4.0, ctx: Context | None = None
) -> str:
    """Ask who the report is for, then write it slowly, reporting progress."""
    await _work(ctx, seconds, 4, lambda step: f"writing {person.name}'s report on {topic}: {step}/4")
    return f"Dear {person.name}, here is your report on {topic}."


@server.tool()
async def add(a: int, b: int) -> int:
    """Add two integers at once."""
    return a + b


@server.tool()
async def failing_job(reason: str = "the job failed") -> str:
    """Fail as a tool (the result has isError: true)."""
    raise ValueError(reason)


def main() -> None:
    if "--stdio" in sys.argv:  # started by the proxy itself: mcp-tasks-proxy ... -- python slow_server.py --stdio
        server.run(transport="stdio")
        return
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ.get("EXAMPLE_SERVER_PORT", "9000"))
    host = os.environ.get("EXAMPLE_SERVER_HOST", "127.0.0.1")  # 0.0.0.0 in a container, behind the proxy
    server.run(transport="streamable-http", host=host, port=port)


if __name__ == "__main__":
    main()
