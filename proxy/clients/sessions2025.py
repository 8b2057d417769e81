"""2025-era client sessions the proxy holds itself, and ends itself: in front of a stdio child, and in front of a
server that speaks 2026-07-28 only (clients/translated2025.py).

A stdio server has one session (its process), initialized once by the proxy; a client's own `initialize` must
never reach it, or the capabilities it declared would replace every other client's. A 2026-07-28 server has no
sessions at all. So each 2025-era client gets a session of the proxy's: its id (`Mcp-Session-Id`), its principal,
version and capabilities (what the server's requests for its calls are checked against), its GET streams, the
resources it subscribed to.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
from typing import Any

import structlog

from ..jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, JsonRpcError, dumps
from ..session_table import SessionsFull, SessionTable

log = structlog.get_logger(__name__)

VERSIONS_2025 = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MAX_DECLARED_BYTES = 16 * 1024
"""What a client's initialize may declare (capabilities and clientInfo, encoded): each of the session's requests
carries it to a 2026-07-28 server, and each of its calls keeps it."""
_STREAM_QUEUE = 256
"""Notifications a GET stream may fall behind by; past it the oldest are dropped (they say "something changed")."""
_MAX_STREAMS = 4
"""GET streams one session may hold open."""
MAX_SUBSCRIBED = 1024
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
    caller: str = ""
    """Who the session counts against for limits: its principal, or an anonymous caller's network address."""
    client_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What its initialize said the client is (a 2026-07-28 server is told it on every request)."""
    calls: dict[Any, Any] = dataclasses.field(default_factory=dict)
    """The client's requests in flight (its id → their Exchange), for its notifications/cancelled."""
    asked: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Ids the client was shown for the child's requests → the child's own ids."""
    streams: dict[asyncio.Queue[dict[str, Any] | None], None] = dataclasses.field(default_factory=dict)
    """Its GET streams' queues, oldest first."""
    subscribed: set[str] = dataclasses.field(default_factory=set)
    resubscribed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set (and replaced) when `subscribed` changes: a subscription the proxy holds for the session is renewed."""
    tasks: dict[str, int] = dataclasses.field(default_factory=dict)
    """The child's own SEP-1686 tasks this session made → the child (of the pool) that made each."""

    @property
    def busy(self) -> bool:
        """A call in flight or a GET stream open: its client is using it now, and it is never ended to make room."""
        return bool(self.calls or self.streams)

    def remember_task(self, task_id: str, child: int) -> None:
        if len(self.tasks) >= _MAX_TASKS:
            del self.tasks[next(iter(self.tasks))]  # the oldest: its polls then get "no such task"
        self.tasks[task_id] = child

    def open_stream(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A new GET stream's queue; past _MAX_STREAMS the oldest stream is ended."""
        if len(self.streams) >= _MAX_STREAMS:
            oldest = next(iter(self.streams))
            del self.streams[oldest]
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

    def subscriptions_changed(self) -> None:
        changed, self.resubscribed = self.resubscribed, asyncio.Event()
        changed.set()

    def remember_asked(self, shown_id: str, child_id: Any) -> bool:
        if len(self.asked) >= _MAX_ASKED:
            return False
        self.asked[shown_id] = child_id
        return True


def call_key(request_id: Any) -> Any:
    """A client's request id as a key of FrontSession.calls: 1 and "1" are different ids, and True is not 1."""
    return (type(request_id).__name__, request_id) if not isinstance(request_id, str) else request_id


class FrontSessions:
    """The sessions, within two bounds: `max_sessions` in all, and `per_caller` for one caller (a principal, or an
    anonymous caller's network address, so that anonymous clients are not one caller). At a bound, the least
    recently used idle session within it is ended (its client gets 404 and initializes again); a busy one never
    is, and when every one is busy the new session is refused (SessionsFull)."""

    def __init__(self, max_sessions: int, *, per_caller: int = 64) -> None:
        self._sessions: SessionTable[str, FrontSession] = SessionTable(
            max_sessions, is_busy=lambda session: session.busy, on_end=self._ended
        )
        self._per_caller = per_caller
        self._of: dict[str, collections.OrderedDict[str, None]] = {}
        """Each caller's session ids, least recently used first."""

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, principal: str, caller: str, protocol_version: str, capabilities: dict[str, Any]) -> FrontSession:
        mine = self._of.get(caller)
        if mine is not None and len(mine) >= self._per_caller and not self._sessions.end_idlest(list(mine)):
            raise SessionsFull(
                f"this caller has {self._per_caller} sessions, each with a call or stream open "
                "(upstream.stdio.max_sessions_per_principal)"
            )
        session = FrontSession(secrets.token_urlsafe(24), principal, protocol_version, capabilities, caller)
        self._sessions.add(session.id, session, what="upstream.stdio.max_sessions")
        self._of.setdefault(caller, collections.OrderedDict())[session.id] = None
        return session

    def open(self, principal: str, caller: str, params: dict[str, Any], default_version: str) -> FrontSession:
        """A session for a client's `initialize` (its params): the version it asked for when it is a 2025 one,
        else `default_version`; what it declared. JsonRpcError 503 at the bounds, when no idle session can go."""
        asked = params.get("protocolVersion")
        capabilities = params.get("capabilities")
        info = params.get("clientInfo")
        try:
            declared = len(dumps({"capabilities": capabilities, "clientInfo": info}))
        except ValueError:  # nested deeper than the encoder goes
            declared = MAX_DECLARED_BYTES + 1
        if declared > MAX_DECLARED_BYTES:
            raise JsonRpcError(
                INVALID_PARAMS, f"Invalid params: capabilities and clientInfo take at most {MAX_DECLARED_BYTES} bytes"
            )
        try:
            session = self.create(
                principal,
                caller,
                asked if asked in VERSIONS_2025 else default_version,
                capabilities if isinstance(capabilities, dict) else {},
            )
        except SessionsFull as exc:
            log.warning("client_session_refused", reason=str(exc))
            raise JsonRpcError(
                INTERNAL_ERROR, f"Cannot open a session: {exc}; end one (HTTP DELETE) or try again later",
                http_status=503,
            ) from exc  # fmt: skip
        if isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("version"), str):
            session.client_info = info
        return session

    def named(self, session_id: str | None, principal: str) -> FrontSession:
        """The session a request names, of its principal: JsonRpcError 400 without one, 404 for one the proxy does
        not hold (its client initializes again)."""
        if session_id is None:
            raise JsonRpcError(INVALID_REQUEST, "Bad Request: no Mcp-Session-Id header (initialize first)")
        session = self.get(session_id)
        if session is None or session.principal != principal:
            raise JsonRpcError(INVALID_REQUEST, "Session not found: initialize again", http_status=404)
        return session

    def get(self, session_id: str) -> FrontSession | None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._of[session.caller].move_to_end(session_id)
        return session

    def end(self, session_id: str) -> bool:
        return self._sessions.end(session_id) is not None

    def _ended(self, session_id: str, session: FrontSession) -> None:
        _close(session)
        mine = self._of.get(session.caller)
        if mine is not None:
            mine.pop(session_id, None)
            if not mine:
                del self._of[session.caller]  # callers are cheap to mint: none is kept for nothing
        log.info("stdio_session_ended", sessions=len(self._sessions))

    def broadcast(self, message: dict[str, Any]) -> None:
        """A notification of the child's that names no call: list changes reach every session, a resource's update
        only those subscribed to it."""
        uri = None
        if message.get("method") == "notifications/resources/updated":
            params = message.get("params")
            uri = params.get("uri") if isinstance(params, dict) else None
            if not isinstance(uri, str):
                return
        for session in self._sessions.values():
            if uri is None or uri in session.subscribed:
                session.push(message)


def _close(session: FrontSession) -> None:
    session.push(None)  # ends its GET streams
    for exchange in list(session.calls.values()):
        exchange.close("the session ended")
