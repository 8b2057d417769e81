"""The 2025-11-25 tasks utility (SEP-1686), served by the proxy to 2025-era clients for the tools its policy names.

The tasks are the proxy's own, from the same runner, store, limits and ownership as SEP-2663 tasks: `initialize`
gains the server's `tasks` capability, `tools/list` shows each rule's `execution.taskSupport`, and a `tools/call`
with `params.task` returns the 2025 `CreateTaskResult` at once while the call runs on the client's own session.
`tasks/get`, `tasks/list` (the caller's tasks on that session only), `tasks/cancel` and `tasks/result` follow.
`tasks/result` blocks until the task ends; meanwhile it is the side channel on which the server's questions reach
the client (with `related-task` metadata), answered back as a durable call's are (proxy/clients/durable.py).

An upstream with SEP-1686 tasks of its own keeps them: then nothing here runs, and its tasks pass through.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from cachetools import LRUCache

from ..config import TaskMode, ToolRule
from ..jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    JsonRpcError,
    dumps,
    error_response,
    result_response,
)
from ..security import Identity, PollGuard, caller_of
from ..store.base import TaskStore
from ..tasks.job import Slots, ToolCall
from ..tasks.model import TaskRecord, TaskStatus, format_time, is_task_id
from ..tasks.runner import TaskRunner
from . import idempotency
from .durable import SEP1686_KIND, upstream_parts
from .durable_stream import DurableStream, related_task_meta
from .envelope import params_of, progress_token
from .translated2025 import Translated2025
from .translation2025 import result_2025

log = structlog.get_logger(__name__)

KIND = SEP1686_KIND
VERSION = "2025-11-25"
METHODS = frozenset({"tasks/get", "tasks/result", "tasks/list", "tasks/cancel"})
CAPABILITY = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
PAGE_SIZE = 50
FINISHED_VIEWS = 10_000
"""Views of finished tasks a replica keeps for tasks/get with the Redis store (a few hundred bytes each)."""
LIST_READ_BYTES = 4 * 1024 * 1024
"""The stored records one tasks/list page reads (with the Redis store, where reading one decodes its result): past
it the page ends early, with a cursor; a page reads one record at least."""
_CURSOR_PREFIX = "mtp1c:"
_CURSOR = re.compile(r"mtp1c:([0-9]{1,20}):([A-Za-z0-9_-]{16,64})")


def has_tool_tasks(result: dict[str, Any]) -> bool:
    """Whether an initialize result declares SEP-1686 tasks for tools/call (the server's own)."""
    capabilities = result.get("capabilities")
    tasks = capabilities.get("tasks") if isinstance(capabilities, dict) else None
    requests = tasks.get("requests") if isinstance(tasks, dict) else None
    tools = requests.get("tools") if isinstance(requests, dict) else None
    return isinstance(tools, dict) and "call" in tools


def advertise(result: dict[str, Any], *, anonymous: bool) -> None:
    """initialize: a 2025-11-25 session gains the proxy's `tasks` capability, unless the server has its own. An
    `anonymous` caller (no credentials, and a server without sessions) is offered no tasks/list: nothing would tell
    its tasks from others'."""
    if result.get("protocolVersion") != VERSION or has_tool_tasks(result):
        return
    capabilities = result.get("capabilities")
    if not isinstance(capabilities, dict):
        capabilities = result["capabilities"] = {}
    capabilities["tasks"] = {key: value for key, value in CAPABILITY.items() if not (anonymous and key == "list")}


def mark_tools(result: dict[str, Any], rule_for: Callable[[str], ToolRule | None]) -> None:
    """tools/list: each tool a rule runs as a task says so (`execution.taskSupport`)."""
    tools = result.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        name = tool.get("name") if isinstance(tool, dict) else None
        rule = rule_for(name) if isinstance(name, str) else None
        if rule is None or rule.task is TaskMode.NEVER:
            continue
        execution = tool.get("execution")
        if not isinstance(execution, dict):
            execution = tool["execution"] = {}
        # The server has no tasks (else this does not run): whatever it says of its tools' taskSupport (SDKs
        # write "forbidden" by default), the tasks are the proxy's.
        execution["taskSupport"] = rule.task.value


def _stream_of(message: dict[str, Any], session_tag: str) -> dict[str, Any]:
    """What a SEP-1686 task's record keeps of its client; its progressToken stays valid for the task's life."""
    stream: dict[str, Any] = {"kind": KIND, "id": message["id"], "session": session_tag}
    token = progress_token(message)
    if token is not None:
        stream["token"] = token
    return stream


def task_view(record: TaskRecord) -> dict[str, Any]:
    """The 2025-11-25 Task of a record."""
    status = record.status.value
    if record.status is TaskStatus.COMPLETED and isinstance(record.result, dict) and record.result.get("isError"):
        status = "failed"  # SEP-1686: a tool result with isError true is a failed task (its result is still read)
    task: dict[str, Any] = {
        "taskId": record.task_id,
        "status": status,
        "createdAt": format_time(record.created_at),
        "lastUpdatedAt": format_time(record.last_updated_at),
        "ttl": record.ttl_ms,
        "pollInterval": record.poll_interval_ms,
    }
    if record.status_message is not None:
        task["statusMessage"] = record.status_message
    return task


def _score(record: TaskRecord) -> int:
    """A task's place in its caller's list: when it expires (for tasks of one TTL, the order they were made in),
    so that expired entries are dropped by score."""
    return int(record.created_at.timestamp() * 1_000_000) + record.ttl_ms * 1000


def _cursor(score: int, task_id: str) -> str:
    return base64.urlsafe_b64encode(f"{_CURSOR_PREFIX}{score}:{task_id}".encode()).decode()


def _after(cursor: Any) -> tuple[int, str] | None:
    if cursor is None:
        return None
    try:
        text = base64.urlsafe_b64decode(cursor.encode() if isinstance(cursor, str) else b"").decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    match = _CURSOR.fullmatch(text)
    if match is None:
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: unknown cursor", http_status=200)
    return int(match.group(1)), match.group(2)


def _terminal(record: TaskRecord) -> JsonRpcError:
    status = task_view(record)["status"]
    return JsonRpcError(INVALID_PARAMS, f"Cannot cancel a task in a terminal status ({status})", http_status=200)


def _not_found() -> JsonRpcError:
    return JsonRpcError(INVALID_PARAMS, "Failed to retrieve task: Task not found", http_status=200)


@dataclass(frozen=True, slots=True)
class _FinishedView:
    principal: str
    session: Any
    view: dict[str, Any]
    poll_interval_ms: int
    size: int
    """The stored record's length when it was read: checked (STRLEN, no read) on every use. Expired, evicted or
    deleted, it is 0. (Views are kept for random ids only, which never come back.)"""


class Tasks2025:
    def __init__(
        self,
        runner: TaskRunner,
        store: TaskStore,
        identity: Identity,
        poll_guard: PollGuard,
        translated: Translated2025 | None = None,
    ) -> None:
        self._translated = translated
        self._runner = runner
        self._store = store
        self._identity = identity
        self._poll_guard = poll_guard
        self._finished: LRUCache[str, _FinishedView] | None = LRUCache(FINISHED_VIEWS) if store.shared else None
        """With Redis, a finished task's view: its tasks/get answered without reading (and decoding) its record,
        result included, again; a finished record does not change, and its length says it is still the one seen."""

    async def create(
        self, request: web.Request, message: dict[str, Any], rule: ToolRule, slots: Slots | None = None
    ) -> web.Response:
        """tools/call with `params.task`: the 2025 CreateTaskResult, the call running on the client's session."""
        params = dict(params_of(message))
        options = params.pop("task")
        if not isinstance(options, dict):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: task must be an object", http_status=200)
        ttl_ms = rule.ttl_ms or self._runner.default_ttl_ms()
        requested = options.get("ttl")
        if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
            ttl_ms = min(ttl_ms, requested)  # a receiver may shorten what is asked, never outlive its own limit
        headers = request.headers
        principal = self._identity.principal(headers)
        session_tag = self._identity.session_tag(headers)
        # The server never sees params.task: the task is the proxy's.
        sent, kept, capabilities, session = await upstream_parts(
            self._translated, self._identity, {**message, "params": params}, headers
        )
        call = ToolCall(
            tool=params["name"],
            message=sent,
            headers=kept,
            capabilities=capabilities,
            principal=principal,
            credential=self._identity.credential(headers),
            caller=caller_of(principal, request.remote),
            stream=_stream_of(message, session_tag),
            client_session=session,
            slots=slots,
        )
        key = idempotency.key_of(message, headers)
        rule = rule.model_copy(update={"sync_window_ms": 0, "ttl_ms": ttl_ms})
        if key is not None:  # the same task for the same key (the record's own TTL, whatever this one asks)
            call.message = idempotency.without_key(call.message)
            call.task_id = self._identity.keyed_task_id(principal, call.tool, key, "sep1686")
            call.fingerprint = idempotency.fingerprint(call.tool, params.get("arguments"))
            record = await self._runner.submit_keyed(call, rule, key)
            if (record.stream or {}).get("session") != session_tag:
                raise idempotency.other_session(key)
        else:
            record = await self._runner.submit(call, rule)
        assert isinstance(record, TaskRecord)
        if principal or session_tag:  # an anonymous caller without a session has no list of its own
            await self._store.index_add(
                self._index(principal, session_tag), record.task_id, _score(record), record.ttl_ms
            )
        log.info("sep1686_task_created", task_id=record.task_id, tool=record.tool)
        return _json(result_response(message["id"], {"task": task_view(record)}))

    async def handle(
        self, request: web.Request, message: dict[str, Any], rule_for: Callable[[str], ToolRule | None]
    ) -> web.StreamResponse:
        method = message["method"]
        params = params_of(message)
        if method == "tasks/list":
            return _json(result_response(message["id"], await self._list(request, params.get("cursor"))))
        if method == "tasks/get":
            task_id, view, poll_interval_ms = await self._view(request, params.get("taskId"))
            self._poll_guard.check(task_id, poll_interval_ms)
            return _json(result_response(message["id"], view))
        record = await self._owned(request, params.get("taskId"))
        if method == "tasks/cancel":
            if record.is_terminal:
                raise _terminal(record)
            cancelled = await self._runner.cancel(record.task_id, record.principal)
            if cancelled is None:
                raise _not_found()
            if cancelled.status is not TaskStatus.CANCELLED:  # it ended first, in a race with this request
                raise _terminal(cancelled)
            return _json(result_response(message["id"], task_view(cancelled)))
        return await self._result(request, message, record, rule_for(record.tool))

    async def _result(
        self, request: web.Request, message: dict[str, Any], record: TaskRecord, rule: ToolRule | None
    ) -> web.StreamResponse:
        """tasks/result: exactly what the call answered, once it has; until then an open stream, on which the
        server's questions reach the client."""
        if record.is_terminal:
            return _json(final_answer(message["id"], record))
        keepalive_s = rule.keepalive_s if rule is not None else 15.0
        stream = DurableStream(self._runner, self._store, keepalive_s=keepalive_s, max_stream_s=float("inf"))
        return await stream.serve(request, record, None, reply_to=message["id"])

    async def _list(self, request: web.Request, cursor: Any) -> dict[str, Any]:
        principal = self._identity.principal(request.headers)
        session_tag = self._identity.session_tag(request.headers)
        if not (principal or session_tag):
            raise JsonRpcError(
                METHOD_NOT_FOUND,
                "tasks/list is not offered to a caller without credentials on a server without sessions",
                http_status=200,
            )
        index = self._index(principal, session_tag)
        last = _after(cursor)
        tasks: list[dict[str, Any]] = []
        read = 0  # bytes of stored records read for this page: a record holds its result, up to max_result_bytes
        full = False
        while not full:
            page = await self._store.index_page(index, last, PAGE_SIZE - len(tasks))
            if not page:
                break
            gone = []
            sizes = await self._store.sizes([task_id for task_id, _ in page])
            for (task_id, score), size in zip(page, sizes, strict=True):
                if read and read + size > LIST_READ_BYTES:
                    full = True  # the rest on the next page: listing costs about what it answers, not 50 results
                    break
                read += size
                last = (score, task_id)
                record = await self._store.get(task_id)
                if record is None or record.principal != principal:
                    gone.append(task_id)
                else:
                    tasks.append(task_view(record))
            await self._store.index_remove(index, gone)
            full = full or len(tasks) == PAGE_SIZE
        result: dict[str, Any] = {"tasks": tasks}
        if full and last is not None and await self._store.index_page(index, last, 1):
            result["nextCursor"] = _cursor(*last)
        return result

    async def _view(self, request: web.Request, task_id: Any) -> tuple[str, dict[str, Any], int]:
        """tasks/get: the caller's task's id, view and poll interval."""
        finished = self._finished.get(task_id) if self._finished is not None and isinstance(task_id, str) else None
        if finished is not None:
            if await self._store.sizes([task_id]) != [finished.size]:
                self._finished.pop(task_id, None)  # type: ignore[union-attr]  # not the record seen: read it again
            elif (finished.principal, finished.session) != (
                self._identity.principal(request.headers),
                self._identity.session_tag(request.headers),
            ):
                raise _not_found()  # another caller's, or another session's: unknown, as its record would say
            else:
                return task_id, finished.view, finished.poll_interval_ms
        record = await self._owned(request, task_id)
        view = task_view(record)
        if self._finished is not None and record.is_terminal and record.fingerprint is None:
            # Only a random id's: a key's task (fingerprint) may be made again under its id once it expired, with
            # a record of the same length; a random id never comes back.
            assert record.stream is not None  # _owned checked it
            (size,) = await self._store.sizes([record.task_id])  # a finished record no longer changes
            if size:
                self._finished[record.task_id] = _FinishedView(
                    record.principal, record.stream.get("session"), view, record.poll_interval_ms, size
                )
        return record.task_id, view, record.poll_interval_ms

    async def _owned(self, request: web.Request, task_id: Any) -> TaskRecord:
        """The caller's own 2025 task on this session; any other id answers as an unknown one."""
        if not isinstance(task_id, str):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: taskId must be a string", http_status=200)
        if not is_task_id(task_id):
            raise _not_found()
        record = await self._store.get(task_id)
        if (
            record is None
            or record.stream is None
            or record.stream.get("kind") != KIND
            or record.principal != self._identity.principal(request.headers)
            or record.stream.get("session") != self._identity.session_tag(request.headers)
        ):
            raise _not_found()
        await self._runner.credentials.shown(record, request.headers)
        return record

    @staticmethod
    def _index(principal: str, session_tag: str) -> str:
        return f"{KIND}:{principal}:{session_tag}"


def final_answer(request_id: Any, record: TaskRecord) -> dict[str, Any]:
    """tasks/result of a terminal task: the call's own result or error, with related-task metadata on a result."""
    if record.status is TaskStatus.COMPLETED and isinstance(record.result, dict):
        result = result_2025(record.result)  # a 2026-07-28 server's, without what 2025 lacks
        meta = {**(result.get("_meta") or {}), **related_task_meta(record.task_id)}
        return result_response(request_id, {**result, "_meta": meta})
    if record.status is TaskStatus.FAILED and isinstance(record.error, dict):
        return error_response(request_id, record.error)
    reason = record.status_message or "the task was cancelled"
    return error_response(request_id, {"code": INTERNAL_ERROR, "message": f"Task cancelled: {reason}"})


def _json(message: dict[str, Any]) -> web.Response:
    return web.Response(body=dumps(message), content_type="application/json")
