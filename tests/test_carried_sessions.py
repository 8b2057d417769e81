"""A client's session carried to another replica in a call's record (LegacySession.carried): where that replica's
server does not know it, the call goes over a session of the proxy's for the call's own caller, busy from the moment
it is chosen. Real clients in the sidecar topology are in test_any_replica.py; here a link answers as a sidecar's
server would (404 for the client's session, which it never made) and holds its answer, to look in between."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from multidict import CIMultiDict

from mcp_tasks_proxy.config import SecurityConfig
from mcp_tasks_proxy.security import Identity
from mcp_tasks_proxy.upstream.era2025 import LegacyUpstream
from mcp_tasks_proxy.upstream.routing import CallRoute, LegacySession

CLIENTS_SESSION = "made-on-the-lost-pod"


class Reply:
    def __init__(self, status: int) -> None:
        self.status = status

    def close(self) -> None:
        pass


class SidecarServer:
    """The replica's own server: it knows the sessions it made, and answers a call once `answer` is set."""

    url = "http://127.0.0.1:9/mcp"
    sessions_per_call = True

    def __init__(self, spawn: Any) -> None:
        self.made = 0
        self.dies = False
        self.answer = asyncio.Event()
        self.sent: list[tuple[str | None, str, bool]] = []
        """(session id, whose session, whether the call was in flight on it as it was sent)."""

    async def initialize(self, caller: str, headers: Any, message: dict, bare: LegacySession) -> tuple:
        self.made += 1
        return {"result": {"protocolVersion": "2025-11-25", "capabilities": {}}}, f"own-{self.made}", 200

    async def opened(self, upstream: Any, session: LegacySession, headers: Any) -> None:
        pass

    def end(self, session: LegacySession) -> None:
        pass

    def stop_reading(self, session: LegacySession) -> None:
        pass

    async def send(self, session: LegacySession, headers: Any, message: dict, route: CallRoute | None) -> Reply:
        self.sent.append((session.session_id, session.principal, route is not None and session.calls.carries(route)))
        if session.session_id == CLIENTS_SESSION:
            return Reply(404)
        if self.dies:
            raise ConnectionResetError("the server went away mid-request")
        await self.answer.wait()
        return Reply(200)


async def test_a_carried_session_the_server_does_not_know_is_replaced_by_one_of_the_callers_own_busy_at_once():
    upstream = LegacyUpstream(SidecarServer, max_sessions=8, identity=Identity(SecurityConfig()))
    server: SidecarServer = upstream.link  # type: ignore[assignment]
    headers = CIMultiDict({"Authorization": "Bearer t"})
    carried = LegacySession(CLIENTS_SESSION, "2025-11-25", "alice", carried=True)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "ask", "arguments": {}}}
    route = CallRoute({"elicitation": {}}, None, caller="10.0.0.7", asks=True)

    posting = asyncio.ensure_future(upstream.post(call, headers, carried, route))
    while len(server.sent) < 2:  # the client's session, then one of the proxy's
        await asyncio.sleep(0)
    (first, _, _), (instead, whose, busy) = server.sent
    assert first == CLIENTS_SESSION and instead == "own-1"
    assert whose.endswith("|10.0.0.7")  # the call's caller's, not anyone's with the same headers
    assert busy  # in flight there before the server answered
    # Meanwhile another call of the same caller that may be asked something gets a session of its own.
    other = CallRoute({"elicitation": {}}, None, caller="10.0.0.7", asks=True)
    assert (await upstream.sessions.session_for(headers, other)).session_id == "own-2"
    server.answer.set()
    session, reply = await posting
    assert (session.session_id, reply.status) == ("own-1", 200)


async def test_a_client_session_that_was_not_carried_gets_the_servers_404_as_it_is():
    """On the replica that made the call, a 404 for the client's session is the client's to hear (it starts again)."""
    upstream = LegacyUpstream(SidecarServer, max_sessions=8, identity=Identity(SecurityConfig()))
    server: SidecarServer = upstream.link  # type: ignore[assignment]
    own = LegacySession(CLIENTS_SESSION, "2025-11-25", "alice")
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "add", "arguments": {}}}
    session, reply = await upstream.post(call, CIMultiDict(), own, None)
    assert (session, reply.status) == (own, 404)
    assert [sent[0] for sent in server.sent] == [CLIENTS_SESSION]


async def test_a_replacement_whose_server_dies_mid_request_is_not_left_busy():
    """The server dies as the call goes over the proxy's session: the call fails as a connection error does, and
    the session is not left marked busy by a call that is no longer anywhere (it could never be ended for room)."""
    upstream = LegacyUpstream(SidecarServer, max_sessions=8, identity=Identity(SecurityConfig()))
    server: SidecarServer = upstream.link  # type: ignore[assignment]
    server.dies = True
    carried = LegacySession(CLIENTS_SESSION, "2025-11-25", "alice", carried=True)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "ask", "arguments": {}}}
    route = CallRoute({"elicitation": {}}, None, caller="10.0.0.7", asks=True)
    with pytest.raises(ConnectionResetError):
        await upstream.post(call, CIMultiDict(), carried, route)
    (instead,) = upstream.sessions.all()
    assert server.sent[-1][2]  # it was busy while the request was on its way
    assert not instead.calls and not instead.calls.carries(route)
