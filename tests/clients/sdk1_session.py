"""A whole session with the official Python SDK 1.x client (a 2025-11-25 client): initialize, lists, calls (one
whose server asks for the user's name: the answer is given by the callback), then the session's DELETE on exit.
Prints what it got as JSON. Runs in tests/.legacy-venv. Usage: python sdk1_session.py URL"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta

from mcp import ClientSession, types
from mcp.client.streamable_http import streamablehttp_client


async def answer(context, params: types.ElicitRequestParams) -> types.ElicitResult:
    return types.ElicitResult(action="accept", content={"name": "Ada"})


async def main(url: str) -> dict:
    async with (
        streamablehttp_client(url, timeout=10, sse_read_timeout=30) as (read, write, session_id),
        ClientSession(read, write, read_timeout_seconds=timedelta(seconds=30), elicitation_callback=answer) as session,
    ):
        await session.initialize()
        tools = await session.list_tools()
        prompts = await session.list_prompts()
        added = await session.call_tool("add", {"a": 2, "b": 3})
        pids = [(await session.call_tool("pid", {})).content[0].text for _ in range(4)]
        asked = await session.call_tool("ask_name", {})
        return {
            "session": session_id() is not None,
            "tools": len(tools.tools),
            "prompts": len(prompts.prompts),
            "added": added.content[0].text,
            "pids": pids,
            "asked": asked.content[0].text,
        }


if __name__ == "__main__":
    try:
        outcome = asyncio.run(asyncio.wait_for(main(sys.argv[1]), 60))
    except BaseException as exc:
        causes = [exc]
        while any(isinstance(cause, BaseExceptionGroup) for cause in causes):
            causes = [
                c for cause in causes for c in (cause.exceptions if isinstance(cause, BaseExceptionGroup) else [cause])
            ]
        outcome = {"failed": "; ".join(f"{type(cause).__name__}: {cause}" for cause in causes)[:1000]}
    print(json.dumps(outcome), flush=True)
