"""Durable calls: long tool calls for clients without tasks (2025-era clients, 2026 clients without the extension).

The call runs exactly as a task does (runner, limits, store, TTL), and the client's POST is answered with an event
stream that follows the task's record until its result:

- keep-alive every `keepalive_s`: `notifications/progress` when the client sent a progressToken (clients that reset
  their timeout on progress keep waiting), else an SSE comment;
- for 2025-11-25 clients the stream is resumable (transport spec, "Resumability and Redelivery"; SEP-1699): it starts
  with a priming event and `retry`, every event has an id, the proxy closes it after `max_stream_s`, and a `GET`
  with `Last-Event-ID` picks it up on any replica, since everything the stream says is derived from the record;
- the upstream's requests during the call (elicitation, sampling, roots) reach the client on the stream, under ids
  that name the task and the input key, and its answers POSTed back go to the task as `tasks/update` answers would;
- `notifications/cancelled` naming the call's request id cancels the task: its id is derived from the caller, the
  session and that request id, so any replica finds it.

Event ids are `<task id>.<record revision>.<n>`: the revision is the record's lastUpdatedAt in microseconds, and n
counts the events sent for that revision, so a resumed stream sends only what came after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any

import structlog
from aiohttp import web

from .config import ToolRule
from .envelope import params_of
from .jsonrpc import (
    ERROR_HTTP_STATUS,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    dumps,
    error_object,
    error_response,
    result_response,
)
from .legacy import LegacySession
from .security import Identity
from .tasks.job import DirectOutcome, ToolCall
from .tasks.model import TaskRecord, TaskStatus, is_task_id, new_task_id
from .tasks.runner import TaskRunner
from .tasks.store import StoreUnavailable, TaskStore
from .upstream import Progress

log = structlog.get_logger(__name__)

RESUMABLE_VERSIONS = frozenset({"2025-11-25"})
"""Client protocol versions whose streams may be closed and resumed (priming events came with 2025-11-25)."""
RETRY_MS = 1000
"""The reconnection delay a resumable stream asks for."""
ANSWER_PREFIX = "mtp-in."
"""Ids of the server requests a durable stream relays: `mtp-in.<task id>.<input key>`."""
_EVENT_ID = re.compile(r"([A-Za-z0-9_-]{16,64})\.([0-9]{1,20})\.([0-9]{1,6})")
ALL_INPUT_KINDS = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}
"""What a 2025-era client may be asked: its own session's server knows what it declared, and asks only that."""
_MAX_GENERATIONS = 8
"""Calls one request id may name on one session, one after another (see Identity.durable_task_id)."""
_MAX_QUEUED_PROGRESS = 64
"""Progress of a kept-alive call not yet written to its client; more is dropped (the next one says as much)."""
_ENDLESS_WINDOW_MS = 30 * 24 * 3600 * 1000
"""A kept-alive call's sync window: longer than any call may take (timeout_s bounds each attempt)."""
_STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


RELATED_TASK = "io.modelcontextprotocol/related-task"


def related_task_meta(task_id: str) -> dict[str, Any]:
    return {RELATED_TASK: {"taskId": task_id}}


def wants_event_stream(headers: Any) -> bool:
    return "text/event-stream" in headers.get("Accept", "")


def client_session(headers: Any, principal: str) -> LegacySession:
    """The 2025-era client's own upstream session, as its headers name it."""
    return LegacySession(
        session_id=headers.get("Mcp-Session-Id"),
        protocol_version=headers.get("MCP-Protocol-Version", "2025-03-26"),
        principal=principal,
    )


def stream_of(message: dict[str, Any], headers: Any, session_tag: str) -> dict[str, Any]:
    """What a durable call's record keeps of its client (TaskRecord.stream)."""
    params = message.get("params") if isinstance(message.get("params"), dict) else {}
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    version = headers.get("MCP-Protocol-Version", "")
    stream: dict[str, Any] = {"id": message["id"], "session": session_tag, "resumable": version in RESUMABLE_VERSIONS}
    token = meta.get("progressToken")
    if isinstance(token, str | int) and not isinstance(token, bool):
        stream["token"] = token
    return stream


def revision(record: TaskRecord) -> int:
    return int(record.last_updated_at.timestamp() * 1_000_000)


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
        self, request: web.Request, record: TaskRecord, after: tuple[int, int] | None, *, reply_to: Any = None
    ) -> web.StreamResponse:
        """The stream from its start (`after` None) or after an event. With `reply_to`, it answers a SEP-1686
        `tasks/result` of that id instead of the call itself, and every message carries related-task metadata."""
        stream = dict(record.stream or {})
        if reply_to is not None:
            stream.update(id=reply_to, related=True, resumable=False)
        resumable = bool(stream.get("resumable"))
        response = web.StreamResponse(headers=_STREAM_HEADERS)
        queue = self._runner.watchers.watch([record.task_id])  # before reading again: no change slips between
        try:
            await response.prepare(request)
            if after is None:
                position = _Position(revision(record), 0)
                if resumable:  # the priming event: an id to resume from before anything else is said
                    await response.write(
                        f"id: {record.task_id}.{position.revision}.0\nretry: {RETRY_MS}\ndata:\n\n".encode()
                    )
                position.revision -= 1  # the record's state itself is still to be sent
            else:
                position = _Position(*after)
                # A priming event again, on the id resumed from: clients resume only streams that began with one.
                primer = f"id: {record.task_id}.{position.revision}.{position.n}\nretry: {RETRY_MS}\ndata:\n\n"
                await response.write(primer.encode())
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
                await response.write(_event(None, {"jsonrpc": "2.0", "id": stream.get("id"), "error": error}))
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
            done, _ = await asyncio.wait([changed], timeout=wait_s)
            if not done:
                changed.cancel()
                if deadline is None or time.monotonic() < deadline:
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
        if record.status is TaskStatus.INPUT_REQUIRED:
            for key, question in (record.input_requests or {}).items():
                n += 1
                if n <= skip or key in position.asked:
                    continue
                position.asked.add(key)
                message = {"jsonrpc": "2.0", "id": f"{ANSWER_PREFIX}{record.task_id}.{key}", **_question(question)}
                if stream.get("related"):  # SEP-1686: a task's requests say which task they are for
                    params = message.setdefault("params", {})
                    params["_meta"] = {**(params.get("_meta") or {}), **related_task_meta(record.task_id)}
                await response.write(_event(self._id(stream, record, n), message))
        elif record.is_terminal:
            await response.write(_event(self._id(stream, record, 1), _final(record, stream)))
            return True
        elif record.status_message and "token" in stream:
            await self._progress(response, record, stream, position)
        position.revision, position.n = current, max(n, skip)
        return False

    def _id(self, stream: dict[str, Any], record: TaskRecord, n: int) -> str | None:
        return f"{record.task_id}.{revision(record)}.{n}" if stream.get("resumable") else None

    async def _keepalive(
        self, response: web.StreamResponse, record: TaskRecord, stream: dict[str, Any], position: _Position
    ) -> None:
        if "token" in stream:
            await self._progress(response, record, stream, position)
        else:
            await response.write(b": keep-alive\n\n")

    async def _progress(
        self, response: web.StreamResponse, record: TaskRecord, stream: dict[str, Any], position: _Position
    ) -> None:
        # Seconds since the call began: larger at every notification, on any replica, across resumed streams.
        elapsed = time.time() - record.created_at.timestamp()
        position.progress = max(round(elapsed, 3), position.progress + 0.001)
        params: dict[str, Any] = {"progressToken": stream["token"], "progress": position.progress}
        if record.status_message:
            params["message"] = record.status_message
        await response.write(_event(None, {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}))


def _progress_token(message: dict[str, Any]) -> str | int | None:
    meta = params_of(message).get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return token if isinstance(token, str | int) and not isinstance(token, bool) else None


def _answer_of(request_id: Any, outcome: DirectOutcome | TaskRecord) -> tuple[dict[str, Any], int]:
    """The JSON-RPC answer to a kept-alive call, and its HTTP status when it is the whole response."""
    if isinstance(outcome, TaskRecord):  # the endless window ended after all: nothing this client can follow
        outcome = DirectOutcome(error=error_object(INTERNAL_ERROR, "Proxy failure: the call outlived its window"))
    if outcome.result is not None:
        return result_response(request_id, outcome.result), 200
    assert outcome.error is not None
    return error_response(request_id, outcome.error), ERROR_HTTP_STATUS.get(outcome.error.get("code"), 200)


def _question(question: Any) -> dict[str, Any]:
    if not isinstance(question, dict):
        return {"method": "ping"}
    out: dict[str, Any] = {"method": question.get("method")}
    if "params" in question:
        out["params"] = question["params"]
    return out


def _final(record: TaskRecord, stream: dict[str, Any]) -> dict[str, Any]:
    if record.status is TaskStatus.COMPLETED and stream.get("related") and isinstance(record.result, dict):
        meta = {**(record.result.get("_meta") or {}), **related_task_meta(record.task_id)}
        return {"jsonrpc": "2.0", "id": stream.get("id"), "result": {**record.result, "_meta": meta}}
    if record.status is TaskStatus.COMPLETED:
        return {"jsonrpc": "2.0", "id": stream.get("id"), "result": record.result}
    if record.status is TaskStatus.FAILED and isinstance(record.error, dict):
        return {"jsonrpc": "2.0", "id": stream.get("id"), "error": record.error}
    reason = record.status_message or "the call was cancelled"
    return {
        "jsonrpc": "2.0",
        "id": stream.get("id"),
        "error": error_object(INTERNAL_ERROR, f"Request cancelled: {reason}"),
    }


def _event(event_id: str | None, message: dict[str, Any]) -> bytes:
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"event: message\ndata: " + dumps(message) + b"\n\n"


def parse_answer_id(value: Any) -> tuple[str, str] | None:
    """(task id, input key) of a client's answer to a request a durable stream relayed; None for any other id."""
    if not isinstance(value, str) or not value.startswith(ANSWER_PREFIX):
        return None
    task_id, dot, key = value[len(ANSWER_PREFIX) :].partition(".")
    return (task_id, key) if dot and key else None


class DurableCalls:
    """The requests of durable calls: the call itself, its resumption, the client's answers and cancellation."""

    def __init__(self, runner: TaskRunner, store: TaskStore, identity: Identity) -> None:
        self._runner = runner
        self._store = store
        self._identity = identity

    async def start(self, request: web.Request, message: dict[str, Any], rule: ToolRule) -> web.StreamResponse:
        """A 2025-era client's tools/call: run as a task, answered with the stream that follows it."""
        headers = request.headers
        principal = self._identity.principal(headers)
        session_tag = self._identity.session_tag(headers)
        task_id, existing = await self._latest(principal, session_tag, message["id"])
        if existing is not None and not existing.is_terminal:
            # The same request again on the same session while it runs (a client that lost its POST and sent it
            # anew): the same call, from its start.
            return await self._stream(rule).serve(request, existing, None)
        if existing is not None:  # that call is over: this is a new one under a request id used before
            task_id = await self._next_free(principal, session_tag, message["id"])
        call = ToolCall(
            tool=params_of(message)["name"],
            message=message,
            headers=headers.copy(),
            capabilities=ALL_INPUT_KINDS,
            principal=principal,
            credential=self._identity.credential(headers),
            task_id=task_id,
            stream=stream_of(message, headers, session_tag),
            client_session=client_session(headers, principal),
        )
        outcome = await self._runner.submit(call, rule.model_copy(update={"sync_window_ms": 0}))
        assert isinstance(outcome, TaskRecord)  # no sync window: the record, stored before the stream starts
        log.info("durable_call_started", task_id=task_id, tool=call.tool, resumable=call.stream["resumable"])
        return await self._stream(rule).serve(request, outcome, None)

    async def resume(self, request: web.Request, rules: Any) -> web.StreamResponse | None:
        """A GET with a Last-Event-ID of a durable stream: the rest of it. None when the id is not the proxy's."""
        position = parse_event_id(request.headers.get("Last-Event-ID"))
        if position is None:
            return None
        task_id, after_revision, after_n = position
        record = await self._store.get(task_id)
        if (
            record is None
            or record.stream is None
            or record.principal != self._identity.principal(request.headers)
            or record.stream.get("session") != self._identity.session_tag(request.headers)
        ):
            # Another caller's event id gets exactly what an unknown one gets.
            log.info("durable_resume_refused", reason="unknown, expired or not the caller's")
            error = error_object(INVALID_PARAMS, "Unknown or expired event stream (Last-Event-ID)")
            return web.Response(
                body=dumps({"jsonrpc": "2.0", "id": None, "error": error}), status=404, content_type="application/json"
            )
        log.info("durable_call_resumed", task_id=task_id, tool=record.tool)
        return await self._stream(rules(record.tool)).serve(request, record, (after_revision, after_n))

    async def answer(self, request: web.Request, message: dict[str, Any]) -> web.Response | None:
        """The client's response to a request a durable stream relayed; None when it answers something else."""
        target = parse_answer_id(message.get("id"))
        if target is None:
            return None
        task_id, key = target
        principal = self._identity.principal(request.headers)
        if not is_task_id(task_id):
            return web.Response(status=202)  # nothing of the proxy's; nothing to tell the client either
        result = message.get("result")
        if isinstance(result, dict):
            record = await self._runner.deliver_input(task_id, {key: result}, principal)
        else:
            # The client refused (a JSON-RPC error): the call cannot go on without its answer.
            record = await self._runner.cancel(task_id, principal)
        log.info("durable_call_answered", task_id=task_id, accepted=record is not None, refused=result is None)
        return web.Response(status=202)

    async def cancelled(self, request: web.Request, message: dict[str, Any]) -> bool:
        """notifications/cancelled from a 2025-era client: True when it named a durable call (now cancelled)."""
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        request_id = params.get("requestId")
        if not isinstance(request_id, str | int) or isinstance(request_id, bool):
            return False
        principal = self._identity.principal(request.headers)
        session_tag = self._identity.session_tag(request.headers)
        task_id, existing = await self._latest(principal, session_tag, request_id)
        if existing is None or existing.is_terminal:
            return existing is not None  # over already: nothing to cancel, and nothing for the server either
        record = await self._runner.cancel(task_id, principal)
        if record is None:
            return False
        log.info("durable_call_cancelled", task_id=task_id, tool=record.tool)
        return True

    async def kept_alive(
        self, request: web.Request, request_id: Any, call: ToolCall, rule: ToolRule
    ) -> web.StreamResponse:
        """A 2026-07-28 client without the tasks extension: the call runs as inside a sync window that lasts as long
        as the call may (its outcome, or an MRTR round, is the answer), and the response stream is kept alive
        meanwhile. 2026 streams are not resumable, so keep-alive is all the proxy can give; closing the request
        cancels the call, as for any 2026 call."""
        window = rule.model_copy(update={"sync_window_ms": _ENDLESS_WINDOW_MS})
        token = _progress_token(call.message)
        progressed: asyncio.Queue[Progress] = asyncio.Queue(maxsize=_MAX_QUEUED_PROGRESS)
        if token is not None:
            call.on_progress = lambda event: None if progressed.full() else progressed.put_nowait(event)
        outcome_of = asyncio.ensure_future(self._runner.submit(call, window))
        response: web.StreamResponse | None = None
        sent = 0.0
        try:
            while True:
                next_progress = asyncio.ensure_future(progressed.get())
                done, _ = await asyncio.wait(
                    [outcome_of, next_progress], timeout=rule.keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if outcome_of in done:
                    next_progress.cancel()
                    break
                if response is None:
                    response = web.StreamResponse(headers=_STREAM_HEADERS)
                    await response.prepare(request)
                if token is None:
                    await response.write(b": keep-alive\n\n")
                    continue
                event = next_progress.result() if next_progress in done else None
                next_progress.cancel()
                # The server's progress as it came, under the client's token; each keep-alive a hair above the last,
                # since every notification must carry a larger value than the one before.
                value = event.progress if event is not None and event.progress is not None else 0.0
                sent = max(value, sent + 0.001)
                params: dict[str, Any] = {"progressToken": token, "progress": sent}
                if event is not None and event.total is not None:
                    params["total"] = event.total
                if event is not None and event.message:
                    params["message"] = event.message
                notification = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
                await response.write(_event(None, notification))
        except asyncio.CancelledError:
            outcome_of.cancel()  # the client closed its request: inside the window, that cancels the call
            raise
        except ConnectionResetError:
            outcome_of.cancel()
            raise
        if response is None:
            # Answered before the first keep-alive: a plain JSON answer (a refusal raises, as for any call).
            answer, status = _answer_of(request_id, await outcome_of)
            return web.Response(body=dumps(answer), status=status, content_type="application/json")
        try:
            answer, _ = _answer_of(request_id, outcome_of.result())
        except Exception as exc:  # the stream is open: the refusal goes on it, as the call's answer
            reason = str(exc) or type(exc).__name__
            log.warning("durable_call_refused", reason=reason)
            answer = {
                "jsonrpc": "2.0",
                "id": request_id,
                "error": error_object(INTERNAL_ERROR, f"Cannot run the call: {reason}"),
            }
        await response.write(_event(None, answer))
        await response.write_eof()
        return response

    async def _latest(self, principal: str, session_tag: str, request_id: Any) -> tuple[str, TaskRecord | None]:
        """The id of the last call made under this request id, and its record (None: there was none)."""
        found: tuple[str, TaskRecord | None] = (
            self._identity.durable_task_id(principal, session_tag, request_id, 0),
            None,
        )
        for generation in range(_MAX_GENERATIONS):
            task_id = self._identity.durable_task_id(principal, session_tag, request_id, generation)
            record = await self._store.get(task_id)
            if record is None or record.principal != principal or record.stream is None:
                return found
            found = (task_id, record)
        return found

    async def _next_free(self, principal: str, session_tag: str, request_id: Any) -> str:
        for generation in range(_MAX_GENERATIONS):
            task_id = self._identity.durable_task_id(principal, session_tag, request_id, generation)
            if await self._store.get(task_id) is None:
                return task_id
        return new_task_id()  # reused past all generations: a random id (only its own replica can cancel it)

    def _stream(self, rule: ToolRule | None) -> DurableStream:
        keepalive_s = rule.keepalive_s if rule is not None else 15.0
        max_stream_s = rule.max_stream_s if rule is not None else 300.0
        return DurableStream(self._runner, self._store, keepalive_s=keepalive_s, max_stream_s=max_stream_s)
