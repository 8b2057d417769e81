"""The upstream as the rest of the proxy sees it, whatever the transport: its era, a call read as events either way,
and the relay of what the proxy does not own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol

import structlog
from aiohttp import web
from multidict import CIMultiDict, MultiMapping

from ..clients.parking import ChildStates
from ..clients.sessions2025 import FrontSessions
from ..jsonrpc import RequestId
from .era2025 import LegacySession, LegacyUpstream
from .events import Event, InputNeeded, UpstreamTask, UpstreamUnavailable, proxy_failure

log = structlog.get_logger(__name__)

Era = Literal["modern", "legacy"]


class ModernUpstream(Protocol):
    """A 2026-07-28 server, however reached: http.modern.Upstream, stdio.modern.StdioModern."""

    @property
    def url(self) -> str: ...

    async def probe(self, client_headers: MultiMapping[str]) -> Era: ...

    def call_tool(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        caller: str = "",
    ) -> AsyncIterator[Event]: ...

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None: ...

    async def takes_2025_sessions(self, client_headers: MultiMapping[str]) -> bool: ...


Rewrite = Callable[[dict[str, Any]], None]


class Relay(Protocol):
    """What the proxy does not own, carried to the server and back: http.relay.HttpRelay, stdio.relay.StdioRelay."""

    async def readiness(self) -> str: ...

    async def relay(
        self, request: web.Request, body: bytes, message: Any, *, request_id: RequestId = None
    ) -> web.StreamResponse: ...

    async def relay_rewritten(
        self,
        request: web.Request,
        body: bytes,
        request_id: RequestId,
        rewrite: Rewrite,
        *,
        limit: int,
        on_headers: Callable[[Any], None] | None = None,
    ) -> web.Response: ...

    async def relay_other(self, request: web.Request, body: bytes | None) -> web.StreamResponse: ...

    async def open_listen(
        self, request: web.Request, body: bytes, *, limit: int, headers: MultiMapping[str] | None = None
    ) -> AsyncGenerator[dict[str, Any], None] | None: ...


class Gateway:
    """The upstream as the rest of the proxy sees it, whatever its transport: its era (configured, or probed once),
    each call sent the way that era expects, and everything else relayed."""

    def __init__(
        self,
        modern: ModernUpstream,
        legacy: LegacyUpstream,
        relay: Relay,
        protocol: str,
        *,
        clients: FrontSessions | None = None,
        unreadable: Callable[[], dict[str, int]] | None = None,
        round_enders: list[Callable[[str | None], bool]] | None = None,
        child_states: ChildStates | None = None,
    ) -> None:
        self.modern = modern
        self.legacy = legacy
        self.relay = relay
        self.front_sessions = clients if clients is not None else FrontSessions(1)
        """2025-era clients' sessions the proxy holds itself: in front of a stdio server, or a 2026-07-28-only one."""
        self._round_enders = round_enders
        self._child_states = child_states
        self.unreadable_counts = unreadable
        """A stdio server's lines that could not be read, by reason (None over HTTP, where an answer that cannot be
        read fails its request as an upstream error)."""
        self._era: Era | None = protocol if protocol in ("modern", "legacy") else None  # type: ignore[assignment]
        self._translates: bool | None = None
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return self.modern.url

    def ends_rounds(self, end_round: Callable[[str | None], bool]) -> None:
        """Where parked MRTR rounds can be ended early (`end_round(caller)`: the caller's oldest, None: anyone's),
        for a call that needs the stdio child one holds: a round a client walked away from then holds no caller's
        call back. Over HTTP a round holds only a session of its own (they are cheap), and nothing is ended early."""
        if self._round_enders is not None:
            self._round_enders.append(end_round)

    def serves_as(self, replica_id: Callable[[], str]) -> None:
        """This replica's id, for what only it can continue: a stdio child's MRTR state names it (ChildStates), so
        that a retry landing on another replica is forwarded here."""
        if self._child_states is not None:
            self._child_states.owner = replica_id

    def session_counts(self) -> dict[str, int]:
        """Open 2025-era sessions: the proxy's with a 2025 upstream, and 2025 clients' with the proxy (those it holds
        itself: in front of a stdio server, or of a 2026-07-28-only one)."""
        return {"upstream": self.legacy.session_count(), "client": len(self.front_sessions)}

    @property
    def known_era(self) -> Era | None:
        return self._era

    @property
    def tasks_reach_replicas(self) -> bool:
        """Whether a 2025 server's own task, made through this replica, can be followed through another."""
        return self._era == "legacy" and self.legacy.link.tasks_reach_replicas

    async def era(self, client_headers: MultiMapping[str] | None = None) -> Era:
        """The era, probing until it is known: a DiscoverResult means 2026-07-28, an MCP answer of another kind
        (to server/discover, else to initialize) means 2025 (the transport's `probe` says what counts).

        Raises UpstreamUnavailable while the upstream cannot be reached, NotMcp when it answers as no MCP server
        does, CredentialsNeeded when it wants credentials to answer at all; the next request probes again.
        """
        if self._era is not None:
            return self._era
        async with self._lock:
            if self._era is None:
                self._era = await self.modern.probe(client_headers or CIMultiDict())
                log.info("upstream_era", era=self._era, upstream=self.url)
        return self._era

    @property
    def translates_2025(self) -> bool:
        """Known to speak 2026-07-28 only to this proxy: 2025-era clients get sessions of the proxy's, their requests
        translated (clients/translated2025.py)."""
        return self._translates is True

    @property
    def passes_2025_as_is(self) -> bool:
        """Known to take a 2025-era client's requests as they are (a 2025 server, or one of both eras over HTTP)."""
        return self._translates is False or self._era == "legacy"

    async def translating(self, client_headers: MultiMapping[str] | None = None) -> bool:
        """Whether 2025-era clients' requests are translated, learning it once: a 2025 server takes them as they
        are; a 2026-07-28 stdio child never does (its one process serves every client); a 2026-07-28 server over
        HTTP does when it answers an initialize of the proxy's. Raises what `era` raises."""
        if self._translates is not None:
            return self._translates
        era = await self.era(client_headers)
        async with self._lock:
            if self._translates is None:
                headers = client_headers or CIMultiDict()
                self._translates = era == "modern" and not await self.modern.takes_2025_sessions(headers)
                log.info("upstream_2025_clients", translated=self._translates, upstream=self.url)
        return self._translates

    def call_tool(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        on_request: Callable[[InputNeeded], Awaitable[None]] | None = None,
        session: LegacySession | None = None,
        follow: UpstreamTask | None = None,
        detached: Callable[[], bool] | None = None,
        caller: str = "",
    ) -> AsyncIterator[Event]:
        """The call's events; a legacy server's request for it outside its stream goes to `on_request`. `caller`
        (security.caller_of) says whose upstream sessions and stdio children it may use. With
        `follow`, the id of a 2025 server's own task made for this call, that task is followed instead. A call
        stopped while `detached()` is true leaves a 2025 server's own task for it running (another replica follows
        it), where it would cancel it.

        With `session` (a 2025-era client's own), the 2025 request goes there as it is, whatever the era. Once the
        era is known, the era's own generator is returned as it is: no frame in between for as long as the call
        runs, and one step less for each event."""
        if session is not None:
            return self.legacy.exchange(
                message, client_headers, capabilities, max_bytes=max_bytes, session=session, caller=caller
            )
        if self._era == "modern":
            if follow is not None:
                return _unfollowable(self.url)
            return self.modern.call_tool(message, client_headers, capabilities, max_bytes=max_bytes, caller=caller)
        options = {
            "max_bytes": max_bytes, "on_request": on_request, "follow": follow, "detached": detached, "caller": caller
        }  # fmt: skip
        if self._era == "legacy":
            return self.legacy.call(message, client_headers, capabilities, **options)  # type: ignore[arg-type]
        return self._call_once_known(
            client_headers,
            lambda: self.call_tool(message, client_headers, capabilities, **options),  # type: ignore[arg-type]
        )

    async def _call_once_known(
        self, client_headers: MultiMapping[str], call: Callable[[], AsyncIterator[Event]]
    ) -> AsyncIterator[Event]:
        try:
            await self.era(client_headers)
        except UpstreamUnavailable as exc:
            # Not reached at all (not "no MCP server here", nor "credentials needed"): the call never left.
            unreached = type(exc) is UpstreamUnavailable
            yield proxy_failure(str(exc), self.url, transient="unsent" if unreached else None)
            return
        events = call()
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None:
        # A legacy-era call posts its own cancellation when its event stream is closed early.
        if self._era == "modern":
            await self.modern.notify_cancelled(request_id, client_headers, reason)


async def _unfollowable(url: str) -> AsyncIterator[Event]:
    # A task the server made while it spoke 2025; it speaks 2026-07-28 now, which has no tasks/get of that kind.
    # Failing is the one safe answer: running the call instead could run it twice.
    yield proxy_failure("the upstream's own task cannot be followed: it no longer speaks the 2025 protocol", url)
