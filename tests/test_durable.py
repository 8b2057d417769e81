"""Durable calls for clients without tasks: a 2025-era client's long call, kept alive, resumable, with its server's
questions and its cancellation, against the SDK 1.x server (tests/legacy_server.py)."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest

from mcp_tasks_proxy.clients.durable_stream import parse_event_id
from mcp_tasks_proxy.upstream.http.sse import SseParser
from tests.conftest import eventually

VERSION = "2025-11-25"


class Client2025:
    """A 2025-era client over raw HTTP: initialize on the proxy, then requests on that session."""

    def __init__(self, http: aiohttp.ClientSession, url: str, *, version: str = VERSION, token: str | None = None):
        self.http, self.url, self.version = http, url, version
        self.headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"

    async def initialize(self, capabilities: dict | None = None) -> None:
        params = {
            "protocolVersion": self.version,
            "capabilities": capabilities or {},
            "clientInfo": {"name": "t", "version": "1"},
        }
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
        async with self.http.post(self.url, json=init, headers=self.headers) as response:
            assert response.status == 200, await response.text()
            self.headers["Mcp-Session-Id"] = response.headers["Mcp-Session-Id"]
            await response.read()
        self.headers["MCP-Protocol-Version"] = self.version
        await self.notify("notifications/initialized")

    async def notify(self, method: str, params: dict | None = None) -> int:
        message = {"jsonrpc": "2.0", "method": method, **({"params": params} if params else {})}
        async with self.http.post(self.url, json=message, headers=self.headers) as response:
            return response.status

    async def answer(self, request_id, result: dict | None = None, error: dict | None = None) -> int:
        message = {"jsonrpc": "2.0", "id": request_id, **({"result": result} if error is None else {"error": error})}
        async with self.http.post(self.url, json=message, headers=self.headers) as response:
            return response.status

    def call(self, name: str, arguments: dict, *, request_id=None, progress_token=None):
        params: dict = {"name": name, "arguments": arguments}
        if progress_token is not None:
            params["_meta"] = {"progressToken": progress_token}
        message = {"jsonrpc": "2.0", "id": request_id or secrets.token_hex(4), "method": "tools/call", "params": params}
        return self.http.post(self.url, json=message, headers=self.headers)

    def resume(self, last_event_id: str, headers: dict | None = None):
        merged = {**self.headers, "Accept": "text/event-stream", "Last-Event-ID": last_event_id, **(headers or {})}
        merged.pop("Content-Type", None)
        return self.http.get(self.url, headers=merged)


async def events_of(response: aiohttp.ClientResponse, *, until_response: bool = True, limit: int = 10_000):
    """(event id, message or None for priming, raw comment count) as they come, until a JSON-RPC response."""
    parser = SseParser()
    async for chunk in response.content.iter_any():
        for event in parser.feed(chunk):
            message = json.loads(event.data) if event.data else None
            yield event, message
            if until_response and isinstance(message, dict) and "method" not in message:
                return


@pytest.fixture
async def proxy(make_proxy, legacy_upstream):
    rules = [
        {"match": "slow", "keepalive_s": 0.2},
        {"match": "gated", "keepalive_s": 0.2},
        {"match": "ask_*", "keepalive_s": 0.2},
        {"match": "add", "durable": False},
    ]
    return await make_proxy(legacy_upstream, tools=rules)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_long_call_streams_keepalives_and_its_exact_result_under_the_clients_id(proxy, http):
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with client.call("slow", {"seconds": 1.2}, request_id=41) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = await response.read()
    text = raw.decode()
    assert text.startswith("id: ") and "retry: 1000" in text.split("\n\n")[0]  # the priming event comes first
    assert text.count(": keep-alive") >= 2  # every 0.2 s while the tool works
    events = [e for e in SseParser().feed(raw) if e.data]
    final = json.loads(events[-1].data)
    assert final["id"] == 41
    assert final["result"]["content"][0]["text"] == "slept 1.2 s"
    assert "resultType" not in final["result"]  # the 2025 result as the server gave it
    assert all(e.id for e in events)  # every event can be resumed from


async def test_a_progress_token_gets_progress_as_keepalive_with_a_rising_value(proxy, http):
    client = Client2025(http, proxy.url)
    await client.initialize()
    progress = []
    async with client.call("slow", {"seconds": 1.2}, progress_token="tok") as response:
        async for _, message in events_of(response):
            if message and message.get("method") == "notifications/progress":
                progress.append(message["params"])
            final = message
    assert final["result"]["content"][0]["text"] == "slept 1.2 s"
    assert len(progress) >= 3 and all(p["progressToken"] == "tok" for p in progress)
    values = [p["progress"] for p in progress]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert any("legacy step" in p.get("message", "") for p in progress)  # the server's own progress, relayed


async def test_a_dropped_stream_resumes_with_last_event_id_and_gets_the_result(proxy, http):
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with client.call("slow", {"seconds": 1.0}) as response:
        async for event, message in events_of(response):
            assert message is None  # the priming event
            last_event_id = event.id
            break
    # The connection is gone; the call goes on in the proxy.
    async with client.resume(last_event_id) as resumed:
        assert resumed.status == 200
        messages = [m async for _, m in events_of(resumed) if m]
    assert messages[-1]["result"]["content"][0]["text"] == "slept 1 s"
    # Resumed again after the end: the result once more, for a client that lost it on the way.
    async with client.resume(last_event_id) as again:
        events = [(e, m) async for e, m in events_of(again)]
    final_event, final = events[-1]
    assert final["result"]["content"][0]["text"] == "slept 1 s"
    # Resumed from the final event itself: nothing more to say, and the stream ends at once.
    async with client.resume(final_event.id) as after_end:
        rest = [m async for _, m in events_of(after_end, until_response=False) if m]
    assert rest == []


async def test_another_callers_last_event_id_gets_nothing(proxy, http):
    alice = Client2025(http, proxy.url, token="alice")
    mallory = Client2025(http, proxy.url, token="mallory")
    await alice.initialize()
    await mallory.initialize()
    async with alice.call("slow", {"seconds": 0.5}) as response:
        async for event, _ in events_of(response):
            last_event_id = event.id
            break
    async with mallory.resume(last_event_id) as stolen:
        assert stolen.status == 404
        body = await stolen.json()
    assert "slept" not in json.dumps(body)
    # Alice on another session of her own is another caller too: a stream belongs to its session.
    other_session = Client2025(http, proxy.url, token="alice")
    await other_session.initialize()
    async with other_session.resume(last_event_id) as response:
        assert response.status == 404


async def test_max_stream_s_closes_the_stream_and_the_client_resumes_it(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow", "keepalive_s": 0.2, "max_stream_s": 0.5}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    streams = 0
    last_event_id = None
    final = None
    async with client.call("slow", {"seconds": 1.6}) as response:
        streams += 1
        async for event, message in events_of(response):
            last_event_id = event.id or last_event_id
            final = message if message and "method" not in message else final
    assert final is None  # closed before the result, on purpose
    while final is None:
        assert streams < 10
        async with client.resume(last_event_id) as response:
            streams += 1
            async for event, message in events_of(response):
                last_event_id = event.id or last_event_id
                final = message if message and "method" not in message else final
    assert final["result"]["content"][0]["text"] == "slept 1.6 s"
    assert streams >= 3


async def test_the_servers_question_reaches_the_client_on_the_stream_and_its_answer_goes_back(proxy, http):
    client = Client2025(http, proxy.url)
    await client.initialize({"elicitation": {}})
    async with client.call("ask_name", {}) as response:
        async for _, message in events_of(response):
            if message and message.get("method") == "elicitation/create":
                assert message["id"].startswith("mtp-in.")
                assert message["params"]["message"] == "Your name?"
                assert await client.answer(message["id"], {"action": "accept", "content": {"name": "Ada"}}) == 202
            final = message
    assert final["result"]["content"][0]["text"] == "hello Ada"


async def test_notifications_cancelled_cancels_the_call_upstream(proxy, http, legacy_client):
    client = Client2025(http, proxy.url)
    await client.initialize()
    tag = secrets.token_hex(4)
    async with client.call("gated", {"tag": tag}, request_id="call-7") as response:
        async for _, message in events_of(response):
            if message is None:
                break

        async def started():
            return await legacy_client.call_tool("gate_state", {"tag": tag}) == "started"

        await eventually(started, what="the call reaching the server")
        status = await client.notify("notifications/cancelled", {"requestId": "call-7", "reason": "user stop"})
        assert status == 202

        async def cancelled():
            return await legacy_client.call_tool("gate_state", {"tag": tag}) == "cancelled"

        await eventually(cancelled, what="notifications/cancelled reaching the server")


async def test_a_rule_that_opts_out_passes_through(proxy, http):
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with client.call("add", {"a": 1, "b": 2}) as response:
        raw = await response.read()
    events = SseParser().feed(raw)
    assert not any(parse_event_id(e.id) for e in events)  # the server's own stream and event ids, untouched
    assert json.loads([e for e in events if e.data][-1].data)["result"]["content"][0]["text"] == "3"


async def test_an_older_2025_client_gets_keepalives_but_no_priming_event(proxy, http):
    client = Client2025(http, proxy.url, version="2025-06-18")
    await client.initialize()
    async with client.call("slow", {"seconds": 0.6}) as response:
        raw = await response.read()
    assert not raw.startswith(b"id:") and b"retry:" not in raw
    assert b": keep-alive" in raw
    final = json.loads([e for e in SseParser().feed(raw) if e.data][-1].data)
    assert final["result"]["content"][0]["text"] == "slept 0.6 s"


async def test_the_same_request_sent_again_joins_the_same_call(proxy, http, legacy_client):
    client = Client2025(http, proxy.url)
    await client.initialize()
    tag = secrets.token_hex(4)
    first = await client.call("gated", {"tag": tag}, request_id="again").__aenter__()
    try:
        second_task = asyncio.ensure_future(_final_of(client.call("gated", {"tag": tag}, request_id="again")))
        await asyncio.sleep(0.3)
        assert await legacy_client.call_tool("release", {"tag": tag}) == "released"
        final = await asyncio.wait_for(second_task, timeout=30)
        assert final["result"]["content"][0]["text"] == f"gate {tag} opened"
    finally:
        first.close()


async def test_a_request_id_used_again_after_its_call_ended_is_a_new_call(proxy, http):
    """A client restarted against a server without sessions numbers its requests from 1 again: the new call runs,
    it never gets the old call's result."""
    client = Client2025(http, proxy.url)
    await client.initialize({"elicitation": {}})
    for name in ("Ada", "Bob"):
        async with client.call("ask_name", {}, request_id=1) as response:
            async for _, message in events_of(response):
                if message and message.get("method") == "elicitation/create":
                    await client.answer(message["id"], {"action": "accept", "content": {"name": name}})
                final = message
        assert final["result"]["content"][0]["text"] == f"hello {name}"


async def _final_of(request_context) -> dict:
    async with request_context as response:
        final = None
        async for _, message in events_of(response):
            final = message
        return final


# --- 2026-07-28 clients without the tasks extension: kept alive, not resumable -------------------------------------


@pytest.mark.parametrize("era", ["modern", "legacy"])
async def test_a_2026_client_without_tasks_gets_keepalives_then_the_result(
    make_proxy, mcp_upstream, legacy_upstream, era
):
    upstream = mcp_upstream if era == "modern" else legacy_upstream
    proxy = await make_proxy(upstream, tools=[{"match": "quiet", "keepalive_s": 0.2}])
    reply = await proxy.client.call_tool("quiet", {"seconds": 1.0}, tasks=False)
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.body.count(b": keep-alive") >= 3
    assert b"retry:" not in reply.body and not reply.body.startswith(b"id:")  # 2026 streams are not resumable
    assert reply.message["result"]["content"][0]["text"] == "quiet for 1 s"
    assert reply.message["result"]["resultType"] == "complete"
    from tests.test_lane import request_counts

    # Counted as what it is: a kept-alive call (a 2025 client's durable call is `durable`).
    assert request_counts(proxy).get(("tools/call", "kept_alive", "200")) == 1


async def test_a_2026_client_without_tasks_gets_a_quick_answer_as_plain_json(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "quiet", "keepalive_s": 5}])
    reply = await proxy.client.call_tool("quiet", {"seconds": 0.05}, tasks=False)
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.message["result"]["content"][0]["text"] == "quiet for 0.05 s"


async def test_a_2026_client_that_leaves_cancels_its_kept_alive_call(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}])
    tag = secrets.token_hex(4)
    call = asyncio.ensure_future(proxy.client.call_tool("gated", {"tag": tag}, tasks=False))

    async def state(expected):
        reply = await upstream_client.call_tool("gate_state", {"tag": tag}, tasks=False)
        return reply.message["result"]["content"][0]["text"] == expected

    await eventually(lambda: state("started"), what="the call reaching the server")
    call.cancel()
    await eventually(lambda: state("cancelled"), what="the server hearing of the cancellation")


async def test_a_call_that_fails_at_once_is_answered_at_once_with_the_servers_own_error(make_proxy, mcp_upstream, http):
    # No session and no _meta to an SDK 2.x server: it refuses with an id-null error. The keep-alive is far away, so
    # an answer missed between the call's start and its stream's first read would hang this test until its timeout.
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_report", "keepalive_s": 300}])
    client = Client2025(http, proxy.url)  # not initialized: no Mcp-Session-Id
    async with client.call("slow_report", {"topic": "t", "seconds": 1}, request_id=7) as response:
        assert response.status == 200
        messages = [message async for _, message in events_of(response) if message]
    assert messages[-1]["id"] == 7
    assert messages[-1]["error"] == {"code": -32600, "message": "Bad Request: Missing session ID"}  # not "closed"


async def test_progress_reaches_a_durable_stream_as_it_happens_not_at_the_keepalive(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow", "keepalive_s": 300}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    seen = []
    async with client.call("slow", {"seconds": 1.2}, progress_token="tok") as response:
        async for _, message in events_of(response):
            if message:
                seen.append(message)
    progress = [m["params"] for m in seen if m.get("method") == "notifications/progress"]
    assert seen[-1]["result"]["content"][0]["text"] == "slept 1.2 s"
    # The keep-alive is 300 s away (past the test timeout): progress before the result is the server's, sent at once.
    assert any("legacy step" in p.get("message", "") for p in progress)
