"""Concurrency limits (limits.rates' `concurrency`): calls running at once per caller, tool, both or the upstream,
background calls included; refused with 429 or queued (a task waits, working; any other call waits at the door);
shared by replicas through a real Redis as leases that lapse when their replica stops renewing them; per replica
while Redis does not answer."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
import pytest

from mcp_tasks_proxy.config import ConfigError, parse_config
from mcp_tasks_proxy.front import concurrency
from mcp_tasks_proxy.front.context import concurrency_key, metrics_key, store_key
from tests.conftest import eventually, start_redis, stop, task_reaches
from tests.factories import meta
from tests.test_mrtr_e2e import ELICIT, accept
from tests.test_sep1686 import initialized, rpc, until_status


@pytest.fixture
def front(both_fronts: str) -> str:
    return both_fronts


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


def tag() -> str:
    return secrets.token_hex(6)


async def gate_state(upstream_client, gate: str) -> str:
    reply = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
    return reply.result["structuredContent"]["result"]


async def release(upstream_client, gate: str) -> None:
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)


async def test_a_caller_past_its_calls_at_once_is_refused_until_one_ends(make_proxy, mcp_upstream, upstream_client,
                                                                        front):  # fmt: skip
    rates = [{"per": "caller+tool", "match": "gated", "concurrency": 1}]
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"rates": rates})
    gate = tag()
    running = await proxy.client.call_tool("gated", {"tag": gate}, headers=auth("alice"))
    assert running.result["resultType"] == "task"
    refused = await proxy.client.call_tool("gated", {"tag": tag()}, headers=auth("alice"))
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert refused.error["code"] == -32603 and refused.error["data"]["limit"] == "caller+tool:gated"
    assert "1 at once" in refused.error["message"]
    # Another caller, another tool, and the caller's polling of its task are not held by it.
    other_gate = tag()
    other = await proxy.client.call_tool("gated", {"tag": other_gate}, headers=auth("bob"))
    assert other.result["resultType"] == "task"
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=auth("alice"))).status == 200
    polled = await proxy.client.get_task(running.result["taskId"], headers=auth("alice"))
    assert polled.result["status"] == "working"
    metrics = proxy.app[metrics_key].render().decode()
    assert 'mcp_tasks_proxy_rate_limited_total{limit="caller+tool:gated"} 1.0' in metrics
    # The background call holds its slot until it ends, then the next call is taken.
    await release(upstream_client, gate)
    await task_reaches(proxy.client, running.result["taskId"], "completed", headers=auth("alice"))

    async def admitted():
        reply = await proxy.client.call_tool("gated", {"tag": other_gate}, headers=auth("alice"))
        return reply if reply.status == 200 else None

    again = await eventually(admitted, what="a slot free once the task ended")
    await release(upstream_client, other_gate)
    for reply, who in ((other, "bob"), (again, "alice")):
        await task_reaches(proxy.client, reply.result["taskId"], "completed", headers=auth(who))


async def test_a_queued_call_is_a_task_at_once_that_waits_working_and_runs_when_a_slot_frees(
    make_proxy, mcp_upstream, upstream_client
):
    rates = [{"per": "tool", "match": "gated", "concurrency": 1, "on_limit": "queue"}]
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"rates": rates})
    first_gate, second_gate = tag(), tag()
    first = await proxy.client.call_tool("gated", {"tag": first_gate}, headers=auth("alice"))
    second = await proxy.client.call_tool("gated", {"tag": second_gate}, headers=auth("bob"))
    assert second.result["resultType"] == "task"  # answered at once: the wait is the task's
    waiting = await proxy.client.get_task(second.result["taskId"], headers=auth("bob"))
    assert waiting.result["status"] == "working"
    assert waiting.result["statusMessage"] == "queued: past the concurrency limit 'tool:gated'"
    assert await gate_state(upstream_client, second_gate) == "unknown"  # not sent while the slot is taken
    await release(upstream_client, first_gate)
    await task_reaches(proxy.client, first.result["taskId"], "completed", headers=auth("alice"))

    async def started():
        return await gate_state(upstream_client, second_gate) == "started"

    await eventually(started, what="the queued call starting once the slot is free")
    await release(upstream_client, second_gate)
    await task_reaches(proxy.client, second.result["taskId"], "completed", headers=auth("bob"))
    assert proxy.app[concurrency_key]._counts == {}  # every slot given back


async def test_a_queued_call_answered_directly_waits_at_the_door_then_is_refused_past_its_time(
    make_proxy, mcp_upstream, upstream_client, front
):
    rates = [{"per": "upstream", "match": "gated", "concurrency": 1, "on_limit": "queue", "queue_timeout_s": 0.3}]
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"rates": rates})  # no rule: passed through
    gate = tag()
    first = asyncio.ensure_future(proxy.client.call_tool("gated", {"tag": gate}, tasks=False))

    async def first_started():
        return await gate_state(upstream_client, gate) == "started"

    await eventually(first_started, what="the first call at its gate")
    refused = await proxy.client.call_tool("gated", {"tag": tag()}, tasks=False)
    assert refused.status == 429 and "queued 0.3 s without a free slot" in refused.error["message"]
    # One that waits while the first ends goes through, in turn.
    second_gate = tag()
    second = asyncio.ensure_future(proxy.client.call_tool("gated", {"tag": second_gate}, tasks=False))
    await asyncio.sleep(0.1)
    await release(upstream_client, gate)
    assert (await first).status == 200
    await eventually(lambda: _started(upstream_client, second_gate), what="the second call sent")
    await release(upstream_client, second_gate)
    assert (await second).status == 200
    assert proxy.app[concurrency_key]._counts == {}


async def test_the_retry_of_an_input_round_that_becomes_a_task_holds_its_slot_while_it_runs(
    make_proxy, mcp_upstream, upstream_client
):
    rates = [{"per": "caller", "concurrency": 1}]
    tools = [{"match": "ask_then_gated", "sync_window_ms": 1500}]
    proxy = await make_proxy(mcp_upstream, tools=tools, limits={"rates": rates})
    gate = tag()
    params = {"name": "ask_then_gated", "arguments": {"tag": gate}, "_meta": meta(**ELICIT)}
    round_one = await proxy.client.call("tools/call", params)
    assert round_one.result["resultType"] == "input_required"
    retry = {**params, "inputResponses": {"name": accept("Ada")}, "requestState": round_one.result["requestState"]}
    created = await proxy.client.call("tools/call", retry)
    assert created.result["resultType"] == "task", created.message
    assert (await proxy.client.call_tool("pid", {}, tasks=False)).status == 429  # the task holds the slot
    await release(upstream_client, gate)
    await task_reaches(proxy.client, created.result["taskId"], "completed")


async def test_replicas_on_one_redis_hold_one_limit_and_a_lost_replicas_slots_lapse(
    make_proxy, mcp_upstream, upstream_client, monkeypatch
):
    monkeypatch.setattr(concurrency, "LEASE_S", 1.0)
    monkeypatch.setattr(concurrency, "_RENEW_S", 0.2)
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": f"slots-{tag()}:"}
        limits = {"rates": [{"per": "caller", "concurrency": 2}]}
        replicas = [
            await make_proxy(mcp_upstream, tools=[{"match": "gated"}], store=store, limits=limits) for _ in range(3)
        ]
        gates = [tag(), tag()]
        held = [await replicas[n].client.call_tool("gated", {"tag": gates[n]}, headers=auth("alice")) for n in range(2)]
        assert all(reply.result["resultType"] == "task" for reply in held)
        await asyncio.sleep(1.5)  # past a lease: renewed by the replicas that hold them
        refused = await replicas[2].client.call_tool("gated", {"tag": tag()}, headers=auth("alice"))
        assert refused.status == 429 and refused.error["data"]["limit"] == "caller"
        assert (await replicas[2].client.call_tool("pid", {}, tasks=False, headers=auth("bob"))).status == 200
        # A replica that stops renewing and gives nothing back, as a lost one: its slot is free once its lease lapses.
        replicas[0].app[concurrency_key]._renewed.clear()

        async def admitted():
            reply = await replicas[2].client.call_tool("pid", {}, tasks=False, headers=auth("alice"))
            return reply.status == 200

        await eventually(admitted, what="the stopped replica's lease lapsing")
        # A call that ends gives its slot back in Redis: two calls fit again, not a third.
        await release(upstream_client, gates[1])
        await task_reaches(replicas[1].client, held[1].result["taskId"], "completed", headers=auth("alice"))
        later = [tag(), tag()]

        async def admitted_at(gate: str):
            reply = await replicas[2].client.call_tool("gated", {"tag": gate}, headers=auth("alice"))
            return reply if reply.status == 200 else None

        # (A slot given back reaches Redis within 5 ms: with the next take of its replica, or alone.)
        again = [await eventually(lambda gate=gate: admitted_at(gate), what="a free slot") for gate in later]
        assert (await replicas[2].client.call_tool("gated", {"tag": tag()}, headers=auth("alice"))).status == 429
        for gate in (*gates, *later):
            await release(upstream_client, gate)
        for reply in again:
            await task_reaches(replicas[2].client, reply.result["taskId"], "completed", headers=auth("alice"))
    finally:
        stop(process)


async def test_while_redis_does_not_answer_each_replica_counts_alone(make_proxy, mcp_upstream, upstream_client):
    process, url = start_redis()
    store = {"backend": "redis", "url": url, "key_prefix": f"slots-{tag()}:", "timeout_s": 0.5}
    limits = {"rates": [{"per": "caller", "match": "gated", "concurrency": 1}]}
    proxy = await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits)  # calls passed through
    stop(process)
    gate = tag()
    running = asyncio.ensure_future(proxy.client.call_tool("gated", {"tag": gate}, tasks=False))

    async def started():
        return await gate_state(upstream_client, gate) == "started"

    await eventually(started, what="the first call at its gate")  # taken: no 500, the replica's own count
    assert (await proxy.client.call_tool("gated", {"tag": tag()}, tasks=False)).status == 429
    assert 'mcp_tasks_proxy_rate_limit_local_total{limit="caller:gated"}' in proxy.app[metrics_key].render().decode()
    assert proxy.app[store_key].failures.get("slots") == 1  # asked once, then counted here for a while
    await release(upstream_client, gate)
    assert (await running).status == 200
    assert proxy.app[concurrency_key]._counts == {}


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"per": "caller"}, "needs requests_per_s, concurrency or both"),
        ({"per": "caller", "concurrency": 2, "burst": 3}, "burst needs requests_per_s"),
        ({"per": "caller", "requests_per_s": 2, "on_limit": "queue"}, "on_limit: queue needs concurrency"),
    ],
)
def test_a_limit_that_limits_nothing_or_mixes_its_settings_is_refused(entry, says):
    with pytest.raises(ConfigError, match=says):
        parse_config({"upstream": {"url": "http://127.0.0.1:1/mcp"}, "limits": {"rates": [entry]}})


async def test_a_2025_clients_tasks_queue_behind_the_limit_in_front_of_a_2025_server(make_proxy, legacy_upstream):
    """SEP-1686 tasks the proxy makes for a 2025-era client hold their slots until they end, as 2026 tasks do."""
    rates = [{"per": "caller+tool", "match": "gated", "concurrency": 1, "on_limit": "queue"}]
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated"}], limits={"rates": rates})
    async with aiohttp.ClientSession() as http:
        client, _ = await initialized(http, proxy.url)
        gates = [tag(), tag()]
        created = [
            (await rpc(client, "tools/call", {"name": "gated", "arguments": {"tag": gate}, "task": {}}))["result"]
            for gate in gates
        ]
        second = created[1]["task"]["taskId"]
        waiting = (await rpc(client, "tasks/get", {"taskId": second}))["result"]
        assert waiting["status"] == "working"
        assert waiting["statusMessage"] == "queued: past the concurrency limit 'caller+tool:gated'"
        for gate in gates:  # the second is sent once the first has ended, and then released
            await rpc(client, "tools/call", {"name": "release", "arguments": {"tag": gate}})
            await until_status(client, created[gates.index(gate)]["task"]["taskId"], "completed")
    assert proxy.app[concurrency_key]._counts == {}


async def test_a_replayed_input_round_retry_takes_a_slot_like_any_call(make_proxy, mcp_upstream, upstream_client,
                                                                       front):  # fmt: skip
    """The retry of an input round runs the tool again upstream (a modern server keeps no call open between
    rounds): it takes a slot, so replaying one requestState cannot run more calls at once than the limit."""
    rates = [{"per": "upstream", "match": "ask_then_gated", "concurrency": 1}]
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"rates": rates})  # no rule: relayed
    gate = tag()
    params = {"name": "ask_then_gated", "arguments": {"tag": gate}, "_meta": meta(tasks=False, **ELICIT)}
    round_one = await proxy.client.call("tools/call", params, tasks=False)
    assert round_one.result["resultType"] == "input_required", round_one.message
    retry = {**params, "inputResponses": {"name": accept("Ada")}, "requestState": round_one.result["requestState"]}
    first = asyncio.ensure_future(proxy.client.call("tools/call", retry, tasks=False))

    async def started():
        return await gate_state(upstream_client, gate) == "started"

    await eventually(started, what="the first retry at its gate")
    replays = [await proxy.client.call("tools/call", retry, tasks=False) for _ in range(2)]
    assert [reply.status for reply in replays] == [429, 429]
    arrivals = await upstream_client.call_tool("gate_arrivals", {"tag": gate}, tasks=False)
    assert arrivals.result["structuredContent"]["result"] == "1"
    await release(upstream_client, gate)
    assert (await first).status == 200


async def test_the_retry_of_a_keyed_call_finds_its_running_task_and_takes_no_slot(make_proxy, mcp_upstream,
                                                                                  upstream_client):  # fmt: skip
    rates = [{"per": "caller", "match": "gated", "concurrency": 1}]
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"rates": rates})
    gate, key = tag(), tag()
    headers = {"Idempotency-Key": key, **auth("alice")}
    first = await proxy.client.call_tool("gated", {"tag": gate}, headers=headers)
    again = await proxy.client.call_tool("gated", {"tag": gate}, headers=headers)  # its first answer was lost
    assert again.status == 200 and again.result["taskId"] == first.result["taskId"]
    assert (await proxy.client.call_tool("gated", {"tag": tag()}, headers=auth("alice"))).status == 429  # still full
    await release(upstream_client, gate)
    await task_reaches(proxy.client, first.result["taskId"], "completed", headers=auth("alice"))


async def test_a_queued_task_that_meets_a_refusing_limit_waits_for_it_too(make_proxy, mcp_upstream,
                                                                          upstream_client):  # fmt: skip
    """Admitted (queued), a task waits for every slot of its call, whatever each limit says of new calls: it never
    fails for a limit it was admitted under."""
    rates = [
        {"per": "tool", "match": "gated", "concurrency": 1, "on_limit": "queue"},
        {"per": "caller", "concurrency": 1},
    ]
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"rates": rates})
    bob_gate, alice_gate, other_gate = tag(), tag(), tag()
    bobs = await proxy.client.call_tool("gated", {"tag": bob_gate}, headers=auth("bob"))
    alices = await proxy.client.call_tool("gated", {"tag": alice_gate}, headers=auth("alice"))  # queued
    assert alices.result["resultType"] == "task"
    # Alice's direct call of another tool holds her caller slot while Bob's ends.
    other = asyncio.ensure_future(
        proxy.client.call_tool("gated_idempotent", {"tag": other_gate}, tasks=False, headers=auth("alice"))
    )
    await eventually(lambda: _started(upstream_client, other_gate), what="Alice's direct call at its gate")
    await release(upstream_client, bob_gate)
    await task_reaches(proxy.client, bobs.result["taskId"], "completed", headers=auth("bob"))
    await asyncio.sleep(0.3)
    assert await gate_state(upstream_client, alice_gate) == "unknown"  # still waiting for her caller slot
    assert (await proxy.client.get_task(alices.result["taskId"], headers=auth("alice"))).result["status"] == "working"
    await release(upstream_client, other_gate)
    assert (await other).status == 200
    await eventually(lambda: _started(upstream_client, alice_gate), what="the queued task sent")
    await release(upstream_client, alice_gate)
    await task_reaches(proxy.client, alices.result["taskId"], "completed", headers=auth("alice"))


async def _started(upstream_client, gate: str) -> bool:
    return await gate_state(upstream_client, gate) == "started"


async def test_a_replica_that_stops_gives_its_slots_back_in_redis(make_proxy, mcp_upstream, upstream_client):
    """A graceful stop (a rolling deploy) gives back what the replica held: the limits are not left full of calls
    that no longer run until their leases lapse."""
    process, url = start_redis()
    try:
        prefix = f"slots-{tag()}:"
        store = {"backend": "redis", "url": url, "key_prefix": prefix}
        limits = {"rates": [{"per": "upstream", "match": "gated", "concurrency": 2}]}
        proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], store=store, limits=limits)
        gate = tag()
        created = await proxy.client.call_tool("gated", {"tag": gate})
        assert created.result["resultType"] == "task"
        redis = proxy.app[store_key]._fast
        assert await redis.execute("ZCARD", f"{prefix}slots:0:upstream") == 1
        await proxy.app[concurrency_key].aclose()
        assert await redis.execute("ZCARD", f"{prefix}slots:0:upstream") == 0
        await release(upstream_client, gate)
    finally:
        stop(process)


@pytest.mark.parametrize("answer", [b"garbage", -1, 7, [1, 2]])
async def test_a_redis_answering_garbage_to_the_slots_script_makes_the_replica_count_alone(
    make_proxy, mcp_upstream, upstream_client, answer
):
    """An answer out of the script's range is a store failure: the call is counted on its replica (no 500), and
    nothing is held in Redis for it."""
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": f"slots-{tag()}:"}
        limits = {"rates": [{"per": "caller", "match": "gated", "concurrency": 1}]}
        proxy = await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits)
        redis_store = proxy.app[store_key]

        async def garbled(*_args):
            return answer

        redis_store._script = garbled
        gate = tag()
        running = asyncio.ensure_future(proxy.client.call_tool("gated", {"tag": gate}, tasks=False))
        await eventually(lambda: _started(upstream_client, gate), what="the call counted on its replica")
        assert (await proxy.client.call_tool("gated", {"tag": tag()}, tasks=False)).status == 429
        assert redis_store.failures.get("slots") == 1
        await release(upstream_client, gate)
        assert (await running).status == 200
        assert proxy.app[concurrency_key]._counts == {}
    finally:
        stop(process)
