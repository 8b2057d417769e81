"""Follow a task through mcp-tasks-proxy with the official Python SDK 2.x client (`pip install mcp`).

Its `Client` declares no tasks extension by itself, so the proxy answers a call in one long request, which a client
or gateway timeout ends. With the `ClientExtension` below in `Client(extensions=[...])`, the SDK declares
`io.modelcontextprotocol/tasks` in every request's `_meta`: the proxy answers a tools/call at once with a
`CreateTaskResult` (`resultType: "task"`), which the extension's `ResultClaim` follows with `tasks/get` until the task
ends. `client.call_tool()` returns the tool's result as usual; every request on the wire is short.

It also declares elicitation (form and URL), so that a tool may ask its user something: a task that asks turns
`input_required`, and the extension answers each question with `tasks/update`, from the terminal (one prompt per
field) or from `--answer` (the same JSON content for every form question, or `decline`).

    python examples/sdk_tasks_client.py http://127.0.0.1:8080/mcp slow_report '{"topic": "tides", "seconds": 4}'
    python examples/sdk_tasks_client.py http://127.0.0.1:8080/mcp personal_report '{"topic": "tides"}'
    python examples/sdk_tasks_client.py --answer '{"name": "Ada"}' http://127.0.0.1:8080/mcp personal_report \
        '{"topic": "tides"}'

Exit status: 0 the tool's result; 1 a failure (connection, task failed or cancelled, tool error); 2 a usage error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Literal

from mcp import Client, MCPError
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import (
    CallToolResult,
    ElicitRequestFormParams,
    ElicitRequestParams,
    ElicitResult,
    Request,
    RequestParams,
    Result,
    TextContent,
)
from pydantic import TypeAdapter

USAGE = "usage: sdk_tasks_client.py [--answer JSON|decline] URL TOOL [JSON_ARGUMENTS]"


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


class UpdateTaskParams(RequestParams):
    task_id: str
    input_responses: dict[str, Any]


class UpdateTask(Request[UpdateTaskParams, Literal["tasks/update"]]):
    """tasks/update: the answers to a task's inputRequests, keyed as the task keys its questions."""

    method: Literal["tasks/update"] = "tasks/update"
    name_param = "taskId"


class Task(Result):
    task_id: str
    status: str  # working, input_required, completed, failed or cancelled
    status_message: str | None = None
    poll_interval_ms: int | None = None
    result: dict[str, Any] | None = None  # the CallToolResult, once completed
    error: dict[str, Any] | None = None  # the JSON-RPC error, once failed
    input_requests: dict[str, dict[str, Any]] | None = None  # the questions, while input_required


class Answered(Result):
    pass


ELICITATION = TypeAdapter(ElicitRequestParams)


class Asker:
    """Answers a server's elicitation: the client's elicitation_callback (which also makes the SDK declare the
    capability), and what the task extension calls for each question a task asks."""

    def __init__(self, answer: str | None) -> None:
        self.answer = answer  # --answer: JSON content for every form question, or "decline"; None: the terminal

    async def __call__(self, context: Any, params: ElicitRequestParams) -> ElicitResult:
        print(f"? {params.message}", flush=True)
        if self.answer == "decline":
            return ElicitResult(action="decline")
        if not isinstance(params, ElicitRequestFormParams):  # URL mode: the user visits the page, then says so
            print(f"  open {params.url}, then press Enter", flush=True)
            return ElicitResult(action="accept") if await self._line("") is not None else ElicitResult(action="cancel")
        if self.answer is not None:
            return ElicitResult(action="accept", content=json.loads(self.answer))
        content: dict[str, Any] = {}
        for name, field in (params.requested_schema.get("properties") or {}).items():
            line = await self._line(f"  {field.get('title') or name}: ")
            if line is None:  # end of input: nothing to answer with
                return ElicitResult(action="cancel")
            if line:
                content[name] = _typed(line, field)
        return ElicitResult(action="accept", content=content)

    async def _line(self, prompt: str) -> str | None:
        print(prompt, end="", flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        if line and not sys.stdin.isatty():
            print(line.rstrip("\n"), flush=True)  # what a piped input answered, on the line of its prompt
        return line.rstrip("\n") if line else None


def _typed(text: str, field: dict[str, Any]) -> Any:
    """A typed answer as the field's schema wants it: numbers, booleans, else the text."""
    kind = field.get("type")
    if kind in ("number", "integer"):
        return int(text) if kind == "integer" else float(text)
    if kind == "boolean":
        return text.strip().lower() in ("y", "yes", "true", "1")
    return text


class TaskEnded(Exception):  # raised in the resolver: client.call_tool() lets it through as it is
    pass


class Tasks(ClientExtension):
    identifier = "io.modelcontextprotocol/tasks"  # the SDK advertises it in clientCapabilities.extensions

    def __init__(self, asker: Asker | None = None) -> None:
        self.asker = asker
        self.answered: set[str] = set()  # keys answered: a task never reuses one

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
            if task.status == "input_required":
                await self.answer(ctx, task)

    async def answer(self, ctx: ClaimContext, task: Task) -> None:
        """Each question not answered yet, answered with tasks/update (the task then goes on working)."""
        if self.asker is None:
            raise TaskEnded("the task asks for input, and this client answers none")
        answers: dict[str, Any] = {}
        for key, request in (task.input_requests or {}).items():
            if key in self.answered:
                continue
            if request.get("method") != "elicitation/create":
                raise TaskEnded(f"the task asks {request.get('method')}, which this client does not answer")
            result = await self.asker(None, ELICITATION.validate_python(request.get("params") or {}))
            answers[key] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        if answers:
            params = UpdateTaskParams(task_id=task.task_id, input_responses=answers)
            await ctx.session.send_request(UpdateTask(params=params), Answered)
            self.answered.update(answers)


async def run(url: str, tool: str, arguments: dict[str, Any], answer: str | None) -> int:
    asker = Asker(answer)
    async with Client(url, extensions=[Tasks(asker)], elicitation_callback=asker) as client:
        result = await client.call_tool(tool, arguments)
    for block in result.content:
        print(block.text if isinstance(block, TextContent) else block.model_dump_json(by_alias=True))
    if result.is_error:
        print(f"error: {tool} returned an error", file=sys.stderr)
    return 1 if result.is_error else 0


def main(argv: list[str]) -> int:
    answer = None
    if argv[:1] == ["--answer"] and len(argv) > 1:
        answer, argv = argv[1], argv[2:]
        try:
            if answer != "decline" and not isinstance(json.loads(answer), dict):
                raise ValueError
        except ValueError:
            print("error: --answer takes a JSON object or decline", file=sys.stderr)
            return 2
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
        return asyncio.run(run(argv[0], argv[1], arguments, answer))
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
