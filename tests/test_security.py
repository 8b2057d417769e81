"""Hostile and broken traffic: task ownership, limits with clear errors, Host and Origin checks."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest
import redis.asyncio as redis_client
import structlog
from aiohttp import web

from mcp_tasks_proxy.front.context import runner_key
from mcp_tasks_proxy.store.redis_store import RedisTaskStore
from tests.conftest import eventually, task_reaches
from tests.factories import McpClient


@pytest.fixture
def front(both_fronts: str) -> str:
    """Every test here runs through both readers, the lane and aiohttp's server (tests/conftest.py)."""
    return both_fronts


ALICE = {"Authorization": "Bearer alice-secret-token"}
BOB = {"Authorization": "Bearer bob-secret-token"}


def tag() -> str:
    return secrets.token_hex(6)


async def test_only_the_owner_sees_answers_or_cancels_a_task(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}])
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate}, headers=ALICE)
    task_id = created.result["taskId"]
    unknown = await proxy.client.get_task("no-such-task", headers=BOB)
    for method, extra in (("tasks/get", {}), ("tasks/update", {"inputResponses": {}}), ("tasks/cancel", {})):
        for who in (BOB, {}):  # another principal, and no credential at all
            reply = await proxy.client.call(method, {"taskId": task_id, **extra}, headers=who)
            # Exactly what an unknown id gets: nothing tells that the task exists.
            assert (reply.status, reply.error) == (unknown.status, unknown.error), method
    assert (await proxy.client.get_task(task_id, headers=ALICE)).result["status"] == "working"
    await proxy.client.cancel_task(task_id, headers=ALICE)
    assert (await proxy.client.get_task(task_id, headers=ALICE)).result["status"] == "cancelled"
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)


async def test_ownership_by_a_trusted_header_or_by_nobody(make_proxy, mcp_upstream):
    proxy = await make_proxy(
        mcp_upstream, tools=[{"match": "slow_report"}], security={"principal": "header", "principal_header": "X-User"}
    )
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0}, headers={"X-User": "ann"})
    task_id = created.result["taskId"]
    assert (await proxy.client.get_task(task_id, headers={"X-User": "ann", **BOB})).status == 200
    assert (await proxy.client.get_task(task_id, headers={"X-User": "ben"})).error["code"] == -32602
    single = await make_proxy(mcp_upstream, tools=[{"match": "slow_report"}], security={"principal": "none"})
    created = await single.client.call_tool("slow_report", {"topic": "t", "seconds": 0}, headers=ALICE)
    assert (await single.client.get_task(created.result["taskId"], headers=BOB)).status == 200


async def test_credentials_are_never_stored_nor_logged(make_proxy, mcp_upstream, redis_url):
    prefix = f"sec-{tag()}:"
    store = RedisTaskStore(redis_url, key_prefix=prefix, lease_s=5, timeout_s=2)
    proxy = await make_proxy(mcp_upstream, store=store, tools=[{"match": "echo_authorization"}])
    with structlog.testing.capture_logs() as logs:
        created = await proxy.client.call_tool("echo_authorization", headers=ALICE)
        done = await task_reaches(proxy.client, created.result["taskId"], "completed", headers=ALICE)
    # The upstream got the credential (its own answer says so) ...
    assert done.result["result"]["structuredContent"] == {"result": ALICE["Authorization"]}
    raw = redis_client.Redis.from_url(redis_url)
    records = [json.loads(await raw.get(key)) async for key in raw.scan_iter(f"{prefix}task:*")]
    await raw.aclose()
    assert len(records) == 1 and "alice-secret-token" in json.dumps(records[0].pop("result"))
    # ... but the store holds no credential outside the tool's own result ...
    assert "alice-secret-token" not in json.dumps(records[0]) and "Authorization" not in json.dumps(records[0])
    # ... and no log line carries it.
    assert "alice-secret-token" not in repr(logs)
    assert logs and all(line.get("principal") != ALICE["Authorization"] for line in logs)


async def test_a_task_keeps_a_bounded_share_of_the_request_headers(make_proxy, mcp_upstream, upstream_client):
    """A working task keeps the client's end-to-end headers for its upstream calls. aiohttp reads heads of about
    1 MB: a creation whose kept headers pass 32 KB is refused, rather than held that long by every task it makes."""
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}])
    padded = {f"X-Pad-{i}": "p" * 8000 for i in range(100)}
    refused = await proxy.client.call_tool("gated", {"tag": tag()}, headers=padded)
    assert refused.error["code"] == -32600, refused.message
    assert "at most 32768 bytes" in refused.error["message"]
    assert proxy.app[runner_key]._state.jobs == {}  # nothing started, nothing kept
    gate = tag()
    within = await proxy.client.call_tool("gated", {"tag": gate}, headers={"X-Pad": "p" * 8000})
    assert within.result["resultType"] == "task", within.message
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    await task_reaches(proxy.client, within.result["taskId"], "completed")


async def test_running_task_limits_refuse_with_clear_errors(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"max_tasks_per_principal": 1})
    gates = [tag(), tag()]
    first = await proxy.client.call_tool("gated", {"tag": gates[0]}, headers=ALICE)
    refused = await proxy.client.call_tool("gated", {"tag": tag()}, headers=ALICE)
    assert refused.error["code"] == -32603
    assert "limits.max_tasks_per_principal" in refused.error["message"]
    assert refused.error["data"] == {"limit": "max_tasks_per_principal"}
    other = await proxy.client.call_tool("gated", {"tag": gates[1]}, headers=BOB)  # someone else still can
    assert other.result["resultType"] == "task"
    for gate in gates:
        await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    await task_reaches(proxy.client, first.result["taskId"], "completed", headers=ALICE)
    await task_reaches(proxy.client, other.result["taskId"], "completed", headers=BOB)
    # A call that ended frees its place: Alice may start another, and the per-caller counts (kept as jobs come and
    # go, not counted over the table) hold no entry for a caller with nothing running.
    admission = proxy.app[runner_key]._admission
    again_gate = tag()
    again = await proxy.client.call_tool("gated", {"tag": again_gate}, headers=ALICE)
    assert again.result["resultType"] == "task", again.message
    assert list(admission._per_caller.values()) == [1]
    await upstream_client.call_tool("release", {"tag": again_gate}, tasks=False)
    await task_reaches(proxy.client, again.result["taskId"], "completed", headers=ALICE)

    async def emptied() -> bool:  # the job leaves the table in its runner's done callback, after the record is stored
        return admission._per_caller == {}

    await eventually(emptied, what="the per-caller counts emptying")

    total = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"max_running_tasks": 1})
    gate = tag()
    await total.client.call_tool("gated", {"tag": gate})
    refused = await total.client.call_tool("gated", {"tag": tag()})
    assert "limits.max_running_tasks" in refused.error["message"]
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)


async def test_anonymous_callers_are_limited_each_by_their_address(make_proxy, mcp_upstream, upstream_client):
    """Anonymous callers share no credential: one of them must not use up the others' max_tasks_per_principal."""
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], limits={"max_tasks_per_principal": 1})
    gates = [tag(), tag()]
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as first_session,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))) as second_session,
    ):
        first, second = McpClient(first_session, proxy.url), McpClient(second_session, proxy.url)
        running = await first.call_tool("gated", {"tag": gates[0]})
        assert running.result["resultType"] == "task"
        refused = await first.call_tool("gated", {"tag": tag()})
        assert refused.error["data"] == {"limit": "max_tasks_per_principal"}
        other = await second.call_tool("gated", {"tag": gates[1]})
        assert other.result["resultType"] == "task", other.message
        for gate in gates:
            await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
        await task_reaches(first, running.result["taskId"], "completed")
        await task_reaches(second, other.result["taskId"], "completed")


async def test_per_tool_concurrency_queues_or_refuses_as_the_rule_says(make_proxy, mcp_upstream, upstream_client):
    queued_proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "max_concurrency": 1}])
    first_gate, second_gate = tag(), tag()
    first = await queued_proxy.client.call_tool("gated", {"tag": first_gate})
    second = await queued_proxy.client.call_tool("gated", {"tag": second_gate})
    waiting = await queued_proxy.client.get_task(second.result["taskId"])
    assert waiting.result["status"] == "working"
    assert waiting.result["statusMessage"].startswith("queued:")
    assert (await upstream_client.call_tool("gate_state", {"tag": second_gate}, tasks=False)).result[
        "structuredContent"
    ]["result"] == "unknown"  # not started upstream while the slot is taken
    await upstream_client.call_tool("release", {"tag": first_gate}, tasks=False)
    await task_reaches(queued_proxy.client, first.result["taskId"], "completed")

    async def second_started():
        state = await upstream_client.call_tool("gate_state", {"tag": second_gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "started"

    await eventually(second_started, what="the queued call starting once the slot is free")
    await upstream_client.call_tool("release", {"tag": second_gate}, tasks=False)
    await task_reaches(queued_proxy.client, second.result["taskId"], "completed")

    refusing = await make_proxy(mcp_upstream, tools=[{"match": "gated", "max_concurrency": 1, "on_limit": "refuse"}])
    gate = tag()
    await refusing.client.call_tool("gated", {"tag": gate})
    refused = await refusing.client.call_tool("gated", {"tag": tag()})
    assert refused.error["code"] == -32603
    assert "max_concurrency" in refused.error["message"] and "on_limit: refuse" in refused.error["message"]
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)


async def test_a_rule_that_limits_any_name_keeps_no_slots_for_names_no_call_uses(make_proxy, mcp_upstream):
    """Under a rule matching any name with max_concurrency, each tool name gets its own slots: they go with the
    name's last call, so the names a client makes up leave nothing behind, and the limit still holds for each."""
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "made_up_*", "max_concurrency": 1}])
    admission = proxy.app[runner_key]._admission
    created = [await proxy.client.call_tool(f"made_up_{i}", {}) for i in range(20)]
    for reply in created:  # the upstream has no such tool: each task fails, and its job ends
        await task_reaches(proxy.client, reply.result["taskId"], "failed", "completed")

    async def emptied() -> bool:
        return not proxy.app[runner_key]._state.jobs

    await eventually(emptied, what="the jobs leaving the table")
    assert admission._slots == {}  # before: one Semaphore per name, for ever


async def test_a_call_does_not_outlive_its_tasks_time_to_live(make_proxy, mcp_upstream, upstream_client):
    """With the memory store, a task's record goes when its TTL ends: its call goes with it (cancelled upstream),
    rather than run on for timeout_s, counted against its caller, for an outcome nobody can read."""
    proxy = await make_proxy(
        mcp_upstream, tools=[{"match": "gated", "ttl_ms": 300}], limits={"max_tasks_per_principal": 1}
    )
    runner = proxy.app[runner_key]
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate}, headers=ALICE)
    assert created.result["resultType"] == "task"

    async def gone() -> bool:
        return not runner._state.jobs

    await eventually(gone, timeout_s=10, what="the call ending with its task's TTL")
    assert runner._admission._per_caller == {}
    again = await proxy.client.call_tool("gated", {"tag": tag()}, headers=ALICE)  # its place is free again
    assert again.result["resultType"] == "task", again.message
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)


async def test_oversized_result_fails_the_task_and_names_the_limit(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_report"}], limits={"max_result_bytes": 100})
    created = await proxy.client.call_tool("slow_report", {"topic": "a long topic " * 10, "seconds": 0})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed", "completed")
    assert failed.result["status"] == "failed"
    assert "exceeds limits.max_result_bytes (100)" in failed.result["statusMessage"]


async def test_an_oversized_result_of_a_2025_server_fails_the_task_too(make_proxy, legacy_upstream):
    """A bridged answer is not measured as it passes (a client's call is bounded as it is read); a task's result
    is, whichever era's server gave it."""
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "slow"}], limits={"max_result_bytes": 60})
    created = await proxy.client.call_tool("slow", {"seconds": 0})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed", "completed")
    assert failed.result["status"] == "failed"
    assert "exceeds limits.max_result_bytes (60)" in failed.result["statusMessage"]


async def test_polling_faster_than_allowed_gets_429_with_the_interval(make_proxy, mcp_upstream):
    from tests.test_store import FakeTimer

    timer = FakeTimer()
    proxy = await make_proxy(
        mcp_upstream, timer=timer, tools=[{"match": "slow_report"}],
        tasks={"poll_interval_ms": 1500}, limits={"min_poll_interval_ms": 1000},
    )  # fmt: skip
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    task_id = created.result["taskId"]
    assert (await proxy.client.get_task(task_id)).status == 200
    too_fast = await proxy.client.get_task(task_id)
    assert too_fast.status == 429
    assert too_fast.error["data"] == {"pollIntervalMs": 1500}
    timer.advance(1.1)
    assert (await proxy.client.get_task(task_id)).status == 200


async def _answer_anything(request: web.Request) -> web.Response:
    request_id = (await request.json())["id"]  # the request's own: the proxy refuses an answer to another
    return web.json_response({"jsonrpc": "2.0", "id": request_id, "result": {"resultType": "complete", "tools": []}})


@pytest.mark.parametrize(
    "headers, status",
    [
        ({"Host": "evil.example"}, 421),
        ({"Host": "evil.example:8080"}, 421),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "http://localhost:3000"}, 200),
        ({"Origin": "http://127.0.0.1"}, 200),
        ({"Host": "localhost:9999"}, 200),
    ],
    ids=["host", "host-port", "origin", "loopback-origin", "loopback-origin-no-port", "loopback-host"],
)
async def test_host_and_origin_checks_on_loopback(make_proxy, fake_upstream, headers, status):
    fake = await fake_upstream(_answer_anything)
    proxy = await make_proxy(fake.url, protocol="modern")
    reply = await proxy.client.call("tools/list", headers=headers)
    assert reply.status == status
    if status != 200:
        assert reply.error["code"] == -32600


async def test_configured_hosts_and_origins(make_proxy, fake_upstream):
    fake = await fake_upstream(_answer_anything)
    security = {"allowed_hosts": ["mcp.internal", "127.0.0.1"], "allowed_origins": ["https://app.example"]}
    proxy = await make_proxy(fake.url, protocol="modern", security=security)
    assert (await proxy.client.call("tools/list", headers={"Host": "mcp.internal"})).status == 200
    assert (await proxy.client.call("tools/list", headers={"Origin": "https://app.example"})).status == 200
    assert (await proxy.client.call("tools/list", headers={"Origin": "http://localhost"})).status == 403


async def test_a_misbehaving_caller_does_not_disturb_another(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_report"}], limits={"max_body_bytes": 2048})

    async def hostile():
        for body in (b"{", b"[" * 1500, b'{"jsonrpc":"2.0","id":1,"method":7}', b"x" * 4096):
            await proxy.client.post_raw(body, {"Content-Type": "application/json"})

    async def honest():
        created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0}, headers=ALICE)
        return await task_reaches(proxy.client, created.result["taskId"], "completed", headers=ALICE)

    _, done = await asyncio.gather(hostile(), honest())
    assert done.result["result"]["content"][0]["text"].startswith("Report on t")


async def test_kept_credential_hashes_follow_the_key_the_replicas_agree_on():
    """A replica keeps the hashes of the credentials it sees; when the store's key replaces its own, none made
    with the old key answers again, or a caller would own its tasks under two names across replicas."""
    import hashlib
    import hmac

    from mcp_tasks_proxy.config import SecurityConfig
    from mcp_tasks_proxy.security import Identity

    class KeyStore:  # the one store call agree() makes; the stores' own is tested in test_store_contract.py
        def __init__(self, key: str) -> None:
            self.key = key

        async def shared_secret(self, name: str, mine: str) -> str:
            return self.key

    def expected(key: str, value: str) -> str:
        return hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()[:32]

    identity = Identity(SecurityConfig(), shared_store=True)
    long_token = "Bearer " + "x" * 5000  # past the kept length: hashed every time, alike
    for key in ("first-key", "second-key"):
        await identity.agree(KeyStore(key))  # type: ignore[arg-type]
        for _ in range(2):  # the second time from what was kept
            assert identity.credential(ALICE) == expected(key, "authorization:" + ALICE["Authorization"])
            assert identity.credential({"Authorization": long_token}) == expected(key, "authorization:" + long_token)
            assert identity.principal(BOB) == expected(key, "authorization:" + BOB["Authorization"])


def test_a_stdio_childs_wrapped_request_state_is_bound_and_survives_any_string():
    from mcp_tasks_proxy.clients.parking import ChildStates, parked_owner

    states = ChildStates()
    states.owner = lambda: "replica-1"
    sealed = states.seal("v1.\ud800 ünïcode", 2, "alice|tools/call|t")  # a child's state may hold anything
    assert states.owns(sealed) and parked_owner(sealed) == "replica-1"
    assert states.open(sealed, "alice|tools/call|t") == (2, "v1.\ud800 ünïcode")
    assert states.open(sealed, "bob|tools/call|t") is None  # another caller's
    assert states.open("mtp1c.\ud800~0-eA.x", "alice|tools/call|t") is None  # forged: invalid, no traceback
