"""Call an MCP tool through mcp-tasks-proxy as a task (MCP 2026-07-28, SEP-2663), in plain HTTP.

  python examples/task_client.py URL TOOL [JSON_ARGUMENTS]
      server/discover, then TOOL called with the 2026-07-28 envelope declaring io.modelcontextprotocol/tasks;
      prints the CreateTaskResult, polls tasks/get until the task ends (printing each status change and its
      statusMessage), answers the server's questions (--answer, or a prompt on a terminal), prints the result.
  python examples/task_client.py URL
      the whole walk-through of the quick start (examples/demo.py runs it), printing every message on the wire.

Example, with the quick start running (python examples/demo.py):
  python examples/task_client.py http://127.0.0.1:8080/mcp slow_report '{"topic": "tides", "seconds": 4}'
  python examples/task_client.py http://127.0.0.1:8080/mcp personal_report '{"topic": "x"}' --answer '{"name": "Ada"}'

Exit status: 0 when the tool's result came back (and is not isError), 1 when the call or task failed, was
cancelled, timed out, or the URL could not be reached, 2 for a usage error, 130 on Ctrl-C (the task is cancelled).
Standard library only, so that nothing hides what goes over the wire.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from contextlib import closing
from typing import Any, NoReturn

PROTOCOL_VERSION = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")
MAX_MRTR_ROUNDS = 10  # as the official SDKs: synchronous input_required rounds before giving up
_ids = itertools.count(1)


class ClientError(Exception):
    """A failure worth one line on stderr and exit status 1 (never a traceback)."""


# --- the wire ---------------------------------------------------------------------------------------------------


def envelope(
    *, declare_tasks: bool = True, elicitation: bool = False, capabilities: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `_meta` every 2026-07-28 request carries: version, this request's client capabilities, client info."""
    declared: dict[str, Any] = dict(capabilities or {})
    if elicitation:
        declared["elicitation"] = {}  # form mode: this client can put a question to its user
    if declare_tasks:
        declared["extensions"] = {TASKS: {}}
    return {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": declared,
        "io.modelcontextprotocol/clientInfo": {"name": "task-client-example", "version": "1.0"},
    }


def header_value(value: str) -> str:
    """An `Mcp-Name` value: as is when plain visible ASCII, else `=?base64?…?=` (SEP-2243)."""
    plain = value.isascii() and value.isprintable() and value == value.strip() and not value.startswith("=?")
    return value if plain else f"=?base64?{base64.b64encode(value.encode()).decode()}?="


def unreachable(url: str, reason: object, timeout: float | None) -> ClientError:
    if isinstance(reason, ConnectionRefusedError):
        return ClientError(f"cannot connect to {url}: connection refused (is the proxy running?)")
    if isinstance(reason, TimeoutError):
        return ClientError(f"no answer from {url} within {timeout:g} s")
    if isinstance(reason, socket.gaierror):
        return ClientError(f"cannot resolve the host of {url}: {reason.strerror}")
    return ClientError(f"cannot reach {url}: {reason}")


def _read_stream(response: Any, request_id: int, on_event: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    """Read an event stream as it arrives until the response to `request_id`; other messages go to on_event."""
    data: list[str] = []
    for raw in response:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:  # comments (": keep-alive"), id:, event:, retry:; or a blank line ending nothing
            continue
        text, data = "\n".join(data), []
        try:
            event = json.loads(text)
        except ValueError:
            continue  # a priming event or other non-JSON data carries no message
        if isinstance(event, dict) and event.get("id") == request_id and ("result" in event or "error" in event):
            return event
        if on_event is not None and isinstance(event, dict):
            on_event(event)
    raise ClientError(f"the event stream ended without an answer to request {request_id}")


def exchange(
    url: str,
    message: dict[str, Any],
    *,
    name: str | None = None,
    timeout: float | None = 30.0,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """POST one request with the 2026-07-28 headers; its JSON-RPC response, from a JSON body or an event stream."""
    method = message["method"]
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": PROTOCOL_VERSION,
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = header_value(name)
    request = urllib.request.Request(url, data=json.dumps(message).encode(), headers=headers, method="POST")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:  # a 4xx or 5xx answer still carries a JSON-RPC error
        response = exc
    except urllib.error.URLError as exc:
        raise unreachable(url, exc.reason, timeout) from None
    except OSError as exc:  # a timeout or reset before the answer's head
        raise unreachable(url, exc, timeout) from None
    with closing(response):
        status = response.status
        try:
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                return _read_stream(response, message["id"], on_event)
            body = response.read()
        except OSError as exc:  # a timeout or reset while the answer arrives
            raise unreachable(url, exc, timeout) from None
    try:
        answer = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        raise ClientError(f"{method}: HTTP {status} from {url}, not a JSON-RPC answer: {text[:200]!r}") from None
    if not isinstance(answer, dict) or not ("result" in answer or "error" in answer):
        raise ClientError(f"{method}: HTTP {status} from {url}, not a JSON-RPC response: {json.dumps(answer)[:200]}")
    return answer


def _print_event(event: dict[str, Any]) -> None:
    print(f"<-- {json.dumps(event)}")


def rpc(
    url: str,
    method: str,
    params: dict[str, Any],
    *,
    name: str | None = None,
    quiet: bool = False,
    timeout: float | None = 30.0,
) -> dict[str, Any]:
    """One request and its response, both printed unless quiet."""
    message = {"jsonrpc": "2.0", "id": next(_ids), "method": method, "params": params}
    if not quiet:
        print(f"\n--> {json.dumps(message)}")
    answer = exchange(url, message, name=name, timeout=timeout, on_event=None if quiet else _print_event)
    if not quiet:
        print(f"<-- {json.dumps(answer)}")
    return answer


def describe(error: Any) -> str:
    """A JSON-RPC error object on one line."""
    if not isinstance(error, dict):
        return json.dumps(error)
    text = f"{error.get('code')} {error.get('message', '')}".strip()
    return f"{text} (data: {json.dumps(error['data'])})" if "data" in error else text


def result_of(answer: dict[str, Any], what: str) -> dict[str, Any]:
    if "error" in answer:
        raise ClientError(f"{what} failed: {describe(answer['error'])}")
    result = answer.get("result")
    if not isinstance(result, dict):
        raise ClientError(f"{what}: the result is not an object: {json.dumps(result)[:200]}")
    return result


# --- answering the server's questions (input requests) ---------------------------------------------------------


def as_response(request: dict[str, Any], answer: Any) -> dict[str, Any]:
    """Complete a short --answer into the InputResponse its request expects."""
    method = request.get("method")
    if method == "elicitation/create" and isinstance(answer, str):
        # Plain text answers a form of one field (or a URL-mode question, which has none).
        fields = list(((request.get("params") or {}).get("requestedSchema") or {}).get("properties") or {})
        if len(fields) > 1:
            raise ClientError(f"--answer {answer!r}: the server asks for {', '.join(fields)}: give a JSON object")
        return {"action": "accept", "content": {fields[0]: answer}} if fields else {"action": "accept"}
    if method == "elicitation/create" and not (isinstance(answer, dict) and "action" in answer):
        return {"action": "accept", "content": answer} if isinstance(answer, dict) else {"action": "accept"}
    if method == "sampling/createMessage" and isinstance(answer, str):
        content = {"type": "text", "text": answer}
        return {"role": "assistant", "content": content, "model": "task-client-example", "stopReason": "endTurn"}
    if method == "roots/list" and isinstance(answer, list):
        return {"roots": [{"uri": uri} if isinstance(uri, str) else uri for uri in answer]}
    if not isinstance(answer, dict):
        raise ClientError(f"--answer {json.dumps(answer)} is not an answer to {method}")
    return answer


def _coerce(text: str, kind: Any) -> Any:
    if kind == "boolean":
        return text.strip().lower() in ("y", "yes", "true", "1")
    if kind in ("integer", "number"):
        try:
            return int(text) if kind == "integer" else float(text)
        except ValueError:
            raise ClientError(f"{text!r} is not a {kind}") from None
    return text


def ask_user(request: dict[str, Any]) -> dict[str, Any]:
    """Put one input request to the person at the terminal (Ctrl-D declines it)."""
    method, params = request.get("method"), request.get("params") or {}
    try:
        if method == "elicitation/create":
            print(f"?   the server asks: {params.get('message', '')}")
            if params.get("mode") == "url":
                input(f"    open {params.get('url')} , then press Enter (Ctrl-D declines) ")
                return {"action": "accept"}
            schema = params.get("requestedSchema") or {}
            content = {}
            for field, spec in (schema.get("properties") or {}).items():
                label = spec.get("title") or field
                text = input(f"    {label} ({spec.get('type', 'string')}): ")
                if text or field in schema.get("required", ()):
                    content[field] = _coerce(text, spec.get("type"))
            return {"action": "accept", "content": content}
        if method == "sampling/createMessage":
            print("?   the server asks your model (sampling); you answer for it:")
            for message in params.get("messages", []):
                content = message.get("content")
                text = content.get("text") if isinstance(content, dict) else json.dumps(content)
                print(f"    {message.get('role')}: {text}")
            return as_response(request, input("    assistant: "))
        if method == "roots/list":
            return as_response(request, input("?   the server asks for your roots (URIs, space-separated): ").split())
    except EOFError:
        print()
        if method == "sampling/createMessage":
            raise ClientError("the sampling request was not answered") from None
        return {"action": "decline"} if method == "elicitation/create" else {"roots": []}
    raise ClientError(f"the server asks for {method}, which this client cannot answer")


class Answerer:
    """Answers input requests: from --answer values in order, then from the terminal if there is one."""

    def __init__(self, answers: list[Any], interactive: bool) -> None:
        self.answers = list(answers)
        self.interactive = interactive

    @property
    def capabilities(self) -> dict[str, Any]:
        """What to declare: only the kinds of question this client can answer (else the server asks none)."""
        if not (self.answers or self.interactive):
            return {}
        return {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}

    def answer(self, key: str, request: dict[str, Any], where: str) -> dict[str, Any]:
        method = request.get("method")
        message = (request.get("params") or {}).get("message")
        print(f"    input request {key!r}: {method}" + (f" {message!r}" if message else ""))
        if self.answers:
            return as_response(request, self.answers.pop(0))
        if self.interactive:
            return ask_user(request)
        raise ClientError(f"{where} asks for input ({key!r}: {method}) and no --answer is left to give it")


# --- one tool, as a task --------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace, answerer: Answerer) -> None:
        self.url: str = args.url
        self.verbose: bool = args.verbose
        self.poll_interval: float | None = args.poll_interval
        self.deadline = None if args.timeout is None else time.monotonic() + args.timeout
        self.timeout: float | None = args.timeout
        self.answerer = answerer
        self.task_id: str | None = None  # a task this client has not seen end: cancelled if the client gives up

    def call(self, method: str, params: dict[str, Any], *, name: str | None = None) -> dict[str, Any]:
        if method == "tools/call":  # a call that is not made a task answers when the tool is done
            timeout = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.1)
        else:
            timeout = 30.0
        return rpc(self.url, method, params, name=name, quiet=not self.verbose, timeout=timeout)

    def meta(self) -> dict[str, Any]:
        return envelope(capabilities=self.answerer.capabilities)

    def discover(self) -> None:
        result = result_of(self.call("server/discover", {"_meta": self.meta()}), "server/discover")
        info = (result.get("_meta") or {}).get("io.modelcontextprotocol/serverInfo") or {}
        offered = TASKS in ((result.get("capabilities") or {}).get("extensions") or {})
        print(f"{self.url}: {info.get('name') or 'an MCP server'}, {TASKS} {'offered' if offered else 'NOT offered'}")
        if not offered:
            print(f"warning: {self.url} does not offer {TASKS}; calls will not become tasks", file=sys.stderr)

    def tool(self, tool: str, arguments: dict[str, Any]) -> int:
        params: dict[str, Any] = {"name": tool, "arguments": arguments, "_meta": self.meta()}
        for _ in range(MAX_MRTR_ROUNDS + 1):
            result = result_of(self.call("tools/call", params, name=tool), f"tools/call {tool}")
            kind = result.get("resultType", "complete")
            if kind == "task":
                print(f"<-- CreateTaskResult {json.dumps(result)}")
                return self.follow(result)
            if kind != "input_required":
                print(f"<-- {json.dumps(result)}")
                return finish(result)
            # A synchronous MRTR round (before any task): answer, then retry with a new id and the same state.
            print("    tools/call: input_required (a synchronous round, before any task)")
            requests = result.get("inputRequests") or {}
            params = {"name": tool, "arguments": arguments, "_meta": self.meta()}
            if requests:
                params["inputResponses"] = {
                    key: self.answerer.answer(key, request, f"tools/call {tool}") for key, request in requests.items()
                }
            if "requestState" in result:
                params["requestState"] = result["requestState"]
        raise ClientError(f"tools/call {tool}: still input_required after {MAX_MRTR_ROUNDS} rounds")

    def follow(self, task: dict[str, Any]) -> int:
        """Poll tasks/get until the task ends; answer its input requests on the way."""
        task_id = task["taskId"]
        self.task_id = task_id
        answered: set[str] = set()
        last = (task.get("status"), task.get("statusMessage"))
        while task.get("status") not in TERMINAL:
            interval = self.poll_interval or (task.get("pollIntervalMs") or 1000) / 1000
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    status = task.get("status")
                    raise ClientError(f"task {task_id} did not finish within {self.timeout:g} s (status {status})")
                interval = min(interval, left)
            time.sleep(interval)
            answer = self.call("tasks/get", {"taskId": task_id, "_meta": self.meta()}, name=task_id)
            task = result_of(answer, f"tasks/get {task_id}")
            line = (task.get("status"), task.get("statusMessage"))
            if line != last:
                print(f"    tasks/get: status={line[0]!r} statusMessage={line[1]!r}")
                last = line
            if task.get("status") == "input_required":
                pending = {k: v for k, v in (task.get("inputRequests") or {}).items() if k not in answered}
                if pending:
                    responses = {k: self.answerer.answer(k, v, f"task {task_id}") for k, v in pending.items()}
                    update = {"taskId": task_id, "inputResponses": responses, "_meta": self.meta()}
                    result_of(self.call("tasks/update", update, name=task_id), f"tasks/update {task_id}")
                    print(f"    tasks/update: answered {', '.join(map(repr, responses))}")
                    answered.update(responses)
        self.task_id = None
        print(f"<-- {json.dumps(task)}")
        status = task["status"]
        if status == "completed":
            return finish(task.get("result") or {})
        if status == "failed":
            error = task.get("error")
            hint = ""
            if isinstance(error, dict) and error.get("code") == -32021 and not self.answerer.capabilities:
                hint = " (give --answer, or run on a terminal, to answer the server's questions)"
            print(f"error: task {task_id} failed: {describe(error)}{hint}", file=sys.stderr)
        else:
            print(f"error: task {task_id} was cancelled: {task.get('statusMessage') or ''}".rstrip(), file=sys.stderr)
        return 1

    def abandon(self) -> None:
        """tasks/cancel for the task the client leaves behind (timeout, Ctrl-C, a question it cannot answer)."""
        if self.task_id is None:
            return
        task_id, self.task_id = self.task_id, None
        try:
            answer = rpc(self.url, "tasks/cancel", {"taskId": task_id, "_meta": self.meta()}, name=task_id, quiet=True)
        except ClientError as exc:
            print(f"note: could not cancel task {task_id}: {exc}", file=sys.stderr)
            return
        outcome = "cancelled" if "result" in answer else f"not cancelled: {describe(answer.get('error'))}"
        print(f"note: task {task_id} {outcome}", file=sys.stderr)


def finish(result: dict[str, Any]) -> int:
    """Print a CallToolResult's text for people; 0 unless it is an error result."""
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    if texts:
        print("\n".join(texts))
    elif "structuredContent" in result:
        print(json.dumps(result["structuredContent"]))
    if result.get("isError"):
        print("error: the tool reported an error (isError: true)", file=sys.stderr)
        return 1
    return 0


# --- the walk-through of the quick start (examples/demo.py calls main(url)) ------------------------------------


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise ClientError(f"walk-through: {what}")


def follow(url: str, task: dict[str, Any], *, until: tuple[str, ...] = TERMINAL) -> dict[str, Any]:
    """Poll tasks/get at the interval the proxy suggests, until the task reaches one of `until`."""
    task_id = task["taskId"]
    last_status = None
    while True:
        time.sleep(task.get("pollIntervalMs", 1000) / 1000)
        answer = rpc(url, "tasks/get", {"taskId": task_id, "_meta": envelope()}, name=task_id, quiet=True)
        task = result_of(answer, f"tasks/get {task_id}")
        line = (task["status"], task.get("statusMessage"))
        if line != last_status:
            print(f"    tasks/get: status={task['status']!r} statusMessage={task.get('statusMessage')!r}")
            last_status = line
        if task["status"] in until:
            print(f"<-- {json.dumps(answer)}")
            return task


def follow_by_notifications(url: str, task_id: str) -> dict[str, Any]:
    """subscriptions/listen with notifications.taskIds: the proxy pushes the task's state; no polling."""
    message = {
        "jsonrpc": "2.0",
        "id": next(_ids),
        "method": "subscriptions/listen",
        "params": {"notifications": {"taskIds": [task_id]}, "_meta": envelope()},
    }
    print(f"\n--> {json.dumps(message)}")
    task: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> None:
        nonlocal task
        if event.get("method") == "notifications/tasks":
            task = event["params"]
            print(f"<-- notifications/tasks: status={task['status']!r} statusMessage={task.get('statusMessage')!r}")
        else:
            print(f"<-- {json.dumps(event)}")

    answer = exchange(url, message, timeout=60, on_event=on_event)  # ends when every task it follows has ended
    print(f"<-- {json.dumps(answer)}")
    return task


def walkthrough(url: str) -> int:
    print(f"Talking to {url}")
    rpc(url, "server/discover", {"_meta": envelope()})

    print("\n# A slow tool, made a task by the policy: the answer is a CreateTaskResult at once.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 4}, "_meta": envelope()},
        name="slow_report",
    )
    final = follow(url, result_of(created, "tools/call slow_report"))
    expect(final["status"] == "completed", f"slow_report ended {final['status']}")

    print("\n# A tool that asks who the report is for: the question arrives as the task's inputRequests.")
    created = rpc(
        url,
        "tools/call",
        {"name": "personal_report", "arguments": {"topic": "tides", "seconds": 2}, "_meta": envelope(elicitation=True)},
        name="personal_report",
    )
    task = follow(url, result_of(created, "tools/call personal_report"), until=("input_required", *TERMINAL))
    expect(task["status"] == "input_required", f"personal_report is {task['status']}, not input_required")
    # Answer every outstanding request, under the keys the task gave (a real client would ask its user here).
    answers = {key: {"action": "accept", "content": {"name": "Ada"}} for key in task["inputRequests"]}
    task_id = task["taskId"]
    rpc(url, "tasks/update", {"taskId": task_id, "inputResponses": answers, "_meta": envelope()}, name=task_id)
    final = follow(url, task)
    expect(final["status"] == "completed", f"personal_report ended {final['status']}")

    print("\n# The same slow tool without declaring the extension: an ordinary call, kept alive while it runs.")
    rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 1}, "_meta": envelope(declare_tasks=False)},
        name="slow_report",
        timeout=60,
    )

    print("\n# Cancel: tasks/cancel is acknowledged, and the upstream call is stopped.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "volcanoes", "seconds": 30}, "_meta": envelope()},
        name="slow_report",
    )
    task_id = result_of(created, "tools/call slow_report")["taskId"]
    rpc(url, "tasks/cancel", {"taskId": task_id, "_meta": envelope()}, name=task_id)
    rpc(url, "tasks/get", {"taskId": task_id, "_meta": envelope()}, name=task_id)

    print("\n# Follow a task by notifications (subscriptions/listen) instead of polling.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "comets", "seconds": 2}, "_meta": envelope()},
        name="slow_report",
    )
    final = follow_by_notifications(url, result_of(created, "tools/call slow_report")["taskId"])
    expect(final.get("status") == "completed", f"the followed task ended {final.get('status')}")

    print("\n# A fast tool the policy leaves alone passes straight through.")
    rpc(url, "tools/call", {"name": "add", "arguments": {"a": 2, "b": 3}, "_meta": envelope()}, name="add")
    print(
        "\nDone: three tasks completed (one after asking for input, one followed by notifications), one cancelled, "
        "one call without tasks kept alive, one call passed through."
    )
    return 0


main = walkthrough  # examples/demo.py runs the walk-through as task_client.main(url)


# --- the command line -------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit status 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _answer(text: str) -> Any:
    """An --answer: JSON when it parses as JSON, else the text itself (`--answer 'Paris.'`)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _json(what: str, text: str, parser: Parser) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        parser.error(f"{what} is not valid JSON ({exc}): {text!r}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="task_client.py",
        usage="%(prog)s [options] URL [TOOL [JSON_ARGUMENTS]]",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="the MCP endpoint of the proxy, e.g. http://127.0.0.1:8080/mcp")
    parser.add_argument("tool", metavar="TOOL", nargs="?", help="the tool to call (omit it for the walk-through)")
    parser.add_argument(
        "arguments", metavar="JSON_ARGUMENTS", nargs="?", default="{}", help="the tool's arguments, a JSON object"
    )
    parser.add_argument(
        "--answer",
        metavar="JSON|TEXT",
        action="append",
        default=[],
        help="an answer to the next question the server asks (repeat for several): an ElicitResult, or just its "
        'content (\'{"name": "Ada"}\'), or plain text for a form of one field; for sampling a CreateMessageResult or '
        "just a string; for roots a list of "
        "URIs. Without it the client asks on a terminal, or declares no elicitation/sampling/roots at all",
    )
    parser.add_argument(
        "--poll-interval",
        metavar="SECONDS",
        type=float,
        help="poll tasks/get this often (default: the task's pollIntervalMs)",
    )
    parser.add_argument(
        "--timeout", metavar="SECONDS", type=float, help="give up (and cancel the task) after this long (default: none)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every request and response on the wire")
    args = parser.parse_args(argv)

    parts = urllib.parse.urlsplit(args.url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        parser.error(f"URL must be an http:// or https:// URL such as http://127.0.0.1:8080/mcp, not {args.url!r}")
    if args.tool is not None and not args.tool.strip():
        parser.error("TOOL is empty")
    arguments = _json("JSON_ARGUMENTS", args.arguments, parser)
    if not isinstance(arguments, dict):
        parser.error(f'JSON_ARGUMENTS must be a JSON object such as \'{{"topic": "tides"}}\', not {args.arguments!r}')
    args.arguments = arguments
    args.answer = [_answer(text) for text in args.answer]
    for option in ("poll_interval", "timeout"):
        value = getattr(args, option)
        if value is not None and not value > 0:
            parser.error(f"--{option.replace('_', '-')} must be a positive number of seconds, not {value:g}")
    return args


def cli(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tool is None:
        try:
            return walkthrough(args.url)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    run = Run(args, Answerer(args.answer, interactive=sys.stdin.isatty()))
    try:
        run.discover()
        return run.tool(args.tool, args.arguments)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        run.abandon()
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        run.abandon()
        return 130


if __name__ == "__main__":
    sys.exit(cli())
