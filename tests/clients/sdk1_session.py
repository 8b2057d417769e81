"""A whole session with the official Python SDK 1.x client (a 2025-11-25 client): initialize, lists, calls (one
whose server asks for the user's name: the answer is given by the callback), then the session's DELETE on exit.
Prints what it got as JSON. Runs in tests/.legacy-venv. Usage: python sdk1_session.py URL [ASK_TOOL [--mrtr]]

ASK_TOOL is the tool that asks (default ask_name). With --mrtr it also pings, sets a log level, and calls the MRTR
tools of tests/upstream_server.py: two questions in one round, two rounds, a sampling request, a progress report."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta

from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client


async def answer(context, params: types.ElicitRequestParams) -> types.ElicitResult:
    """ "Ada" for every string field the form asks for (the user's name)."""
    properties = (getattr(params, "requestedSchema", None) or {}).get("properties") or {"name": {}}
    return types.ElicitResult(action="accept", content={field: "Ada" for field in properties})


async def sample(context, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
    return types.CreateMessageResult(role="assistant", content=types.TextContent(type="text", text="Paris"), model="m")


def text(result: types.CallToolResult) -> str:
    return result.content[0].text if result.content else repr(result)


async def main(url: str, ask_tool: str, mrtr: bool) -> dict:
    progress: list[float] = []

    async def on_progress(value, total, message):
        progress.append(value)

    async with (
        streamablehttp_client(url, timeout=10, sse_read_timeout=30) as (read, write, session_id),
        ClientSession(
            read, write, read_timeout_seconds=timedelta(seconds=30), elicitation_callback=answer,
            sampling_callback=sample if mrtr else None,
        ) as session,
    ):  # fmt: skip
        initialized = await session.initialize()
        tools = await session.list_tools()
        prompts = await session.list_prompts()
        added = await session.call_tool("add", {"a": 2, "b": 3})
        pids = [(await session.call_tool("pid", {})).content[0].text for _ in range(4)]
        asked = await session.call_tool(ask_tool, {})
        outcome = {
            "session": session_id() is not None,
            "version": initialized.protocolVersion,
            "tools": len(tools.tools),
            "prompts": len(prompts.prompts),
            "added": added.content[0].text,
            "pids": pids,
            "asked": text(asked),
            "received": asked.structuredContent,  # what the server was sent (tests/upstream_server.py's MRTR tools)
        }
        if mrtr:
            await session.send_ping()
            await session.set_logging_level("info")
            outcome["two_at_once"] = text(await session.call_tool("two_at_once", {}))
            outcome["same_key_twice"] = text(await session.call_tool("same_key_twice", {}))
            outcome["sampled"] = text(await session.call_tool("asks_sampling", {}))
            reported = await session.call_tool(
                "slow_report", {"topic": "t", "seconds": 1.5}, progress_callback=on_progress
            )
            outcome["report"] = text(reported)
            outcome["progress"] = len(progress)
            outcome["unknown"] = (await session.call_tool("no_such_tool", {})).isError
        return outcome


if __name__ == "__main__":
    try:
        ask = sys.argv[2] if len(sys.argv) > 2 else "ask_name"
        outcome = asyncio.run(asyncio.wait_for(main(sys.argv[1], ask, "--mrtr" in sys.argv), 60))
    except BaseException as exc:
        causes = [exc]
        while any(isinstance(cause, BaseExceptionGroup) for cause in causes):
            causes = [
                c for cause in causes for c in (cause.exceptions if isinstance(cause, BaseExceptionGroup) else [cause])
            ]
        outcome = {"failed": "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes)[:1000]}
    print(json.dumps(outcome), flush=True)
