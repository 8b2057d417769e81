"""A 2025-era server over stdio: one initialize per run of the child (the proxy's, never a client's: a second
initialize would replace the capabilities the child holds for everyone), then requests multiplexed on the channel.

Every principal shares the child's one session, so the LegacyUpstream sessions all name it; what keeps callers apart
is the channel (ids the proxy owns, server requests tied to their call). A 2025-era client's own session (a durable
call's) is one the proxy made for it (clients/sessions2025.py): 404 once ended, as an HTTP server says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
from multidict import MultiMapping

from ..era2025 import LEGACY_VERSION, LegacySession, proxy_initialize
from ..events import AnswerTooLarge, CallCut, UpstreamUnavailable, failure_reason
from ..routing import CallRoute
from .channel import StdioChannel
from .exchange import OWN_ANSWER_MAX_BYTES, ChildGone, Exchange, child_exited, own_answer
from .pool import StdioPool

if TYPE_CHECKING:
    from ...clients.sessions2025 import FrontSession, FrontSessions
    from ..era2025 import LegacyUpstream

log = structlog.get_logger(__name__)

ASK_TIMEOUT_S = 30.0


class StdioReply:
    """The child's answer to one request: always "200" (stdio has no status), or 404 for an ended client session."""

    content_type = "application/json"
    retry_after_s = None

    def __init__(self, exchange: Exchange | None, status: int = 200) -> None:
        self._exchange = exchange
        self.status = status

    async def messages(self, max_bytes: int) -> AsyncIterator[dict[str, Any]]:
        if self._exchange is None:
            return
        async for message in self._exchange.messages(max_bytes):
            if child_exited(self._exchange, message):
                raise CallCut(message["error"])
            yield message

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()  # tells the child when the answer had not come

    def cancel(self, reason: str) -> None:
        """Closing told the child already."""


class StdioLegacyLink:
    """How LegacyUpstream reaches a 2025-era stdio child."""

    def __init__(self, pool: StdioPool, sessions: FrontSessions, *, start_timeout_s: float) -> None:
        self.pool = pool
        self._sessions = sessions
        self._start_timeout_s = start_timeout_s
        self.shared = LegacySession(session_id=None, protocol_version=LEGACY_VERSION, principal="stdio")
        self.initialize_result: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return self.pool.name

    async def _handshake(self, channel: StdioChannel) -> dict[str, Any]:
        """The proxy's initialize, once per run of each child, before any caller's request reaches it."""
        try:
            # Never cancelled: MCP forbids cancelling initialize.
            answer = await own_answer(
                channel, proxy_initialize(), timeout_s=self._start_timeout_s, prepared=False, tell_child=False
            )
        except TimeoutError:
            raise UpstreamUnavailable(
                f"the stdio server did not answer initialize within {self._start_timeout_s:g} s "
                "(upstream.stdio.start_timeout_s)"
            ) from None
        except AnswerTooLarge:
            raise UpstreamUnavailable(
                f"the stdio server's initialize answer exceeds {OWN_ANSWER_MAX_BYTES} bytes"
            ) from None
        result = answer.get("result")
        if not isinstance(result, dict):
            error = answer.get("error")
            message = failure_reason(error) if isinstance(error, dict) else None
            raise UpstreamUnavailable(f"the stdio server refused initialize: {str(message or error)[:200]}")
        await channel.notify({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialize_result = result
        self.shared.protocol_version = str(result.get("protocolVersion") or LEGACY_VERSION)
        log.info("stdio_session_initialized", upstream=self.url, protocol_version=self.shared.protocol_version)
        return result

    async def ready(self) -> dict[str, Any]:
        """A running child's initialize result, the handshake made first if need be. Raises UpstreamUnavailable.

        The first call also makes the handshake every child's first step from then on (the era is 2025)."""
        self.pool.set_prepare(self._handshake)
        try:
            return await self.pool.prepared(self._start_timeout_s)
        except ChildGone as exc:
            raise UpstreamUnavailable(str(exc)) from exc

    async def initialize(
        self, principal: str, client_headers: MultiMapping[str], message: dict[str, Any], bare: LegacySession
    ) -> tuple[dict[str, Any] | None, str | None, int]:
        return {"result": await self.ready()}, None, 200

    async def opened(self, legacy: LegacyUpstream, session: LegacySession, client_headers: MultiMapping[str]) -> None:
        """Nothing to open: stdio has no standalone stream (every request of the child's comes the same way)."""

    def end(self, session: LegacySession) -> None:
        """Sessions of principals all name the child's one session, which lives as long as the child."""

    def stop_reading(self, session: LegacySession) -> None:
        """No stream to stop."""

    @property
    def follows_tasks(self) -> bool:
        return True  # a task's polls and cancel go with its call's route, to the child that made it

    @property
    def tasks_reach_replicas(self) -> bool:
        return False  # each replica's children are its own

    @property
    def sessions_per_call(self) -> bool:
        return False  # the sessions all name the child's one; the pool keeps callers' calls apart

    def client_capabilities(self, session: LegacySession) -> dict[str, Any] | None:
        front = self._front(session) if session.session_id is not None else None
        return front.capabilities if front is not None else None

    def _front(self, session: LegacySession) -> FrontSession | None:
        """The 2025-era client session a client's own LegacySession names, when it is that caller's."""
        front = self._sessions.get(session.session_id) if session.session_id is not None else None
        return front if front is not None and front.principal == session.principal else None

    async def send(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None,
    ) -> StdioReply:
        front = self._front(session) if session.session_id is not None else None
        if session.session_id is not None and front is None:
            return StdioReply(None, 404)  # a client's session the proxy has ended (or never made, or not this caller's)
        await self.ready()
        if route is None and front is not None:  # a 2025 client's own call: on that client's children
            route = CallRoute(front.capabilities, None, caller=front.caller)
        exchange = await self.pool.request(message, route=route, wait_s=self._start_timeout_s)
        if front is not None and self._front(session) is not front:  # ended meanwhile
            exchange.close("the session ended")
            return StdioReply(None, 404)
        if front is not None:  # a durable call is the session's: it ends with it (DELETE, eviction)
            front.calls[("durable", exchange.child_id)] = exchange
            exchange.on_close = lambda: front.calls.pop(("durable", exchange.child_id), None)
        return StdioReply(exchange)

    async def respond(
        self, session: LegacySession, client_headers: MultiMapping[str], request_id: Any, answer: dict[str, Any]
    ) -> None:
        await self.pool.respond(request_id, answer)

    async def ask(
        self,
        session: LegacySession,
        client_headers: MultiMapping[str],
        message: dict[str, Any],
        route: CallRoute | None = None,
    ) -> tuple[int, dict[str, Any] | None]:
        await self.ready()
        try:
            return 200, await own_answer(
                self.pool, message, timeout_s=ASK_TIMEOUT_S, wait_s=self._start_timeout_s, route=route
            )
        except ChildGone as exc:
            raise UpstreamUnavailable(f"{message['method']}: {exc}") from exc
        except TimeoutError as exc:
            raise UpstreamUnavailable(f"{message['method']}: no answer within {ASK_TIMEOUT_S:g} s") from exc
        except AnswerTooLarge:
            log.warning("upstream_answer_too_large", limit=OWN_ANSWER_MAX_BYTES)
            return 200, None
