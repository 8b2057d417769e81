"""2025-era client sessions in front of a stdio child, which the proxy ends itself.

A stdio server has one session (its process), initialized once by the proxy; a client's own `initialize` must
never reach it, or the capabilities it declared would replace every other client's. So each 2025-era client gets a
session of the proxy's: its id (`Mcp-Session-Id`), its principal, version and capabilities (what the child's
requests for its calls are checked against), its GET streams, the resources it subscribed to.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

import structlog
from cachetools import LRUCache

log = structlog.get_logger(__name__)

_STREAM_QUEUE = 256
"""Notifications a GET stream may fall behind by; past it the oldest are dropped (they say "something changed")."""
_MAX_STREAMS = 4
"""GET streams one session may hold open."""
_MAX_SUBSCRIBED = 1024
"""Resources one session may subscribe to."""
_MAX_TASKS = 10_000
"""The child's own tasks remembered per session."""
_MAX_ASKED = 1024
"""Requests of the child shown to one session's client and not yet answered."""


@dataclasses.dataclass(eq=False, slots=True)
class FrontSession:
    id: str
    principal: str
    protocol_version: str
    capabilities: dict[str, Any]
    calls: dict[Any, Any] = dataclasses.field(default_factory=dict)
    """The client's requests in flight (its id → their Exchange), for its notifications/cancelled."""
    asked: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Ids the client was shown for the child's requests → the child's own ids."""
    streams: dict[asyncio.Queue[dict[str, Any] | None], None] = dataclasses.field(default_factory=dict)
    """Its GET streams' queues, oldest first."""
    subscribed: set[str] = dataclasses.field(default_factory=set)
    tasks: dict[str, int] = dataclasses.field(default_factory=dict)
    """The child's own SEP-1686 tasks this session made → the child (of the pool) that made each."""

    def remember_task(self, task_id: str, child: int) -> None:
        if len(self.tasks) >= _MAX_TASKS:
            del self.tasks[next(iter(self.tasks))]  # the oldest: its polls then get "no such task"
        self.tasks[task_id] = child

    def open_stream(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A new GET stream's queue; past _MAX_STREAMS the oldest stream is ended."""
        if len(self.streams) >= _MAX_STREAMS:
            oldest = next(iter(self.streams))
            self.streams.discard(oldest)
            if oldest.full():
                oldest.get_nowait()
            oldest.put_nowait(None)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=_STREAM_QUEUE)
        self.streams[queue] = None
        return queue

    def push(self, message: dict[str, Any] | None) -> None:
        for queue in list(self.streams):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(message)

    def remember_asked(self, shown_id: str, child_id: Any) -> bool:
        if len(self.asked) >= _MAX_ASKED:
            return False
        self.asked[shown_id] = child_id
        return True


class FrontSessions:
    """The sessions, least recently used ended first past `max_sessions`."""

    def __init__(self, max_sessions: int, *, per_principal: int = 64) -> None:
        self._sessions: LRUCache[str, FrontSession] = _Evicting(maxsize=max_sessions, on_evict=self._evicted)
        self._per_principal = per_principal
        self._of: dict[str, list[str]] = {}
        """Each principal's session ids, oldest first."""

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, principal: str, protocol_version: str, capabilities: dict[str, Any]) -> FrontSession:
        session = FrontSession(secrets.token_urlsafe(24), principal, protocol_version, capabilities)
        mine = [sid for sid in self._of.get(principal, []) if sid in self._sessions]
        while len(mine) >= self._per_principal:  # a caller's many sessions end its own oldest, not anyone else's
            self.end(mine.pop(0))
        mine.append(session.id)
        self._of[principal] = mine
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> FrontSession | None:
        return self._sessions.get(session_id)

    def end(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        _close(session)
        self._evicted(session)
        return True

    def _evicted(self, session: FrontSession) -> None:
        mine = self._of.get(session.principal)
        if mine is not None and session.id in mine:
            mine.remove(session.id)
        if not mine:
            self._of.pop(session.principal, None)  # principals are cheap to mint: none is kept for nothing

    def broadcast(self, message: dict[str, Any]) -> None:
        """A notification of the child's that names no call: list changes reach every session, a resource's update
        only those subscribed to it."""
        uri = None
        if message.get("method") == "notifications/resources/updated":
            params = message.get("params")
            uri = params.get("uri") if isinstance(params, dict) else None
            if not isinstance(uri, str):
                return
        for session in list(self._sessions.values()):
            if uri is None or uri in session.subscribed:
                session.push(message)


def _close(session: FrontSession) -> None:
    session.push(None)  # ends its GET streams
    for exchange in list(session.calls.values()):
        exchange.close("the session ended")


class _Evicting(LRUCache):
    def __init__(self, maxsize: int, on_evict: Any) -> None:
        super().__init__(maxsize=maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[str, FrontSession]:
        key, session = super().popitem()
        _close(session)
        self._on_evict(session)
        log.info("stdio_session_evicted", reason="upstream.stdio.max_sessions")
        return key, session
