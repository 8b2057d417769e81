"""A 2025-era server over Streamable HTTP: sessions (`Mcp-Session-Id`), a call's POST and its JSON or event-stream
answer (resumed with GET and Last-Event-ID), answers posted back, notifications, DELETE, the standalone GET stream.

The era's rules (what to send, how to read it) are upstream/era2025.py's; this is only how it travels over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from multidict import CIMultiDict, MultiMapping

from ...jsonrpc import dumps, loads
from ..events import RETRIED_STATUSES, UpstreamUnavailable, retry_after_s
from ..routing import CallRoute
from .client import CallError, CallResponse
from .endpoint import Upstream, finished, single_answer
from .headers import session_headers, session_post_fields, stream_headers
from .sse import SseParser, StreamPosition
from .standalone import open_stream

if TYPE_CHECKING:
    from ..era2025 import LegacySession, LegacyUpstream

log = structlog.get_logger(__name__)

_MAX_RESUMES = 5
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""Control characters a header value cannot carry (a tab it can)."""
ASK_TIMEOUT_S = 30.0
"""How long a request of the proxy's own, or its answer to a server request, may take upstream."""


class _JsonAnswer:
    """The one message of a JSON answer, as an iterator: most answers are JSON, and an async generator would cost
    each a registration with the event loop (its asyncgen hooks) for a single item. Nothing for a body that is not
    a JSON object: the caller then finds the stream ended without an answer."""

    __slots__ = ("_response", "_max_bytes")

    def __init__(self, response: CallResponse, max_bytes: int) -> None:
        self._response: CallResponse | None = response
        self._max_bytes = max_bytes

    def __aiter__(self) -> _JsonAnswer:
        return self

    async def __anext__(self) -> dict[str, Any]:
        response, self._response = self._response, None
        if response is None:
            raise StopAsyncIteration
        body = await response.read(self._max_bytes)
        try:
            message = loads(body)
        except ValueError:
            raise StopAsyncIteration from None
        if not isinstance(message, dict):
            raise StopAsyncIteration
        return message


class HttpReply:
    """The server's answer to one POSTed request: its status, then its messages."""

    def __init__(
        self,
        link: HttpLegacyLink,
        session: LegacySession,
        client_headers: MultiMapping[str],
        response: CallResponse,
        request_id: Any,
    ) -> None:
        self._link = link
        self._session = session
        self._client_headers = client_headers
        self._response = response
        self._request_id = request_id
        self.status = response.status
        self.content_type = response.content_type
        self.retry_after_s = (
            retry_after_s(response.headers.get("retry-after")) if response.status in RETRIED_STATUSES else None
        )

    def close(self) -> None:
        self._response.close()  # pooled if read to its end, else closed

    def cancel(self, reason: str) -> None:
        """The call ends unfinished: a legacy server does not read a dropped stream as a cancellation."""
        self._link.cancel_later(self._session, self._client_headers, self._request_id, reason)

    def messages(self, max_bytes: int) -> AsyncIterator[dict[str, Any]]:
        """Every JSON-RPC message of the answer, JSON or event stream.

        A 2025-11-25 server may close the connection without ending the stream (after a `retry:`); the call is
        then resumed with GET and Last-Event-ID, honouring the retry delay. Priming events carry no message. A body
        or event longer than `max_bytes` raises BodyTooLarge or SseLimitError.
        """
        if self._response.content_type != "text/event-stream":
            return _JsonAnswer(self._response, max_bytes)
        return self._events(max_bytes)

    async def _events(self, max_bytes: int) -> AsyncIterator[dict[str, Any]]:
        response = self._response
        position = StreamPosition()
        resumes = 0
        current = response
        while True:
            parser = SseParser(max_bytes)
            try:
                async for chunk in current.iter_chunks():
                    for message in position.messages(parser, chunk):
                        resumes = 0
                        yield message
            except CallError:
                pass
            finally:
                if current is not response:  # (the call's own is closed by its owner, HttpReply.close)
                    current.close()
            if position.last_event_id is None or resumes >= _MAX_RESUMES:
                return
            resumes += 1
            await asyncio.sleep(position.retry_ms / 1000)  # at most http.sse.MAX_RETRY_MS
            headers = stream_headers(self._session, self._client_headers, position.last_event_id)
            try:
                current = await self._link.upstream.request("GET", headers, None)
            except CallError:
                return
            if current.status != 200:
                current.close()
                return
            log.info("legacy_stream_resumed", last_event_id=position.last_event_id)


class HttpLegacyLink:
    """How LegacyUpstream reaches a 2025-era server over Streamable HTTP."""

    def __init__(self, upstream: Upstream, spawn: Callable[[Awaitable[None]], None]) -> None:
        self.upstream = upstream
        self._spawn = spawn

    @property
    def url(self) -> str:
        return self.upstream.url

    async def initialize(
        self, principal: str, client_headers: MultiMapping[str], message: dict[str, Any], bare: LegacySession
    ) -> tuple[dict[str, Any] | None, str | None, int]:
        """POST the proxy's initialize: the answer, the session id the server gave, and the HTTP status."""
        headers = session_headers(bare, client_headers)
        headers.popall("MCP-Protocol-Version", None)
        response = await self.upstream.request("POST", headers, dumps(message))  # CallError: a ConnectionError
        async with response:
            answer = await single_answer(response, message["id"])
            session_id, status = response.headers.get("mcp-session-id"), response.status
        result = answer.get("result") if answer is not None else None
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        if version is not None and _NOT_IN_A_HEADER.search(str(version)):
            # The session's version goes in every request's MCP-Protocol-Version header, which a CR or LF would split.
            if session_id is not None:
                self.end(dataclasses.replace(bare, session_id=session_id))
            raise UpstreamUnavailable("the upstream's initialize answer names a protocolVersion no header can carry")
        return answer, session_id, status

    async def opened(self, legacy: LegacyUpstream, session: LegacySession, client_headers: MultiMapping[str]) -> None:
        initialized = dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
        await finished(await self.upstream.request("POST", session_headers(session, client_headers), initialized))
        if session.session_id is not None:
            # Before any call: a server may send a call's request there (server-everything's roots/list).
            await open_stream(legacy, self.upstream, session, client_headers)

    def end(self, session: LegacySession) -> None:
        if session.reader is not None:
            session.reader.cancel()
        if session.session_id is None:
            return
        headers = CIMultiDict({"Mcp-Session-Id": session.session_id, "MCP-Protocol-Version": session.protocol_version})

        async def delete() -> None:
            with contextlib.suppress(CallError):
                await finished(await self.upstream.request("DELETE", headers, None))

        self._spawn(delete())

    follows_tasks = True
    tasks_reach_replicas = True  # the server at upstream.url; in per-pod sidecars the task is gone with the pod
    sessions_per_call = True

    def client_capabilities(self, session: LegacySession) -> dict[str, Any] | None:
        return None  # the client initialized the server itself: the server knows, and asks only what it may

    def stop_reading(self, session: LegacySession) -> None:
        if session.reader is not None:
            session.reader.cancel()

    async def send(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None,
    ) -> HttpReply:
        """POST one request. Through the lean client: a working task holds this response open for as long as the
        tool runs."""
        try:
            fields = session_post_fields(session, client_headers)
        except ValueError as exc:
            raise CallError(str(exc)) from None
        try:
            response = await self.upstream.post(fields, dumps(message))
        except asyncio.CancelledError:
            # Dropped before the response's headers (timeout, tasks/cancel, a client that left): the server
            # may hold the request already, and only notifications/cancelled tells it to stop.
            if "id" in message:
                self.cancel_later(session, client_headers, message["id"], "cancelled by the client")
            raise
        return HttpReply(self, session, client_headers, response, message.get("id"))

    async def respond(
        self, session: LegacySession, client_headers: MultiMapping[str], request_id: Any, answer: dict[str, Any]
    ) -> None:
        """Answer a server-to-client request: a POST whose body is the JSON-RPC response (the server says 202)."""
        message = {"jsonrpc": "2.0", "id": request_id, **answer}
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                response = await self.upstream.request("POST", session_headers(session, client_headers), dumps(message))
                status = await finished(response)
        except OSError as exc:  # CallError and TimeoutError included
            # The call's own stream breaks too, and that ends the call with a clear failure.
            log.warning("legacy_answer_not_delivered", reason=str(exc))
            return
        if status >= 400:
            log.warning("legacy_answer_refused", status=status)

    async def ask(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None = None,
    ) -> tuple[int, dict[str, Any] | None]:
        """A request of the proxy's own and its one answer, within ASK_TIMEOUT_S. Raises UpstreamUnavailable."""
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                response = await self.upstream.request("POST", session_headers(session, client_headers), dumps(message))
                async with response:
                    return response.status, await single_answer(response, message["id"])
        except OSError as exc:  # CallError and TimeoutError included
            raise UpstreamUnavailable(f"{message['method']}: {exc or type(exc).__name__}") from exc

    def cancel_later(
        self, session: LegacySession, client_headers: MultiMapping[str], request_id: Any, reason: str
    ) -> None:
        """Post notifications/cancelled: a legacy server does not read a dropped stream as a cancellation."""
        message = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": reason},
        }

        async def send() -> None:
            try:
                await finished(
                    await self.upstream.request("POST", session_headers(session, client_headers), dumps(message))
                )
            except CallError as exc:
                log.warning("upstream_cancel_not_delivered", reason=str(exc))

        self._spawn(send())
