"""Tasks end to end: a real `mcp` 2.x upstream that knows nothing of tasks, behind the proxy, over loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from tests.conftest import eventually, task_reaches
from tests.factories import TASKS, meta
from tests.schemas import validate, validate_error, validate_response


@pytest.fixture
def front(both_fronts: str) -> str:
    """Every test here runs through both readers, the lane and aiohttp's server (tests/conftest.py)."""
    return both_fronts


TASK_RULES = [
    {"match": "slow_*", "task": "optional"},
    {"match": "gated", "task": "optional"},
    {"match": "failing_job", "task": "optional"},
    {"match": "protocol_error_job", "task": "optional"},
    {"match": "echo_authorization", "task": "optional"},
    {"match": "add", "task": "never"},
]


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    return await make_proxy(mcp_upstream, tools=TASK_RULES, tasks={"poll_interval_ms": 50})


def tag() -> str:
    return secrets.token_hex(6)


async def test_slow_call_becomes_task_and_completes_with_the_upstream_result(proxy, upstream_client):
    # SEP-2663 task creation: CreateTaskResult at once; tasks/get then answers the full CallToolResult.
    created = await proxy.client.call_tool("slow_report", {"topic": "tides", "seconds": 0.2})
    assert created.status == 200
    validate_response(created.message, "CreateTaskResult")
    task = created.result
    assert task["resultType"] == "task"
    assert task["status"] == "working"
    assert task["ttlMs"] == 3_600_000 and task["pollIntervalMs"] == 50
    assert "result" not in task and "requestState" not in task

    done = await task_reaches(proxy.client, task["taskId"], "completed")
    validate_response(done.message, "GetTaskResult")
    validate(done.result, "CompletedTask")
    assert done.result["resultType"] == "complete"
    validate(done.result["result"], "CallToolResult", "core")
    direct = await upstream_client.call_tool("slow_report", {"topic": "tides", "seconds": 0}, tasks=False)
    assert done.result["result"]["content"][0]["text"] == "Report on tides: all 5 steps done in 0.2 s."
    assert done.result["result"].keys() == direct.result.keys()
    assert done.result["createdAt"] == task["createdAt"]
    assert done.result["lastUpdatedAt"] >= task["lastUpdatedAt"]


async def test_progress_becomes_status_message_while_working(proxy):
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]

    async def message_seen():
        reply = await proxy.client.get_task(task_id)
        return reply if reply.result.get("statusMessage") == f"waiting at gate {gate}" else None

    working = await eventually(message_seen, what="statusMessage from upstream progress")
    assert working.result["status"] == "working"
    validate(working.result, "WorkingTask")
    await proxy.client.call_tool("release", {"tag": gate}, tasks=False)
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == f"gate {gate} opened"


async def test_tool_error_is_a_completed_task_with_is_error(proxy):
    created = await proxy.client.call_tool("failing_job", {"reason": "disk full"})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed"
    assert done.result["result"]["isError"] is True
    validate(done.result, "CompletedTask")


async def test_upstream_jsonrpc_error_is_a_failed_task_with_that_error(proxy):
    created = await proxy.client.call_tool("protocol_error_job")
    done = await task_reaches(proxy.client, created.result["taskId"], "failed")
    validate(done.result, "FailedTask")
    assert done.result["error"] == {
        "code": -32602,
        "message": "the job's parameters were rejected",
        "data": {"field": "none"},
    }
    assert "JSON-RPC error -32602" in done.result["statusMessage"]


async def test_cancel_stops_the_upstream_work_and_the_state_never_changes_again(proxy, upstream_client):
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]

    async def started():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "started"

    await eventually(started, what="the upstream call starting")
    ack = await proxy.client.cancel_task(task_id)
    assert ack.status == 200
    assert ack.result == {"resultType": "complete"}
    validate_response(ack.message, "CancelTaskResult")

    got = await proxy.client.get_task(task_id)
    assert got.result["status"] == "cancelled"
    validate(got.result, "CancelledTask")

    async def upstream_cancelled():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "cancelled"

    # Closing the upstream stream is how 2026-07-28 HTTP cancels: the tool itself must see it.
    await eventually(upstream_cancelled, what="the upstream tool being cancelled")
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    again = await proxy.client.cancel_task(task_id)
    assert again.result == {"resultType": "complete"}
    assert (await proxy.client.get_task(task_id)).result["status"] == "cancelled"


async def test_cancel_after_completion_keeps_completed(proxy):
    created = await proxy.client.call_tool("slow_report", {"topic": "x", "seconds": 0})
    task_id = created.result["taskId"]
    await task_reaches(proxy.client, task_id, "completed")
    ack = await proxy.client.cancel_task(task_id)
    assert ack.result == {"resultType": "complete"}
    assert (await proxy.client.get_task(task_id)).result["status"] == "completed"


async def test_optional_tool_without_the_extension_passes_through_synchronously(proxy, upstream_client):
    via_proxy = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0}, tasks=False)
    direct = await upstream_client.call_tool("slow_report", {"topic": "t", "seconds": 0}, tasks=False)
    assert via_proxy.status == direct.status == 200
    assert via_proxy.result == direct.result
    assert via_proxy.result["resultType"] == "complete"


async def test_required_tool_without_the_extension_is_minus_32021(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_report", "task": "required"}])
    reply = await proxy.client.call_tool("slow_report", {"topic": "t"}, tasks=False)
    assert reply.status == 400
    validate_error(reply.message, "MissingRequiredClientCapabilityError")
    assert reply.error["data"] == {"requiredCapabilities": {"extensions": {TASKS: {}}}}
    assert "slow_report" in reply.error["message"]
    # With the extension, the same call is a task.
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    assert created.result["resultType"] == "task"


async def test_never_rule_and_unmatched_tools_pass_through_even_with_the_extension(proxy):
    reply = await proxy.client.call_tool("add", {"a": 2, "b": 40})
    assert reply.result["structuredContent"] == {"result": 42}
    assert "taskId" not in reply.result


async def test_sync_window_returns_a_fast_result_directly(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "*", "sync_window_ms": 30_000}])
    reply = await proxy.client.call_tool("add", {"a": 1, "b": 2})
    assert reply.result["resultType"] == "complete"
    assert reply.result["structuredContent"] == {"result": 3}
    failed = await proxy.client.call_tool("protocol_error_job")
    assert failed.error["code"] == -32602


async def test_sync_window_turns_a_slow_call_into_a_task_that_keeps_its_progress(make_proxy, mcp_upstream):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "sync_window_ms": 300}])
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate})
    assert created.result["resultType"] == "task"
    validate_response(created.message, "CreateTaskResult")
    task_id = created.result["taskId"]
    await proxy.client.call_tool("release", {"tag": gate}, tasks=False)
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == f"gate {gate} opened"


async def test_timeout_fails_the_task_with_a_message_naming_the_limit(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "timeout_s": 0.3}])
    gate = tag()
    created = await proxy.client.call_tool("gated", {"tag": gate})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    validate(failed.result, "FailedTask")
    assert failed.result["error"]["code"] == -32603
    assert "0.3 s limit (timeout_s)" in failed.result["statusMessage"]

    async def upstream_cancelled():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "cancelled"

    await eventually(upstream_cancelled, what="the timed-out upstream call being stopped")


async def test_background_call_carries_the_callers_credentials(proxy):
    created = await proxy.client.call_tool("echo_authorization", headers={"Authorization": "Bearer sekrit"})
    done = await task_reaches(
        proxy.client, created.result["taskId"], "completed", headers={"Authorization": "Bearer sekrit"}
    )
    assert done.result["result"]["structuredContent"] == {"result": "Bearer sekrit"}


async def test_task_ids_are_unique_and_carry_128_random_bits(proxy):
    ids = set()
    for _ in range(20):
        created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
        ids.add(created.result["taskId"])
    assert len(ids) == 20
    for task_id in ids:
        assert len(task_id) >= 22  # base64 of 16 random bytes


async def test_discover_advertises_the_extension(proxy, upstream_client):
    reply = await proxy.client.call("server/discover")
    validate_response(reply.message, "DiscoverResult", "core")
    assert reply.result["capabilities"]["extensions"][TASKS] == {}
    direct = await upstream_client.call("server/discover", tasks=False)
    assert TASKS not in direct.result["capabilities"].get("extensions", {})
    # Everything else is the upstream's own.
    for key in ("supportedVersions", "cacheScope", "ttlMs", "_meta"):
        assert reply.result[key] == direct.result[key]


async def test_unsupported_protocol_version_on_a_task_request_is_minus_32022(proxy):
    params = {"name": "slow_report", "arguments": {"topic": "t"}, "_meta": meta(version="1900-01-01")}
    reply = await proxy.client.call("tools/call", params, headers={"MCP-Protocol-Version": "1900-01-01"})
    assert reply.status == 400
    validate_error(reply.message, "UnsupportedProtocolVersionError")
    assert reply.error["data"] == {"supported": ["2026-07-28"], "requested": "1900-01-01"}


async def test_expired_task_answers_minus_32602(make_proxy, mcp_upstream):
    from tests.test_store import FakeTimer

    timer = FakeTimer()
    proxy = await make_proxy(mcp_upstream, timer=timer, tools=[{"match": "slow_*", "ttl_ms": 60_000}])
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    task_id = created.result["taskId"]
    assert created.result["ttlMs"] == 60_000
    await task_reaches(proxy.client, task_id, "completed")
    timer.advance(59)
    assert (await proxy.client.get_task(task_id)).status == 200
    timer.advance(2)
    gone = await proxy.client.get_task(task_id)
    assert gone.status == 400 and gone.error["code"] == -32602


async def test_full_store_refuses_new_tasks_with_a_clear_error_and_keeps_running_ones(
    make_proxy, mcp_upstream, upstream_client
):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated"}], tasks={"max_tasks": 2})
    gates = [tag(), tag()]
    created = [await proxy.client.call_tool("gated", {"tag": g}) for g in gates]
    refused = await proxy.client.call_tool("gated", {"tag": tag()})
    assert refused.error["code"] == -32603
    assert "task capacity reached: 2 tasks are running" in refused.error["message"]
    for gate, reply in zip(gates, created, strict=True):
        await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
        await task_reaches(proxy.client, reply.result["taskId"], "completed")
    # Finished tasks make room: the oldest is evicted for the next one.
    last_gate = tag()
    again = await proxy.client.call_tool("gated", {"tag": last_gate})
    assert again.result["resultType"] == "task"
    await upstream_client.call_tool("release", {"tag": last_gate}, tasks=False)
    assert (await proxy.client.get_task(created[0].result["taskId"])).status == 400
    assert (await proxy.client.get_task(created[1].result["taskId"])).result["status"] == "completed"


async def test_client_leaving_inside_the_sync_window_cancels_the_upstream_call(
    make_proxy, mcp_upstream, upstream_client
):
    import aiohttp

    from tests.factories import headers_for, request

    proxy = await make_proxy(mcp_upstream, tools=[{"match": "gated", "sync_window_ms": 60_000}])
    gate = tag()
    message = request("tools/call", {"name": "gated", "arguments": {"tag": gate}, "_meta": meta()})

    async def started():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "started"

    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(session.post(proxy.url, json=message, headers=headers_for(message)))
        await eventually(started, what="the upstream call starting")
        pending.cancel()  # the client gives up inside the window and closes its connection
        with contextlib.suppress(asyncio.CancelledError):
            await pending

    async def cancelled():
        state = await upstream_client.call_tool("gate_state", {"tag": gate}, tasks=False)
        return state.result["structuredContent"]["result"] == "cancelled"

    await eventually(cancelled, what="the upstream call being cancelled")
