"""What the proxy does not own, relayed to a stdio child: each client request an exchange on the channel, its
answer written back as JSON (or as an event stream when progress, a log line or a request of the child's comes
first), the way a Streamable HTTP server would answer it.

2025-era clients of a 2025-era child get sessions of the proxy's (clients/sessions2025.py): the proxy answers their
`initialize` from the child's, `ping` itself, and their GET streams and DELETE; a request of the child's for one of
their calls is shown to them under an id of the proxy's, and their answer goes back under the child's.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from multidict import MultiMapping

from ...clients.envelope import check_modern_request, is_modern, params_of
from ...clients.sessions2025 import MAX_SUBSCRIBED, VERSIONS_2025, FrontSession, FrontSessions, call_key
from ...jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    JsonRpcError,
    RequestId,
    classify,
    error_object,
    error_response,
    loads,
    result_response,
)
from ...security import Identity, caller_of
from ..events import UpstreamUnavailable
from ..routing import CallRoute
from .child2026 import StdioModern
from .exchange import ChildGone, Exchange
from .pool import StdioPool
from .responses import (
    ResponseWriter,
    Rewrite,
    json_response,
    listen_messages,
    serve_stream,
    upstream_failure,
)
from .session2025 import StdioLegacyLink

log = structlog.get_logger(__name__)


class StdioRelay:
    def __init__(
        self,
        pool: StdioPool,
        link: StdioLegacyLink,
        modern: StdioModern,
        sessions: FrontSessions,
        identity: Identity,
        era: Callable[[], Awaitable[str]],
        known_era: Callable[[], str | None],
        *,
        max_bytes: Callable[[], int],
    ) -> None:
        self.pool = pool
        self._link = link
        self._modern = modern
        self.sessions = sessions
        self._identity = identity
        self._era = era
        self._known_era = known_era
        self._responses = ResponseWriter(pool, max_bytes=max_bytes)
        pool.on_notification(sessions.broadcast)

    async def readiness(self) -> str:
        if self.pool.state != "running":
            return f"upstream {self.pool.state}"
        era = self._known_era()
        if era is None:
            return "upstream starting (era not known yet)"
        if era == "legacy":
            try:
                await asyncio.wait_for(self._link.ready(), 2.0)
            except (TimeoutError, UpstreamUnavailable) as exc:
                return f"upstream not initialized ({str(exc) or 'initialize not answered yet'})"
        elif not await self._modern.answers(2.0):
            return "upstream does not answer server/discover"
        return "ok"

    # --- POST ---------------------------------------------------------------------------------------------------

    async def relay(
        self, request: web.Request, body: bytes, message: Any, *, request_id: RequestId = None
    ) -> web.StreamResponse:
        # The body, not the message: the proxy may have rewritten it (a tasks declaration removed).
        return await self._relay(request, loads(body) if body is not None else message, None, None)

    async def relay_rewritten(
        self,
        request: web.Request,
        body: bytes,
        request_id: RequestId,
        rewrite: Rewrite,
        *,
        limit: int,
        on_headers: Callable[[Any], None] | None = None,
    ) -> web.Response:
        response = await self._relay(request, loads(body), rewrite, on_headers)
        assert isinstance(response, web.Response)  # a rewritten answer is read whole: never a stream
        return response

    async def _relay(
        self, request: web.Request, message: Any, rewrite: Rewrite | None, on_headers: Callable[[Any], None] | None
    ) -> web.StreamResponse:
        kind = classify(message)
        if kind == "batch":
            raise JsonRpcError(INVALID_REQUEST, "Invalid request: a stdio server takes no JSON-RPC batches")
        modern = is_modern(message, request.headers)
        try:
            era = await self._era()
        except UpstreamUnavailable as exc:
            raise _unavailable(exc) from exc
        if era == "legacy" and not modern:
            return await self._legacy_client(request, message, kind, rewrite, on_headers)
        if not modern:  # the front translates a 2025 client's requests for a 2026 child: none reaches here
            raise JsonRpcError(
                INVALID_REQUEST, "This stdio server speaks 2026-07-28 only (it answered server/discover)"
            )
        if kind == "request":
            # The headers stop here (stdio has none): what a 2026-07-28 server checks of them, the proxy checks.
            check_modern_request(message, request.headers)
            exchange = await self._send(message, CallRoute({}, None, caller=self._caller(request)))
            return await self._responses.response(request, exchange, None, {}, rewrite=rewrite, modern=True)
        if kind == "notification":
            if message["method"] != "notifications/cancelled":  # a 2026 client cancels by closing its stream
                await self.pool.notify(message, self._caller(request))
            return web.Response(status=202)
        raise JsonRpcError(INVALID_REQUEST, "Invalid request: a 2026-07-28 client sends no responses")

    async def _legacy_client(
        self,
        request: web.Request,
        message: dict[str, Any],
        kind: str,
        rewrite: Rewrite | None,
        on_headers: Callable[[Any], None] | None,
    ) -> web.StreamResponse:
        if kind == "request" and message["method"] == "initialize":
            return await self._initialize(request, message, rewrite, on_headers)
        front = self._front(request)
        if kind == "notification":
            method, params = message["method"], params_of(message)
            if method == "notifications/cancelled":
                request_id = params.get("requestId")
                valid = isinstance(request_id, str | int) and not isinstance(request_id, bool)
                exchange = front.calls.get(call_key(request_id)) if valid else None
                if exchange is not None:
                    exchange.close(str(params.get("reason") or "cancelled by the client"))
            elif method not in ("notifications/initialized", "notifications/roots/list_changed"):
                # initialized was the proxy's to send; the child's roots are asked per call, never listed ahead.
                await self.pool.notify(message, front.caller)
            return web.Response(status=202)
        if kind == "response":
            child_id = front.asked.pop(message["id"], None) if isinstance(message["id"], str) else None
            if child_id is None:
                log.info("stdio_answer_unknown", reason="no request of the server's has this id")
            else:
                answer = {"error": message["error"]} if "error" in message else {"result": message.get("result")}
                await self.pool.respond(child_id, answer)
            return web.Response(status=202)
        method = message["method"]
        if method == "ping":
            return json_response(result_response(message["id"], {}))
        params = params_of(message)
        if method == "resources/subscribe" and isinstance(params.get("uri"), str):
            if len(front.subscribed) >= MAX_SUBSCRIBED and params["uri"] not in front.subscribed:
                error = error_object(INVALID_REQUEST, f"At most {MAX_SUBSCRIBED} subscriptions per session")
                return json_response(error_response(message["id"], error))
            front.subscribed.add(params["uri"])
        elif method == "resources/unsubscribe" and isinstance(params.get("uri"), str):
            front.subscribed.discard(params["uri"])
        try:
            await self._link.ready()
        except UpstreamUnavailable as exc:
            return json_response(error_response(message["id"], upstream_failure(str(exc), self.pool.name)))
        route = CallRoute(front.capabilities, None, caller=front.caller)
        observe: Rewrite | None = None
        if method in _SERVER_TASK_METHODS:
            # The child's own SEP-1686 tasks: one child serves every session, so each session sees and touches only
            # the tasks it made, on the child that made them.
            task_id = params.get("taskId")
            if not isinstance(task_id, str) or task_id not in front.tasks:
                error = error_object(INVALID_PARAMS, "Invalid params: no such task in this session")
                return json_response(error_response(message["id"], error))
            route.affinity = front.tasks[task_id]
        elif method == "tasks/list":
            rewrite = _only_tasks_of(front, rewrite)
        elif method == "tools/call" and "task" in params:
            observe = _records_task(front)
        try:
            exchange = await self._send(message, route)
        except JsonRpcError as exc:
            return json_response(error_response(message["id"], exc.to_error()))  # a 2025 client ends its session on 5xx
        if self.sessions.get(front.id) is not front:  # ended while the request waited for the child
            exchange.close("the session ended")
            raise JsonRpcError(INVALID_REQUEST, "Session not found: initialize again", http_status=404)
        front.calls[call_key(message["id"])] = exchange
        try:
            return await self._responses.response(
                request, exchange, front, front.capabilities, rewrite=rewrite, modern=False, observe=observe
            )
        finally:
            if front.calls.get(call_key(message["id"])) is exchange:
                del front.calls[call_key(message["id"])]

    async def _initialize(
        self,
        request: web.Request,
        message: dict[str, Any],
        rewrite: Rewrite | None,
        on_headers: Callable[[Any], None] | None,
    ) -> web.Response:
        try:
            child = await self._link.ready()
        except UpstreamUnavailable as exc:
            raise _unavailable(exc) from exc
        principal = self._identity.principal(request.headers)
        version = str(child.get("protocolVersion") or VERSIONS_2025[-1])
        front = self.sessions.open(principal, caller_of(principal, request.remote), params_of(message), version)
        result = copy.deepcopy(child)
        result["protocolVersion"] = front.protocol_version
        if rewrite is not None:
            rewrite(result)
        headers = {"Mcp-Session-Id": front.id}
        if on_headers is not None:
            on_headers(headers)
        log.info("stdio_session_opened", protocol_version=front.protocol_version, sessions=len(self.sessions))
        return json_response(result_response(message["id"], result), headers=headers)

    def _caller(self, request: web.Request) -> str:
        """Whose children a 2026 client's request goes to (security.caller_of)."""
        return caller_of(self._identity.principal(request.headers), request.remote)

    def _front(self, request: web.Request) -> FrontSession:
        return self.sessions.named(request.headers.get("Mcp-Session-Id"), self._identity.principal(request.headers))

    async def _send(self, message: dict[str, Any], route: CallRoute | None) -> Exchange:
        try:
            return await self.pool.request(message, route=route)
        except ChildGone as exc:
            raise JsonRpcError(INTERNAL_ERROR, f"Upstream failure: {exc}", {"upstream": self.pool.name}) from exc

    # --- GET, DELETE, other paths --------------------------------------------------------------------------------

    async def relay_other(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        if request.path != "/mcp":
            raise JsonRpcError(INVALID_REQUEST, f"Not found: a stdio server has no {request.path}", http_status=404)
        if self._known_era() != "legacy" or request.method not in ("GET", "DELETE"):
            return web.Response(status=405, headers={"Allow": "POST"})
        front = self._front(request)
        if request.method == "DELETE":
            self.sessions.end(front.id)
            return web.Response(status=200)
        return await self._standalone(request, front)

    async def _standalone(self, request: web.Request, front: FrontSession) -> web.StreamResponse:
        """The session's GET stream: list changes, and updates of the resources it subscribed to."""
        return await serve_stream(request, front, front.open_stream())

    async def open_listen(
        self, request: web.Request, body: bytes, *, limit: int, headers: MultiMapping[str] | None = None
    ) -> AsyncGenerator[dict[str, Any], None] | None:
        """The child's part of a subscriptions/listen (a 2026-07-28 child): its notifications, until it ends.
        (`headers`: what an HTTP server would be sent instead of the client's; stdio has none.)"""
        exchange = await self._send(loads(body), None)
        return listen_messages(exchange, limit)


_SERVER_TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/cancel"})


def _records_task(front: FrontSession) -> Callable[[dict[str, Any], Exchange], None]:
    def record(answer: dict[str, Any], exchange: Exchange) -> None:
        task = answer.get("result", {}).get("task") if isinstance(answer.get("result"), dict) else None
        task_id = task.get("taskId") if isinstance(task, dict) else None
        if isinstance(task_id, str):
            front.remember_task(task_id, exchange.channel_index)

    return record


def _only_tasks_of(front: FrontSession, then: Rewrite | None) -> Rewrite:
    def only(result: dict[str, Any]) -> None:
        tasks = result.get("tasks")
        if isinstance(tasks, list):
            result["tasks"] = [t for t in tasks if isinstance(t, dict) and t.get("taskId") in front.tasks]
        if then is not None:
            then(result)

    return only


def _unavailable(exc: Exception) -> JsonRpcError:
    return JsonRpcError(INTERNAL_ERROR, f"Upstream failure: {exc}", http_status=503)
