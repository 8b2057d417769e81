"""Rate limits (limits.rates): per caller, per tool, per both and per upstream, on both readers; shared by replicas
through a real Redis, so that the admitted count holds whichever replica each request hits; per replica while Redis
does not answer."""

from __future__ import annotations

import time

import pytest

from mcp_tasks_proxy.config import ConfigError, parse_config
from mcp_tasks_proxy.front.context import metrics_key, rates_key, store_key
from mcp_tasks_proxy.front.rates import RateLimited
from tests.conftest import start_redis, stop
from tests.factories import meta
from tests.test_lane import lane_counts


@pytest.fixture
def front(both_fronts: str) -> str:
    return both_fronts


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


async def calls(proxy, n: int, *, who: str = "alice", tool: str = "pid") -> list:
    return [await proxy.client.call_tool(tool, {}, tasks=False, headers=auth(who)) for _ in range(n)]


def refused(replies) -> list:
    return [reply for reply in replies if reply.status == 429]


async def test_a_caller_past_its_rate_gets_429_with_retry_after_and_others_go_on(make_proxy, mcp_upstream, front):
    rates = [{"per": "caller", "requests_per_s": 0.5, "burst": 3}]
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"rates": rates})
    replies = await calls(proxy, 5)
    assert [reply.status for reply in replies[:3]] == [200, 200, 200]  # the burst
    over = refused(replies)
    assert len(over) == 2
    error = over[0].error
    assert error["code"] == -32603 and error["data"]["limit"] == "caller"
    assert 0 < error["data"]["retryAfterMs"] <= 2000
    assert int(over[0].headers["Retry-After"]) == 2  # whole seconds, rounded up
    # Another caller has a rate of its own.
    assert [reply.status for reply in await calls(proxy, 3, who="bob")] == [200, 200, 200]
    assert 'mcp_tasks_proxy_rate_limited_total{limit="caller"} 2.0' in proxy.app[metrics_key].render().decode()
    if front == "lane":  # every request on the lane, which answered the refusals itself
        assert lane_counts(proxy) == {"relayed": 8, "served": 0, "handled": 0, "handed_over": 0}


async def test_a_limit_that_names_tools_counts_only_their_calls(make_proxy, mcp_upstream):
    rates = [{"per": "caller+tool", "match": "pi*", "requests_per_s": 0.1, "burst": 1, "name": "pid-calls"}]
    proxy = await make_proxy(mcp_upstream, protocol="modern", limits={"rates": rates})
    first, second = await calls(proxy, 2)
    assert first.status == 200 and second.status == 429
    assert second.error["data"]["limit"] == "pid-calls"
    # Another tool, and other methods, are not counted.
    assert (await proxy.client.call_tool("echo_traceparent", {}, tasks=False, headers=auth("alice"))).status == 200
    listed = await proxy.client.call("tools/list", {"_meta": meta(tasks=False)}, headers=auth("alice"))
    assert listed.status == 200


async def test_a_limit_on_the_upstream_counts_every_caller_together(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, protocol="modern",
                             limits={"rates": [{"per": "upstream", "requests_per_s": 0.1, "burst": 2}]})  # fmt: skip
    statuses = [reply.status for who in ("a", "b", "c") for reply in await calls(proxy, 1, who=who)]
    assert statuses == [200, 200, 429]


async def test_replicas_on_one_redis_hold_one_limit_whichever_replica_each_request_hits(make_proxy, mcp_upstream):
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": "rates:"}
        rate, burst = 4.0, 5
        limits = {"rates": [{"per": "caller", "requests_per_s": rate, "burst": burst}]}
        replicas = [await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits) for _ in range(3)]
        started = time.monotonic()
        replies = [
            await replicas[n % 3].client.call_tool("pid", {}, tasks=False, headers=auth("alice")) for n in range(60)
        ]
        elapsed = time.monotonic() - started
        admitted = sum(reply.status == 200 for reply in replies)
        assert all(reply.status in (200, 429) for reply in replies)
        # The burst, then the rate for as long as the requests came: the same bound however fast the machine.
        assert burst <= admitted <= burst + rate * elapsed + 1, (admitted, elapsed)
        assert admitted < 3 * burst  # not a limit per replica
    finally:
        stop(process)


async def test_while_redis_does_not_answer_each_replica_counts_alone(make_proxy, mcp_upstream):
    process, url = start_redis()
    store = {"backend": "redis", "url": url, "key_prefix": "rates:", "timeout_s": 0.5}
    limits = {"rates": [{"per": "caller", "requests_per_s": 0.1, "burst": 2}]}
    proxy = await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits)
    stop(process)
    replies = await calls(proxy, 3)
    assert [reply.status for reply in replies] == [200, 200, 429]  # no 500: the replica's own count
    assert 'mcp_tasks_proxy_rate_limit_local_total{limit="caller"} 3.0' in proxy.app[metrics_key].render().decode()
    # Asked once: for a while after a failure the replica counts alone without waiting on Redis for each request.
    assert proxy.app[store_key].failures.get("rate") == 1


def test_two_limits_with_one_name_are_refused():
    rates = [{"per": "caller", "requests_per_s": 1}, {"per": "caller", "requests_per_s": 2}]
    with pytest.raises(ConfigError, match="two rate limits are called 'caller'"):
        parse_config({"upstream": {"url": "http://127.0.0.1:1/mcp"}, "limits": {"rates": rates}})


async def test_under_load_each_replica_counts_ahead_in_redis_and_the_limit_still_holds(make_proxy, mcp_upstream):
    """A replica that sees many requests of a key counts several at once in Redis (up to 50 ms of the rate, never
    past the burst) and admits them without asking again: fewer script calls, and never more admitted than the
    limit allows, whichever replica each request hits."""
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": "ahead:"}
        rate, burst = 200.0, 10
        limits = {"rates": [{"per": "caller", "requests_per_s": rate, "burst": burst}]}
        replicas = [await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits) for _ in range(3)]
        asked = 0
        for replica in replicas:
            store_of = replica.app[store_key]
            counting = store_of.rate

            async def counted(*args, counting=counting):
                nonlocal asked
                asked += 1
                return await counting(*args)

            store_of.rate = counted
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "pid"}}
        offered = admitted = 0
        started = time.monotonic()
        while time.monotonic() - started < 1.0:
            for replica in replicas:
                offered += 1
                try:
                    await replica.app[rates_key].check(message, "alice")
                    admitted += 1
                except RateLimited:
                    pass
        elapsed = time.monotonic() - started
        assert admitted <= burst + rate * elapsed + 1, (admitted, elapsed)
        assert admitted >= min(offered * 0.9, rate * elapsed * 0.8), (admitted, offered, elapsed)
        assert asked < offered, (asked, offered)  # some were admitted from what was counted ahead
    finally:
        stop(process)


async def test_counts_given_back_stay_given_back_when_the_request_is_refused(make_proxy, mcp_upstream):
    """A replica gives back what it counted ahead and did not use with its next script call for the key; that call
    may be refused, and what it gave back must stay given back (it was lost, and the limit admitted less)."""
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": "given:"}
        limits = {"rates": [{"per": "caller", "requests_per_s": 1, "burst": 1}]}
        proxy = await make_proxy(mcp_upstream, protocol="modern", store=store, limits=limits)
        redis_store = proxy.app[store_key]
        seconds, micros = await redis_store._fast.execute("TIME")
        now = int(seconds) * 1_000_000 + int(micros)
        await redis_store._fast.execute("SET", "given:rate:k", str(now + 5_000_000))  # 5 counted ahead, 1 µs apart
        refused = await redis_store.rate("k", 1_000_000, 0, 1, 2)  # 2 of them given back, and still refused
        assert -3_100_000 < refused < -2_500_000, refused
        kept = int(await redis_store._fast.execute("GET", "given:rate:k"))
        assert now + 2_500_000 < kept < now + 3_500_000, kept - now
    finally:
        stop(process)
