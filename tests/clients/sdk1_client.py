"""One tool call with the official Python SDK 1.x client (a 2025-11-25 client), as a user's program makes it; prints
the outcome as JSON. It resumes a broken stream with GET + Last-Event-ID by itself, as that SDK does.

With --as-task it is a SEP-1686 client: the SDK's experimental task API (call_tool_as_task, poll_task,
get_task_result), as a 2025-11-25 client with tasks uses it.

With --connection-per-request its HTTP client keeps no connection alive between requests. Polling through a
middlebox that limits how long a connection stays open, the SDK's pooled connection, opened for one poll, is reused
for the next one pollInterval later, just as the middlebox cuts it: the keep-alive race, in which the poll is lost on
the way (the server never sees it), and the SDK 1.x client lets the transport error out of its task group
(python-sdk#3522). That race is the client's and the middlebox's, whatever the server does.

With --list-first it lists the tools before the call, as hosts do (else the SDK lists them after the call, to
validate its result against the tool's output schema).

Runs in tests/.legacy-venv. Usage: python sdk1_client.py URL TOOL ARGUMENTS_JSON TIMEOUT_S [--progress] [--as-task]
[--connection-per-request] [--list-first]
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from datetime import timedelta

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.types import CallToolResult

warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks its experimental task API deprecated


def connection_per_request(headers=None, timeout=None, auth=None) -> httpx.AsyncClient:
    """The SDK's default client (mcp.shared._httpx_utils.create_mcp_http_client), keeping no connection alive."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(headers=headers, timeout=timeout, auth=auth, limits=limits)


async def main(url: str, tool: str, arguments: dict, timeout_s: float, flags: list[str]) -> dict:
    progress, as_task = "--progress" in flags, "--as-task" in flags
    transport = {"httpx_client_factory": connection_per_request} if "--connection-per-request" in flags else {}
    kwargs = {}
    if progress:

        async def on_progress(value, total, message):  # a progressToken goes out with the call
            pass

        kwargs["progress_callback"] = on_progress
    async with (
        streamablehttp_client(url, timeout=10, sse_read_timeout=timeout_s, **transport) as (read, write, _),
        ClientSession(read, write, read_timeout_seconds=timedelta(seconds=timeout_s)) as session,
    ):
        initialized = await session.initialize()
        if as_task:
            if initialized.capabilities.tasks is None:
                return {"failed": "the server declares no tasks capability"}
            created = await session.experimental.call_tool_as_task(tool, arguments, ttl=600_000)
            statuses = [status.status async for status in session.experimental.poll_task(created.task.taskId)]
            result = await session.experimental.get_task_result(created.task.taskId, CallToolResult)
            return {"text": result.content[0].text, "isError": result.isError, "statuses": statuses[-1:]}
        if "--list-first" in flags:  # as hosts do; else call_tool lists the tools after the call, to check its result
            await session.list_tools()
        result = await session.call_tool(tool, arguments, **kwargs)
        return {"text": result.content[0].text, "isError": result.isError}


if __name__ == "__main__":
    url, tool, arguments, timeout_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    try:
        call = main(url, tool, arguments, timeout_s, sys.argv[5:])
        outcome = asyncio.run(asyncio.wait_for(call, timeout_s + 5))
    except BaseException as exc:  # the point of some tests: the call dies, and how
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # the SDK's task group: what broke
            exc = exc.exceptions[0]
        outcome = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps(outcome), flush=True)
