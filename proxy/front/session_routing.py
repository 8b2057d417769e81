"""Any replica answers any request of a 2025-era session (listen.advertise_url, with the Redis store).

A 2025 session lives in one place: the upstream server that made it (a sidecar's own server, one per pod), or
this proxy in front of a stdio child. A replica that answers a request which creates a session (its response names
an `Mcp-Session-Id`) records in the store that the session is its own; a request for a session another replica
holds is forwarded to that replica, over HTTP to the URL it advertises with its lease, and the answer (event
streams included) is relayed back as it arrives. So a plain round-robin balancer works, without affinity.

The hop is signed with the replicas' shared key (the request's method, path, session and a timestamp); a replica
serves a signed request itself, whatever it knows of the session, and never forwards it again. A client's own
`Mcp-Tasks-Proxy-Hop` header signs nothing, is never passed upstream, and only costs it a log line. When the
session's replica is gone (its lease lapsed, or its address refuses connections), its record is dropped and the
request is served where it landed, as any session this replica does not know: a sidecar's server went with its
pod and answers 404, what the spec gives for a lost session (the client starts a new one with `initialize`), while
replicas in front of one shared server keep the session. A replica that holds the lease but does
not answer in time gets 503 (try again).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from cachetools import TTLCache

from ..clients.durable_stream import parse_answer_id, parse_event_id
from ..clients.envelope import params_of
from ..clients.parking import parked_owner
from ..jsonrpc import dumps, error_object, loads
from ..security import Identity, same_mac
from ..store.base import StoreUnavailable, TaskStore
from ..upstream.http.headers import HOP_BY_HOP, HOP_HEADER, RESPONSE_SKIP, end_to_end_headers
from .context import MCP_PATH
from .dispatch import read_body

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION_TTL_S = 24 * 3600.0
"""How long a session's owner is kept after the session was last used through its replica."""
SESSION_RENEW_S = 3600.0
"""A session in use has its record written again at most this often (one SET an hour, not one per request)."""
_MAX_LOCAL_SESSIONS = 100_000
_HOP_SKEW_S = 60.0
"""How old (or how far ahead, between clocks) a signed hop may be."""
_SKIP = HOP_BY_HOP | {"content-length", HOP_HEADER.lower()}
"""Request headers not forwarded as they came. Host is: the replica that answers checks it as the first one did
(security.allowed_hosts names the name clients use, not a pod's address)."""
forwarded_key = web.RequestKey("forwarded_key", bool)


class SessionRouting:
    def __init__(
        self,
        store: TaskStore,
        identity: Identity,
        replica_id: Callable[[], str],
        *,
        connect_timeout_s: float = 5.0,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._identity = identity
        self._replica_id = replica_id
        self._timer = timer
        self._local: TTLCache[str, float] = TTLCache(maxsize=_MAX_LOCAL_SESSIONS, ttl=SESSION_TTL_S, timer=timer)
        """The sessions made through this replica (their tags), with when their record was last written: answered
        here without asking the store."""
        self._connect_timeout_s = connect_timeout_s
        self._client: aiohttp.ClientSession | None = None

    def routed(self, handler: Handler) -> Handler:
        """`handler`, for requests of sessions this replica holds (or does not know); the others go to theirs."""

        async def route(request: web.Request) -> web.StreamResponse:
            forwarded = await self._forward_if_elsewhere(request)
            return forwarded if forwarded is not None else await handler(request)

        return route

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """A response that names a session made through this replica: the session is recorded as its own."""
        if request.get(forwarded_key) or request.path != MCP_PATH or response.status >= 300:
            return
        ended = request.method == "DELETE" and request.headers.get("Mcp-Session-Id")
        session_id = ended or response.headers.get("Mcp-Session-Id")
        if not session_id:
            return
        try:
            tag = self._tag(session_id)  # (StoreUnavailable while the shared key is not loaded yet)
            if ended:  # the session is over: its record goes (else it would stay for SESSION_TTL_S)
                self._local.pop(tag, None)
                await self._store.forget_session(tag)
                return
            if self._recorded(tag):
                return
            await self._record(tag)  # only once recorded: a failed claim is tried again with the next answer
        except StoreUnavailable:
            log.warning("session_not_recorded", reason="the store did not answer")  # only this replica will know

    def _recorded(self, tag: str) -> bool:
        """Whether this replica recorded the session `tag` as its own, less than SESSION_RENEW_S ago."""
        written = self._local.get(tag)
        return written is not None and self._timer() - written < SESSION_RENEW_S

    async def _record(self, tag: str) -> None:
        await self._store.claim_session(tag, self._replica_id(), int(SESSION_TTL_S * 1000))
        self._local[tag] = self._timer()

    async def _renew_if_due(self, tag: str) -> None:
        """A session of this replica's, in use: its record lasts SESSION_TTL_S from now (renewed hourly), so a
        session kept open for days is still routed here from every replica."""
        if tag in self._local and not self._recorded(tag):
            try:
                await self._record(tag)
            except StoreUnavailable:
                log.warning("session_not_renewed", reason="the store did not answer")  # tried again next request

    async def _forward_if_elsewhere(self, request: web.Request) -> web.StreamResponse | None:
        session_id = request.headers.get("Mcp-Session-Id")
        if not session_id:
            return await self._parked_elsewhere(request)
        hop = request.headers.get(HOP_HEADER)
        if hop is not None:
            if self._signed(hop, request.method, request.path, session_id):
                with contextlib.suppress(StoreUnavailable):
                    await self._renew_if_due(self._tag(session_id))
                return None  # sent here by the replica that got it: this one answers, whatever it knows
            log.warning("hop_header_refused", reason="not signed by a replica")
        try:
            tag = self._tag(session_id)
        except StoreUnavailable:
            return None  # the shared key is not loaded yet (Redis not answering at start): tried here
        if tag in self._local:
            await self._renew_if_due(tag)
            return None
        try:
            owner = await self._store.session_owner(tag)
            url = await self._store.replica_url(owner) if owner is not None and owner != self._replica_id() else None
        except StoreUnavailable:
            # Where the session lives cannot be told: 503, try again. Tried here, a session of another replica's
            # would get its server's 404, and the client would give up a live session.
            return _unavailable("the task store does not answer, so the replica holding this session is not known")
        if owner is None or owner == self._replica_id():
            return None
        if url is not None:
            try:
                forwarded = await self._forward(request, url, session_id)
            except _Unreachable as exc:
                # Slow, restarting, or gone without a word: a call of the session is answered here, from its record;
                # anything else tries again.
                return None if _about_recorded_calls(request, await _posted(request)) else _unavailable(str(exc))
            if forwarded is not None:
                return forwarded
        # Its lease lapsed, or its address refuses connections (the process is gone, its lease not yet lapsed).
        log.info("session_replica_gone", replica=owner)
        with contextlib.suppress(StoreUnavailable):
            await self._store.forget_session(tag)
        if _about_recorded_calls(request, await _posted(request)):
            # A durable call's stream resumed, a SEP-1686 task of the proxy's polled: everything about them is in the
            # store, so this replica answers, following the record while the lost replica's lease decides (the call
            # run again, or its outcome written as unknown).
            log.info("session_call_answered_here", replica=owner)
        # Anything else is served here as a session this replica does not know, now and after the record is gone:
        # its server answers (404 from a sidecar's own server, gone with its pod; replicas sharing one server keep
        # the session), or the proxy itself in front of a stdio or 2026 server (404: initialize again).
        return None

    async def _parked_elsewhere(self, request: web.Request) -> web.StreamResponse | None:
        """A 2026 client's retry of a synchronous MRTR round whose call another replica holds open (parked in front
        of a 2025 server, parking.py): the retry goes there. Anything else, and a state that names no live replica
        (the call is gone with it: the retry is refused here as any expired state), is this replica's."""
        if request.method != "POST" or request.path != MCP_PATH:
            return None
        body = await read_body(request)  # kept by aiohttp: the handler reads the same bytes
        if not may_name_a_parked_call(body):
            return None
        try:
            message = loads(body)
        except ValueError:
            return None
        state = params_of(message).get("requestState") if isinstance(message, dict) else None
        owner = parked_owner(state)
        if owner is None or owner == self._replica_id():
            return None
        hop = request.headers.get(HOP_HEADER)
        if hop is not None and self._signed(hop, request.method, request.path, state):
            return None
        try:
            url = await self._store.replica_url(owner)
        except StoreUnavailable:
            return None
        # A replica that refuses connections took the call with it: refused here as any expired state.
        try:
            return await self._forward(request, url, state) if url is not None else None
        except _Unreachable as exc:
            return _unavailable(str(exc))  # slow or restarting: the client tries again

    async def _forward(self, request: web.Request, base_url: str, session_id: str) -> web.StreamResponse | None:
        """The answer of the replica at `base_url`; None when it refuses connections (nothing was sent: its process
        is gone, whatever its lease says); _Unreachable when it cannot be reached otherwise."""
        request[forwarded_key] = True
        # Bounded in size and time as any request's (listen.body_timeout_s); read already when the route needed it.
        body = await read_body(request) if request.body_exists else None
        headers = end_to_end_headers(request.headers, _SKIP)
        headers[HOP_HEADER] = self._sign(request.method, request.path, session_id)
        client = self._session()
        target = base_url.rstrip("/") + request.path_qs
        try:
            upstream = await client.request(request.method, target, headers=headers, data=body)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
                return None
            # A timeout or a reset may be a replica that is slow or restarting: the client tries again.
            log.warning("session_replica_unreachable", reason=str(exc) or type(exc).__name__)
            raise _Unreachable("the replica holding this session cannot be reached") from None
        try:
            headers = end_to_end_headers(upstream.headers, RESPONSE_SKIP)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():  # streams relayed as they come, never buffered
                    await response.write(chunk)
            except (aiohttp.ClientError, OSError):
                if request.transport is not None:
                    request.transport.close()  # cut there, cut here: the client sees a broken response
                return response
            await response.write_eof()
            return response
        finally:
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()  # a stream the client left is closed, not pooled: the owner sees the cancel

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            timeout = aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s)
            # Bytes as sent: nothing decompressed, no header the client did not send (aiohttp's Accept-Encoding
            # and User-Agent), no cookies between clients; and no pool limit: every forwarded stream holds a
            # connection for as long as it lasts (aiohttp's default of 100 stalled every forward past it).
            self._client = aiohttp.ClientSession(
                timeout=timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                connector=aiohttp.TCPConnector(limit=0),
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _tag(self, session_id: str) -> str:
        return self._identity.session_tag({"Mcp-Session-Id": session_id})

    def _sign(self, method: str, path: str, session_id: str) -> str:
        stamp, replica = str(int(time.time())), self._replica_id()
        return f"{replica}.{stamp}.{self._identity.mac('hop', replica, stamp, method, path, session_id)}"

    def _signed(self, hop: str, method: str, path: str, session_id: str) -> bool:
        parts = hop.rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or abs(time.time() - int(parts[1])) > _HOP_SKEW_S:
            return False
        replica, stamp, mac = parts
        return same_mac(mac, self._identity.mac("hop", replica, stamp, method, path, session_id))


class _Unreachable(Exception):
    """A replica's address did not answer in time, or the connection broke before its answer began."""


_RECORDED_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/cancel", "tasks/list", "notifications/cancelled"})
"""A 2025 session's requests about its calls that the store answers: the proxy's SEP-1686 tasks, a durable call's
cancellation."""


async def _posted(request: web.Request) -> Any:
    """The JSON a POST to the MCP endpoint carries (read once: aiohttp keeps the body); None for any other request,
    or a body that is not JSON."""
    if request.method != "POST" or request.path != MCP_PATH:
        return None
    try:
        return loads(await read_body(request))
    except ValueError:
        return None


def _about_recorded_calls(request: web.Request, message: Any) -> bool:
    """Whether a request of a 2025 session (`message`, what it POSTs) is about calls the proxy records (a durable
    call's stream resumed with the proxy's Last-Event-ID, an answer to a question it relayed, a SEP-1686 task's poll
    or cancel), which any replica answers from the store."""
    if request.method == "GET":
        return parse_event_id(request.headers.get("Last-Event-ID")) is not None
    if not isinstance(message, dict):
        return False
    if "method" in message:
        return message["method"] in _RECORDED_METHODS
    return parse_answer_id(message.get("id")) is not None


def may_name_a_parked_call(body: bytes) -> bool:
    """Whether a request's body may hold a parked call's handle (parking.py): the usual case is decided without
    parsing."""
    return b'"mtp1' in body


def _unavailable(reason: str) -> web.Response:
    error = error_object(-32603, f"Proxy failure: {reason}; try again")
    return web.Response(status=503, body=dumps({"jsonrpc": "2.0", "id": None, "error": error}),
                        content_type="application/json")  # fmt: skip
