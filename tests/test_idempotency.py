"""Idempotency keys (proxy/idempotency.py): a task-creating call sent again with its key gets the same task, and
the upstream runs the tool once; a key used for another request, or a malformed one, is refused."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest
from aiohttp import web

from proxy.idempotency import META_KEY
from tests.conftest import task_reaches
from tests.factories import meta
from tests.test_sep1686 import initialized, rpc, until_status

ALICE = {"Authorization": "Bearer alice-secret-token"}
BOB = {"Authorization": "Bearer bob-secret-token"}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def keyed(key: str, **headers: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **headers}


async def test_a_key_sent_again_gets_the_same_task_and_the_tool_runs_once(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "sync_window_ms": 200}])
    gate, key = secrets.token_hex(6), secrets.token_hex(8)
    first = await proxy.client.call_tool("gated", {"tag": gate}, headers=keyed(key, **ALICE))
    task_id = first.result["taskId"]
    # While it runs (the connection that carried the answer dropped, say): the same task, nothing run again.
    again = await proxy.client.call_tool("gated", {"tag": gate}, headers=keyed(f'"{key}"', **ALICE))  # sf-string
    assert again.result["resultType"] == "task" and again.result["taskId"] == task_id
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    done = await task_reaches(proxy.client, task_id, "completed", headers=ALICE)
    # After it finished: the same task, its stored outcome.
    late = await proxy.client.call_tool("gated", {"tag": gate}, headers=keyed(key, **ALICE))
    assert late.result["taskId"] == task_id and late.result["status"] == "completed"
    assert late.result["result"] == done.result["result"]
    arrivals = await upstream_client.call_tool("gate_arrivals", {"tag": gate}, tasks=False)
    assert arrivals.result["content"][0]["text"] == "1"
    # Another caller's same key is another task: keys are scoped to the principal.
    bobs = await proxy.client.call_tool("gated", {"tag": gate}, headers=keyed(key, **BOB))
    assert bobs.result["taskId"] != task_id
    await task_reaches(proxy.client, bobs.result["taskId"], "completed", headers=BOB)  # the gate is open


async def test_a_key_used_for_other_arguments_is_refused_and_nothing_runs(make_proxy, fake_upstream):
    fake = await fake_upstream(_answers_calls)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    key = secrets.token_hex(8)
    first = await proxy.client.call_tool("job", {"n": 1}, headers=keyed(key))
    await task_reaches(proxy.client, first.result["taskId"], "completed")
    other = await proxy.client.call_tool("job", {"n": 2}, headers=keyed(key))
    assert other.error["code"] == -32602 and "used for another request" in other.error["message"]
    assert other.error["data"] == {"reason": "idempotency_key_reused"}
    # Another tool under the same key is another request too: keys are scoped to the tool, so it runs.
    another_tool = await proxy.client.call_tool("other_job", {"n": 1}, headers=keyed(key))
    await task_reaches(proxy.client, another_tool.result["taskId"], "completed")
    assert [call["params"]["name"] for call in _tool_calls(fake)] == ["job", "other_job"]


async def test_concurrent_submissions_of_one_key_make_one_task_and_one_call(make_proxy, fake_upstream):
    fake = await fake_upstream(_answers_calls)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    key = secrets.token_hex(8)
    replies = await asyncio.gather(*(proxy.client.call_tool("job", {"n": 1}, headers=keyed(key)) for _ in range(30)))
    assert len({reply.result["taskId"] for reply in replies}) == 1
    await task_reaches(proxy.client, replies[0].result["taskId"], "completed")
    assert len(_tool_calls(fake)) == 1


async def test_the_meta_key_works_and_never_reaches_the_upstream(make_proxy, fake_upstream):
    fake = await fake_upstream(_answers_calls)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    key = secrets.token_hex(8)
    params = {"name": "job", "arguments": {}, "_meta": {**meta(), META_KEY: key}}
    first = await proxy.client.call("tools/call", params)
    second = await proxy.client.call("tools/call", params)
    assert first.result["taskId"] == second.result["taskId"]
    await task_reaches(proxy.client, first.result["taskId"], "completed")
    (sent,) = _tool_calls(fake)
    assert META_KEY not in sent["params"]["_meta"]
    both = await proxy.client.call("tools/call", params, headers=keyed("another-key"))
    assert both.error["code"] == -32602 and "two different idempotency keys" in both.error["message"]


async def test_an_mrtr_retry_ignores_the_key_and_never_forwards_it(make_proxy, fake_upstream):
    fake = await fake_upstream(_answers_calls)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    params = {"name": "job", "arguments": {}, "requestState": "the-upstreams", "_meta": {**meta(), META_KEY: "k"}}
    created = await proxy.client.call("tools/call", params)
    await task_reaches(proxy.client, created.result["taskId"], "completed")
    (sent,) = _tool_calls(fake)
    assert sent["params"]["requestState"] == "the-upstreams" and META_KEY not in sent["params"]["_meta"]


async def test_malformed_keys_are_refused(make_proxy, fake_upstream):
    fake = await fake_upstream(_answers_calls)
    proxy = await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}])
    for bad in ("x" * 256, "tab\tinside", "", '""'):
        refused = await proxy.client.call_tool("job", {}, headers=keyed(bad))
        assert refused.error["code"] == -32602 and "idempotency key" in refused.error["message"], bad
    for bad in (7, "", None, "é"):
        params = {"name": "job", "arguments": {}, "_meta": {**meta(), META_KEY: bad}}
        refused = await proxy.client.call("tools/call", params)
        assert refused.error["code"] == -32602, bad
    assert _tool_calls(fake) == []


async def test_replicas_sharing_redis_make_one_task_of_one_key(make_proxy, fake_upstream, redis_url):
    fake = await fake_upstream(_answers_calls)
    store = {"backend": "redis", "url": redis_url, "key_prefix": f"idem-{secrets.token_hex(4)}:"}
    security = {"principal_key": "shared-for-the-test"}
    replicas = [
        await make_proxy(fake.url, protocol="modern", tools=[{"match": "*"}], store=store, security=security)
        for _ in range(2)
    ]
    key = secrets.token_hex(8)
    replies = await asyncio.gather(
        *(replicas[n % 2].client.call_tool("job", {"n": 1}, headers=keyed(key)) for n in range(20))
    )
    assert len({reply.result["taskId"] for reply in replies}) == 1
    await task_reaches(replicas[1].client, replies[0].result["taskId"], "completed")
    assert len(_tool_calls(fake)) == 1


async def test_a_sep1686_task_request_sent_again_with_its_key_gets_the_same_task(
    make_proxy, legacy_upstream, legacy_client, http
):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated"}], tasks={"poll_interval_ms": 100})
    client, _ = await initialized(http, proxy.url)
    gate, key = secrets.token_hex(6), secrets.token_hex(8)
    client.headers["Idempotency-Key"] = key
    params = {"name": "gated", "arguments": {"tag": gate}, "task": {"ttl": 60_000}}
    first = (await rpc(client, "tools/call", params))["result"]["task"]
    second = (await rpc(client, "tools/call", params))["result"]["task"]
    assert second["taskId"] == first["taskId"]
    await legacy_client.call_tool("release", {"tag": gate})
    await until_status(client, first["taskId"], "completed")
    # On another session the key's task cannot be shown (SEP-1686 tasks are the session's), nor run again.
    other, _ = await initialized(http, proxy.url)
    other.headers["Idempotency-Key"] = key
    refused = await rpc(other, "tools/call", params)
    assert refused["error"]["code"] == -32602 and refused["error"]["data"] == {
        "reason": "idempotency_key_other_session"
    }
    assert await legacy_client.call_tool("gate_arrivals", {"tag": gate}) == "1"


async def _answers_calls(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    result = {"resultType": "complete", "content": [{"type": "text", "text": "done"}], "isError": False}
    return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": result})


def _tool_calls(fake) -> list[dict]:
    return [
        json.loads(seen["body"])
        for seen in fake.received
        if seen["body"] and json.loads(seen["body"]).get("method") == "tools/call"
    ]


async def test_a_durable_call_sent_again_with_its_key_joins_the_running_call_and_answers_as_the_new_request(
    make_proxy, legacy_upstream, legacy_client, http
):
    """A 2025-era client's durable call (no tasks): its connection drops, it sends the call again with a new id and
    the same key, and that request follows the one call, answered under its own id; the tool runs once."""
    from tests.test_durable import Client2025, events_of

    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    gate, key = secrets.token_hex(6), secrets.token_hex(8)
    client.headers["Idempotency-Key"] = key
    async with client.call("gated", {"tag": gate}, request_id="first") as response:
        async for _event, _message in events_of(response):
            break  # the priming event; then the connection is gone
    async with client.call("gated", {"tag": gate}, request_id="again") as response:
        assert response.status == 200
        await legacy_client.call_tool("release", {"tag": gate})
        final = None
        async for _event, message in events_of(response):
            final = message
    assert final["id"] == "again" and final["result"]["content"][0]["text"] == f"gate {gate} opened"
    assert await legacy_client.call_tool("gate_arrivals", {"tag": gate}) == "1"

    # The same key for other arguments is refused, nothing runs; on another session it is refused as well.
    async with client.call("gated", {"tag": "other"}, request_id="other") as response:
        refused = await response.json()
    assert refused["error"]["code"] == -32602 and refused["error"]["data"] == {"reason": "idempotency_key_reused"}
    elsewhere = Client2025(http, proxy.url)
    await elsewhere.initialize()
    elsewhere.headers["Idempotency-Key"] = key
    async with elsewhere.call("gated", {"tag": gate}, request_id="elsewhere") as response:
        refused = await response.json()
    assert refused["error"]["data"] == {"reason": "idempotency_key_other_session"}
    assert await legacy_client.call_tool("gate_arrivals", {"tag": gate}) == "1"


@pytest.mark.parametrize("named", ["first", "joined"])
async def test_a_joined_durable_call_is_cancelled_by_the_id_of_either_request(
    make_proxy, legacy_upstream, legacy_client, http, named
):
    from tests.conftest import eventually
    from tests.test_durable import Client2025, events_of

    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}])
    client = Client2025(http, proxy.url)
    await client.initialize()
    gate = secrets.token_hex(6)
    client.headers["Idempotency-Key"] = secrets.token_hex(8)
    async with client.call("gated", {"tag": gate}, request_id="first") as response:
        async for _event, _message in events_of(response):
            break
    async with client.call("gated", {"tag": gate}, request_id="joined") as response:
        assert response.status == 200  # following the call (kept alive: nothing to read until it ends)

        async def started() -> bool:
            return await legacy_client.call_tool("gate_state", {"tag": gate}) == "started"

        await eventually(started, what="the call running")
        assert await client.notify("notifications/cancelled", {"requestId": named}) == 202

        async def cancelled() -> bool:
            return await legacy_client.call_tool("gate_state", {"tag": gate}) == "cancelled"

        await eventually(cancelled, what="the call stopped for the request that joined it")
