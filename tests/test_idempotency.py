"""Idempotency keys (proxy/clients/idempotency.py): a task-creating call sent again with its key gets the same task, and
the upstream runs the tool once; a key used for another request, or a malformed one, is refused."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest
from aiohttp import web

from mcp_tasks_proxy.clients.idempotency import META_KEY
from tests.conftest import task_reaches
from tests.factories import meta
from tests.schemas import validate_response
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


# --- 2026-07-28 clients without the tasks extension: keyed kept-alive calls ----------------------------------------


def _kept_call(name: str, arguments: dict, **params) -> dict:
    return {"name": name, "arguments": arguments, "_meta": meta(tasks=False, elicitation={}), **params}


async def test_a_keyed_kept_alive_call_outlives_its_request_and_the_key_gets_its_one_result(
    make_proxy, mcp_upstream, upstream_client
):
    from tests.conftest import eventually

    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "keepalive_s": 0.2}])
    gate, key = secrets.token_hex(6), secrets.token_hex(8)

    async def state() -> str:
        reply = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return reply.message["result"]["content"][0]["text"]

    first = asyncio.ensure_future(proxy.client.call("tools/call", _kept_call("gated", {"tag": gate}), tasks=False,
                                                    headers=keyed(key, **ALICE)))  # fmt: skip
    await eventually(lambda: _is(state, "started"), what="the call reaching the server")
    first.cancel()  # the client's connection drops
    await asyncio.sleep(0.5)
    assert await state() == "started"  # with a key the call goes on: the client may come back for it
    again = asyncio.ensure_future(
        proxy.client.call("tools/call", _kept_call("gated", {"tag": gate}), tasks=False, headers=keyed(key, **ALICE))
    )
    await asyncio.sleep(0.3)
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    reply = await again
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.message["id"] == reply.events[-1]["id"] and "result" in reply.message, reply.message
    assert reply.message["result"]["isError"] is False and reply.message["result"]["resultType"] == "complete"
    arrivals = await upstream_client.call_tool("gate_arrivals", {"tag": gate}, tasks=False)
    assert arrivals.result["content"][0]["text"] == "1"  # one upstream call for both requests
    # After it ended: its stored outcome, nothing run again; other arguments under the key are refused.
    late = await proxy.client.call("tools/call", _kept_call("gated", {"tag": gate}), tasks=False,
                                   headers=keyed(key, **ALICE))  # fmt: skip
    assert late.message["result"] == reply.message["result"]
    other = await proxy.client.call("tools/call", _kept_call("gated", {"tag": "x"}), tasks=False,
                                    headers=keyed(key, **ALICE))  # fmt: skip
    assert other.error["data"] == {"reason": "idempotency_key_reused"}


async def _is(read, expected) -> bool:
    return await read() == expected


async def test_a_keyed_kept_alive_call_asks_for_input_by_mrtr_and_only_its_caller_can_answer(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "one_question", "keepalive_s": 0.2}])
    key = secrets.token_hex(8)
    asked = await proxy.client.call("tools/call", _kept_call("one_question", {}), tasks=False,
                                    headers=keyed(key, **ALICE))  # fmt: skip
    round_ = asked.result
    validate_response(asked.message, "InputRequiredResult", "core")
    assert round_["resultType"] == "input_required" and list(round_["inputRequests"]) == ["q"]
    assert round_["inputRequests"]["q"]["method"] == "elicitation/create"
    state = round_["requestState"]
    answer = {"q": {"action": "accept", "content": {"answer": "yes"}}}
    # Forged, or another caller's: refused, and the call still waits for its own caller.
    forged = state[:-2] + ("AA" if not state.endswith("AA") else "BB")
    # A MAC that is not ASCII (compare_digest refuses such a str): refused as any forgery, not an internal error.
    not_ascii = state.rsplit(".", 1)[0] + ".é\ud800"
    for headers, request_state in ((ALICE, forged), (BOB, state), (ALICE, "mtp1k.nonsense"), (ALICE, not_ascii)):
        refused = await proxy.client.call(
            "tools/call", _kept_call("one_question", {}, inputResponses=answer, requestState=request_state),
            tasks=False, headers=headers,
        )  # fmt: skip
        assert refused.error["data"] == {"reason": "invalid_request_state"}, refused.message
    malformed = await proxy.client.call(
        "tools/call", _kept_call("one_question", {}, inputResponses={"q": "yes"}, requestState=state), tasks=False,
        headers=ALICE,
    )  # fmt: skip
    assert malformed.error["code"] == -32602 and "inputResponses" in malformed.error["message"]
    # Its caller's retry, on a new request without the key (as MRTR retries are), brings the answer.
    done = await proxy.client.call(
        "tools/call", _kept_call("one_question", {}, inputResponses=answer, requestState=state), tasks=False,
        headers=ALICE,
    )  # fmt: skip
    assert done.result["structuredContent"]["inputResponses"] == answer
    validate_response(done.message, "CallToolResult", "core")


async def test_a_keyed_kept_alive_call_is_found_again_and_its_input_answered_on_another_replica(
    make_proxy, mcp_upstream, redis_url
):
    store = {"backend": "redis", "url": redis_url, "key_prefix": f"kept-{secrets.token_hex(4)}:"}
    rules = [{"match": "one_question", "keepalive_s": 0.2}]
    a, b = [await make_proxy(mcp_upstream, tools=rules, store=store) for _ in range(2)]
    key = secrets.token_hex(8)
    first = await a.client.call("tools/call", _kept_call("one_question", {}), tasks=False, headers=keyed(key, **ALICE))
    again = await b.client.call("tools/call", _kept_call("one_question", {}), tasks=False, headers=keyed(key, **ALICE))
    assert again.result == first.result  # the same round of the same call: the state names its task
    answer = {"q": {"action": "accept", "content": {"answer": "on b"}}}
    params = _kept_call("one_question", {}, inputResponses=answer, requestState=first.result["requestState"])
    done = await b.client.call("tools/call", params, tasks=False, headers=ALICE)
    assert done.result["structuredContent"]["inputResponses"] == answer
