"""A tools/call that outlives every timeout on the way, from the official Python SDK 2.x client (`pip install mcp`).

The SDK's `Client` does not declare the tasks extension (SEP-2663) by itself: through mcp-tasks-proxy its long calls
are kept-alive calls, which a client or gateway timeout still ends. Declared with the SDK's own extension interface
(`mcp.client.extension`), a tool the proxy's policy runs as a task answers at once with a `CreateTaskResult`
(`resultType: "task"`); the claim below follows the task with `tasks/get` until it ends, so `client.call_tool()`
returns the tool's result as usual, and every request on the wire is short.

    python examples/sdk2_tasks_client.py http://127.0.0.1:8080/mcp slow_report '{"topic": "tides", "seconds": 4}'
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Literal

from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import CallToolResult, Request, RequestParams, Result, TextContent

TASKS = "io.modelcontextprotocol/tasks"
TERMINAL = {"completed", "failed", "cancelled"}


class CreateTaskResult(Result):
    """What a task-creating tools/call answers (only the fields this client reads)."""

    result_type: Literal["task"]
    task_id: str
    status: str
    poll_interval_ms: int | None = None


class TaskParams(RequestParams):
    task_id: str


class GetTask(Request[TaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"  # the Mcp-Name header SEP-2663 asks for


class Task(Result):
    """A tasks/get answer: the task's state, and its result or error once it ended."""

    task_id: str
    status: str
    status_message: str | None = None
    poll_interval_ms: int | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class Tasks(ClientExtension):
    """Declares the extension on every request (the SDK puts it in each request's _meta) and follows the tasks."""

    identifier = TASKS

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self.follow)]

    async def follow(self, created: CreateTaskResult, ctx: ClaimContext) -> CallToolResult:
        print(f"task {created.task_id}: {created.status}", file=sys.stderr)
        interval_s = (created.poll_interval_ms or 1000) / 1000
        while True:
            await asyncio.sleep(interval_s)
            task = await ctx.session.send_request(GetTask(params=TaskParams(task_id=created.task_id)), Task)
            print(f"task {task.task_id}: {task.status} {task.status_message or ''}".rstrip(), file=sys.stderr)
            interval_s = (task.poll_interval_ms or interval_s * 1000) / 1000
            if task.status == "completed" and task.result is not None:
                return CallToolResult.model_validate(task.result)
            if task.status in TERMINAL:
                reason = (task.error or {}).get("message") or task.status
                return CallToolResult(content=[TextContent(type="text", text=f"task {task.status}: {reason}")],
                                      is_error=True)  # fmt: skip
            # input_required: this example answers no questions (examples/task_client.py does, with tasks/update).


async def main(url: str, tool: str, arguments: dict[str, Any]) -> int:
    async with Client(url, extensions=[Tasks()]) as client:
        result = await client.call_tool(tool, arguments)
    for block in result.content:
        print(block.text if isinstance(block, TextContent) else block.model_dump_json())
    return 1 if result.is_error else 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: {sys.argv[0]} URL TOOL [JSON_ARGUMENTS]")
    try:
        arguments = json.loads(sys.argv[3]) if len(sys.argv) == 4 else {}
    except ValueError as exc:
        sys.exit(f"JSON_ARGUMENTS is not JSON: {exc}")
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], arguments)))
