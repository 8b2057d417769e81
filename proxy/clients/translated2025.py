"""2025-era clients in front of a server that speaks 2026-07-28 only: the proxy speaks 2025 to the client and
2026-07-28 to the server, as proxy/upstream/bridge.py does the other way round.

The proxy holds the client's session (clients/sessions2025.py), as it does in front of a stdio child: it answers
`initialize` from the server's `server/discover`, `ping`, `logging/setLevel` (accepted, not offered: no log line of
a call's is relayed), `resources/subscribe` and `unsubscribe`; the 2025 requests 2026-07-28 still has go to the
server in the envelope built from what the session declared (clients/translation2025.py), their results back
without the 2026 fields. A `tools/call` is the front's to run (proxy/front/dispatch.py): a durable call or a
SEP-1686 task, whatever the policy says of the tool, so that the server's MRTR questions reach the client as the
requests a 2025 client expects (elicitation, sampling, roots) on the call's stream, and its answers go back in the
retry. The session's GET stream is clients/translated_stream.py's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from multidict import CIMultiDict, MultiMapping

from ..jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    dumps,
    error_object,
    error_response,
    result_response,
)
from ..security import Identity, caller_of
from ..upstream.era2026 import discover_probe
from ..upstream.events import Failed, Finished, InputNeeded, UpstreamUnavailable
from ..upstream.tools import list_tools
from .envelope import (
    header_params,
    param_headers,
    params_of,
)
from .sessions2025 import MAX_SUBSCRIBED, VERSIONS_2025, FrontSession, FrontSessions, call_key
from .translated_stream import session_stream
from .translation2025 import as_2026, headers_2026, initialize_result, result_2025

if TYPE_CHECKING:
    from ..upstream.gateway import Gateway

log = structlog.get_logger(__name__)

LOG_LEVELS = frozenset({"debug", "info", "notice", "warning", "error", "critical", "alert", "emergency"})
_FORWARDED = frozenset({"tools/list", "resources/list", "resources/templates/list", "resources/read", "prompts/list",
                        "prompts/get", "completion/complete"})  # fmt: skip
"""The requests of a 2025 session that go to the server (tools/call is the front's; the rest are answered here)."""


Rewrite = Callable[[dict[str, Any]], None]


class Translated2025:
    """2025-era clients' sessions with a 2026-07-28-only server, and the requests of theirs the front does not run
    as calls (see the module docstring)."""

    def __init__(
        self, gateway: Gateway, sessions: FrontSessions, identity: Identity, *, max_bytes: Callable[[], int]
    ) -> None:
        self._gateway = gateway
        self.sessions = sessions
        self._identity = identity
        self._max_bytes = max_bytes
        self._header_params = HeaderParams()

    @property
    def applies(self) -> bool:
        """The server is known to speak 2026-07-28 only: every 2025-era client's request is translated."""
        return self._gateway.translates_2025

    async def initialize(
        self, request: web.Request, message: dict[str, Any], rewrite: Rewrite | None = None
    ) -> web.Response:
        """A new session of the proxy's, answered from the server's server/discover."""
        probe = discover_probe()
        principal = self._identity.principal(request.headers)
        caller = caller_of(principal, request.remote)
        discover = await self._result(probe, headers_2026(probe, request.headers), {}, caller)
        if "error" in discover:
            return _answer_error(message["id"], discover)
        front = self.sessions.open(principal, caller, params_of(message), VERSIONS_2025[-1])
        result = initialize_result(discover["result"], front.protocol_version)
        if rewrite is not None:
            rewrite(result)
        log.info("translated_session_opened", protocol_version=front.protocol_version, sessions=len(self.sessions))
        return _json(result_response(message["id"], result), headers={"Mcp-Session-Id": front.id})

    def front(self, request: web.Request) -> FrontSession:
        """The session the request names (400 without one, 404 for one the proxy does not hold: initialize again)."""
        return self.sessions.named(request.headers.get("Mcp-Session-Id"), self._identity.principal(request.headers))

    async def call_parts(
        self, message: dict[str, Any], client_headers: MultiMapping[str]
    ) -> tuple[dict[str, Any], CIMultiDict[str], dict[str, Any]]:
        """What a durable call or a SEP-1686 task of a session sends the server: the request in the 2026 envelope,
        the headers for it (with the tool's Mcp-Param-* ones), and the capabilities the session declared (what the
        server may ask its client)."""
        front = self.sessions.named(client_headers.get("Mcp-Session-Id"), self._identity.principal(client_headers))
        headers = headers_2026(message, client_headers)
        params = params_of(message)
        if isinstance(params.get("name"), str):
            header_params = await self._header_params.of(params["name"], lambda: self._list_tools(client_headers))
            headers.update(param_headers(header_params, params.get("arguments")))
        return as_2026(message, front), headers, front.capabilities

    async def _list_tools(self, client_headers: MultiMapping[str]) -> list[dict[str, Any]]:
        try:
            return await list_tools(self._gateway, max_bytes=self._max_bytes(), credentials=client_headers)
        except UpstreamUnavailable as exc:
            log.info("translated_tools_unlisted", reason=str(exc))  # the call goes without: the server says
            return []

    async def request(
        self, request: web.Request, message: dict[str, Any], front: FrontSession, rewrite: Rewrite | None = None
    ) -> web.Response:
        """A request of the session's that is no call: answered here (ping, logging/setLevel, resources/subscribe and
        unsubscribe), or sent to the server in the 2026 envelope and its result returned as 2025 has it."""
        method = message["method"]
        if method == "ping":
            return _json(result_response(message["id"], {}))
        if method == "logging/setLevel":
            # Not offered (no log line of the server's reaches the session), and harmless: accepted.
            level = params_of(message).get("level")
            if not (isinstance(level, str) and level in LOG_LEVELS):
                error = error_object(INVALID_PARAMS, f"Invalid params: level must be one of {sorted(LOG_LEVELS)}")
                return _json(error_response(message["id"], error))
            return _json(result_response(message["id"], {}))
        if method in ("resources/subscribe", "resources/unsubscribe"):
            return self._subscription(message, front)
        if method not in _FORWARDED:
            error = error_object(METHOD_NOT_FOUND, f"Method not found: {method}")
            return _json(error_response(message["id"], error))
        headers = headers_2026(message, request.headers)
        answer = await self._result(as_2026(message, front), headers, front.capabilities, front.caller)
        if "error" in answer:
            return _answer_error(message["id"], answer)
        if method == "tools/list" and isinstance(answer["result"].get("tools"), list):
            self._header_params.learn(answer["result"]["tools"])
        result = result_2025(answer["result"])
        if rewrite is not None:
            rewrite(result)
        return _json(result_response(message["id"], result))

    async def _result(
        self, message: dict[str, Any], headers: MultiMapping[str], capabilities: dict[str, Any], caller: str
    ) -> dict[str, Any]:
        """{"result": ...} or {"error": ..., "challenge": ...}: the server's answer to one request (a challenge
        when it refused the request's credentials)."""
        events = self._gateway.modern.call_tool(
            message, headers, capabilities, max_bytes=self._max_bytes(), caller=caller
        )
        try:
            async for event in events:
                if isinstance(event, Finished):
                    return {"result": event.result}
                if isinstance(event, Failed) and event.refused_credentials:
                    return {"error": event.error, "challenge": event.challenge or ""}
                if isinstance(event, Failed):
                    return {"error": event.error}
                if isinstance(event, InputNeeded):
                    return {
                        "error": error_object(
                            INTERNAL_ERROR,
                            f"The server asked for input to answer "
                            f"{message['method']}, which the proxy relays to a 2025 client only in a tools/call",
                        )
                    }
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        return {"error": error_object(INTERNAL_ERROR, "Upstream failure: no answer")}

    @contextlib.contextmanager
    def in_flight(self, front: FrontSession, request: web.Request, request_id: Any) -> Iterator[None]:
        """The request being served, in the session's calls: the session is busy (never ended to make room), and
        its DELETE or a notifications/cancelled naming the id ends the request (and so what it waits for)."""
        key, handling = call_key(request_id), _Handling(request)
        front.calls[key] = handling
        try:
            yield
        finally:
            if front.calls.get(key) is handling:
                del front.calls[key]

    def notified(self, request: web.Request, message: Any) -> None:
        """A notification or response of the session's: a notifications/cancelled ends the request it names."""
        front = self.front(request)
        if isinstance(message, dict) and message.get("method") == "notifications/cancelled":
            request_id = params_of(message).get("requestId")
            if isinstance(request_id, str | int) and not isinstance(request_id, bool):
                handling = front.calls.get(call_key(request_id))
                if handling is not None:
                    handling.close("cancelled by the client")

    def _subscription(self, message: dict[str, Any], front: FrontSession) -> web.Response:
        uri = params_of(message).get("uri")
        if not isinstance(uri, str):
            error = error_object(INVALID_PARAMS, "Invalid params: uri must be a string")
            return _json(error_response(message["id"], error))
        if message["method"] == "resources/unsubscribe":
            if uri in front.subscribed:
                front.subscribed.discard(uri)
                front.subscriptions_changed()
            return _json(result_response(message["id"], {}))
        if uri not in front.subscribed:
            if len(front.subscribed) >= MAX_SUBSCRIBED:
                error = error_object(INVALID_REQUEST, f"At most {MAX_SUBSCRIBED} subscriptions per session")
                return _json(error_response(message["id"], error))
            front.subscribed.add(uri)
            front.subscriptions_changed()
        return _json(result_response(message["id"], {}))

    async def other(self, request: web.Request) -> web.StreamResponse:
        """GET and DELETE of a session: DELETE ends it, GET is its stream."""
        front = self.front(request)
        if request.method == "DELETE":
            self.sessions.end(front.id)
            log.info("translated_session_ended", sessions=len(self.sessions))
            return web.Response(status=200)
        return await session_stream(request, front, self._gateway.relay, self._max_bytes)


class HeaderParams:
    """Each tool's Mcp-Param-* parameters (envelope.header_params), as the server's tools/list says: learnt from the
    sessions' own listings, and listed on a call of a tool not seen (at most every _RELIST_S)."""

    def __init__(self) -> None:
        self._of: dict[str, dict[tuple[str, ...], str]] = {}
        self._listed_at = -_RELIST_S

    def learn(self, tools: list[Any]) -> None:
        if len(self._of) > _MAX_TOOLS:
            self._of.clear()  # a server whose tools keep changing names: learnt again as they are called
        for tool in tools:
            if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                self._of[tool["name"]] = header_params(tool.get("inputSchema"))

    async def of(self, tool: str, listed: Callable[[], Awaitable[list[dict[str, Any]]]]) -> dict[tuple[str, ...], str]:
        if tool not in self._of and time.monotonic() - self._listed_at >= _RELIST_S:
            self._listed_at = time.monotonic()
            self.learn(await listed())
        return self._of.get(tool, {})


_RELIST_S = 30.0
_MAX_TOOLS = 10_000


class _Handling:
    """A request of the session's being served, as FrontSession.calls holds it: closing it closes the client's
    connection, as if the client had left (the handler is cancelled, its upstream request closed, and the client,
    which sent no more than a notification, waits for no answer)."""

    __slots__ = ("_request",)

    def __init__(self, request: web.Request) -> None:
        self._request = request

    def close(self, reason: str) -> None:
        transport = self._request.transport
        if transport is not None and not transport.is_closing():
            log.info("translated_request_ended", reason=reason)
            transport.close()


def _answer_error(request_id: Any, answer: dict[str, Any]) -> web.Response:
    """The server's error as the client's answer; a refused credential as HTTP 401 with the server's challenge, so
    that the client's authorization flow starts (a JSON-RPC error on 200 would end there)."""
    if "challenge" in answer:
        headers = {"WWW-Authenticate": answer["challenge"]} if answer["challenge"] else None
        body = dumps(error_response(request_id, answer["error"]))
        return web.Response(status=401, body=body, content_type="application/json", headers=headers)
    return _json(error_response(request_id, answer["error"]))


def _json(message: dict[str, Any], *, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(message), content_type="application/json", headers=headers)
