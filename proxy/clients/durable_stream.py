"""A durable call's event stream, derived from its task's record (proxy/clients/durable.py says what durable calls are).

Event ids are `mtp.<task id>.<record revision>.<n>`: the revision is the record's lastUpdatedAt in microseconds, and n
counts the events sent for that revision, so a resumed stream sends only what came after, on any replica. The
stream's messages: the server's questions (ids `mtp-in.<task id>.<input key>`), progress or comments as keep-alive,
and the final answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from typing import Any

from aiohttp import web

from ..jsonrpc import INTERNAL_ERROR, error_object
from ..store.base import StoreUnavailable, TaskStore
from ..tasks.model import TaskRecord, TaskStatus
from ..tasks.runner import TaskRunner
from ..upstream.http.sse import KEEP_ALIVE, event_bytes, message_event
from ..upstream.routing import RELATED_TASK
from .translation2025 import result_2025

RESUMABLE_VERSIONS = frozenset({"2025-11-25"})
"""Client protocol versions whose streams may be closed and resumed (priming events came with 2025-11-25)."""
RETRY_MS = 1000
"""The reconnection delay a resumable stream asks for."""
ANSWER_PREFIX = "mtp-in."
"""Ids of the server requests a durable stream relays: `mtp-in.<task id>.<input key>`."""
_EVENT_ID = re.compile(r"mtp\.([A-Za-z0-9_-]{16,64})\.([0-9]{1,20})\.([0-9]{1,6})")
"""The proxy's event ids, `mtp.<task id>.<revision>.<n>`: any other Last-Event-ID is the server's, and goes there."""
STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def related_task_meta(task_id: str) -> dict[str, Any]:
    return {RELATED_TASK: {"taskId": task_id}}


def revision(record: TaskRecord) -> int:
    return int(record.last_updated_at.timestamp() * 1_000_000)


def event_id(task_id: str, revision: int, n: int) -> str:
    return f"mtp.{task_id}.{revision}.{n}"


def parse_event_id(value: str | None) -> tuple[str, int, int] | None:
    match = _EVENT_ID.fullmatch(value or "")
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


@dataclasses.dataclass
class _Position:
    """Where the client's stream stands: the last event sent, as (revision, n)."""

    revision: int
    n: int
    progress: float = 0.0
    """The last progress value sent: each notifications/progress must carry a larger one."""
    asked: set[str] = dataclasses.field(default_factory=set)
    """Input keys asked on this stream: a record that changes as answers come in is not asked again."""


class DurableStream:
    """Serves one durable call's event stream: from its start (the POST) or after an event id (a resume)."""

    def __init__(self, runner: TaskRunner, store: TaskStore, *, keepalive_s: float, max_stream_s: float) -> None:
        self._runner = runner
        self._store = store
        self._keepalive_s = keepalive_s
        self._max_stream_s = max_stream_s

    async def serve(
        self,
        request: web.Request,
        record: TaskRecord,
        after: tuple[int, int] | None,
        *,
        reply_to: Any = None,
        answer_as: Any = None,
        kept: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """The stream from its start (`after` None) or after an event. With `reply_to`, it answers a SEP-1686
        `tasks/result` of that id instead of the call itself, and every message carries related-task metadata.
        With `answer_as`, it answers another request of the same call (one sent again with its idempotency key):
        not resumable, as its event ids would name the first request; the key is what finds the call again.
        With `kept`, a 2026 client's keyed kept-alive call (proxy/clients/kept_alive.py): its request id, progress token
        and the requestState of its input rounds (`mrtr`), which end the stream as MRTR answers."""
        stream = dict(record.stream or {}) if kept is None else kept
        if reply_to is not None:
            stream.update(id=reply_to, related=True, resumable=False)
        elif answer_as is not None:
            stream.update(id=answer_as, resumable=False)
        resumable = bool(stream.get("resumable"))
        response = web.StreamResponse(headers=STREAM_HEADERS)
        queue = self._runner.watchers.watch([record.task_id], progress=True)
        try:
            # Read again now that changes are watched: one made since the caller read it (a call that failed at
            # once) would otherwise wait for the next keep-alive tick.
            with contextlib.suppress(StoreUnavailable):
                record = await self._store.get(record.task_id) or record
            await response.prepare(request)
            if after is None:
                position = _Position(revision(record), 0)
                if resumable:  # the priming event: an id to resume from before anything else is said
                    primer = event_id(record.task_id, position.revision, 0)
                    await response.write(event_bytes(b"", event=None, event_id=primer, retry_ms=RETRY_MS))
                position.revision -= 1  # the record's state itself is still to be sent
            else:
                position = _Position(*after)
                # A priming event again, on the id resumed from: clients resume only streams that began with one.
                primer = event_id(record.task_id, position.revision, position.n)
                await response.write(event_bytes(b"", event=None, event_id=primer, retry_ms=RETRY_MS))
            deadline = time.monotonic() + self._max_stream_s if resumable else None
            await self._follow(response, record, position, queue, deadline, stream)
            await response.write_eof()
        finally:
            self._runner.watchers.unwatch([record.task_id], queue)
        return response

    async def _follow(
        self,
        response: web.StreamResponse,
        record: TaskRecord | None,
        position: _Position,
        queue: asyncio.Queue[str],
        deadline: float | None,
        stream: dict[str, Any],
    ) -> None:
        task_id = record.task_id if record is not None else ""
        principal = record.principal if record is not None else ""
        while True:
            if record is None or record.principal != principal:
                error = error_object(INTERNAL_ERROR, "The call's result has expired (its task's TTL ended)")
                await response.write(message_event({"jsonrpc": "2.0", "id": stream.get("id"), "error": error}))
                return
            news = revision(record) > position.revision or record.status is TaskStatus.INPUT_REQUIRED
            if news and await self._send_state(response, record, stream, position):
                return
            if record.is_terminal:
                return  # resumed after the final event itself: the client has everything
            wait_s = self._keepalive_s
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return  # closed on purpose: the client resumes with GET and Last-Event-ID
            changed = asyncio.ensure_future(queue.get())
            try:
                done, _ = await asyncio.wait([changed], timeout=wait_s)
            finally:
                changed.cancel()  # (also when the client left mid-wait: a pending get would be destroyed later)
            if not done and (deadline is None or time.monotonic() < deadline):
                await self._keepalive(response, record, stream, position)
            try:
                record = await self._store.get(task_id)
            except StoreUnavailable:
                continue  # logged by the store; the stream stays open and the next tick reads again

    async def _send_state(
        self, response: web.StreamResponse, record: TaskRecord, stream: dict[str, Any], position: _Position
    ) -> bool:
        """The events the record's state calls for that the client has not had; True once the stream is done."""
        current = revision(record)
        skip = position.n if current == position.revision else 0
        n = 0
        if record.status is TaskStatus.INPUT_REQUIRED and "mrtr" in stream:
            # A 2026 client is asked by the call's answer: its retry, with this state, brings the answers.
            requests = record.input_requests or {}
            result = {"resultType": "input_required", "inputRequests": requests, "requestState": stream["mrtr"]}
            await response.write(message_event({"jsonrpc": "2.0", "id": stream.get("id"), "result": result}))
            return True
        if record.status is TaskStatus.INPUT_REQUIRED:
            for key, question in (record.input_requests or {}).items():
                n += 1
                if n <= skip or key in position.asked:
                    continue
                position.asked.add(key)
                asked = f"{record.task_id}.{key}"
                message = {"jsonrpc": "2.0", "id": f"{ANSWER_PREFIX}{asked}", **_question(question, asked)}
                if stream.get("related"):  # SEP-1686: a task's requests say which task they are for
                    params = message.setdefault("params", {})
                    params["_meta"] = {**(params.get("_meta") or {}), **related_task_meta(record.task_id)}
                await response.write(message_event(message, event_id=self._id(stream, record, n)))
        elif record.is_terminal:
            await response.write(message_event(_final(record, stream), event_id=self._id(stream, record, 1)))
            return True
        elif record.status_message and "token" in stream:
            await self._progress(response, record, stream, position)
        position.revision, position.n = current, max(n, skip)
        return False

    def _id(self, stream: dict[str, Any], record: TaskRecord, n: int) -> str | None:
        return event_id(record.task_id, revision(record), n) if stream.get("resumable") else None

    async def _keepalive(
        self, response: web.StreamResponse, record: TaskRecord, stream: dict[str, Any], position: _Position
    ) -> None:
        if "token" in stream:
            await self._progress(response, record, stream, position)
        else:
            await response.write(KEEP_ALIVE)

    async def _progress(
        self, response: web.StreamResponse, record: TaskRecord, stream: dict[str, Any], position: _Position
    ) -> None:
        # Seconds since the call began: larger at every notification, on any replica, across resumed streams.
        elapsed = time.time() - record.created_at.timestamp()
        position.progress = round(max(elapsed, position.progress + 0.001), 3)
        params: dict[str, Any] = {"progressToken": stream["token"], "progress": position.progress}
        if record.status_message:
            params["message"] = record.status_message
        await response.write(message_event({"jsonrpc": "2.0", "method": "notifications/progress", "params": params}))


def _question(question: Any, asked: str) -> dict[str, Any]:
    if not isinstance(question, dict):
        return {"method": "ping"}
    out: dict[str, Any] = {"method": question.get("method")}
    params = question.get("params")
    if isinstance(params, dict) and params.get("mode") == "url" and "elicitationId" not in params:
        # A 2026-07-28 server's URL elicitation names none; a 2025-11-25 client needs one.
        params = {**params, "elicitationId": asked}
    if "params" in question:
        out["params"] = params
    return out


def _final(record: TaskRecord, stream: dict[str, Any]) -> dict[str, Any]:
    result = record.result
    if isinstance(result, dict) and "mrtr" not in stream:
        result = result_2025(result)  # a 2025 client's: a 2026-07-28 server's result without what 2025 lacks
    if record.status is TaskStatus.COMPLETED and stream.get("related") and isinstance(result, dict):
        meta = {**(result.get("_meta") or {}), **related_task_meta(record.task_id)}
        return {"jsonrpc": "2.0", "id": stream.get("id"), "result": {**result, "_meta": meta}}
    if record.status is TaskStatus.COMPLETED:
        return {"jsonrpc": "2.0", "id": stream.get("id"), "result": result}
    if record.status is TaskStatus.FAILED and isinstance(record.error, dict):
        return {"jsonrpc": "2.0", "id": stream.get("id"), "error": record.error}
    reason = record.status_message or "the call was cancelled"
    return {
        "jsonrpc": "2.0",
        "id": stream.get("id"),
        "error": error_object(INTERNAL_ERROR, f"Request cancelled: {reason}"),
    }


def parse_answer_id(value: Any) -> tuple[str, str] | None:
    """(task id, input key) of a client's answer to a request a durable stream relayed; None for any other id."""
    if not isinstance(value, str) or not value.startswith(ANSWER_PREFIX):
        return None
    task_id, dot, key = value[len(ANSWER_PREFIX) :].partition(".")
    return (task_id, key) if dot and key else None
