"""2025-era clients in front of a server that speaks 2026-07-28 only (clients/translated2025.py): the official SDK
1.x and TypeScript SDK 1.x clients, over HTTP and stdio, against the official 2.x SDK's server with its 2025
handshake turned off (tests/upstream_server.py --2026-only). Straight to that server a 2025 client gets nowhere;
through the proxy its whole session works: lists, calls, the server's MRTR questions as the elicitation and sampling
requests a 2025 client answers, progress, SEP-1686 tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import aiohttp
import pytest
from aiohttp import web

from mcp_tasks_proxy.front.context import gateway_key
from tests.balancer import RoundRobin
from tests.conftest import ROOT, free_port, legacy_python, serve_script
from tests.test_durable import Client2025, events_of
from tests.test_real_clients import run_client, sdk1_call, ts_call

SESSION_CLIENT = ROOT / "tests" / "clients" / "sdk1_session.py"
MODERN_ONLY_STDIO = [sys.executable, str(ROOT / "tests" / "upstream_server.py"), "--stdio", "--2026-only"]


@pytest.fixture(scope="module")
def modern_only_upstream():
    with contextlib.contextmanager(serve_script)(sys.executable, "upstream_server.py", "--2026-only") as url:
        yield url


@pytest.fixture(params=["http", "stdio"])
def modern_only(request, modern_only_upstream):
    """The 2026-only server as the proxy's upstream: its URL, or the command of a stdio child."""
    return modern_only_upstream if request.param == "http" else MODERN_ONLY_STDIO


async def sdk1_session(url: str, *args: str) -> dict:
    return await run_client(str(legacy_python()), str(SESSION_CLIENT), url, *args, timeout_s=60)


async def test_straight_to_the_server_a_2025_client_gets_nowhere(modern_only_upstream):
    outcome = await sdk1_session(modern_only_upstream, "one_question")
    assert "failed" in outcome and "Unsupported protocol version" in outcome["failed"], outcome


async def test_a_whole_sdk_1x_session_through_the_proxy(make_proxy, modern_only):
    proxy = await make_proxy(modern_only)
    outcome = await sdk1_session(proxy.url, "one_question", "--mrtr")
    assert "failed" not in outcome, outcome
    assert outcome["session"] and outcome["version"] == "2025-11-25"
    assert outcome["tools"] > 20 and outcome["added"] == "5" and len(set(outcome["pids"])) == 1
    # The server's questions, asked in MRTR rounds, reached the client as elicitation and sampling requests; its
    # answers went back in the retries, one round and two, one question and two at once.
    assert outcome["asked"] == "you said Ada"
    assert outcome["two_at_once"] == "Ada+Ada" and outcome["same_key_twice"] == "Ada then Ada"
    assert outcome["sampled"] == "sampled"
    assert outcome["report"].startswith("Report on t") and outcome["progress"] >= 2
    assert outcome["unknown"] is True  # the server's "unknown tool" is the client's error result
    # The 2026 envelope the server got was built from what the session declared, and the state came back unchanged.
    received = outcome["received"]
    assert received["requestState"] == '{"round": 1, "note": "ünïcode and  spaces"}'
    assert "elicitation" in received["capabilities"] and "tasks" not in received["capabilities"]
    assert received["inputResponses"]["q"]["content"] == {"answer": "Ada"}
    gateway = proxy.app[gateway_key]
    assert gateway.translates_2025 and gateway.session_counts()["client"] == 0  # the client's DELETE ended it


async def test_the_typescript_sdk_1x_client(make_proxy, modern_only):
    proxy = await make_proxy(modern_only)
    outcome = await ts_call(proxy.url, "add", {"a": 2, "b": 3})
    assert outcome == {"text": "5", "isError": False}


async def test_a_sep_1686_client_gets_the_proxys_tasks(make_proxy, modern_only):
    proxy = await make_proxy(modern_only, tools=[{"match": "slow_report"}])
    outcome = await sdk1_call(proxy.url, "slow_report", {"topic": "t", "seconds": 1}, "--as-task")
    assert outcome.get("statuses") == ["completed"], outcome
    assert outcome["text"].startswith("Report on t") and outcome["isError"] is False


async def test_the_session_is_the_proxys(make_proxy, modern_only_upstream):
    proxy = await make_proxy(modern_only_upstream)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, proxy.url)

        async def post(message: dict, **headers: str) -> tuple[int, dict]:
            async with http.post(proxy.url, json=message, headers={**client.headers, **headers}) as response:
                return response.status, await response.json()

        init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        status, answer = await post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init})
        result = answer["result"]
        assert status == 200 and result["protocolVersion"] == "2025-06-18"  # the version the client asked for
        assert result["serverInfo"]["name"] == "slow-example" and "instructions" in result
        assert "extensions" not in result["capabilities"] and "resultType" not in result
        assert "logging" not in result["capabilities"]  # no log line of the server's would reach the session
        huge = {**init, "capabilities": {"experimental": {"x": "y" * 20_000}}}
        status, answer = await post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": huge})
        assert answer["error"]["code"] == -32602  # carried by every request of the session: bounded
        await client.initialize()
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        status, answer = await post(request)
        assert status == 200 and answer["result"]["tools"]
        assert not {"resultType", "ttlMs", "cacheScope"} & set(answer["result"])
        assert (await post({**request, "method": "ping"}))[1] == {"jsonrpc": "2.0", "id": 1, "result": {}}
        level = {**request, "method": "logging/setLevel", "params": {"level": "loud"}}
        assert (await post(level))[1]["error"]["code"] == -32602
        assert (await post({**level, "params": {"level": []}}))[1]["error"]["code"] == -32602
        for method in ("subscriptions/listen", "tasks/get", "server/discover"):  # not 2025 methods of this session
            assert (await post({**request, "method": method, "params": {}}))[1]["error"]["code"] == -32601
        deep = {
            **request,
            "method": "prompts/get",
            "params": {"name": "p", "arguments": json.loads("[" * 600 + "]" * 600)},
        }
        status, answer = await post(deep)
        assert answer["error"]["code"] == -32600 and status < 500  # encoded again for the server: refused first
        assert (await post({**level, "params": {"level": "info"}}))[1]["result"] == {}
        subscribe = {**request, "method": "resources/subscribe", "params": {"uri": "file:///x"}}
        assert (await post(subscribe))[1]["result"] == {}
        assert (await post({**subscribe, "params": {"uri": 7}}))[1]["error"]["code"] == -32602
        assert (await post({**subscribe, "method": "resources/unsubscribe"}))[1]["result"] == {}
        status, answer = await post([request, {**request, "id": 2}])
        assert status == 200 and answer["error"]["code"] == -32600  # a batch: nothing 2026 could carry
        status, answer = await post(request, **{"Mcp-Session-Id": "not-a-session"})
        assert status == 404
        async with http.delete(proxy.url, headers=client.headers) as response:
            assert response.status == 200
        assert (await post(request))[0] == 404  # ended: the client initializes again


async def test_a_server_of_both_eras_takes_2025_clients_as_they_are(make_proxy, mcp_upstream):
    """The SDK 2.x server speaks 2025 as well: the session is the server's own, untouched."""
    proxy = await make_proxy(mcp_upstream)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, proxy.url)
        await client.initialize()
        gateway = proxy.app[gateway_key]
        assert gateway.passes_2025_as_is and not gateway.translates_2025
        assert gateway.session_counts()["client"] == 0  # the session is the server's, not the proxy's


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_whole_session_through_round_robin_replicas(replicas, modern_only_upstream, transport):
    """Three replicas sharing Redis behind a balancer with no affinity: each request of the session, and each answer
    to the server's questions, lands on any of them (listen.advertise_url routes the proxy's session)."""
    upstream = modern_only_upstream if transport == "http" else MODERN_ONLY_STDIO
    proxies = [replicas(upstream, advertise=True) for _ in range(3)]
    balancer = RoundRobin([proxy.url.removesuffix("/mcp") for proxy in proxies])
    url = await balancer.start(free_port())
    try:
        outcome = await sdk1_session(url, "one_question", "--mrtr")
    finally:
        await balancer.close()
    assert "failed" not in outcome, outcome
    assert outcome["asked"] == "you said Ada" and outcome["two_at_once"] == "Ada+Ada"
    assert outcome["sampled"] == "sampled" and len(set(outcome["pids"])) == 1
    assert {index for index, _, _ in balancer.hits} == {0, 1, 2}
    assert not [hit for hit in balancer.hits if hit[2] >= 400]


async def test_the_sessions_get_stream_carries_the_servers_list_changes(make_proxy, modern_only):
    """A subscriptions/listen of the proxy's behind the session's GET stream: the server's notification reaches the
    2025 client as that era has it (no subscription id)."""
    proxy = await make_proxy(modern_only)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, proxy.url)
        await client.initialize()
        async with http.get(proxy.url, headers=client.headers) as stream:
            assert stream.status == 200 and stream.content_type == "text/event-stream"
            seen: list[dict] = []

            async def read() -> None:
                async for line in stream.content:
                    if line.startswith(b"data:") and line[5:].strip():
                        seen.append(json.loads(line[5:]))

            reading = asyncio.ensure_future(read())
            try:
                for _ in range(20):  # (the proxy's listen may not be open yet when the first is announced)
                    async with client.call("announce_tools_changed", {}) as response:
                        assert "announced" in await response.text()
                    await asyncio.sleep(0.5)
                    if seen:
                        break
            finally:
                reading.cancel()
    assert seen and seen[0] == {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}, seen


async def test_refused_questions_become_what_a_2026_server_takes(make_proxy, modern_only_upstream):
    """A 2025 client answers a question it will not take with a JSON-RPC error, which 2026-07-28 has no form for: a
    refused form is declined (the server asks again), any other refusal ends the call."""
    proxy = await make_proxy(modern_only_upstream)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, proxy.url)
        await client.initialize({"elicitation": {}, "sampling": {}})
        refusal = {"code": -1, "message": "no"}
        async with client.call("asks_sampling", {}) as response:
            async for _, message in events_of(response):
                if isinstance(message, dict) and message.get("method") == "sampling/createMessage":
                    assert await client.answer(message["id"], error=refusal) == 202
                final = message
        assert "cancelled" in final["error"]["message"], final
        asked = []
        async with client.call("one_question", {}) as response:
            async for _, message in events_of(response):
                if isinstance(message, dict) and message.get("method") == "elicitation/create":
                    asked.append(message)
                    if len(asked) == 1:
                        assert await client.answer(message["id"], error=refusal) == 202
                    else:
                        await client.answer(message["id"], {"action": "accept", "content": {"answer": "yes"}})
        assert len(asked) == 2  # declined, the server asked again
        assert message["result"]["content"][0]["text"] == "you said yes"


async def test_a_server_that_wants_credentials_gets_its_challenge_to_the_client(make_proxy, fake_upstream):
    """A 2026-only server behind OAuth (a fake, to inject the 401s): a 2025 client without a token gets the server's
    401 and challenge, as without the proxy, so its authorization flow starts; with one, a session of the proxy's,
    and a token that stops being good mid-session brings the challenge again."""
    challenge = 'Bearer resource_metadata="https://example.test/.well-known/oauth-protected-resource"'

    async def server(http: web.Request) -> web.StreamResponse:
        if http.headers.get("Authorization") != "Bearer good":
            return web.json_response({"error": "unauthorized"}, status=401, headers={"WWW-Authenticate": challenge})
        message = json.loads(await http.read())
        if message["method"] == "initialize":
            error = {"code": -32022, "message": "Unsupported protocol version", "data": {"supported": ["2026-07-28"]}}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error})
        assert http.headers["MCP-Protocol-Version"] == "2026-07-28" and http.headers["Mcp-Method"] == message["method"]
        if message["method"] == "server/discover":
            result = {"resultType": "complete", "supportedVersions": ["2026-07-28"], "capabilities": {"tools": {}}}
        else:
            result = {"resultType": "complete", "tools": [], "ttlMs": 0, "cacheScope": "public"}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    fake = await fake_upstream(server)
    proxy = await make_proxy(fake.url, security={"principal": "none"})  # (a new token is the same caller)
    async with aiohttp.ClientSession() as http:
        init = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        message = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
        plain = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        async with http.post(proxy.url, json=message, headers=plain) as response:
            assert response.status == 401 and response.headers["WWW-Authenticate"] == challenge
        client = Client2025(http, proxy.url, token="good")
        await client.initialize()
        assert proxy.app[gateway_key].translates_2025
        listed = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        async with http.post(proxy.url, json=listed, headers=client.headers) as response:
            assert response.status == 200 and await response.json() == {
                "jsonrpc": "2.0",
                "id": 1,
                "result": {"tools": []},
            }
        client.headers["Authorization"] = "Bearer expired"
        async with http.post(proxy.url, json=listed, headers=client.headers) as response:
            assert response.status == 401 and response.headers["WWW-Authenticate"] == challenge


async def test_a_cancelled_request_and_an_ended_session_stop_what_they_wait_for(make_proxy, fake_upstream):
    """A 2025 client's notifications/cancelled for a request in flight, or its session's DELETE, ends the request:
    the proxy closes its upstream request, which is how a 2026-07-28 server hears of it (a fake, to hold a read),
    and the client's, which waits for no answer."""
    reads: dict[str, str] = {}

    async def server(http: web.Request) -> web.StreamResponse:
        message = json.loads(await http.read())
        if message["method"] == "initialize":
            error = {"code": -32022, "message": "Unsupported protocol version"}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error})
        if message["method"] == "server/discover":
            result = {"resultType": "complete", "supportedVersions": ["2026-07-28"], "capabilities": {}}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
        uri = message["params"]["uri"]
        reads[uri] = "waiting"
        try:
            await asyncio.sleep(15)
        except asyncio.CancelledError:  # the test server cancels a handler whose client closed the request
            reads[uri] = "closed"
            raise
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"contents": []}})

    fake = await fake_upstream(server)
    proxy = await make_proxy(fake.url)
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, proxy.url)
        await client.initialize()

        async def read(uri: str, request_id: int) -> int:
            message = {"jsonrpc": "2.0", "id": request_id, "method": "resources/read", "params": {"uri": uri}}
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(proxy.url, json=message, headers=client.headers) as response:
                    await response.read()
                    return response.status
            return 0

        reading = asyncio.ensure_future(read("file:///a", 5))
        await _until(lambda: reads.get("file:///a") == "waiting")
        assert await client.notify("notifications/cancelled", {"requestId": 5, "reason": "enough"}) == 202
        await _until(lambda: reads["file:///a"] == "closed")
        assert await asyncio.wait_for(reading, 5) == 0  # the client's request ended too: it waits for nothing
        reading = asyncio.ensure_future(read("file:///b", 6))
        await _until(lambda: reads.get("file:///b") == "waiting")
        async with http.delete(proxy.url, headers=client.headers) as response:
            assert response.status == 200
        await _until(lambda: reads["file:///b"] == "closed")
        assert await asyncio.wait_for(reading, 5) == 0


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_tools_header_parameters_go_as_mcp_param_headers(make_proxy, modern_only_upstream):
    """SEP-2243: a tool whose schema names header parameters is called with them mirrored into Mcp-Param-* headers
    (the server refuses the call without them: -32020), the proxy being the 2026 client here."""
    arguments = {"region": "eu-west ü", "shards": 3}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "in_region", "arguments": arguments,
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                      "io.modelcontextprotocol/clientCapabilities": {}}}}  # fmt: skip
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "in_region"}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.post(modern_only_upstream, json=call, headers=headers) as response:
            assert response.status == 400 and "-32020" in await response.text()  # straight, without the headers
        proxy = await make_proxy(modern_only_upstream)
        client = Client2025(http, proxy.url)
        await client.initialize()
        async with client.call("in_region", arguments) as response:
            final = [message async for _, message in events_of(response)][-1]
    assert final["result"]["content"][0]["text"] == "3 in eu-west ü", final


async def test_a_server_down_for_a_moment_is_asked_again(make_proxy, fake_upstream):
    """The proxy's question (does the server take 2025 clients?) answered by a restart's 503 teaches nothing: the
    2025 client is told the upstream failed, and the next one's initialize asks again (a fake, to inject the 503)."""
    asked: list[int] = []

    async def server(http: web.Request) -> web.StreamResponse:
        message = json.loads(await http.read())
        if message["method"] == "server/discover":
            result = {"resultType": "complete", "supportedVersions": ["2026-07-28"], "capabilities": {}}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
        if message["method"] == "initialize":
            asked.append(1)
            if len(asked) == 1:
                return web.Response(status=503, text="restarting")
            error = {"code": -32022, "message": "Unsupported protocol version"}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error})
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": []}})

    fake = await fake_upstream(server)
    proxy = await make_proxy(fake.url)
    init = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    message = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url, json=message, headers=headers) as response:
            assert response.status == 502 and "503" in await response.text()
        assert not proxy.app[gateway_key].translates_2025 and not proxy.app[gateway_key].passes_2025_as_is
        async with http.post(proxy.url, json=message, headers=headers) as response:
            assert response.status == 200 and "Mcp-Session-Id" in response.headers
    assert proxy.app[gateway_key].translates_2025 and len(asked) == 2
