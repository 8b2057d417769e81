"""Durable calls: long tool calls for 2025-era clients without tasks (2026 clients without the extension get
kept-alive calls, proxy/clients/kept_alive.py).

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

The stream itself is proxy/clients/durable_stream.py; a keyed kept-alive call is served by it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from ..config import ToolRule
from ..jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, dumps, error_object
from ..security import Identity, caller_of
from ..store.base import StoreUnavailable, TaskIdTaken, TaskStore
from ..tasks.job import Slots, ToolCall
from ..tasks.model import TaskRecord, is_task_id, new_task_id
from ..tasks.runner import TaskRunner
from ..upstream.era2025 import ERROR_ANSWER, LegacySession
from ..upstream.http.headers import call_headers
from . import idempotency
from .durable_stream import (
    RESUMABLE_VERSIONS,
    DurableStream,
    parse_answer_id,
    parse_event_id,
)
from .envelope import params_of, progress_token
from .translated2025 import Translated2025

log = structlog.get_logger(__name__)

ALL_INPUT_KINDS = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}
"""What a 2025-era client may be asked: its own session's server knows what it declared, and asks only that."""
_MAX_GENERATIONS = 64
"""Calls one request id may name on one session, one after another (see Identity.durable_task_id)."""
_ACCEPT_WAIT_S = 2.0
"""How long a durable call's answer waits for the server to take the request (or say 404) before streaming."""
SEP1686_KIND = "sep1686"
"""TaskRecord.stream["kind"] of a SEP-1686 task (proxy/clients/tasks2025.py): answered like a durable call, not
resumed."""


def wants_event_stream(headers: Any) -> bool:
    return "text/event-stream" in headers.get("Accept", "")


def client_session(headers: Any, principal: str, *, on_status: Callable[[int], None] | None = None) -> LegacySession:
    """The 2025-era client's own upstream session, as its headers name it."""
    return LegacySession(
        session_id=headers.get("Mcp-Session-Id"),
        protocol_version=headers.get("MCP-Protocol-Version", "2025-03-26"),
        principal=principal,
        on_status=on_status,
    )


def _first(future: asyncio.Future[int]) -> Callable[[int], None]:
    """A callback that settles `future` with the first HTTP status the server answers the call with."""

    def settle(status: int) -> None:
        if not future.done():
            future.set_result(status)

    return settle


async def upstream_parts(
    translated: Translated2025 | None,
    identity: Identity,
    message: dict[str, Any],
    headers: Any,
    *,
    on_status: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], Any, dict[str, Any], LegacySession | None]:
    """What a 2025-era client's call (durable, or a SEP-1686 task) sends upstream: the request, the headers it
    keeps, the capabilities that bound what may be asked, and the client's own upstream session. In front of a
    2026-07-28-only server the request goes in the 2026 envelope of the proxy's session, on no upstream session."""
    if translated is not None and translated.applies:
        call, call_headers_2026, capabilities = await translated.call_parts(message, headers)
        return call, call_headers(call_headers_2026, identity.principal_header), capabilities, None
    principal = identity.principal(headers)
    session = client_session(headers, principal, on_status=on_status)
    return message, call_headers(headers, identity.principal_header), ALL_INPUT_KINDS, session


def stream_of(message: dict[str, Any], headers: Any, session_tag: str) -> dict[str, Any]:
    """What a durable call's record keeps of its client (TaskRecord.stream)."""
    version = headers.get("MCP-Protocol-Version", "")
    stream: dict[str, Any] = {"id": message["id"], "session": session_tag, "resumable": version in RESUMABLE_VERSIONS}
    token = progress_token(message)
    if token is not None:
        stream["token"] = token
    return stream


def _refusal(error: Any) -> dict[str, Any]:
    """A client's JSON-RPC error as a well-formed error object (an integer code and a string message), so that the
    server takes it as the refusal it is instead of answering 400 and waiting on."""
    error = error if isinstance(error, dict) else {}
    code, message = error.get("code"), error.get("message")
    refusal = {
        "code": code if isinstance(code, int) and not isinstance(code, bool) else INTERNAL_ERROR,
        "message": message if isinstance(message, str) else "The client refused the request",
    }
    if "data" in error:
        refusal["data"] = error["data"]
    return refusal


class DurableCalls:
    """The requests of durable calls: the call itself, its resumption, the client's answers and cancellation."""

    def __init__(
        self, runner: TaskRunner, store: TaskStore, identity: Identity, translated: Translated2025 | None = None
    ) -> None:
        self._runner = runner
        self._store = store
        self._identity = identity
        self._translated = translated

    async def start(
        self, request: web.Request, message: dict[str, Any], rule: ToolRule, slots: Slots | None = None
    ) -> web.StreamResponse:
        """A 2025-era client's tools/call: run as a task, answered with the stream that follows it. `slots`: the
        request's under the concurrency limits, which the call takes over."""
        headers = request.headers
        principal = self._identity.principal(headers)
        session_tag = self._identity.session_tag(headers)
        key = idempotency.key_of(message, headers)
        if key is not None:
            return await self._start_keyed(request, idempotency.without_key(message), rule, key, slots)
        task_id: str | None = None
        if session_tag:
            # On a session, a request id names one call while it runs: the id is derived from it, so that any
            # replica finds the call from the client's notifications/cancelled, and a POST sent again joins it.
            # Without a session, clients of one caller number their requests alike: every call is a new task.
            task_id, existing = await self._latest(principal, session_tag, message["id"])
            if existing is not None and not existing.is_terminal:
                return await self._stream(rule).serve(request, existing, None)
            if existing is not None:  # that call is over: this is a new one under a request id used before
                task_id = await self._next_free(principal, session_tag, message["id"])
        return await self._run(request, message, rule, task_id, slots=slots)

    async def _start_keyed(
        self, request: web.Request, message: dict[str, Any], rule: ToolRule, key: str, slots: Slots | None
    ) -> web.StreamResponse:
        """A durable call with an idempotency key: the task made for the key on this session, running or finished,
        answered as this request's (the connection of the first one dropped); else a new one."""
        headers = request.headers
        principal = self._identity.principal(headers)
        session_tag = self._identity.session_tag(headers)
        params = params_of(message)
        task_id = self._identity.keyed_task_id(principal, params["name"], key, "durable")
        fingerprint = idempotency.fingerprint(params["name"], params.get("arguments"))
        existing = await self._store.get(task_id)
        alias = self._alias(principal, session_tag, message["id"])
        if existing is None:
            # notifications/cancelled names the request's id: it finds the call through the alias.
            await self._store.alias(alias, task_id, rule.ttl_ms or self._runner.default_ttl_ms())
            try:
                return await self._run(request, message, rule, task_id, fingerprint, slots=slots)
            except TaskIdTaken:  # the same key, sent at the same moment: both follow the one call
                existing = await self._store.get(task_id)
                if existing is None:
                    raise
        if existing.fingerprint != fingerprint or existing.principal != principal or existing.stream is None:
            raise idempotency.key_reused(key)
        if existing.stream.get("session") != session_tag:
            raise idempotency.other_session(key)  # the call and its questions go on the first one's session
        await self._store.alias(alias, task_id, existing.ttl_ms)
        log.info("durable_call_joined", task_id=task_id, tool=existing.tool)
        return await self._stream(rule).serve(request, existing, None, answer_as=message["id"])

    def _alias(self, principal: str, session_tag: str, request_id: Any) -> str:
        return self._identity.durable_task_id(principal, session_tag, request_id, 0)

    async def _run(
        self,
        request: web.Request,
        message: dict[str, Any],
        rule: ToolRule,
        task_id: str | None,
        fingerprint: str | None = None,
        *,
        slots: Slots | None,
    ) -> web.StreamResponse:
        headers = request.headers
        principal = self._identity.principal(headers)
        session_tag = self._identity.session_tag(headers)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        sent, kept, capabilities, session = await upstream_parts(
            self._translated, self._identity, message, headers, on_status=_first(accepted)
        )
        call = ToolCall(
            tool=params_of(message)["name"],
            message=sent,
            headers=kept,
            capabilities=capabilities,
            principal=principal,
            credential=self._identity.credential(headers),
            caller=caller_of(principal, request.remote),
            task_id=task_id,
            stream=stream_of(message, headers, session_tag),
            client_session=session,
            fingerprint=fingerprint,
            slots=slots,
        )
        try:
            outcome = await self._runner.submit(call, rule.model_copy(update={"sync_window_ms": 0}))
        except TaskIdTaken:  # the same request, sent twice at once: both follow the one call
            if fingerprint is not None:
                raise  # a keyed one: the caller checks the key's task
            existing = await self._store.get(call.task_id or "")
            if existing is None:
                raise
            return await self._stream(rule).serve(request, existing, None)
        assert isinstance(outcome, TaskRecord)  # no sync window: the record, stored before the stream starts
        log.info("durable_call_started", task_id=outcome.task_id, tool=call.tool, resumable=call.stream["resumable"])
        # A session the server has ended (404) must reach the client as the server said it, or it would never
        # initialize again: the stream starts once the server took the request, or after a short wait.
        if session is not None:
            await asyncio.wait([accepted], timeout=min(rule.keepalive_s, _ACCEPT_WAIT_S))
        if accepted.done() and accepted.result() == 404:
            error = error_object(INVALID_REQUEST, "Session not found: the server ended this session")
            return web.Response(
                body=dumps({"jsonrpc": "2.0", "id": message["id"], "error": error}),
                status=404,
                content_type="application/json",
            )
        return await self._stream(rule).serve(request, outcome, None)

    async def resume(self, request: web.Request, rules: Any) -> web.StreamResponse | None:
        """A GET with a Last-Event-ID of a durable stream: the rest of it. None when the id is not the proxy's."""
        position = parse_event_id(request.headers.get("Last-Event-ID"))
        if position is None:
            return None
        task_id, after_revision, after_n = position
        record = await self._store.get(task_id)
        if record is None or not self._is_callers(request, record) or record.stream.get("kind") == SEP1686_KIND:
            # Another caller's event id gets exactly what an unknown one gets.
            log.info("durable_resume_refused", reason="unknown, expired or not the caller's")
            error = error_object(INVALID_PARAMS, "Unknown or expired event stream (Last-Event-ID)")
            return web.Response(
                body=dumps({"jsonrpc": "2.0", "id": None, "error": error}), status=404, content_type="application/json"
            )
        log.info("durable_call_resumed", task_id=task_id, tool=record.tool)
        await self._runner.credentials.shown(record, request.headers)
        return await self._stream(rules(record.tool)).serve(request, record, (after_revision, after_n))

    async def answer(self, request: web.Request, message: dict[str, Any]) -> web.Response | None:
        """The client's response to a request a durable stream relayed; None when it answers something else."""
        target = parse_answer_id(message.get("id"))
        if target is None:
            return None
        task_id, key = target
        record = await self._store.get(task_id) if is_task_id(task_id) else None
        if record is None or not self._is_callers(request, record):
            return web.Response(status=202)  # nothing of this caller's; nothing to tell the client either
        result = message.get("result")
        await self._runner.credentials.shown(record, request.headers)
        if not isinstance(result, dict) and self._translated is not None and self._translated.applies:
            # A 2026-07-28 server takes only results for answers: a refused form is declined, any other refusal
            # ends the call (the client's stream says it was cancelled).
            question = (record.input_requests or {}).get(key)
            if not (isinstance(question, dict) and question.get("method") == "elicitation/create"):
                cancelled = await self._runner.cancel(task_id, record.principal)
                log.info("durable_call_refused_question", task_id=task_id, cancelled=cancelled is not None)
                return web.Response(status=202)
            result = {"action": "decline"}
        # A refusal (a JSON-RPC error) goes back to a 2025 server as such: the tool decides what it means.
        answer = result if isinstance(result, dict) else {ERROR_ANSWER: _refusal(message.get("error"))}
        delivered = await self._runner.deliver_input(task_id, {key: answer}, record.principal)
        log.info("durable_call_answered", task_id=task_id, accepted=delivered is not None, refused=result is None)
        return web.Response(status=202)

    async def cancelled(self, request: web.Request, message: dict[str, Any]) -> bool:
        """notifications/cancelled from a 2025-era client: True when it stopped a running durable call; else the
        notification is the server's, as before."""
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        request_id = params.get("requestId")
        session_tag = self._identity.session_tag(request.headers)
        if not session_tag or not isinstance(request_id, str | int) or isinstance(request_id, bool):
            return False
        principal = self._identity.principal(request.headers)
        try:
            task_id, existing = await self._latest(principal, session_tag, request_id)
            if existing is None or existing.is_terminal:  # a request that joined a keyed call, maybe
                joined = await self._store.aliased(self._alias(principal, session_tag, request_id))
                if joined is not None:
                    task_id, existing = joined, await self._store.get(joined)
        except StoreUnavailable:
            return False  # whatever it names, the server hears of it as before
        if existing is not None and not self._is_callers(request, existing):
            return False
        if existing is None or existing.is_terminal:
            return False
        record = await self._runner.cancel(task_id, principal)
        if record is None:
            return False
        log.info("durable_call_cancelled", task_id=task_id, tool=record.tool)
        return True

    def _is_callers(self, request: web.Request, record: TaskRecord) -> bool:
        """The record is a durable call's (or a SEP-1686 task's) of this caller, on this session."""
        return (
            record.stream is not None
            and record.principal == self._identity.principal(request.headers)
            and record.stream.get("session") == self._identity.session_tag(request.headers)
        )

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
