"""Follow a task through mcp-tasks-proxy with the official Python SDK 2.x client (`pip install mcp`).

Its `Client` declares no tasks extension by itself, so the proxy answers a call in one long request, which a client
or gateway timeout ends. With the `ClientExtension` below in `Client(extensions=[...])`, the SDK declares
`io.modelcontextprotocol/tasks` in every request's `_meta`: the proxy answers a tools/call at once with a
`CreateTaskResult` (`resultType: "task"`), which the extension's `ResultClaim` follows with `tasks/get` until the task
ends. `client.call_tool()` returns the tool's result as usual; every request on the wire is short.

    python examples/sdk_tasks_client.py http://127.0.0.1:8080/mcp slow_report '{"topic": "tides", "seconds": 4}'

Exit status: 0 the tool's result; 1 a failure (connection, task failed or cancelled, tool error); 2 a usage error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Literal

from mcp import Client, MCPError
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import CallToolResult, Request, RequestParams, Result, TextContent

USAGE = "usage: sdk_tasks_client.py URL TOOL [JSON_ARGUMENTS]"


class CreateTaskResult(Result):
    result_type: Literal["task"]  # what the claim matches: ResultClaim insists on a Literal of its result_type
    task_id: str
    status: str
    poll_interval_ms: int | None = None


class GetTaskParams(RequestParams):
    task_id: str


class GetTask(Request[GetTaskParams, Literal["tasks/get"]]):
    """The SDK has no tasks/get (the 2026-07-28 core has none), but sends any Request subclass, with the same `_meta`
    envelope, extension included, that SEP-2663 asks of tasks/get too."""

    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"  # the SDK mirrors params.taskId into the Mcp-Name header, as SEP-2663 requires


class Task(Result):
    task_id: str
    status: str  # working, input_required, completed, failed or cancelled
    status_message: str | None = None
    poll_interval_ms: int | None = None
    result: dict[str, Any] | None = None  # the CallToolResult, once completed
    error: dict[str, Any] | None = None  # the JSON-RPC error, once failed


class TaskEnded(Exception):  # raised in the resolver: client.call_tool() lets it through as it is
    pass


class Tasks(ClientExtension):
    identifier = "io.modelcontextprotocol/tasks"  # the SDK advertises it in clientCapabilities.extensions

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self.follow)]

    async def follow(self, created: CreateTaskResult, ctx: ClaimContext) -> CallToolResult:
        print(f"task {created.task_id}: {created.status}", flush=True)
        interval_ms, shown = created.poll_interval_ms or 1000, created.status
        while True:
            await asyncio.sleep(interval_ms / 1000)
            task = await ctx.session.send_request(GetTask(params=GetTaskParams(task_id=created.task_id)), Task)
            interval_ms = task.poll_interval_ms or interval_ms  # the server may change its suggestion
            line = f"task {task.task_id}: {task.status}" + (f" ({task.status_message})" if task.status_message else "")
            if line != shown:
                print(line, flush=True)
                shown = line
            if task.status == "completed":
                return CallToolResult.model_validate(task.result or {}, by_name=False)
            if task.status in ("failed", "cancelled"):
                raise TaskEnded(f"task {task.status}: {(task.error or {}).get('message') or task.status_message}")
            if task.status == "input_required":  # answering takes tasks/update: see examples/task_client.py
                raise TaskEnded("the task asks for input, which this example does not answer")


async def run(url: str, tool: str, arguments: dict[str, Any]) -> int:
    async with Client(url, extensions=[Tasks()]) as client:
        result = await client.call_tool(tool, arguments)
    for block in result.content:
        print(block.text if isinstance(block, TextContent) else block.model_dump_json(by_alias=True))
    if result.is_error:
        print(f"error: {tool} returned an error", file=sys.stderr)
    return 1 if result.is_error else 0


def main(argv: list[str]) -> int:
    wants_help = argv[:1] in (["-h"], ["--help"])
    if wants_help or len(argv) not in (2, 3) or not argv[0].startswith(("http://", "https://")):
        print(USAGE, file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    try:
        arguments = json.loads(argv[2]) if len(argv) == 3 else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        print("error: JSON_ARGUMENTS must be a JSON object", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(argv[0], argv[1], arguments))
    except Exception as exc:
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the SDK's task groups wrap what they raise
            exc = exc.exceptions[0]
        if isinstance(exc, TaskEnded | MCPError):  # a task that ended badly, or a JSON-RPC error
            print(f"error: {exc}", file=sys.stderr)
        else:  # the connection or the transport
            print(f"error: {argv[0]}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
