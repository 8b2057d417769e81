"""The 2025-11-25 tasks utility (SEP-1686) served by the proxy to 2025-era clients, in front of the SDK 1.x server
(which has no tasks of its own); every tasks message validates against the 2025-11-25 schema."""

from __future__ import annotations

import json
import secrets

import aiohttp
import pytest

from proxy import tasks2025
from tests.conftest import eventually
from tests.schemas import validate
from tests.test_durable import Client2025, events_of

RULES = [
    {"match": "slow"},
    {"match": "gated"},
    {"match": "ask_*"},
    {"match": "broken"},
    {"match": "add", "task": "never"},
]


@pytest.fixture
async def proxy(make_proxy, legacy_upstream):
    return await make_proxy(legacy_upstream, tools=RULES, tasks={"poll_interval_ms": 100})


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def rpc(client: Client2025, method: str, params: dict | None = None, request_id=None) -> dict:
    message = {"jsonrpc": "2.0", "id": request_id or secrets.token_hex(4), "method": method, "params": params or {}}
    async with client.http.post(client.url, json=message, headers=client.headers) as response:
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            final = None
            async for _, event in events_of(response):
                final = event
            return final
        return await response.json()


async def initialized(http, url, **kw) -> tuple[Client2025, dict]:
    client = Client2025(http, url, **kw)
    params = {
        "protocolVersion": "2025-11-25",
        "capabilities": {"elicitation": {}},
        "clientInfo": {"name": "t", "version": "1"},
    }
    message = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
    async with http.post(url, json=message, headers=client.headers) as response:
        client.headers["Mcp-Session-Id"] = response.headers["Mcp-Session-Id"]
        raw = await response.read()
    text = raw.decode()
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    result = json.loads(data[-1] if data else text)["result"]
    client.headers["MCP-Protocol-Version"] = "2025-11-25"
    await client.notify("notifications/initialized")
    return client, result


async def until_status(client: Client2025, task_id: str, *statuses: str) -> dict:
    async def reached():
        task = (await rpc(client, "tasks/get", {"taskId": task_id}))["result"]
        return task if task["status"] in statuses else None

    return await eventually(reached, what=f"task {task_id} reaching {statuses}")


async def test_initialize_and_tools_list_announce_the_proxys_tasks(proxy, http):
    client, result = await initialized(http, proxy.url)
    assert result["capabilities"]["tasks"] == tasks2025.CAPABILITY
    validate(result, "InitializeResult", "2025")
    listed = (await rpc(client, "tools/list"))["result"]
    validate(listed, "ListToolsResult", "2025")
    support = {tool["name"]: tool.get("execution", {}).get("taskSupport") for tool in listed["tools"]}
    assert support["slow"] == "optional" and support["ask_name"] == "optional"
    assert support["add"] is None and support["release"] is None  # never, and no rule


async def test_a_task_is_created_followed_and_its_exact_result_read(proxy, http):
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0.6}, "task": {"ttl": 60_000}})
    validate(created, "JSONRPCResultResponse", "2025")
    validate(created["result"], "CreateTaskResult", "2025")
    task = created["result"]["task"]
    assert task["status"] == "working" and task["ttl"] == 60_000
    got = await rpc(client, "tasks/get", {"taskId": task["taskId"]})
    validate(got["result"], "GetTaskResult", "2025")
    # tasks/result blocks until the task ends, then answers exactly what the call did.
    final = await rpc(client, "tasks/result", {"taskId": task["taskId"]})
    validate(final["result"], "CallToolResult", "2025")
    assert final["result"]["content"][0]["text"] == "slept 0.6 s"
    assert final["result"]["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task["taskId"]}
    done = await until_status(client, task["taskId"], "completed")
    validate(done, "GetTaskResult", "2025")
    again = await rpc(client, "tasks/result", {"taskId": task["taskId"]})  # terminal: at once, as JSON
    assert again["result"] == final["result"]


async def test_the_servers_question_comes_on_tasks_result_and_its_answer_goes_back(proxy, http):
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "ask_name", "arguments": {}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    await until_status(client, task_id, "input_required")
    message = {"jsonrpc": "2.0", "id": "r1", "method": "tasks/result", "params": {"taskId": task_id}}
    async with http.post(client.url, json=message, headers=client.headers) as response:
        async for _, event in events_of(response):
            if event and event.get("method") == "elicitation/create":
                validate(event, "JSONRPCRequest", "2025")
                assert event["params"]["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task_id}
                await client.answer(event["id"], {"action": "accept", "content": {"name": "Ada"}})
            final = event
    assert final["id"] == "r1"
    assert final["result"]["content"][0]["text"] == "hello Ada"


async def test_tasks_list_shows_only_the_callers_tasks_page_by_page(proxy, http, monkeypatch):
    monkeypatch.setattr(tasks2025, "PAGE_SIZE", 2)
    alice, _ = await initialized(http, proxy.url, token="alice")
    bob, _ = await initialized(http, proxy.url, token="bob")
    mine = []
    for _ in range(3):
        created = await rpc(alice, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
        mine.append(created["result"]["task"]["taskId"])
    await rpc(bob, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    first = (await rpc(alice, "tasks/list"))["result"]
    validate(first, "ListTasksResult", "2025")
    assert len(first["tasks"]) == 2 and "nextCursor" in first
    second = (await rpc(alice, "tasks/list", {"cursor": first["nextCursor"]}))["result"]
    assert "nextCursor" not in second
    assert [t["taskId"] for t in first["tasks"] + second["tasks"]] == mine
    assert [t["taskId"] for t in (await rpc(bob, "tasks/list"))["result"]["tasks"]] not in ([], mine)
    # Another caller's task is unknown to Alice, whatever the method.
    bobs = (await rpc(bob, "tasks/list"))["result"]["tasks"][0]["taskId"]
    for method in ("tasks/get", "tasks/result", "tasks/cancel"):
        refused = await rpc(alice, method, {"taskId": bobs})
        assert refused["error"]["code"] == -32602
    bad = await rpc(alice, "tasks/list", {"cursor": "not-a-cursor"})
    assert bad["error"]["code"] == -32602


async def test_tasks_cancel_stops_the_call_and_refuses_a_terminal_task(proxy, http, legacy_client):
    client, _ = await initialized(http, proxy.url)
    tag = secrets.token_hex(4)
    created = await rpc(client, "tools/call", {"name": "gated", "arguments": {"tag": tag}, "task": {}})
    task_id = created["result"]["task"]["taskId"]

    async def state(expected):
        return await legacy_client.call_tool("gate_state", {"tag": tag}) == expected

    await eventually(lambda: state("started"), what="the call reaching the server")
    cancelled = await rpc(client, "tasks/cancel", {"taskId": task_id})
    validate(cancelled["result"], "CancelTaskResult", "2025")
    assert cancelled["result"]["status"] == "cancelled"
    await eventually(lambda: state("cancelled"), what="the server hearing of it")
    again = await rpc(client, "tasks/cancel", {"taskId": task_id})
    assert again["error"]["code"] == -32602


async def test_a_server_with_tasks_of_its_own_keeps_them(make_proxy, everything_upstream, http):
    """server-everything has SEP-1686 tasks: its initialize, tools/list and tasks/* pass through untouched."""
    proxy = await make_proxy(everything_upstream, tools=[{"match": "*"}])
    client, result = await initialized(http, proxy.url)
    _, straight = await initialized(http, everything_upstream)
    assert result["capabilities"]["tasks"] == straight["capabilities"]["tasks"]
    listed = (await rpc(client, "tasks/list"))["result"]
    assert "tasks" in listed  # the server's own answer


async def test_a_tool_result_with_is_error_is_a_failed_task_whose_result_is_still_read(proxy, http):
    """SEP-1686: for tool calls, failed includes a result with isError true; tasks/result gives that result."""
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "broken", "arguments": {}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    failed = await until_status(client, task_id, "failed", "completed")
    assert failed["status"] == "failed"
    final = await rpc(client, "tasks/result", {"taskId": task_id})
    assert final["result"]["isError"] is True and "the tool broke" in final["result"]["content"][0]["text"]


async def test_an_older_session_is_left_as_it_was(proxy, http):
    client = Client2025(http, proxy.url, version="2025-06-18")
    await client.initialize()
    listed = (await rpc(client, "tools/list"))["result"]
    assert all("execution" not in tool for tool in listed["tools"])
