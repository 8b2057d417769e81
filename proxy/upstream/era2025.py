"""Legacy (2025-06-18 / 2025-11-25) upstreams: calls over the proxy's sessions (legacy_sessions.py), and translation
to and from 2026-07-28.

A legacy server fixes capabilities at `initialize`, keys requests to an `Mcp-Session-Id`, and asks for user input by
sending JSON-RPC requests (`elicitation/create`, `sampling/createMessage`, `roots/list`) on the event stream of the
call they belong to; the answer is a new POST carrying a JSON-RPC response. This module turns all of that into the
same events the runner reads from a modern upstream.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import structlog
from multidict import MultiMapping

from .. import PROTOCOL_VERSION, TASKS_EXTENSION, __version__
from ..clients.envelope import params_of
from ..jsonrpc import INVALID_PARAMS, METHOD_NOT_FOUND, error_object
from ..security import Identity
from .events import (
    RETRIED_STATUSES,
    AnswerTooLarge,
    CallCut,
    Event,
    Failed,
    Finished,
    InputNeeded,
    RequestUnsent,
    UpstreamTask,
    UpstreamUnavailable,
    cut_failure,
    interpret_progress,
    proxy_failure,
    too_large,
)
from .legacy_sessions import CallerSessions, NoSessionRoom
from .legacy_tasks import TASKED, TaskSupport, run_as_upstream_task, without_task_support
from .routing import CallRoute, LegacySession, asks_client

log = structlog.get_logger(__name__)

LEGACY_VERSION = "2025-11-25"
INPUT_METHODS = frozenset({"elicitation/create", "sampling/createMessage", "roots/list"})
_MODERN_META_KEYS = frozenset(
    {
        "io.modelcontextprotocol/protocolVersion",
        "io.modelcontextprotocol/clientCapabilities",
        "io.modelcontextprotocol/clientInfo",
        "io.modelcontextprotocol/logLevel",
    }
)
# Results that 2026-07-28 makes cacheable: they must carry ttlMs and cacheScope.
_CACHEABLE = frozenset({"tools/list", "prompts/list", "resources/list", "resources/templates/list", "resources/read"})
ERROR_ANSWER = "io.github.mcp-tasks-proxy/error"
"""An answer to a server request that is a JSON-RPC error (a durable call's client refused): {ERROR_ANSWER: error}."""
# Everything the proxy can relay, declared once per session (NOTES §8): what a modern client did not declare for
# its own request is declined per request.
_PROXY_CAPABILITIES = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {"listChanged": False}}


def to_legacy(message: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 request as a legacy server expects it: no envelope _meta keys (progressToken stays)."""
    params = dict(message.get("params") or {})
    meta = params.get("_meta")
    if isinstance(meta, dict):
        meta = {key: value for key, value in meta.items() if key not in _MODERN_META_KEYS}
        if meta:
            params["_meta"] = meta
        else:
            del params["_meta"]
    params.pop("task", None)
    legacy = {"jsonrpc": "2.0", "id": message["id"], "method": message["method"]}
    if params:
        legacy["params"] = params
    return legacy


def to_modern_result(method: str, result: dict[str, Any]) -> dict[str, Any]:
    """Fix a legacy result up for a 2026-07-28 client: resultType always; ttlMs and cacheScope where cacheable."""
    result.setdefault("resultType", "complete")
    if method in _CACHEABLE:
        result.setdefault("ttlMs", 0)
        result.setdefault("cacheScope", "private")  # fetched over one principal's session
    return result


def to_modern_error(error: dict[str, Any]) -> dict[str, Any]:
    if error.get("code") == -32002:  # legacy "resource not found", reserved in 2026-07-28
        return {**error, "code": INVALID_PARAMS}
    return error


def clean_input_request(message: dict[str, Any]) -> dict[str, Any]:
    """A legacy server-to-client request as a 2026 InputRequest: {method, params}, legacy-only fields removed."""
    request: dict[str, Any] = {"method": message["method"]}
    params = message.get("params")
    if isinstance(params, dict):
        params = {key: value for key, value in params.items() if key not in ("elicitationId", "task")}
        meta = params.get("_meta")
        if isinstance(meta, dict):
            meta = {k: v for k, v in meta.items() if k != "io.modelcontextprotocol/related-task"}
            if meta:
                params["_meta"] = meta
            else:
                del params["_meta"]
        request["params"] = params
    return request


def proxy_initialize() -> dict[str, Any]:
    """The proxy's own initialize: everything it can relay, declared once per session (NOTES §8)."""
    return {
        "jsonrpc": "2.0",
        "id": "mtp-initialize",
        "method": "initialize",
        "params": {
            "protocolVersion": LEGACY_VERSION,
            "capabilities": _PROXY_CAPABILITIES,
            "clientInfo": {"name": "mcp-tasks-proxy", "version": __version__},
        },
    }


def declined_answer(method: str, capabilities: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """The answer the proxy gives the upstream itself when the client did not declare what a request needs.

    None when the client can answer it. Elicitation is declined (the user's "no" in the protocol's own terms);
    sampling and roots get a JSON-RPC error, as a client without them would send.
    """
    if method == "elicitation/create":
        declared = capabilities.get("elicitation")
        mode = params.get("mode", "form")
        if isinstance(declared, dict) and (
            (mode == "url" and "url" in declared) or (mode != "url" and (not declared or "form" in declared))
        ):
            return None
        return {"result": {"action": "decline"}}
    if method == "sampling/createMessage" and "sampling" in capabilities:
        return None
    if method == "roots/list" and "roots" in capabilities:
        return None
    what = method if method in INPUT_METHODS else f"the method {method}"
    return {"error": error_object(METHOD_NOT_FOUND, f"The client does not support {what} for this request")}


class LegacyReply(Protocol):
    """The server's answer to one request sent: a status (an HTTP status; 404 means the session is gone), then its
    messages (progress, the server's requests for the call, the response last)."""

    status: int
    content_type: str
    retry_after_s: float | None

    def messages(self, max_bytes: int) -> AsyncIterator[dict[str, Any]]: ...

    def close(self) -> None: ...

    def cancel(self, reason: str) -> None:
        """The call ends unfinished: tell the server (notifications/cancelled), unless closing already did."""


class LegacyLink(Protocol):
    """How a 2025-era server is reached: http.legacy.HttpLegacyLink, stdio.legacy.StdioLegacyLink."""

    @property
    def url(self) -> str: ...

    async def initialize(
        self, principal: str, client_headers: MultiMapping[str], message: dict[str, Any], bare: LegacySession
    ) -> tuple[dict[str, Any] | None, str | None, int]: ...

    async def opened(
        self, legacy: LegacyUpstream, session: LegacySession, client_headers: MultiMapping[str]
    ) -> None: ...

    def end(self, session: LegacySession) -> None: ...

    def stop_reading(self, session: LegacySession) -> None: ...

    def client_capabilities(self, session: LegacySession) -> dict[str, Any] | None:
        """What a 2025-era client declared at its own initialize, when the link (not the server) holds it."""

    @property
    def follows_tasks(self) -> bool:
        """Whether the server's own SEP-1686 tasks can be followed: their polls reach the server that made them."""

    @property
    def tasks_reach_replicas(self) -> bool:
        """Whether other proxy replicas reach the same server, so that one can follow a task another made."""

    @property
    def sessions_per_call(self) -> bool:
        """Whether a call whose client may be asked something gets a session to itself (HTTP, where a session is
        cheap and its standalone stream names no call); else the link keeps calls apart itself (stdio's children)."""

    async def send(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None,
    ) -> LegacyReply: ...

    async def respond(
        self, session: LegacySession, client_headers: MultiMapping[str], request_id: Any, answer: dict[str, Any]
    ) -> None: ...

    async def ask(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None = None,
    ) -> tuple[int, dict[str, Any] | None]: ...


class LegacyUpstream:
    """A legacy upstream behind the proxy: calls read as events, over sessions of each caller's (`sessions`)."""

    def __init__(
        self,
        link: Callable[[Callable[[Awaitable[None]], None]], LegacyLink],
        *,
        max_sessions: int,
        identity: Identity,
        max_sessions_per_caller: int | None = None,
    ) -> None:
        self._identity = identity
        self._background: set[asyncio.Task[None]] = set()
        self.link = link(self.spawn)
        self.sessions = CallerSessions(
            self._handshake,
            end=self.link.end,
            sessions_per_call=self.link.sessions_per_call,
            identity=identity,
            max_sessions=max_sessions,
            max_sessions_per_caller=max_sessions_per_caller,
        )
        self.initialize_result: dict[str, Any] | None = None
        self.task_support = TaskSupport()

    @property
    def url(self) -> str:
        return self.link.url

    # --- sessions ---------------------------------------------------------------------------------------------

    async def _handshake(self, caller: str, client_headers: MultiMapping[str], number: int) -> LegacySession:
        """Session `number` opened with the upstream for `caller`: its initialize, then what the link does next."""
        bare = LegacySession(session_id=None, protocol_version=LEGACY_VERSION, principal=caller)
        answer, session_id, status = await self.link.initialize(caller, client_headers, proxy_initialize(), bare)
        if answer is None or not isinstance(answer.get("result"), dict):
            raise UpstreamUnavailable(f"the upstream refused initialize (HTTP {status})")
        result = answer["result"]
        self.initialize_result = result
        session = LegacySession(
            session_id=session_id,
            protocol_version=str(result.get("protocolVersion") or LEGACY_VERSION),
            principal=caller,
            number=number,
        )
        await self.link.opened(self, session, client_headers)
        return session

    def forget(self, session: LegacySession) -> None:
        """The upstream ended this session (404): the next request opens a new one."""
        self.link.stop_reading(session)
        self.sessions.forget(session)

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run `coro` beside the calls; it is cancelled when the proxy stops."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def session_count(self) -> int:
        return len(self.sessions)

    async def aclose(self) -> None:
        for session in self.sessions.all():
            self.link.stop_reading(session)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def post(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        session: LegacySession | None = None,
        route: CallRoute | None = None,
    ) -> tuple[LegacySession, LegacyReply]:
        """Send a call over the caller's session, opening a new one when the upstream says the old one is gone
        (404); or over `session` (a client's own), as it is, unless the call's record carried it here and the
        upstream does not know it (LegacySession.carried)."""
        given, instead = session, False
        for attempt in range(2):
            session = await self.sessions.session_for(client_headers, route) if given is None else given
            if instead and route is not None:
                # Busy from now, not once the server answers: never ended for room, nor taken by another asking call.
                session.calls[message["id"]] = route
            try:
                reply = await self.link.send(session, client_headers, message, route)
            except BaseException:
                if instead:
                    session.calls.pop(message["id"], None)
                raise
            if reply.status == 404 and session.session_id is not None and attempt == 0:
                if given is None:
                    reply.close()
                    self.forget(session)
                    log.info("legacy_session_expired")
                    continue
                if given.carried:  # (nothing ran: a 404 is the answer to the session, before the request is read)
                    reply.close()
                    given, instead = None, True
                    log.info("legacy_client_session_unknown_here", reason="the call runs on a session of the proxy's")
                    continue
            return session, reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def respond(
        self, session: LegacySession, client_headers: MultiMapping[str], request_id: Any, answer: dict[str, Any]
    ) -> None:
        """Answer a server-to-client request."""
        await self.link.respond(session, client_headers, request_id, answer)

    async def ask(
        self,
        client_headers: MultiMapping[str],
        method: str,
        params: dict[str, Any],
        *,
        session: LegacySession | None = None,
        route: CallRoute | None = None,
    ) -> dict[str, Any] | None:
        """A request of the proxy's own (tools/list, tasks/get, tasks/cancel) and its one answer, within
        ASK_TIMEOUT_S; None when the upstream gave none. On the caller's session, or on `session` when the request
        only means something there (an upstream task belongs to its session); as part of the call `route` is, when
        given (on stdio it then reaches the child that took the call). Raises UpstreamUnavailable."""
        message = {"jsonrpc": "2.0", "id": f"mtp-{method}-{secrets.token_hex(6)}", "method": method, "params": params}
        for attempt in range(2):
            current = session or await self.sessions.session_for(client_headers)
            status, answer = await self.link.ask(current, client_headers, message, route)
            if status == 404 and current.session_id is not None and attempt == 0:
                self.forget(current)
                if session is None:
                    continue
            return answer
        return None

    # --- reading a call -----------------------------------------------------------------------------------------

    async def call(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        on_request: Callable[[InputNeeded], Awaitable[None]] | None = None,
        follow: UpstreamTask | None = None,
        detached: Callable[[], bool] | None = None,
        caller: str = "",
    ) -> AsyncIterator[Event]:
        """POST one request and yield its events; the last is Finished or Failed. With `follow`, the id of the
        server's own task for this call (made through another replica), nothing is posted: that task is followed;
        `detached` as in run_as_upstream_task. A server request the client may answer is yielded as InputNeeded whose
        `reply` posts the answer back; the stream is read on meanwhile. `ping` is answered here; a request the client
        did not declare is declined here. A request for this call on the session's standalone stream goes to
        `on_request` instead (http/standalone.py). Ending early (cancel, timeout, shutdown) posts
        notifications/cancelled for the request."""
        legacy = to_legacy(message)
        del message  # the caller's: this generator holds only what it sends, and that only until it is sent
        request_id = legacy["id"]
        route = CallRoute(
            capabilities,
            on_request,
            caller=caller or self._identity.principal(client_headers),
            asks=asks_client(legacy["method"], capabilities),
        )
        try:
            if follow is not None:  # the session the server made its task in, opened through another replica
                session = LegacySession(follow.session_id, follow.protocol_version, route.caller)
            else:
                session = await self.sessions.session_for(client_headers, route)
        except (ConnectionError, OSError, UpstreamUnavailable) as exc:
            yield proxy_failure(_unreachable(exc), self.url, transient="unsent")  # the call itself never left
            return
        session.calls[request_id] = route  # for the whole call: an upstream task's follow-up requests included
        try:
            # (A call to follow made its task already: it is followed, never sent, whatever the link.)
            if follow is not None or await runs_as_task(self, legacy, client_headers):
                route.upstream_task = True
                events = run_as_upstream_task(
                    self, session, legacy, client_headers, capabilities, route, max_bytes, follow, detached
                )
            else:
                events = self.exchange(legacy, client_headers, capabilities, max_bytes=max_bytes, route=route)
            del legacy  # the events' own now
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()
        finally:
            session.calls.pop(request_id, None)

    async def exchange(
        self,
        legacy: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        route: CallRoute | None = None,
        session: LegacySession | None = None,
        verbatim: bool | None = None,
        caller: str = "",
    ) -> AsyncIterator[Event]:
        """One request's POST and its response stream, read as events. `route` is the call it belongs to, known to
        the session the POST went over (a new one when the old one had expired). `caller` (security.caller_of) is
        whose sessions a call on a carried client session may use instead (LegacySession.carried).

        With `session`, a 2025-era client's own: the request goes over it, and results, errors and the server's
        requests come back verbatim, for that client; with `verbatim` False, the proxy's own session that a call's
        upstream task belongs to."""
        request_id, request_method = legacy["id"], legacy["method"]
        verbatim = session is not None if verbatim is None else verbatim
        if verbatim and session is not None:
            # Where the server cannot know what this client declared (one stdio child for all), the proxy checks.
            declared = self.link.client_capabilities(session)
            capabilities = declared if declared is not None else capabilities
        if session is not None and session.carried and route is None:
            # Should this server not know the session, the call goes over one of the proxy's, kept busy by the call.
            route = CallRoute(capabilities, None, caller=caller, asks=asks_client(request_method, capabilities))
        try:
            session, response = await self.post(legacy, client_headers, session, route)
        except (ConnectionError, OSError, UpstreamUnavailable) as exc:
            unsent = isinstance(exc, RequestUnsent | UpstreamUnavailable)  # no connection, or no session to send it on
            yield proxy_failure(_unreachable(exc), self.url, transient="unsent" if unsent else "unanswered")
            return
        del legacy  # sent: a call may run for hours, and its arguments may be large
        if session.on_status is not None:
            session.on_status(response.status)
        if route is not None:
            session.calls[request_id] = route
        finished = False
        try:
            if response.status >= 400 and "json" not in response.content_type:
                finished = True
                reason = f"the upstream answered HTTP {response.status} without a JSON-RPC response"
                if response.status in RETRIED_STATUSES:
                    yield proxy_failure(reason, self.url, transient="unanswered", retry_after_s=response.retry_after_s)
                else:
                    yield proxy_failure(reason, self.url)
                return
            async for upstream_message in response.messages(max_bytes):
                method = upstream_message.get("method")
                if method == "notifications/progress":
                    yield interpret_progress(upstream_message)
                elif isinstance(method, str) and "id" in upstream_message:
                    event = await self.server_request(
                        session, client_headers, upstream_message, capabilities, verbatim=verbatim
                    )
                    if event is not None:
                        yield event
                elif method is None and (
                    upstream_message.get("id") == request_id
                    # An error with id null in an HTTP error answer is this POST's one request refused before the
                    # server read its id (the SDKs' "Missing session ID", "Invalid Content-Type"): it is the answer.
                    or (response.status >= 400 and upstream_message.get("id") is None and "error" in upstream_message)
                ):
                    finished = True
                    yield answer_event(request_method, upstream_message, self, verbatim=verbatim)
                    return
            finished = True
            yield proxy_failure("the upstream closed its event stream before answering the call", self.url)
        except AnswerTooLarge:
            yield too_large(max_bytes)  # not finished upstream: the finally below cancels the call there
        except CallCut as cut:
            finished = True  # nobody left to tell
            yield cut_failure(cut.error)
        finally:
            if route is not None:
                session.calls.pop(request_id, None)
            response.close()
            if not finished:
                response.cancel("cancelled by the client")

    async def server_request(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        capabilities: dict[str, Any],
        *,
        verbatim: bool = False,
    ) -> InputNeeded | None:
        method, upstream_id = message["method"], message["id"]
        if method == "ping":
            await self.respond(session, client_headers, upstream_id, {"result": {}})
            return None
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        declined = declined_answer(method, capabilities, params)
        if declined is not None:
            log.info("legacy_request_declined", upstream_method=method)
            await self.respond(session, client_headers, upstream_id, declined)
            return None

        async def reply(answer: dict[str, Any]) -> None:
            error = answer.get(ERROR_ANSWER) if len(answer) == 1 else None
            if isinstance(error, dict):  # a 2025-era client's refusal, relayed as the error it is
                await self.respond(session, client_headers, upstream_id, {"error": error})
            else:
                await self.respond(session, client_headers, upstream_id, {"result": answer})

        result = {"resultType": "input_required", "inputRequests": dict([question_of(message, verbatim=verbatim)])}
        return InputNeeded(result, reply)


async def runs_as_task(upstream: LegacyUpstream, legacy: dict[str, Any], client_headers: MultiMapping[str]) -> bool:
    """Whether the server runs this call as a SEP-1686 task of its own (its tool's taskSupport), which the proxy
    then follows."""
    name = params_of(legacy).get("name")
    if legacy["method"] != "tools/call" or not isinstance(name, str) or not upstream.link.follows_tasks:
        return False
    return await upstream.task_support.of(upstream, client_headers, name) in TASKED


def question_of(message: dict[str, Any], *, verbatim: bool) -> tuple[str, dict[str, Any]]:
    """A server's request as an input request, and its key: as the server asked it for a 2025-era client
    (verbatim), else in the 2026 shape."""
    method = message["method"]
    key = f"{method.split('/')[0]}-{message['id']}"
    if verbatim:
        return key, {"method": method, **({"params": message["params"]} if "params" in message else {})}
    return key, clean_input_request(message)


def answer_event(method: str, answer: dict[str, Any], upstream: LegacyUpstream, *, verbatim: bool) -> Event:
    """The event of the upstream's answer to a request: as it is for a 2025-era client's own session (verbatim),
    else translated for a modern one (a tools/list teaches the upstream's task support on the way)."""
    if isinstance(answer.get("error"), dict):
        error = answer["error"] if verbatim else to_modern_error(answer["error"])
        return Failed(error, f"the upstream answered with JSON-RPC error {error.get('code')}")
    result = answer.get("result")
    if not isinstance(result, dict):
        return proxy_failure("the upstream's response has no result object", upstream.url)
    if verbatim:
        return Finished(result)
    if method == "tools/list":
        upstream.task_support.learn(result)
        result = without_task_support(result)
    result = to_modern_result(method, result)
    return Finished(result)  # its size is measured where a bound applies (a task's result), not for every answer


def _unreachable(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, NoSessionRoom) else f"upstream unreachable ({exc})"


def discover_result(initialize_result: dict[str, Any] | None) -> dict[str, Any]:
    """server/discover for a modern client, answered from a legacy upstream's initialize result."""
    init = initialize_result or {}
    capabilities = dict(init.get("capabilities") or {})
    capabilities.pop("tasks", None)
    extensions = capabilities.get("extensions")
    capabilities["extensions"] = {**(extensions if isinstance(extensions, dict) else {}), TASKS_EXTENSION: {}}
    result: dict[str, Any] = {
        "resultType": "complete",
        "supportedVersions": [PROTOCOL_VERSION],
        "capabilities": capabilities,
        "ttlMs": 0,
        "cacheScope": "private",
    }
    if isinstance(init.get("instructions"), str):
        result["instructions"] = init["instructions"]
    if isinstance(init.get("serverInfo"), dict):
        result["_meta"] = {"io.modelcontextprotocol/serverInfo": init["serverInfo"]}
    return result
