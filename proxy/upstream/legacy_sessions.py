"""A legacy (2025) upstream's sessions: each one caller's, bounded, and the one a request goes over.

Each session is one caller's, and a call whose client may be asked something has one to itself: a server request
on the standalone stream then names its call, and what a server keeps of one caller (the roots it was given) never
reaches another. Bounded: one caller opening many (made-up credentials cost nothing) ends only idle ones, never a
session with a call in flight.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import structlog
from multidict import MultiMapping

from ..security import Identity
from ..session_table import SessionsFull, SessionTable
from .events import UpstreamUnavailable
from .routing import CallRoute, LegacySession

log = structlog.get_logger(__name__)

Handshake = Callable[[str, MultiMapping[str], int], Awaitable[LegacySession]]
"""Opens session number `n` with the upstream for a caller (initialize, and what follows it); raises
UpstreamUnavailable when the upstream refuses."""


class NoSessionRoom(UpstreamUnavailable):
    """Every session the proxy may keep with the upstream has a call in flight: the upstream itself is fine."""


class CallerSessions:
    """The sessions of one legacy upstream, by caller."""

    def __init__(
        self,
        handshake: Handshake,
        *,
        end: Callable[[LegacySession], None],
        sessions_per_call: bool,
        identity: Identity,
        max_sessions: int,
        max_sessions_per_caller: int | None = None,
    ) -> None:
        self._handshake = handshake
        self._end = end
        self._per_call = sessions_per_call  # (over stdio the sessions all name the child's one: one a caller)
        self._identity = identity
        self._per_caller = max_sessions_per_caller or max_sessions
        self._table: SessionTable[int, LegacySession] = SessionTable(
            max_sessions, is_busy=lambda session: bool(session.calls), on_end=self._ended
        )
        self._by_caller: dict[str, list[LegacySession]] = {}
        self._numbers = itertools.count(1)
        self._opening: dict[str, asyncio.Task[LegacySession]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def all(self) -> list[LegacySession]:
        return self._table.values()

    async def session_for(self, client_headers: MultiMapping[str], route: CallRoute | None = None) -> LegacySession:
        """A session of the caller's for a request (of the call `route`, when given): one with no call that may be
        asked something, or, for such a call, one with nothing in flight; a new one when there is none.

        Whose: the request's credential (a server may bind its session to the token that opened it) and its caller
        (the call's, security.caller_of: its principal, or an anonymous client's address), else its principal."""
        who = route.caller if route is not None and route.caller else self._identity.principal(client_headers)
        caller = f"{self._identity.credential(client_headers)}|{who}"
        per_call = self._per_call
        alone = route is not None and route.asks and per_call
        while True:
            sessions = self._by_caller.get(caller, ())
            if route is not None:  # the call's own requests (its POST after call() chose the session, follow-ups)
                for session in sessions:
                    if session.calls.carries(route):
                        return session
            for session in sessions:
                if (not session.calls) if alone else (not per_call or not session.calls.asking):
                    self._table.get(session.number)  # the most recently used now
                    return session
            try:
                if alone and len(sessions) >= self._per_caller:
                    raise NoSessionRoom("upstream.max_sessions_per_caller")  # shared below, as when all are busy
                if alone:  # its own, made for it: no other call finds it free before it is in flight there
                    return await self._open(caller, client_headers)
                opening = self._opening.get(caller)
                if opening is None:  # one initialize per caller, however many requests wait for it
                    opening = asyncio.ensure_future(self._open(caller, client_headers))
                    self._opening[caller] = opening
                    opening.add_done_callback(lambda _: self._opening.pop(caller, None))
                session = await asyncio.shield(opening)
            except NoSessionRoom:
                sessions = self._by_caller.get(caller, ())
                if not sessions:
                    raise
                # Every session is busy, or the caller has its share: rather than fail, the call shares the caller's
                # session with the fewest calls that may be asked something; a question on its standalone stream
                # may then be refused as ambiguous, never sent to another caller.
                bound = "max_sessions_per_caller" if len(sessions) >= self._per_caller else "max_sessions"
                log.info("legacy_session_shared", reason=f"upstream.{bound}")
                return min(sessions, key=lambda session: session.calls.asking)
            if alone or not session.calls.asking:  # (else a call that may be asked took it meanwhile: look again)
                return session

    def forget(self, session: LegacySession) -> None:
        """The upstream ended this session (404): it is no longer chosen, and the next request opens a new one."""
        if self._table.get(session.number) is session:
            self._table.pop(session.number)
            self._unlist(session)

    async def _open(self, caller: str, client_headers: MultiMapping[str]) -> LegacySession:
        try:
            self._table.make_room(what="upstream.max_sessions")  # before the upstream makes one for nothing
        except SessionsFull as exc:
            raise _no_room(exc) from exc
        session = await self._handshake(caller, client_headers, next(self._numbers))
        try:
            self._table.add(session.number, session, what="upstream.max_sessions")
        except SessionsFull as exc:  # filled up while this one opened
            self._end(session)
            raise _no_room(exc) from exc
        self._by_caller.setdefault(caller, []).append(session)
        log.info(
            "legacy_session_opened", protocol_version=session.protocol_version, has_session_id=bool(session.session_id)
        )
        return session

    def _ended(self, number: int, session: LegacySession) -> None:
        self._unlist(session)
        self._end(session)

    def _unlist(self, session: LegacySession) -> None:
        sessions = self._by_caller.get(session.principal)
        if sessions is not None and session in sessions:
            sessions.remove(session)
            if not sessions:
                del self._by_caller[session.principal]


def _no_room(exc: SessionsFull) -> NoSessionRoom:
    log.warning("legacy_session_refused", reason=str(exc))
    return NoSessionRoom(f"cannot open another session with the upstream: {exc}")
