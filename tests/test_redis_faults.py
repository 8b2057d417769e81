"""The Redis store under faults, with a real redis-server of each test's own: dropped pub/sub connections, Redis killed
and restarted (with and without persistence), Redis at maxmemory, a wrong password. What it acknowledged, it keeps."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import re
import secrets
import subprocess
import threading
import time
import urllib.request
from datetime import datetime

import pytest
import redis.asyncio as redis
import structlog

from tests.conftest import PROXY, RedisServer, eventually, free_port, stop, task_reaches
from tests.factories import McpClient, meta
from tests.test_replicas import gate_is, gate_tag

PRINCIPAL_KEY = "faults-share-this-key"


def store_section(url: str, prefix: str, **overrides) -> dict:
    return {
        "backend": "redis",
        "url": url,
        "key_prefix": prefix,
        "lease_s": 1,
        "reap_interval_s": 0.3,
        "timeout_s": 0.5,
        **overrides,
    }


async def replica(make_proxy, upstream: str, url: str, prefix: str, **store):
    return await make_proxy(
        upstream,
        protocol="modern",
        store=store_section(url, prefix, **store),
        tools=[{"match": name} for name in ("gated", "gated_then_progress", "one_question", "slow_report")],
        tasks={"poll_interval_ms": 50},
        security={"principal_key": PRINCIPAL_KEY},
    )


async def owner_and_other(make_proxy, upstream: str, url: str, prefix: str, *, owner_reconcile_s: float = 600):
    """Two replicas of one store: the owner of the tasks a test makes, and another that answers or cancels them.
    The other's slow timer is far away; the owner's is too, unless the test is about it."""
    owner = await replica(make_proxy, upstream, url, prefix, reconcile_interval_s=owner_reconcile_s)
    other = await replica(make_proxy, upstream, url, prefix, reconcile_interval_s=600)
    return owner, other


async def ask(client: McpClient) -> str:
    created = await client.call("tools/call", {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})})
    task_id = created.result["taskId"]
    await task_reaches(client, task_id, "input_required")
    return task_id


async def answer(client: McpClient, task_id: str, text: str) -> None:
    asking = (await client.get_task(task_id)).result
    (key,) = asking["inputRequests"]
    reply = await client.call(
        "tasks/update",
        {"taskId": task_id, "inputResponses": {key: {"action": "accept", "content": {"answer": text}}}},
    )
    assert reply.result == {"resultType": "complete"}


async def kill_pubsub(url: str) -> int:
    admin = redis.Redis.from_url(url)
    try:
        return await admin.client_kill_filter(_type="pubsub")
    finally:
        await admin.aclose()


@pytest.mark.parametrize("attempt", range(3))
async def test_an_answer_given_while_the_owners_subscription_is_down_still_resumes_the_task(
    make_proxy, mcp_upstream, redis_server, attempt
):
    server = redis_server()
    prefix = f"pubsub-{secrets.token_hex(3)}:"
    # The slow timer is far away: only the re-read after the re-subscription can save the answer.
    owner, other = await owner_and_other(make_proxy, mcp_upstream, server.url, prefix)
    task_id = await ask(owner.client)
    assert await kill_pubsub(server.url) >= 2  # both replicas' subscriptions
    await answer(other.client, task_id, f"after the kill {attempt}")  # published while nobody listens
    done = await task_reaches(owner.client, task_id, "completed", "failed")
    assert done.result["status"] == "completed"
    assert f"you said after the kill {attempt}" in done.result["result"]["content"][0]["text"]


async def test_a_cancel_given_while_the_owners_subscription_is_down_still_stops_the_call(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    server = redis_server()
    prefix = f"cancel-{secrets.token_hex(3)}:"
    owner, other = await owner_and_other(make_proxy, mcp_upstream, server.url, prefix)
    tag = gate_tag()
    task_id = (await owner.client.call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call starting")
    await kill_pubsub(server.url)
    assert (await other.client.cancel_task(task_id)).result == {"resultType": "complete"}
    await eventually(lambda: gate_is(upstream_client, tag, "cancelled"), what="the owner stopping the call")
    assert (await owner.client.get_task(task_id)).result["status"] == "cancelled"


async def test_events_lost_without_a_reconnect_are_caught_by_the_slow_timer(make_proxy, mcp_upstream, redis_server):
    # A publish that failed after its record was written (the ack stays true): the owner's timer finds the answer.
    server = redis_server()
    prefix = f"deaf-{secrets.token_hex(3)}:"
    owner, other = await owner_and_other(make_proxy, mcp_upstream, server.url, prefix, owner_reconcile_s=0.3)
    from mcp_tasks_proxy.front.context import store_key

    async def lost(event):  # this replica's publishes go nowhere
        return None

    other.app[store_key].publish = lost
    task_id = await ask(owner.client)
    await answer(other.client, task_id, "never published")
    done = await task_reaches(owner.client, task_id, "completed", "failed")
    assert "you said never published" in done.result["result"]["content"][0]["text"]


async def release_all(upstream_client: McpClient, tags: list[str]) -> None:
    for tag in tags:
        await upstream_client.call_tool("release", {"tag": tag}, tasks=False)


async def statuses(client: McpClient, task_ids: list[str]) -> list[str | None]:
    found = []
    for task_id in task_ids:
        reply = await client.get_task(task_id)
        found.append(reply.result["status"] if reply.status == 200 else None)
    return found


async def test_redis_killed_and_restarted_with_persistence_every_task_completes(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    server = redis_server("--appendonly", "yes", "--appendfsync", "always")
    proxy = await replica(make_proxy, mcp_upstream, server.url, "aof:", lease_s=3)
    tags = [gate_tag() for _ in range(10)]
    # Half the calls report progress after their release, while Redis is gone: a write that cannot be made and
    # must be skipped, not fail the call (defect 3).
    tools = ["gated", "gated_then_progress"] * 5
    task_ids = [
        (await proxy.client.call_tool(tool, {"tag": tag})).result["taskId"]
        for tool, tag in zip(tools, tags, strict=True)
    ]
    for tag in tags:
        await eventually(lambda tag=tag: gate_is(upstream_client, tag, "started"), what="every call starting")
    server.kill()
    await release_all(upstream_client, tags)  # the calls finish while Redis is gone
    reply = await proxy.client.get_task(task_ids[0])
    assert reply.status == 503 and "Task store unavailable" in reply.error["message"]
    await asyncio.sleep(2)
    server.start()  # the same port and data directory: the append-only file is read back

    async def all_completed():
        return await statuses(proxy.client, task_ids) == ["completed"] * len(task_ids)

    await eventually(all_completed, what="every task completing after Redis came back")
    for task_id in task_ids:
        task = (await proxy.client.get_task(task_id)).result
        assert task["result"]["content"][0]["text"].startswith("gate ")


async def test_redis_restarted_without_persistence_loses_its_tasks_cleanly(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    from mcp_tasks_proxy.front.context import runner_key

    server = redis_server("--appendonly", "no")
    proxy = await replica(make_proxy, mcp_upstream, server.url, "nopersist:")
    tags = [gate_tag() for _ in range(5)]
    task_ids = [(await proxy.client.call_tool("gated", {"tag": tag})).result["taskId"] for tag in tags]
    for tag in tags:
        await eventually(lambda tag=tag: gate_is(upstream_client, tag, "started"), what="every call starting")
    server.kill()
    await release_all(upstream_client, tags)
    await asyncio.sleep(1)
    server.start()  # empty: every record is gone with the old process

    async def all_unknown():
        replies = [await proxy.client.get_task(task_id) for task_id in task_ids]
        return all(r.status == 400 and r.error["code"] == -32602 for r in replies)

    await eventually(all_unknown, what="the lost tasks answering as unknown")
    # Nothing waits on in the proxy for a record that cannot come back, and it serves new tasks at once.
    await eventually(lambda: _none_running(proxy.app[runner_key]), what="the runner letting go of the lost tasks")
    created = await proxy.client.call_tool("slow_report", {"topic": "after", "seconds": 0})
    assert (await task_reaches(proxy.client, created.result["taskId"], "completed")).result["status"] == "completed"


async def _none_running(runner) -> bool:
    return runner.running == 0


async def test_redis_at_maxmemory_keeps_results_until_it_has_room_and_no_live_task_is_reaped(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    server = redis_server("--maxmemory-policy", "noeviction")
    prefix = "oom:"
    owner = await replica(make_proxy, mcp_upstream, server.url, prefix)
    sweeper = await replica(make_proxy, mcp_upstream, server.url, prefix)  # its sweep looks for lost replicas
    tags = [gate_tag() for _ in range(5)]
    task_ids = [(await owner.client.call_tool("gated", {"tag": tag})).result["taskId"] for tag in tags]
    for tag in tags:
        await eventually(lambda tag=tag: gate_is(upstream_client, tag, "started"), what="every call starting")
    admin = redis.Redis.from_url(server.url)
    try:
        await admin.config_set("maxmemory", 1)  # below what it uses: every write that needs memory is refused
        refused = await owner.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
        assert refused.status == 503 and "out of memory" in refused.error["message"]
        ready_url = owner.url.replace("/mcp", "/readyz")
        async with owner.client.session.get(ready_url) as response:
            assert response.status == 503
            assert "out of memory" in (await response.json())["store"]
        await release_all(upstream_client, tags)
        await asyncio.sleep(3)  # three lease periods: a live owner whose lease lapsed would be reaped by now
        assert await statuses(sweeper.client, task_ids) == ["working"] * len(tags)
        await admin.config_set("maxmemory", 0)
    finally:
        await admin.aclose()

    async def all_completed():
        return await statuses(sweeper.client, task_ids) == ["completed"] * len(task_ids)

    await eventually(all_completed, what="the kept results being written once Redis had room")


async def test_a_wrong_password_is_a_clear_error_and_leaks_no_connection(make_proxy, mcp_upstream, redis_server):
    server = redis_server("--requirepass", "right-password")
    wrong = server.url.replace("redis://", "redis://:wrong-password@")
    proxy = await replica(make_proxy, mcp_upstream, wrong, "auth:")
    task_id = "A" * 22
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(300):
        reply = await proxy.client.get_task(task_id)
        assert reply.status == 503
        assert "refused the credentials" in reply.error["message"] and "WRONGPASS" in reply.error["message"]
        assert "wrong-password" not in reply.body.decode()
    assert len(os.listdir("/proc/self/fd")) - fds_before < 20
    admin = redis.Redis.from_url(server.url.replace("redis://", "redis://:right-password@"))
    try:
        clients = (await admin.info("clients"))["connected_clients"]
    finally:
        await admin.aclose()
    assert clients < 20, clients
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        assert response.status == 503
        assert "refused the credentials of store.url" in (await response.json())["store"]


async def test_a_task_id_that_is_not_unicode_is_refused_and_every_caller_keeps_its_own_record(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    """Defect 1 end to end: a `tasks/get` for "\\ud800" used to shift every later Redis reply on the replica by one."""
    server = redis_server()
    proxy = await replica(make_proxy, mcp_upstream, server.url, f"surrogate-{secrets.token_hex(3)}:")
    tags = [gate_tag() for _ in range(8)]
    task_ids = []
    for tag in tags:
        created = await proxy.client.call("tools/call", {"name": "gated", "arguments": {"tag": tag}, "_meta": meta()})
        task_ids.append(created.result["taskId"])
    hostile = '{"jsonrpc":"2.0","id":7,"method":"tasks/get","params":{"taskId":"\\ud800","_meta":%s}}'
    import json

    for _ in range(3):
        reply = await proxy.client.post_raw(
            hostile % json.dumps(meta()),
            {
                "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream",
                "MCP-Protocol-Version": "2026-07-28",
                "Mcp-Method": "tasks/get",
            },
        )
        assert reply.status in (200, 400) and reply.message["error"]["code"] == -32602
    for _ in range(5):
        answers = await asyncio.gather(*(proxy.client.get_task(task_id) for task_id in task_ids * 4))
        assert [a.result["taskId"] for a in answers] == task_ids * 4
    await release_all(upstream_client, tags)
    for task_id in task_ids:
        assert (await task_reaches(proxy.client, task_id, "completed")).result["taskId"] == task_id


async def test_a_result_in_hand_outlasts_the_calls_timeout_while_redis_is_down(
    make_proxy, mcp_upstream, upstream_client, redis_server
):
    """The result's write is retried outside the rule's timeout_s: a slow store never turns a result into a
    timeout failure."""
    server = redis_server("--appendonly", "yes", "--appendfsync", "always")
    proxy = await make_proxy(
        mcp_upstream,
        protocol="modern",
        store=store_section(server.url, "in-hand:", lease_s=3),
        tools=[{"match": "gated", "timeout_s": 4}],
        tasks={"poll_interval_ms": 50},
        security={"principal_key": PRINCIPAL_KEY},
    )
    tag = gate_tag()
    task_id = (await proxy.client.call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call starting")
    server.kill()
    await release_all(upstream_client, [tag])  # the result arrives while Redis is gone ...
    await asyncio.sleep(6)  # ... and stays unwritten past the call's timeout_s
    server.start()
    done = await task_reaches(proxy.client, task_id, "completed", "failed")
    assert done.result["status"] == "completed", done.result.get("statusMessage")
    assert done.result["result"]["content"][0]["text"] == f"gate {tag} opened"


async def keyless_replica(make_proxy, upstream: str, url: str, prefix: str):
    """A replica as the compose example runs it: no principal key anywhere, so it takes the one kept in Redis."""
    return await make_proxy(
        upstream, protocol="modern", store=store_section(url, prefix), tools=[{"match": "slow_report"}]
    )


ALICE, MALLORY = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer mallory"}


async def made_here_seen_there(maker, seer) -> bool:
    created = await maker.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
    if "result" not in created.message:  # the store reconnecting
        return False
    reply = await seer.client.get_task(created.result["taskId"], headers=ALICE)
    return "result" in reply.message


async def test_replicas_without_a_key_share_the_one_kept_in_redis_even_after_redis_lost_it(
    make_proxy, mcp_upstream, redis_server, monkeypatch
):
    monkeypatch.delenv("MCP_TASKS_PROXY_PRINCIPAL_KEY", raising=False)
    server = redis_server()
    prefix = f"key-{secrets.token_hex(3)}:"
    a = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
    b = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
    created = await a.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
    task_id = created.result["taskId"]
    assert (await task_reaches(b.client, task_id, "completed", headers=ALICE)).result["status"] == "completed"
    assert (await b.client.get_task(task_id, headers=MALLORY)).error["code"] == -32602  # still another owner's
    admin = redis.Redis.from_url(server.url)
    try:
        assert len(await admin.get(f"{prefix}principal-key")) == 64
    finally:
        await admin.aclose()

    server.kill()  # no persistence: the key is gone with everything else
    server.start()
    c = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
    # Whichever replica wrote the key again first, all three converge on it within a lease (1 s here).
    for maker, seer in [(c, a), (a, c), (b, c)]:
        await eventually(lambda m=maker, s=seer: made_here_seen_there(m, s), what="the replicas agreeing again")


async def test_an_explicit_key_wins_over_the_one_in_redis(make_proxy, mcp_upstream, redis_server, monkeypatch):
    monkeypatch.delenv("MCP_TASKS_PROXY_PRINCIPAL_KEY", raising=False)
    server = redis_server()
    prefix = f"key-{secrets.token_hex(3)}:"
    keyless = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
    keyed = await replica(make_proxy, mcp_upstream, server.url, prefix)  # security.principal_key set
    created = await keyed.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
    await task_reaches(keyed.client, created.result["taskId"], "completed", headers=ALICE)
    # Alice's hash differs between the two keys: to the keyless replica the task is someone else's.
    assert (await keyless.client.get_task(created.result["taskId"], headers=ALICE)).error["code"] == -32602


async def test_a_replica_started_before_redis_answers_store_unavailable_until_the_key_loads(
    make_proxy, mcp_upstream, redis_server, monkeypatch, tmp_path
):
    monkeypatch.delenv("MCP_TASKS_PROXY_PRINCIPAL_KEY", raising=False)
    server = RedisServer(tmp_path)  # not started yet: the store's address answers nothing
    early = await keyless_replica(make_proxy, mcp_upstream, server.url, f"early-{secrets.token_hex(3)}:")
    reply = await early.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
    assert reply.status == 503 and "Task store unavailable" in reply.error["message"]
    async with early.client.session.get(early.url.replace("/mcp", "/readyz")) as response:
        body = await response.json()
    assert response.status == 503 and "not loaded yet" in body["principal_key"]
    async with early.client.session.get(early.url.replace("/mcp", "/metrics")) as response:
        exposition = await response.text()
    assert re.search(r'^mcp_tasks_proxy_store_errors_total\{operation="shared_secret"\} [1-9]', exposition, re.M)
    try:
        server.start()

        async def works() -> bool:
            made = await early.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
            return made.status == 200 and made.result["status"] == "working"

        await eventually(works, what="the key loading once Redis answers")
        async with early.client.session.get(early.url.replace("/mcp", "/readyz")) as response:
            assert response.status == 200 and "principal_key" not in await response.json()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("", "is empty"),
        ("short", "is not a key of the proxy's"),
        (b"\xff" * 40, "is not a key of the proxy's"),
        ("list", "holds a Redis list, not a string"),
    ],
    ids=["empty", "short", "binary", "wrong-type"],
)
async def test_an_unusable_shared_key_in_redis_is_replaced_once_and_disturbs_nobody(
    make_proxy, mcp_upstream, redis_server, monkeypatch, bad, reason
):
    """Issue 25: an empty value under principal-key was read as a garbled reply; the shared connection was reset on
    every retry, unrelated requests got 503, the replica never became ready, and the log named the wrong cause."""
    monkeypatch.delenv("MCP_TASKS_PROXY_PRINCIPAL_KEY", raising=False)
    server = redis_server()
    prefix = f"bad-key-{secrets.token_hex(3)}:"
    key = f"{prefix}principal-key"
    admin = redis.Redis.from_url(server.url)
    try:
        if bad == "list":
            await admin.rpush(key, "a", "b")
        else:
            await admin.set(key, bad)
        with structlog.testing.capture_logs() as logs:
            a = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
            b = await keyless_replica(make_proxy, mcp_upstream, server.url, prefix)
            for replica_ in (a, b):
                async with replica_.client.session.get(replica_.url.replace("/mcp", "/readyz")) as response:
                    assert response.status == 200, await response.json()
            created = await a.client.call_tool("slow_report", {"topic": "k", "seconds": 0}, headers=ALICE)
            assert created.status == 200, created.message
            done = await task_reaches(b.client, created.result["taskId"], "completed", headers=ALICE)
            assert done.result["status"] == "completed"  # both replicas hash Alice alike: one key
        stored = await admin.get(key)
        assert stored is not None and re.fullmatch(rb"[0-9a-f]{64}", stored)
    finally:
        await admin.aclose()
    invalid = [line for line in logs if line["event"] == "principal_key_invalid"]
    assert invalid and all(line["key"] == key and reason in line["reason"] for line in invalid), invalid
    assert len(invalid) <= 2  # once per replica at most: the first replacement is the one both keep
    assert not [line for line in logs if line["event"] in ("store_unavailable", "store_record_corrupt")], logs


async def readyz(proxy) -> tuple[int, dict]:
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        return response.status, await response.json()


async def test_an_evicting_maxmemory_policy_is_named_at_start_and_on_readyz(make_proxy, mcp_upstream, redis_server):
    """Issue 25: with volatile-ttl (once the README's advice) Redis evicts running tasks' records and the replicas'
    leases under memory pressure, and those tasks are lost while their calls go on."""
    server = redis_server("--maxmemory-policy", "volatile-ttl")
    with structlog.testing.capture_logs() as logs:
        proxy = await replica(make_proxy, mcp_upstream, server.url, "policy:")
        status, body = await readyz(proxy)
    assert status == 200, body  # a shared setting takes no replica out of service
    (warning,) = body["warnings"]
    assert warning.startswith("Redis maxmemory-policy is volatile-ttl: under memory pressure it evicts keys with a TTL")
    assert warning.endswith("set maxmemory-policy noeviction")
    assert [line["policy"] for line in logs if line["event"] == "store_eviction_policy"] == ["volatile-ttl"]
    admin = redis.Redis.from_url(server.url)
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        assert "warnings" not in (await readyz(proxy))[1]
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        assert "evicts any key" in (await readyz(proxy))[1]["warnings"][0]
    finally:
        await admin.aclose()


async def test_a_policy_that_cannot_be_read_is_said_once(make_proxy, mcp_upstream, redis_server):
    """Managed Redis services often disable CONFIG (and some INFO): the proxy says it cannot check, once."""
    server = redis_server()
    admin = redis.Redis.from_url(server.url)
    try:
        await admin.execute_command("ACL", "SETUSER", "tasks", "on", ">secret", "~*", "&*", "+@all", "-info", "-config")
    finally:
        await admin.aclose()
    limited = server.url.replace("redis://", "redis://tasks:secret@")
    with structlog.testing.capture_logs() as logs:
        proxy = await replica(make_proxy, mcp_upstream, limited, "acl:")
        for _ in range(3):
            status, body = await readyz(proxy)
            assert status == 200 and "warnings" not in body, body
    unknown = [line for line in logs if line["event"] == "store_eviction_policy_unknown"]
    assert len(unknown) == 1 and "INFO memory" in unknown[0]["reason"] and "CONFIG GET" in unknown[0]["reason"]
    assert "noeviction" in unknown[0]["advice"]


def test_redis_away_is_one_warning_then_one_per_back_off_step_and_one_line_when_it_is_back(tmp_path):
    """The proxy started on a Redis URL with nothing behind it (as a newcomer mistypes a port): its lease, events and
    key loops fail many times a second, but the log says so once, then once per back-off step (1 s, 2 s, 4 s...),
    and says when Redis answers again. Every failure still counts in /metrics."""
    server = RedisServer(tmp_path)  # its port, free: nothing listens there until start()
    port = free_port()
    proxy = subprocess.Popen(
        [*PROXY, "--upstream", f"http://127.0.0.1:{free_port()}/mcp", "--port", str(port), "--store", server.url,
         "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[dict] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(json.loads(line)) for line in proxy.stdout], daemon=True)
    reader.start()
    try:
        warned: list[float] = []
        deadline = time.monotonic() + 60
        while len(warned) < 4 and time.monotonic() < deadline:  # the first warning and three steps: about 7 s
            line = lines.get(timeout=30)
            if line["event"] in ("store_unavailable", "store_still_unavailable") and line["level"] == "warning":
                warned.append(datetime.fromisoformat(line["timestamp"]).timestamp())
        assert len(warned) == 4
        gaps = [later - earlier for earlier, later in itertools.pairwise(warned)]
        assert all(gap >= 0.95 * 2**step for step, gap in enumerate(gaps)), gaps  # 1 s, 2 s, 4 s at least
        errors = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        failed = sum(float(value) for value in re.findall(r"^mcp_tasks_proxy_store_errors_total\{.*\} (\S+)$",
                                                          errors, re.M))  # fmt: skip
        assert failed > len(warned)  # many more failures than warnings: they are counted, not logged
        server.start()
        while (line := lines.get(timeout=30))["event"] != "store_available_again":
            pass
        assert line["level"] == "info" and line["failures"] >= failed and line["down_s"] > 0
    finally:
        stop(proxy)
        reader.join(timeout=10)  # (the pipe's end, once the proxy is gone)
        proxy.stdout.close()
        server.stop()


def test_an_outages_warnings_follow_the_back_off_and_a_flapping_redis_keeps_its_step():
    """Outage (proxy/store/redis_link.py) on a clock of the test's own: failures many times a second make one
    warning per step (1, 2, 4 s...), the return one info line; an outage right after keeps the step it had reached,
    one after a quiet step starts again at 1 s."""
    from mcp_tasks_proxy.store.redis_link import Outage

    now = [0.0]
    outage = Outage(clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for _ in range(64):  # 8 s of failures, eight a second
            outage.failed("lease", "refused")
            now[0] += 0.125
        warned = [line for line in logs if line["log_level"] == "warning"]
        assert [line["event"] for line in warned] == ["store_unavailable"] + [
            "store_still_unavailable"
        ] * 3  # 0, 1, 3, 7 s
        assert [line["failures"] for line in warned[1:]] == [9, 25, 57]
        outage.over()
        assert logs[-1]["event"] == "store_available_again" and logs[-1]["failures"] == 64
        logs.clear()
        now[0] += 1  # back for a second only: the same outage, as far as the log goes
        outage.failed("lease", "refused")
        assert [line["log_level"] for line in logs] == ["debug"]  # inside the step the last warning began: no line
        outage.over()
        logs.clear()
        now[0] += 3600  # an hour later: a new outage, from the first step
        for _ in range(12):
            outage.failed("lease", "refused")
            now[0] += 0.125
        assert [line["event"] for line in logs if line["log_level"] == "warning"] == [
            "store_unavailable", "store_still_unavailable"]  # fmt: skip
