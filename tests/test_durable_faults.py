"""Durable calls against what an attack run found: servers without sessions, requests sent twice at once, refusals,
ended sessions, clocks that disagree, and ids that are not the caller's (or not the proxy's)."""

from __future__ import annotations

import asyncio
import json
import secrets
from datetime import timedelta

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import eventually
from tests.test_durable import Client2025, events_of


class StatelessServer:
    """A 2025-11-25 server, by default without sessions (as FastMCP(stateless_http=True) runs); it records what it
    receives."""

    def __init__(self, *, sessions: bool = False) -> None:
        self.cancelled: list[object] = []
        self.calls: list[dict] = []
        self.sessions = sessions

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=405)
        message = json.loads(await request.read())
        method = message.get("method")
        if "id" not in message or method is None:
            if method == "notifications/cancelled":
                self.cancelled.append(message["params"]["requestId"])
            return web.Response(status=202)
        if method == "initialize":
            result = {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "s", "version": "1"},
            }
            headers = {"Mcp-Session-Id": secrets.token_hex(8)} if self.sessions else {}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result}, headers=headers)
        if method != "tools/call":
            return web.json_response(
                {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "no"}}
            )
        arguments = message["params"].get("arguments", {})
        self.calls.append(arguments)
        await asyncio.sleep(float(arguments.get("seconds", 0)))
        result = {"content": [{"type": "text", "text": f"result for {arguments.get('who')}"}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})


async def final_of(response: aiohttp.ClientResponse) -> dict | None:
    final = None
    async for _, message in events_of(response):
        final = message
    return final


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_callers_of_a_server_without_sessions_never_share_a_call(make_proxy, fake_upstream, http):
    """Clients number their requests alike: without a session, the same request id is two calls, and one client's
    notifications/cancelled is not another's."""
    server = StatelessServer()
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url, tools=[{"match": "work", "keepalive_s": 0.2}])
    alice, bob = Client2025(http, proxy.url), Client2025(http, proxy.url)
    alice.headers["MCP-Protocol-Version"] = bob.headers["MCP-Protocol-Version"] = "2025-11-25"
    async with alice.call("work", {"who": "alice", "seconds": 0.8}, request_id=1) as first:
        async with bob.call("work", {"who": "bob", "seconds": 0.1}, request_id=1) as second:
            assert (await final_of(second))["result"]["content"][0]["text"] == "result for bob"
        assert await bob.notify("notifications/cancelled", {"requestId": 1}) == 202
        assert (await final_of(first))["result"]["content"][0]["text"] == "result for alice"
    assert [call["who"] for call in server.calls] == ["alice", "bob"]
    assert server.cancelled == [1]  # not the proxy's to take: the server hears it, as without the proxy


async def test_the_same_request_sent_twice_at_once_is_one_call_that_stays_cancellable(
    make_proxy, legacy_upstream, http, legacy_client
):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    tag = secrets.token_hex(4)
    calls = [client.call("gated", {"tag": tag}, request_id="twice") for _ in range(2)]
    responses = await asyncio.gather(*(call.__aenter__() for call in calls))
    try:
        assert all(response.status == 200 for response in responses)

        async def state(expected):
            return await legacy_client.call_tool("gate_state", {"tag": tag}) == expected

        await eventually(lambda: state("started"), what="the one call reaching the server")
        assert await client.notify("notifications/cancelled", {"requestId": "twice"}) == 202
        await eventually(lambda: state("cancelled"), what="the cancellation reaching the server")
    finally:
        for response in responses:
            response.close()


async def test_a_cancel_naming_a_finished_durable_call_goes_to_the_server(make_proxy, fake_upstream, http):
    """Only a running durable call is the proxy's to cancel; any other notifications/cancelled is the server's."""
    server = StatelessServer(sessions=True)
    fake = await fake_upstream(server.handle)
    proxy = await make_proxy(fake.url, tools=[{"match": "work", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with client.call("work", {"who": "me"}, request_id=5) as response:
        assert (await final_of(response))["result"]["content"][0]["text"] == "result for me"
    assert await client.notify("notifications/cancelled", {"requestId": 5}) == 202
    assert server.cancelled == [5]


@pytest.mark.parametrize(
    ("error", "told"),
    [({"code": -1, "message": "User rejected sampling request"}, "sampling refused: -1"),
     ("nope", "sampling refused: -32603")],  # not an error object: still a refusal, made well-formed
    ids=["refusal", "malformed-refusal"],
)  # fmt: skip
async def test_a_clients_refusal_reaches_the_server_as_an_error(make_proxy, legacy_upstream, http, error, told):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "ask_model", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize({"sampling": {}})
    async with client.call("ask_model", {}) as response:
        async for _, message in events_of(response):
            if message and message.get("method") == "sampling/createMessage":
                body = {"jsonrpc": "2.0", "id": message["id"], "error": error}
                async with http.post(client.url, json=body, headers=client.headers) as answered:
                    assert answered.status == 202
            final = message
    assert final["result"]["content"][0]["text"] == told


async def test_another_sessions_answer_is_not_taken(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "ask_name", "keepalive_s": 0.2}])
    owner = Client2025(http, proxy.url)
    await owner.initialize({"elicitation": {}})
    other = Client2025(http, proxy.url)
    await other.initialize({"elicitation": {}})
    async with owner.call("ask_name", {}) as response:
        async for _, message in events_of(response):
            if message and message.get("method") == "elicitation/create":
                await other.answer(message["id"], {"action": "accept", "content": {"name": "Mallory"}})
                await asyncio.sleep(0.3)
                await owner.answer(message["id"], {"action": "accept", "content": {"name": "Ada"}})
            final = message
    assert final["result"]["content"][0]["text"] == "hello Ada"


@pytest.mark.parametrize("limits", [{"limits": {"max_running_tasks": 1}}, {"tasks": {"max_tasks": 1}}])
async def test_a_refused_durable_call_gets_the_limits_error(make_proxy, legacy_upstream, http, limits, legacy_client):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}], **limits)
    client = Client2025(http, proxy.url)
    await client.initialize()
    tag = secrets.token_hex(4)
    async with client.call("gated", {"tag": tag}) as first:
        await asyncio.sleep(0.2)
        async with client.call("gated", {"tag": tag + "b"}) as second:
            refused = await second.json()
        assert refused["error"]["code"] == -32603
        assert refused["error"]["message"].startswith("Cannot create a task:")
        await legacy_client.call_tool("release", {"tag": tag})
        assert (await final_of(first))["result"]["content"][0]["text"] == f"gate {tag} opened"


async def test_a_session_the_server_ended_is_answered_404_as_the_server_says(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with http.delete(proxy.url, headers=client.headers) as ended:
        assert ended.status in (200, 204)
    async with client.call("slow", {"seconds": 0}) as response:
        assert response.status == 404  # clients open a new session on 404; a 200 stream would hide it
        assert "Session not found" in (await response.json())["error"]["message"]


async def test_an_event_id_that_is_not_the_proxys_goes_to_the_server(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow"}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    async with client.resume("stream_0000000001.42.7") as response:
        body = await response.text()
    assert "Unknown or expired event stream" not in body  # the server's answer, whatever it is


async def test_a_sep_1686_tasks_id_does_not_resume_as_a_durable_stream(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow"}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    message = {"jsonrpc": "2.0", "id": 77, "method": "tools/call",
               "params": {"name": "slow", "arguments": {"seconds": 0}, "task": {}}}  # fmt: skip
    async with http.post(proxy.url, json=message, headers=client.headers) as response:
        task_id = (await response.json())["result"]["task"]["taskId"]
    async with client.resume(f"mtp.{task_id}.0.0") as resumed:
        assert resumed.status == 404


def test_every_update_moves_the_revision_forward_whatever_the_clock_says():
    """Replicas' clocks differ; a durable stream reads lastUpdatedAt as the record's revision."""
    from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStatus, transition, utc_now

    now = utc_now()
    record = TaskRecord("t" * 22, "tool", TaskStatus.WORKING, now, now, 1000, 100)
    behind = transition(record, TaskStatus.WORKING, now=now - timedelta(seconds=1), status_message="x")
    assert behind.last_updated_at > record.last_updated_at
    ahead = transition(behind, TaskStatus.COMPLETED, now=now + timedelta(seconds=5), result={})
    assert ahead.last_updated_at == now + timedelta(seconds=5)


async def test_a_store_fault_reaches_a_2025_client_on_http_200(make_proxy, legacy_upstream, http, monkeypatch):
    """The SDK 1.x client ends its whole session on a 5xx to one of its requests: the fault comes as JSON-RPC."""
    from mcp_tasks_proxy.front.context import store_key
    from mcp_tasks_proxy.store.base import StoreUnavailable

    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow"}])
    client = Client2025(http, proxy.url)
    await client.initialize()

    async def unavailable(task_id):
        raise StoreUnavailable("redis did not answer")

    monkeypatch.setattr(proxy.app[store_key], "get", unavailable)
    message = {"jsonrpc": "2.0", "id": 3, "method": "tasks/get", "params": {"taskId": "a" * 22}}
    async with http.post(proxy.url, json=message, headers=client.headers) as response:
        assert response.status == 200
        assert "Task store unavailable" in (await response.json())["error"]["message"]
