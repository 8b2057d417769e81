"""The 2025-11-25 tasks utility (SEP-1686) served by the proxy to 2025-era clients, in front of the SDK 1.x server
(which has no tasks of its own); every tasks message validates against the 2025-11-25 schema."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mcp_tasks_proxy.clients import tasks2025
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


async def test_a_task_call_nested_too_deeply_to_send_again_is_refused_before_it_starts(proxy, http):
    """The proxy sends a task's call upstream encoded again; past jsonrpc.MAX_DUMPS_DEPTH it could not, so the
    request is refused at once (on HTTP 200, as this era's clients expect errors), and no task is made."""
    client, _ = await initialized(http, proxy.url)
    deep = json.loads("[" * 600 + "]" * 600)
    refused = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": deep}, "task": {"ttl": 60_000}})
    assert refused["error"]["code"] == -32600 and "512 levels" in refused["error"]["message"]
    assert (await rpc(client, "tasks/list"))["result"]["tasks"] == []


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


# --- what a review found -------------------------------------------------------------------------------------------


async def test_errors_come_on_http_200_so_the_sdk_1x_session_survives(proxy, http):
    """A 2025 client reads JSON-RPC errors on HTTP 200; the SDK 1.x client ends its whole session on a 4xx."""
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    await until_status(client, task_id, "completed")
    for method, params in [
        ("tasks/cancel", {"taskId": task_id}),
        ("tasks/get", {"taskId": "x" * 22}),
        ("tasks/list", {"cursor": "bm9wZQ=="}),
        ("tools/call", {"name": "slow", "arguments": {}, "task": 5}),
    ]:
        message = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        async with http.post(client.url, json=message, headers=client.headers) as response:
            assert response.status == 200, method
            assert (await response.json())["error"]["code"] == -32602, method


async def test_a_cursor_that_is_not_the_proxys_is_invalid_params(proxy, http):
    import base64

    client, _ = await initialized(http, proxy.url)
    for text in ("mtp1c:\u00b2:" + "a" * 22, "mtp1c:1", "x" * 5000):
        cursor = base64.urlsafe_b64encode(text.encode()).decode()
        refused = await rpc(client, "tasks/list", {"cursor": cursor})
        assert refused["error"]["code"] == -32602


async def test_an_anonymous_caller_without_a_session_is_offered_no_list(make_proxy, fake_upstream, http):
    from tests.test_durable_faults import StatelessServer

    fake = await fake_upstream(StatelessServer().handle)
    proxy = await make_proxy(fake.url, tools=[{"match": "work"}])
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with http.post(proxy.url, json=init, headers=headers) as response:
        tasks = (await response.json())["result"]["capabilities"]["tasks"]
    assert "list" not in tasks and tasks["requests"] == {"tools": {"call": {}}}
    client = Client2025(http, proxy.url)
    client.headers["MCP-Protocol-Version"] = "2025-11-25"
    created = await rpc(client, "tools/call", {"name": "work", "arguments": {"who": "victim"}, "task": {}})
    assert created["result"]["task"]["status"] == "working"
    refused = await rpc(client, "tasks/list")
    assert refused["error"]["code"] == -32601


async def test_a_servers_forbidden_task_support_is_the_proxys_to_say(make_proxy, fake_upstream, http):
    """SDKs write taskSupport "forbidden" by default, even without tasks; the proxy's rule says what it is."""
    from tests.test_durable_faults import StatelessServer

    class Listing(StatelessServer):
        async def handle(self, request):
            message = json.loads(await request.read()) if request.method == "POST" else {}
            if message.get("method") == "tools/list":
                tools = [{"name": "work", "inputSchema": {"type": "object"}, "execution": {"taskSupport": "forbidden"}}]
                return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": tools}})
            return await super().handle(request)

    fake = await fake_upstream(Listing().handle)
    proxy = await make_proxy(fake.url, tools=[{"match": "work", "task": "required"}])
    client = Client2025(http, proxy.url)
    client.headers["MCP-Protocol-Version"] = "2025-11-25"
    listed = (await rpc(client, "tools/list"))["result"]["tools"]
    assert listed[0]["execution"] == {"taskSupport": "required"}


async def test_a_required_tool_called_without_a_task_is_method_not_found(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow", "task": "required"}])
    client, _ = await initialized(http, proxy.url)
    client.headers["Accept"] = "application/json"  # no event stream: no durable call either
    refused = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}})
    assert refused["error"]["code"] == -32601


async def test_a_required_rule_leaves_the_servers_own_tasks_alone(make_proxy, everything_upstream, http):
    proxy = await make_proxy(everything_upstream, tools=[{"match": "*", "task": "required"}])
    client, _ = await initialized(http, proxy.url)
    params = {"name": "simulate-research-query", "arguments": {"topic": "tides", "ambiguous": False}, "task": {}}
    created = await rpc(client, "tools/call", params)
    assert "task" in created["result"], created  # the server's own CreateTaskResult
    got = await rpc(client, "tasks/get", {"taskId": created["result"]["task"]["taskId"]})
    assert got["result"]["taskId"] == created["result"]["task"]["taskId"]


async def test_polling_faster_than_min_poll_interval_is_refused(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=RULES, limits={"min_poll_interval_ms": 5000})
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    assert "result" in await rpc(client, "tasks/get", {"taskId": task_id})
    too_fast = await rpc(client, "tasks/get", {"taskId": task_id})
    assert too_fast["error"]["code"] == -32603 and "Polling too fast" in too_fast["error"]["message"]


async def test_tasks_sharing_a_score_are_all_listed(monkeypatch):
    from mcp_tasks_proxy.store.base import MemoryTaskStore
    from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStatus, utc_now

    store = MemoryTaskStore(max_tasks=100)
    now = utc_now()
    ids = [f"{n:02d}" + "a" * 20 for n in range(5)]
    for task_id in ids:
        await store.create(TaskRecord(task_id, "t", TaskStatus.WORKING, now, now, 60_000, 100))
        await store.index_add("i", task_id, 7, 60_000)
    seen, after = [], None
    while page := await store.index_page("i", after, 2):
        seen += [task_id for task_id, _ in page]
        after = (page[-1][1], page[-1][0])
    assert seen == ids


async def test_the_memory_list_finds_a_page_without_sorting_the_whole_list():
    # Counted, not timed: score comparisons while 2,000 tasks are listed 50 at a time. The list was sorted again for
    # every page (2.7 ms a page at 10,000 tasks, quadratic to page through); it is kept in order now.
    from mcp_tasks_proxy.store.base import MemoryTaskStore
    from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStatus, utc_now

    comparisons = 0

    class Score(int):
        def __lt__(self, other):
            nonlocal comparisons
            comparisons += 1
            return int(self) < int(other)

        __gt__ = lambda self, other: Score.__lt__(other, self)  # noqa: E731
        __le__ = lambda self, other: not Score.__lt__(other, self)  # noqa: E731
        __ge__ = lambda self, other: not Score.__lt__(self, other)  # noqa: E731

    store = MemoryTaskStore(max_tasks=5000)
    now = utc_now()
    for number in range(2000):
        task_id = f"{number:06d}" + "a" * 16
        await store.create(TaskRecord(task_id, "t", TaskStatus.WORKING, now, now, 60_000, 100))
        await store.index_add("i", task_id, Score(10_000 - number), 60_000)  # the newest first
    comparisons = 0
    seen, after = [], None
    while page := await store.index_page("i", after, 50):
        seen += [task_id for task_id, _ in page]
        after = (Score(page[-1][1]), page[-1][0])
    assert seen == [f"{number:06d}" + "a" * 16 for number in reversed(range(2000))]
    assert comparisons < 41 * 40, comparisons  # a bisection a page (160,000 before)


async def redis_backed(make_proxy, legacy_upstream, redis_url) -> tuple[Any, str]:
    """A proxy with the Redis store under a key prefix of its own, and that prefix (to read its records)."""
    prefix = f"sep1686-{secrets.token_hex(4)}:"
    store = {"backend": "redis", "url": redis_url, "key_prefix": prefix}
    return await make_proxy(legacy_upstream, tools=RULES, store=store, security={"principal_key": "k"}), prefix


async def test_the_redis_list_keeps_long_lived_tasks_and_drops_expired_ones(
    make_proxy, legacy_upstream, http, redis_url
):
    proxy, prefix = await redis_backed(make_proxy, legacy_upstream, redis_url)
    client, _ = await initialized(http, proxy.url)
    long = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    for _ in range(3):  # shorter-lived tasks after it: the list must outlive them, and forget them once expired
        await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {"ttl": 300}})
    await asyncio.sleep(0.6)
    listed = (await rpc(client, "tasks/list"))["result"]["tasks"]
    assert [task["taskId"] for task in listed] == [long["result"]["task"]["taskId"]]
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        (key,) = [k async for k in r.scan_iter(match=f"{prefix}index:*")]
        await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})  # prunes on add
        assert await r.zcard(key) == 2 and await r.pttl(key) > 60_000
    finally:
        await r.aclose()


async def test_a_list_page_reads_a_bounded_number_of_bytes_of_records(
    make_proxy, legacy_upstream, http, redis_url, monkeypatch
):
    # With Redis, reading a record decodes its result (up to limits.max_result_bytes, 16 MB by default): a page of
    # 50 made one tasks/list read 800 MB. Past LIST_READ_BYTES the page ends early, with a cursor; here the bound is
    # two records' worth, and five tasks are listed two, two and one at a time.
    import redis.asyncio as aioredis

    proxy, prefix = await redis_backed(make_proxy, legacy_upstream, redis_url)
    client, _ = await initialized(http, proxy.url, token="alice")
    made = []
    for _ in range(5):
        created = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
        made.append(created["result"]["task"]["taskId"])
    for task_id in made:
        await until_status(client, task_id, "completed")
    r = aioredis.Redis.from_url(redis_url)
    try:
        sizes = [await r.strlen(f"{prefix}task:{task_id}") for task_id in made]
    finally:
        await r.aclose()
    assert 3 * min(sizes) > 2 * max(sizes) > 0  # records of about one size: two fit the bound, three do not
    monkeypatch.setattr(tasks2025, "LIST_READ_BYTES", 2 * max(sizes))
    pages, cursor = [], None
    while True:
        listed = (await rpc(client, "tasks/list", {"cursor": cursor} if cursor else {}))["result"]
        pages.append([task["taskId"] for task in listed["tasks"]])
        cursor = listed.get("nextCursor")
        if cursor is None:
            break
    assert pages == [made[0:2], made[2:4], made[4:]]


async def test_a_finished_tasks_get_is_answered_without_reading_its_record_again(
    make_proxy, legacy_upstream, http, redis_url
):
    # With Redis, reading a record decodes its result (up to limits.max_result_bytes) to answer a few hundred bytes.
    # A finished record does not change, so its view is kept and only the record's length checked (STRLEN): shown
    # by changing the stored record behind the proxy's back at the same length, which a read would show.
    import redis.asyncio as aioredis

    proxy, prefix = await redis_backed(make_proxy, legacy_upstream, redis_url)
    alice, _ = await initialized(http, proxy.url, token="alice")
    bob, _ = await initialized(http, proxy.url, token="bob")
    created = await rpc(alice, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    finished = await until_status(alice, task_id, "completed")
    r = aioredis.Redis.from_url(redis_url)
    try:
        key = f"{prefix}task:{task_id}"
        raw = await r.get(key)
        stored = json.loads(raw)
        moved = "1999" + stored["last_updated_at"][4:]
        await r.set(key, raw.replace(stored["last_updated_at"].encode(), moved.encode()), keepttl=True)
        assert await r.strlen(key) == len(raw)  # the same length: only a read would see it
        again = (await rpc(alice, "tasks/get", {"taskId": task_id}))["result"]
        assert again == finished and not again["lastUpdatedAt"].startswith("1999")
        refused = await rpc(bob, "tasks/get", {"taskId": task_id})  # kept for its caller only
        assert refused["error"]["code"] == -32602
        await r.set(key, json.dumps({**stored, "status_message": "longer now"}), keepttl=True)
        assert (await rpc(alice, "tasks/get", {"taskId": task_id}))["result"]["statusMessage"] == "longer now"
        await r.delete(key)  # evicted, or expired: gone at once, whatever the clocks
        assert (await rpc(alice, "tasks/get", {"taskId": task_id}))["error"]["code"] == -32602
    finally:
        await r.aclose()
    # An idempotency key sent again once its task expired makes a task under the same id: its own view, not the
    # kept one of the first.
    alice.headers["Idempotency-Key"] = "once"
    first = await rpc(alice, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {"ttl": 500}})
    first_id = first["result"]["task"]["taskId"]
    await until_status(alice, first_id, "completed")
    await asyncio.sleep(0.6)
    second = await rpc(alice, "tools/call", {"name": "slow", "arguments": {"seconds": 5}, "task": {"ttl": 500}})
    assert second["result"]["task"]["taskId"] == first_id
    assert (await rpc(alice, "tasks/get", {"taskId": first_id}))["result"]["status"] == "working"
    # Made again from another session of the same caller: the first session's view neither refuses the new owner
    # nor answers the first session.
    alice.headers["Idempotency-Key"] = "twice"
    made = await rpc(alice, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {"ttl": 500}}, 7)
    twice_id = made["result"]["task"]["taskId"]
    await until_status(alice, twice_id, "completed")  # its view kept, for this session
    await asyncio.sleep(0.6)
    other, _ = await initialized(http, proxy.url, token="alice")
    other.headers["Idempotency-Key"] = "twice"
    remade = await rpc(other, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {"ttl": 900}}, 7)
    assert remade["result"]["task"]["taskId"] == twice_id
    await asyncio.sleep(0.3)  # finished, as the first one did: its record has the very same length (no id grew)
    assert (await until_status(other, twice_id, "completed"))["createdAt"] == remade["result"]["task"]["createdAt"]
    assert (await rpc(alice, "tasks/get", {"taskId": twice_id}))["error"]["code"] == -32602  # the other session's


async def test_the_polling_refusal_names_the_interval_it_enforces(make_proxy, legacy_upstream, http):
    proxy = await make_proxy(legacy_upstream, tools=RULES, limits={"min_poll_interval_ms": 5000})
    client, _ = await initialized(http, proxy.url)
    created = await rpc(client, "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": {}})
    task_id = created["result"]["task"]["taskId"]
    await rpc(client, "tasks/get", {"taskId": task_id})
    too_fast = await rpc(client, "tasks/get", {"taskId": task_id})
    assert too_fast["error"]["data"] == {"pollIntervalMs": 5000}
