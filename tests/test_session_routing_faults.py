"""Faults of session routing between replicas (proxy/front/session_routing.py) that an attack review found: each test
failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.conftest import free_port, legacy_python, serve_script
from tests.test_any_replica import list_tools
from tests.test_durable import Client2025

RULES = [{"match": "ask_name"}]


@pytest.fixture
def one_server():
    with contextlib.ExitStack() as stack:
        start = contextlib.contextmanager(serve_script)
        yield [stack.enter_context(start(legacy_python(), "legacy_server.py")) for _ in range(2)]


@pytest.mark.parametrize("n", [99, 100])
async def test_forwarding_stalls_after_100_open_streams(replicas, one_server, n):
    """Each forwarded GET stream holds one connection of the forwarding pool (aiohttp default limit=100, no
    pool-wait timeout): the 101st forwarded request through that replica waits forever."""
    owner, other = (replicas(s, advertise=True, tools=RULES) for s in one_server)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        clients = []
        for _ in range(101):
            c = Client2025(http, owner.url)
            await c.initialize()
            c.url = other.url
            clients.append(c)
        streams = []
        for c in clients[:n]:
            get_headers = {k: v for k, v in c.headers.items() if k != "Content-Type"}
            get_headers["Accept"] = "text/event-stream"
            r = await http.get(other.url, headers=get_headers)
            assert r.status == 200, r.status
            streams.append(r)
        try:
            # the 101st session's ordinary request, through the same replica
            status = await asyncio.wait_for(list_tools(clients[n]), 10)
            assert status == 200
        finally:
            for r in streams:
                r.close()


# --- helpers: a replica with listen settings of the test's own -------------------------------------------------


@pytest.fixture
def replicas_listen(replicas):
    """Replicas that advertise themselves, with the routing rules of these tests (conftest's `replicas`)."""

    def start(upstream, *, listen=None, store_url=None):
        store = {"store_url": store_url} if store_url is not None else {}
        return replicas(upstream, advertise=True, listen=listen, tools=RULES, **store)

    return start


async def raw_post(url: str, head_extra: bytes, body: bytes, *, send_body: bytes | None = None, wait_s: float = 10):
    """A POST written by hand (header bytes as given); the status line read back, or None on timeout."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        b"POST /mcp HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\nContent-Type: application/json\r\n"
        b"Accept: application/json, text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n"
        % len(body)
        + head_extra
        + b"\r\n"
    )
    writer.write(head + (body if send_body is None else send_body))
    await writer.drain()
    try:
        status = await asyncio.wait_for(reader.readline(), wait_s)
        rest = await asyncio.wait_for(reader.read(), 5)
        return status + rest
    except TimeoutError:
        return None
    finally:
        writer.close()


LIST = b'{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{}}'


def session_head(client: Client2025) -> bytes:
    return (
        b"Mcp-Session-Id: "
        + client.headers["Mcp-Session-Id"].encode()
        + b"\r\nMCP-Protocol-Version: "
        + client.version.encode()
        + b"\r\n"
    )


async def test_a_non_utf8_header_works_on_the_owner_but_not_through_another_replica(replicas_listen, one_server):
    owner, other = (replicas_listen(s) for s in one_server)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
    extra = session_head(client) + b"X-Custom: caf\xe9\r\n"  # latin-1 byte: allowed on the wire (obs-text)
    direct = await raw_post(owner.url, extra, LIST)
    forwarded = await raw_post(other.url, extra, LIST)
    print("\nDIRECT:", direct[:300], "\nFORWARDED:", forwarded[:400])
    assert direct.startswith(b"HTTP/1.1 200") and b'"tools"' in direct
    assert forwarded.startswith(b"HTTP/1.1 200") and b'"tools"' in forwarded


async def test_a_session_whose_claim_failed_once_is_never_recorded():
    """The store misses one SET (a blip) while the session's initialize is answered: the tag is put in the local
    cache before the claim, so none of the session's later responses through its replica records it either; every
    other replica then takes the session for unknown (tried there: 404 from its own server) for 24 h."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from mcp_tasks_proxy.config import SecurityConfig
    from mcp_tasks_proxy.front.session_routing import SessionRouting
    from mcp_tasks_proxy.security import Identity
    from mcp_tasks_proxy.store.base import MemoryTaskStore, StoreUnavailable

    class Flaky(MemoryTaskStore):
        def __init__(self):
            super().__init__(max_tasks=10)
            self.claims, self.fail_next = {}, True

        async def claim_session(self, tag, replica_id, ttl_ms):
            if self.fail_next:
                self.fail_next = False
                raise StoreUnavailable("blip")
            self.claims[tag] = replica_id

    store = Flaky()
    routing = SessionRouting(store, Identity(SecurityConfig(principal_key="k")), lambda: "me")
    for _ in range(5):  # initialize, then later requests of the session through its replica, the store back
        request = make_mocked_request("POST", "/mcp", headers={"Mcp-Session-Id": "s-1"})
        await routing.on_response_prepare(request, web.Response(headers={"Mcp-Session-Id": "s-1"}))
    assert store.claims, "the session was never recorded in the store"


async def test_store_down_a_live_replicas_session_gets_404_through_another(replicas_listen, one_server, redis_server):
    """Redis unreachable for a moment: a request for a session another (live, reachable) replica holds is tried on
    this replica, whose server answers 404 Session not found; a 2025 client takes that as its session being gone
    for good (it starts over), where 503 would have it retry."""
    redis = redis_server()
    owner, other = (replicas_listen(s, store_url=redis.url) for s in one_server)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
        client.url = other.url
        assert await list_tools(client) == 200
        redis.kill()
        status = await list_tools(client)
        assert status != 404, "a live session answered 404 (session gone) while only the store was down"


@pytest.fixture
async def recording_upstream():
    """A minimal 2025-11-25 server that records the headers of every request it gets."""
    import json as _json

    from aiohttp import web

    seen: list[dict] = []

    async def mcp(request: web.Request) -> web.StreamResponse:
        seen.append({"method": request.method, **{k.lower(): v for k, v in request.headers.items()}})
        if request.method == "DELETE":
            return web.Response(status=200)
        if request.method == "GET":
            return web.Response(status=405)
        message = _json.loads(await request.read())
        if "id" not in message:
            return web.Response(status=202)
        method = message.get("method")
        if method == "initialize":
            result = {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "rec", "version": "1"},
            }
            return web.json_response(
                {"jsonrpc": "2.0", "id": message["id"], "result": result}, headers={"Mcp-Session-Id": "sess-rec-1"}
            )
        if method == "tools/list":
            tools = [{"name": "ask_name", "inputSchema": {"type": "object"}}]
            response = web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": tools}})
            if "gzip" in request.headers.get("Accept-Encoding", ""):  # as a server behind compression middleware
                response.enable_compression(web.ContentCoding.gzip)
            return response
        if method == "tools/call":
            result = {"content": [{"type": "text", "text": "ok"}]}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
        if method == "resources/list":
            response = web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"resources": []}})
            if "gzip" in request.headers.get("Accept-Encoding", ""):
                response.enable_compression(web.ContentCoding.gzip)
            return response
        return web.json_response(
            {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "Method not found"}}
        )

    app = web.Application()
    app.router.add_route("*", "/mcp", mcp)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/mcp", seen
    await runner.cleanup()


async def test_the_hop_header_never_reaches_the_upstream(replicas_listen, recording_upstream):
    url, seen = recording_upstream
    owner, other = replicas_listen(url), replicas_listen(url)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
        client.url = other.url
        assert await list_tools(client) == 200
        async with client.call("ask_name", {}) as response:  # a durable call (tools rule): the task path
            await response.read()
        async with http.get(other.url, headers={**client.headers, "Accept": "text/event-stream"}) as response:
            await response.read()
        async with http.delete(other.url, headers=client.headers) as response:
            assert response.status == 200
    print("\n", [(h["method"], sorted(k for k in h if k.startswith("mcp"))) for h in seen])
    assert len(seen) >= 5
    assert not [h for h in seen if "mcp-tasks-proxy-hop" in h]


async def test_a_forwarded_request_gets_an_encoding_its_client_never_accepted(replicas_listen, recording_upstream):
    """The forwarding client is aiohttp's with its auto headers: Accept-Encoding: gzip, deflate (and User-Agent) are
    added to a request that had none, the owner passes them upstream, and the compressed answer goes back (nothing
    decompressed) to a client that never said it takes gzip."""
    url, seen = recording_upstream
    owner, other = replicas_listen(url), replicas_listen(url)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
    resources = b'{"jsonrpc":"2.0","id":8,"method":"resources/list","params":{}}'
    direct = await raw_post(owner.url, session_head(client), resources)
    assert b"content-encoding" not in direct.lower(), direct[:400]
    forwarded = await raw_post(other.url, session_head(client), resources)
    print(
        "\nFORWARDED:",
        forwarded[:400],
        "\nUPSTREAM SAW:",
        {k: v for k, v in seen[-1].items() if k in ("accept-encoding", "user-agent")},
    )
    assert b"content-encoding" not in forwarded.lower(), "gzip sent to a client without Accept-Encoding"


async def test_a_deleted_session_is_forgotten_in_the_store(replicas_listen, one_server, redis_server):
    """store.forget_session says it is for DELETE too; a DELETE leaves the session's record for 24 h."""
    import redis.asyncio as aioredis

    redis = redis_server()
    owner, other = (replicas_listen(s, store_url=redis.url) for s in one_server)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
        async with http.delete(other.url, headers=client.headers) as response:
            assert response.status == 200
    r = aioredis.from_url(redis.url)
    keys = [k async for k in r.scan_iter(match="*session:*")]
    await r.aclose()
    assert not keys, keys


async def test_a_session_in_use_keeps_its_record_past_a_day():
    """A session's record lasted 24 h from its creation: a client that kept its session open longer was then unknown
    to the other replicas (their server's 404). A session used through its replica is renewed, hourly."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from mcp_tasks_proxy.config import SecurityConfig
    from mcp_tasks_proxy.front.session_routing import SESSION_RENEW_S, SESSION_TTL_S, SessionRouting
    from mcp_tasks_proxy.security import Identity
    from mcp_tasks_proxy.store.base import MemoryTaskStore

    class Recording(MemoryTaskStore):
        def __init__(self):
            super().__init__(max_tasks=10)
            self.claims: list[tuple[float, int]] = []

        async def claim_session(self, tag, replica_id, ttl_ms):
            self.claims.append((now[0], ttl_ms))

    now = [1000.0]
    store = Recording()
    routing = SessionRouting(store, Identity(SecurityConfig(principal_key="k")), lambda: "me", timer=lambda: now[0])
    headers = {"Mcp-Session-Id": "s-1"}
    await routing.on_response_prepare(make_mocked_request("POST", "/mcp", headers=headers),
                                      web.Response(headers=headers))  # fmt: skip
    assert store.claims == [(1000.0, int(SESSION_TTL_S * 1000))]
    for hours in range(1, 49):  # two days of use, a request every hour and a bit
        now[0] = 1000.0 + hours * (SESSION_RENEW_S + 1)
        routed = await routing._forward_if_elsewhere(make_mocked_request("POST", "/mcp", headers=headers))
        assert routed is None  # this replica's session: answered here
    assert len(store.claims) == 49  # renewed once an hour, not once a request
    assert [at for at, _ in store.claims][-1] == now[0]
    quiet = len(store.claims)
    now[0] += 60
    await routing._forward_if_elsewhere(make_mocked_request("POST", "/mcp", headers=headers))
    assert len(store.claims) == quiet  # within the hour: no write
