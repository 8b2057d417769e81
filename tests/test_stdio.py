"""stdio upstreams: the proxy starts the server itself (upstream.command) and speaks MCP over its stdin and stdout.

Real servers over stdio: the Python SDK 1.x FastMCP server (2025-11-25: elicitation, sampling, roots requests,
progress), the SDK 2.x server (2026-07-28: MRTR), and npm server-everything in its stdio mode. tests/stdio_hostile.py
only injects faults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from mcp_tasks_proxy.front.context import gateway_key
from tests.conftest import EVERYTHING, PROXY, ROOT, eventually, everything_node, legacy_python, task_reaches
from tests.factories import McpClient, meta, request
from tests.schemas import validate_response
from tests.test_real_clients import sdk1_call

ELICIT = {"elicitation": {}}
RULES = [{"match": name, "task": "optional"} for name in ("ask_*", "gated", "slow", "slow_report", "one_question")]


def legacy_command() -> list[str]:
    return [str(legacy_python()), str(ROOT / "tests" / "legacy_server.py"), "--stdio"]


def modern_command() -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "upstream_server.py"), "--stdio"]


def everything_command() -> list[str]:
    script = EVERYTHING / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    return [str(everything_node()), str(script), "stdio"]


def hostile_command(mode: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "stdio_hostile.py"), mode]


async def ready(proxy, *, timeout_s: float = 60.0) -> dict:
    async def check():
        async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
            return await response.json() if response.status == 200 else None

    return await eventually(check, timeout_s=timeout_s, what="the stdio server ready")


async def readiness(proxy) -> tuple[int, dict]:
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/readyz")) as response:
        return response.status, await response.json()


def text_of(reply) -> str:
    return (
        reply.result["result"]["content"][0]["text"] if "result" in reply.result else reply.result["content"][0]["text"]
    )


async def stdio_proxy(make_proxy, command, **sections):
    sections.setdefault("tools", RULES)
    sections.setdefault("tasks", {"poll_interval_ms": 50})
    proxy = await make_proxy(command, **sections)
    await ready(proxy)
    return proxy


async def tool_text(proxy, name: str, arguments: dict | None = None, **kw) -> str:
    reply = await proxy.client.call_tool(name, arguments or {}, tasks=False, **kw)
    assert "result" in reply.message, reply.message
    return reply.result["content"][0]["text"]


async def one_round(proxy, tool: str, arguments: dict, caps: dict, method: str, answer: dict) -> dict:
    """A task of `tool` that asks one question of `method`, answered with `answer`: the completed task."""
    created = await proxy.client.call("tools/call", {"name": tool, "arguments": arguments, "_meta": meta(**caps)})
    validate_response(created.message, "CreateTaskResult")
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == method, question
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: answer}})
    return (await task_reaches(proxy.client, task_id, "completed")).result


ACCEPT = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


async def open_2025_session(proxy, *, capabilities: dict | None = None, **extra: str) -> dict:
    """A 2025-11-25 client's initialize through the proxy: the headers of its later requests (`extra` included)."""
    init = request(
        "initialize",
        {
            "protocolVersion": "2025-11-25",
            "capabilities": capabilities or {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    )
    async with proxy.client.session.post(proxy.url, json=init, headers={**ACCEPT, **extra}) as response:
        session_id = response.headers["Mcp-Session-Id"]
    return {**ACCEPT, **extra, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}


# --- a 2025-era server (SDK 1.x FastMCP) --------------------------------------------------------------------------


@pytest.fixture
async def legacy(make_proxy):
    return await stdio_proxy(make_proxy, legacy_command())


async def test_legacy_task_with_progress_and_elicitation_as_input_requests(legacy):
    answer = {"action": "accept", "content": {"name": "Ada"}}
    done = await one_round(legacy, "ask_name", {}, ELICIT, "elicitation/create", answer)
    assert done["result"]["content"][0]["text"] == "hello Ada"

    gate = secrets.token_hex(4)
    created = await legacy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]

    async def waiting():
        reply = await legacy.client.get_task(task_id)
        return reply.result.get("statusMessage") == f"waiting at gate {gate}"

    await eventually(waiting, what="the child's progress as statusMessage")
    await legacy.client.cancel_task(task_id)

    async def cancelled_in_the_child():
        return await tool_text(legacy, "gate_state", {"tag": gate}) == "cancelled"

    # The gates live in the one child the proxy runs: notifications/cancelled reached it.
    await eventually(cancelled_in_the_child, what="notifications/cancelled reaching the child")


async def test_legacy_sampling_and_roots_reach_the_client_that_asked(legacy):
    caps = {"sampling": {}, "roots": {}}
    answer = {"role": "assistant", "content": {"type": "text", "text": "Paris"}, "model": "m"}
    done = await one_round(legacy, "ask_model", {}, caps, "sampling/createMessage", answer)
    assert done["result"]["content"][0]["text"] == "model said Paris"
    answer = {"roots": [{"uri": "file:///home/user/project", "name": "project"}]}
    done = await one_round(legacy, "ask_roots", {}, caps, "roots/list", answer)
    assert done["result"]["content"][0]["text"] == "file:///home/user/project"

    # Undeclared: the child is told no by the proxy (sampling as -32601, elicitation declined).
    created = await legacy.client.call("tools/call", {"name": "ask_model", "arguments": {}, "_meta": meta()})
    assert (
        text_of(await task_reaches(legacy.client, created.result["taskId"], "completed")) == "sampling refused: -32601"
    )


async def test_a_2025_client_does_its_own_initialize_through_the_proxy(legacy):
    # The SDK 1.x client initializes, calls with progress, and DELETEs its session; the child never sees any of it.
    done = await sdk1_call(legacy.url, "slow", {"seconds": 0.3}, "--progress")
    assert done == {"text": "slept 0.3 s", "isError": False}, done
    plain = await sdk1_call(legacy.url, "add", {"a": 2, "b": 3})
    assert plain["text"] == "5", plain
    # Its client declared no elicitation: the child's question is declined for it alone.
    declined = await sdk1_call(legacy.url, "ask_name", {})
    assert declined["text"] == "no name (decline)", declined


async def test_a_2025_session_is_the_proxys_and_ends_with_delete(legacy):
    session = legacy.client.session
    init = request(
        "initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    )
    async with session.post(legacy.url, json=init, headers=ACCEPT) as response:
        answer = await response.json()
        session_id = response.headers["Mcp-Session-Id"]
    assert answer["result"]["protocolVersion"] == "2025-06-18"  # the client's version, which the proxy speaks
    assert answer["result"]["serverInfo"]["name"] == "legacy-example"
    headers = {**ACCEPT, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-06-18"}
    call = request("tools/call", {"name": "add", "arguments": {"a": 1, "b": 1}})
    async with session.post(legacy.url, json=call, headers=headers) as response:
        assert response.status == 200
    async with session.post(legacy.url, json=call, headers=ACCEPT) as response:
        assert response.status == 400  # no session
    async with session.delete(legacy.url, headers=headers) as response:
        assert response.status == 200
    async with session.post(legacy.url, json=call, headers=headers) as response:
        assert response.status == 404  # ended: a client initializes again


async def test_fifty_concurrent_calls_from_three_principals_never_cross(make_proxy):
    proxy = await stdio_proxy(
        make_proxy, legacy_command(), security={"principal": "header", "principal_header": "X-User"}
    )

    async def one(n: int) -> None:
        user = f"user-{n % 3}"
        headers = {"X-User": user}
        if n % 2:  # a task, polled to its end
            created = await proxy.client.call_tool("slow", {"seconds": 0.05 * (n % 4)}, headers=headers)
            done = await task_reaches(proxy.client, created.result["taskId"], "completed", headers=headers)
            assert text_of(done) == f"slept {0.05 * (n % 4):g} s"
        else:  # a synchronous call through the relay
            reply = await proxy.client.call_tool("add", {"a": n, "b": 1000}, tasks=False, headers=headers)
            assert reply.result["content"][0]["text"] == str(n + 1000)

    await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(50))), 120)


async def _ask_two_at_once(proxy) -> list:
    created = [
        await proxy.client.call("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)})
        for _ in range(2)
    ]
    return [await task_reaches(proxy.client, c.result["taskId"], "input_required", "completed") for c in created]


async def test_two_calls_asking_at_once_on_one_shared_child_cannot_be_told_apart(legacy):
    # Nothing on stdio says which call a question is for: with two in flight the proxy refuses rather than guess.
    gate = secrets.token_hex(4)
    held = await legacy.client.call_tool("gated", {"tag": gate})
    await eventually(lambda: _gate_is(legacy, gate, "started"), what="a first call in flight")
    created = await legacy.client.call("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)})
    refused = await task_reaches(legacy.client, created.result["taskId"], "completed", "input_required")
    assert refused.result["status"] == "completed", refused.result  # the tool went on with the refusal
    assert "2 calls are in flight on the stdio server" in text_of(refused), refused.result
    await tool_text(legacy, "release", {"tag": gate})
    await task_reaches(legacy.client, held.result["taskId"], "completed")


async def test_exclusive_dispatch_gives_each_asking_call_a_child_of_its_own(make_proxy):
    stdio = {"children": 1, "max_children": 2, "dispatch": "exclusive"}
    proxy = await stdio_proxy(make_proxy, legacy_command(), upstream={"stdio": stdio})
    asking = await _ask_two_at_once(proxy)
    assert [reply.result["status"] for reply in asking] == ["input_required", "input_required"]
    assert len(proxy.app[gateway_key].relay.pool.channels) == 2  # the second started for the second asking call
    # A third asking call, past max_children, waits for a free child instead of being refused.
    third = await proxy.client.call("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)})
    await asyncio.sleep(0.5)
    assert (await proxy.client.get_task(third.result["taskId"])).result["status"] == "working"
    for reply, name in zip(asking, ("Ada", "Grace"), strict=True):
        ((key, _),) = reply.result["inputRequests"].items()
        answer = {"action": "accept", "content": {"name": name}}
        await proxy.client.call("tasks/update", {"taskId": reply.result["taskId"], "inputResponses": {key: answer}})
    for reply, name in zip(asking, ("Ada", "Grace"), strict=True):
        assert text_of(await task_reaches(proxy.client, reply.result["taskId"], "completed")) == f"hello {name}"
    waited = await task_reaches(proxy.client, third.result["taskId"], "input_required")
    ((key, _),) = waited.result["inputRequests"].items()
    answer = {"action": "accept", "content": {"name": "Hopper"}}
    await proxy.client.call("tasks/update", {"taskId": third.result["taskId"], "inputResponses": {key: answer}})
    assert text_of(await task_reaches(proxy.client, third.result["taskId"], "completed")) == "hello Hopper"


async def test_a_killed_child_fails_its_calls_then_comes_back(make_proxy):
    proxy = await stdio_proxy(make_proxy, legacy_command(), upstream={"stdio": {"restart_min_s": 0.2}})
    pid = int(await tool_text(proxy, "pid"))
    gate = secrets.token_hex(4)
    created = await proxy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]
    await task_reaches(proxy.client, task_id, "working")
    # A task is working from its creation, before its call reaches the child: killed earlier, the call would find
    # no child to write to (another failure, "not running"), not lose the one it runs in.
    await eventually(lambda: _gate_is(proxy, gate, "started"), what="the call running in the child")
    os.kill(pid, signal.SIGKILL)
    failed = await task_reaches(proxy.client, task_id, "failed")
    error = failed.result["error"]
    assert "exited with status -9" in error["message"], error
    assert error["data"]["exitStatus"] == -9
    assert isinstance(error["data"]["stderr"], list)
    await ready(proxy)  # restarted, initialized again
    assert int(await tool_text(proxy, "pid")) != pid
    assert await tool_text(proxy, "add", {"a": 1, "b": 2}) == "3"


# --- a 2026-07-28 server (SDK 2.x) --------------------------------------------------------------------------------


async def test_modern_child_mrtr_progress_and_cancel(make_proxy):
    proxy = await stdio_proxy(make_proxy, modern_command())
    reply = await proxy.client.call("server/discover")
    validate_response(reply.message, "DiscoverResult", "core")

    answer = {"action": "accept", "content": {"answer": "42"}}
    done = await one_round(proxy, "one_question", {}, ELICIT, "elicitation/create", answer)
    assert done["result"]["content"][0]["text"] == "you said 42"

    created = await proxy.client.call_tool("slow_report", {"topic": "tides", "seconds": 1})
    task_id = created.result["taskId"]

    async def progressed():
        reply = await proxy.client.get_task(task_id)
        return reply.result.get("statusMessage") or reply.result["status"] == "completed"

    await eventually(progressed, what="the modern child's progress as statusMessage")
    await task_reaches(proxy.client, task_id, "completed")

    gate = secrets.token_hex(4)
    created = await proxy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]
    await eventually(lambda: _gate_is(proxy, gate, "started"), what="the modern call starting in the child")
    await proxy.client.cancel_task(task_id)
    await eventually(lambda: _gate_is(proxy, gate, "cancelled"), what="notifications/cancelled reaching the child")


async def test_modern_child_listen_notifications_merge_with_task_notifications(make_proxy):
    from tests.test_listen import SUB, Subscription, subscribe

    proxy = await stdio_proxy(make_proxy, modern_command())
    gate = secrets.token_hex(4)
    task = (await proxy.client.call_tool("gated", {"tag": gate})).result
    message, response = await subscribe(proxy, [task["taskId"]], toolsListChanged=True)
    stream = Subscription(response)
    ack = await stream.next()
    assert ack["params"]["notifications"] == {"toolsListChanged": True, "taskIds": [task["taskId"]]}
    await stream.next()  # the task's current state
    await tool_text(proxy, "announce_tools_changed")
    changed = await stream.next()
    # The child's notification carried its subscription id (the proxy's id for the child); the client sees its own.
    assert changed["method"] == "notifications/tools/list_changed", changed
    assert changed["params"]["_meta"] == {SUB: message["id"]}
    await tool_text(proxy, "release", {"tag": gate})
    done = await stream.next()
    assert done["method"] == "notifications/tasks" and done["params"]["status"] == "completed"
    response.close()


async def _gate_is(proxy, gate: str, state: str) -> bool:
    return await tool_text(proxy, "gate_state", {"tag": gate}) == state


# --- server-everything over stdio ---------------------------------------------------------------------------------


@pytest.fixture
async def everything(make_proxy):
    rules = [
        {"match": name, "task": "optional"}
        for name in ("trigger-long-running-operation", "trigger-elicitation-request", "trigger-sampling-request")
    ]
    return await stdio_proxy(make_proxy, everything_command(), tools=rules)


async def test_everything_over_stdio_tasks_with_progress_elicitation_and_sampling(everything):
    created = await everything.client.call_tool("trigger-long-running-operation", {"duration": 1, "steps": 2})
    task_id = created.result["taskId"]
    done = await task_reaches(everything.client, task_id, "completed")
    assert "Long running operation completed" in text_of(done)

    done = await one_round(
        everything, "trigger-elicitation-request", {}, ELICIT, "elicitation/create", {"action": "decline"}
    )
    assert "decline" in json.dumps(done["result"]).lower()
    answer = {"role": "assistant", "content": {"type": "text", "text": "sampled!"}, "model": "m"}
    done = await one_round(
        everything, "trigger-sampling-request", {"prompt": "hi"}, {"sampling": {}}, "sampling/createMessage", answer
    )
    assert "sampled!" in json.dumps(done["result"])


async def test_everything_over_stdio_serves_2025_clients(everything):
    done = await sdk1_call(everything.url, "echo", {"message": "hi"})
    assert done == {"text": "Echo: hi", "isError": False}, done
    # A durable call (the policy's tool, a 2025 client with an event stream) with progress.
    slow = await sdk1_call(everything.url, "trigger-long-running-operation", {"duration": 1, "steps": 2}, "--progress")
    assert "Long running operation completed" in slow["text"], slow
    # server-everything's own SEP-1686 tasks pass through to a SEP-1686 client, untouched.
    research = await sdk1_call(
        everything.url, "simulate-research-query", {"topic": "tides", "ambiguous": False}, "--as-task", timeout_s=60
    )
    assert "tides" in research["text"], research


async def test_the_childs_own_tasks_are_each_sessions_own(everything):
    session = everything.client.session

    async def post(message: dict, headers: dict) -> dict:
        async with session.post(everything.url, json=message, headers=headers) as response:
            raw = await response.read()
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            return json.loads(events[-1])
        return json.loads(raw)

    alice, bob = await open_2025_session(everything), await open_2025_session(everything)
    arguments = {"topic": "tides", "ambiguous": False}
    created = await post(
        request("tools/call", {"name": "simulate-research-query", "arguments": arguments, "task": {"ttl": 60000}}),
        alice,
    )
    task_id = created["result"]["task"]["taskId"]
    assert "result" in await post(request("tasks/get", {"taskId": task_id}), alice)
    refused = await post(request("tasks/get", {"taskId": task_id}), bob)
    assert refused["error"]["code"] == -32602, refused  # as an unknown id: nothing says it exists
    listed = await post(request("tasks/list", {}), bob)
    assert task_id not in json.dumps(listed), listed
    assert task_id in json.dumps(await post(request("tasks/list", {}), alice))


# --- faults -------------------------------------------------------------------------------------------------------


async def test_a_child_that_dies_mid_call_fails_it_with_its_status_and_stderr(make_proxy):
    proxy = await stdio_proxy(
        make_proxy,
        hostile_command("die_mid_call"),
        tools=[{"match": "sleep"}],
        upstream={"stdio": {"restart_min_s": 0.2}},
    )
    created = await proxy.client.call_tool("sleep", {"seconds": 5})
    failed = await task_reaches(proxy.client, created.result["taskId"], "failed")
    error = failed.result["error"]
    assert error["data"]["exitStatus"] == 3, error
    assert "dying now" in error["data"]["stderr"], error
    await ready(proxy)
    assert await tool_text(proxy, "echo", {"text": "back"}) == "back"


async def test_a_child_that_exits_at_start_keeps_the_proxy_not_ready(make_proxy):
    proxy = await make_proxy(
        hostile_command("exit_at_start"), upstream={"stdio": {"restart_min_s": 0.2, "start_timeout_s": 1}}
    )

    async def not_ready_with_reason():
        status, body = await readiness(proxy)
        return status == 503 and ("exited with status 2" in body["upstream"] or "not" in body["upstream"])

    await eventually(not_ready_with_reason, what="/readyz saying why the child is down")
    reply = await proxy.client.call_tool("echo", {"text": "x"}, tasks=False)
    assert reply.message["error"]["code"] == -32603, reply.message
    assert reply.message["error"]["message"].count("Upstream failure") == 1, reply.message


async def test_a_child_that_exits_on_its_first_request_is_named_once_in_the_error(make_proxy):
    """The era probe's answer (the channel's own error, "Upstream failure: the stdio server exited...") was prefixed
    again: "Upstream failure: Upstream failure: ..."."""
    command = [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)"]
    proxy = await make_proxy(command, upstream={"stdio": {"restart_min_s": 5, "start_timeout_s": 5}})
    reply = await proxy.client.call_tool("echo", {"text": "x"}, tasks=False)
    assert reply.message["error"]["message"] == "Upstream failure: the stdio server exited with status 3"


async def test_a_child_that_never_answers_is_not_ready_and_calls_fail_in_time(make_proxy):
    proxy = await make_proxy(hostile_command("never_answers"), upstream={"stdio": {"start_timeout_s": 1}})
    status, body = await readiness(proxy)
    assert status == 503, body
    reply = await asyncio.wait_for(proxy.client.call_tool("echo", {"text": "x"}, tasks=False), 30)
    assert reply.message["error"]["code"] == -32603, reply.message
    assert "initialize" in reply.message["error"]["message"] or "1 s" in reply.message["error"]["message"]


@pytest.mark.parametrize("mode", ["banner", "stderr_flood"])
async def test_banners_and_a_stderr_flood_do_not_stop_the_child(make_proxy, mode):
    proxy = await stdio_proxy(make_proxy, hostile_command(mode), tools=[])
    assert await tool_text(proxy, "echo", {"text": "fine"}) == "fine"


async def test_a_line_over_the_limit_fails_its_call_and_the_next_works(make_proxy):
    proxy = await stdio_proxy(
        make_proxy, hostile_command("long_line"), tools=[], limits={"max_result_bytes": 1_000_000}
    )
    reply = await asyncio.wait_for(proxy.client.call_tool("echo", {"text": "flood"}, tasks=False), 60)
    assert reply.message["error"]["code"] == -32603, reply.message
    assert "max_line_bytes" in reply.message["error"]["message"]
    assert await tool_text(proxy, "echo", {"text": "after"}) == "after"


async def test_a_million_junk_lines_are_skipped(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("junk_lines"), tools=[])
    reply = await asyncio.wait_for(proxy.client.call_tool("echo", {"text": "flood"}, tasks=False), 120)
    assert reply.result["content"][0]["text"] == "flood", reply.message


async def test_a_child_that_stops_reading_stdin_is_restarted_and_its_calls_fail(make_proxy, monkeypatch):
    from mcp_tasks_proxy.upstream.stdio import process as stdio_process

    monkeypatch.setattr(stdio_process, "_WRITE_TIMEOUT_S", 1.0)
    proxy = await stdio_proxy(
        make_proxy, hostile_command("stops_reading"), tools=[], upstream={"stdio": {"restart_min_s": 0.2}}
    )
    pid = int(await tool_text(proxy, "pid"))
    assert await tool_text(proxy, "echo", {"text": "stop"}) == "stop"
    big = "x" * 300_000  # more than the pipe holds: writes wait on a child that never reads them
    replies = await asyncio.wait_for(
        asyncio.gather(*(proxy.client.call_tool("echo", {"text": big}, tasks=False) for _ in range(4))), 60
    )
    for reply in replies:
        assert reply.message["error"]["code"] == -32603, reply.message
    await ready(proxy)
    assert int(await tool_text(proxy, "pid")) != pid  # stopped and started again


@pytest.mark.parametrize("kind", ["relayed", "durable"])
async def test_a_2025_clients_call_ends_when_cancelled_or_its_session_ends(make_proxy, kind):
    # A tool no rule names is relayed as it is; one the policy names is a durable call (a task of the proxy's).
    legacy = await stdio_proxy(make_proxy, legacy_command(), tools=[] if kind == "relayed" else RULES)
    session = legacy.client.session
    for ending in ("cancelled", "deleted"):
        headers = await open_2025_session(legacy)
        gate = secrets.token_hex(4)
        call = {
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "gated", "arguments": {"tag": gate}},
        }
        pending = asyncio.ensure_future(session.post(legacy.url, json=call, headers=headers))
        await eventually(lambda gate=gate: _gate_is(legacy, gate, "started"), what="the relayed call in the child")
        if ending == "cancelled":
            cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
            async with session.post(legacy.url, json=cancel, headers=headers) as response:
                assert response.status == 202
        else:
            async with session.delete(legacy.url, headers=headers) as response:
                assert response.status == 200
        response = await asyncio.wait_for(pending, 30)  # the POST ends: nothing is left waiting on the proxy
        response.release()
        await eventually(lambda gate=gate: _gate_is(legacy, gate, "cancelled"), what=f"the child told ({ending})")


async def test_anonymous_clients_opening_sessions_never_end_another_clients_running_call(make_proxy):
    """Issue 25: an anonymous client opening sessions past the per-caller bound ended another anonymous client's
    session, and its running durable call with it ("the session ended", then "Session not found")."""
    proxy = await stdio_proxy(make_proxy, legacy_command(), upstream={"stdio": {"max_sessions_per_principal": 4}})
    session = proxy.client.session
    victim = await open_2025_session(proxy)
    gate = secrets.token_hex(4)
    call = request("tools/call", {"name": "gated", "arguments": {"tag": gate}}, id=7)
    pending = asyncio.ensure_future(session.post(proxy.url, json=call, headers=victim))
    await eventually(lambda: _gate_is(proxy, gate, "started"), what="the victim's durable call in the child")
    others = [await open_2025_session(proxy) for _ in range(12)]  # the same caller as far as anyone can tell
    await tool_text(proxy, "release", {"tag": gate})
    response = await asyncio.wait_for(pending, 30)
    assert f"gate {gate} opened" in await response.text()
    # The victim's session lives on; the flood's own idle sessions made room for the flood.
    async with session.post(proxy.url, json=request("ping"), headers=victim) as answer:
        assert answer.status == 200 and "result" in await answer.json()
    async with session.post(proxy.url, json=request("ping"), headers=others[0]) as answer:
        assert answer.status == 404


async def test_a_caller_whose_sessions_are_all_busy_is_refused_a_new_one_and_others_are_not(make_proxy):
    proxy = await stdio_proxy(make_proxy, legacy_command(), upstream={"stdio": {"max_sessions_per_principal": 2}})
    streams = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as crowded:
        for _ in range(2):  # each with its GET stream open: busy
            headers = await open_2025_session(dataclasses.replace(proxy, client=McpClient(crowded, proxy.url)))
            stream = await crowded.get(proxy.url, headers={**headers, "Accept": "text/event-stream"})
            assert stream.status == 200
            streams.append(stream)
        init = request(
            "initialize",
            {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
        )
        async with crowded.post(proxy.url, json=init, headers=ACCEPT) as refused:
            assert refused.status == 503
            error = (await refused.json())["error"]
        assert error["code"] == -32603
        assert error["message"] == (
            "Cannot open a session: this caller has 2 sessions, each with a call or stream open "
            "(upstream.stdio.max_sessions_per_principal); end one (HTTP DELETE) or try again later"
        )
        # An anonymous client at another address is another caller; one with credentials is its principal.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))) as elsewhere:
            assert "Mcp-Session-Id" in await open_2025_session(
                dataclasses.replace(proxy, client=McpClient(elsewhere, proxy.url))
            )
        async with crowded.post(proxy.url, json=init, headers={**ACCEPT, "Authorization": "Bearer b"}) as other:
            assert other.status == 200 and "Mcp-Session-Id" in other.headers
        for stream in streams:
            stream.close()


async def test_a_2025_session_is_only_its_principals_for_durable_calls_too(make_proxy):
    proxy = await stdio_proxy(make_proxy, legacy_command())
    alices = await open_2025_session(proxy, capabilities={"elicitation": {}}, Authorization="Bearer alice")
    call = request("tools/call", {"name": "ask_name", "arguments": {}})  # a policy tool: a durable call
    headers = {**alices, "Authorization": "Bearer mallory"}
    async with proxy.client.session.post(proxy.url, json=call, headers=headers) as response:
        assert response.status == 404, await response.text()


async def test_requests_past_max_in_flight_fail_at_once_even_in_a_burst(make_proxy):
    proxy = await stdio_proxy(make_proxy, hostile_command("ok"), tools=[], upstream={"stdio": {"max_in_flight": 2}})
    replies = await asyncio.gather(*(proxy.client.call_tool("sleep", {"seconds": 1}, tasks=False) for _ in range(6)))
    failed = [r for r in replies if "error" in r.message]
    assert len(failed) == 4, [r.message for r in replies]
    assert all("2 calls are in flight" in r.message["error"]["message"] for r in failed), failed


def test_a_caller_at_its_bound_ends_only_its_own_idle_sessions_and_is_refused_when_all_are_busy():
    from mcp_tasks_proxy.clients.sessions2025 import FrontSessions
    from mcp_tasks_proxy.session_table import SessionsFull

    sessions = FrontSessions(max_sessions=100, per_caller=2)
    alice = sessions.create("alice", "alice", "2025-11-25", {})
    alice.calls["durable"] = object()  # a call in flight
    idle_neighbour = sessions.create("", "address:127.0.0.1", "2025-11-25", {})
    mallorys = [sessions.create("mallory", "mallory", "2025-11-25", {}) for _ in range(50)]
    assert sessions.get(alice.id) is alice and sessions.get(idle_neighbour.id) is idle_neighbour
    assert [s.id for s in mallorys if sessions.get(s.id)] == [mallorys[-2].id, mallorys[-1].id]
    for session in mallorys[-2:]:
        session.streams[object()] = None  # each with a GET stream open: busy
    with pytest.raises(SessionsFull, match="max_sessions_per_principal"):
        sessions.create("mallory", "mallory", "2025-11-25", {})
    assert [s.id for s in mallorys if sessions.get(s.id)] == [mallorys[-2].id, mallorys[-1].id]
    # The least recently used idle session of the caller goes first, not the oldest.
    bob = [sessions.create("bob", "bob", "2025-11-25", {}) for _ in range(2)]
    sessions.get(bob[0].id)
    sessions.create("bob", "bob", "2025-11-25", {})
    assert sessions.get(bob[0].id) is bob[0] and sessions.get(bob[1].id) is None


def test_at_the_global_bound_an_idle_session_goes_and_a_busy_one_never():
    from mcp_tasks_proxy.clients.sessions2025 import FrontSessions
    from mcp_tasks_proxy.session_table import SessionsFull

    sessions = FrontSessions(max_sessions=3, per_caller=64)
    busy = [sessions.create(name, name, "2025-11-25", {}) for name in ("a", "b")]
    for session in busy:
        session.calls["call"] = object()
    idle = sessions.create("c", "c", "2025-11-25", {})
    newest = sessions.create("d", "d", "2025-11-25", {})  # the idle one makes room, though it is the newest
    assert sessions.get(idle.id) is None and all(sessions.get(s.id) is s for s in busy)
    newest.calls["call"] = object()
    with pytest.raises(SessionsFull, match=r"all 3 sessions are busy \(upstream.stdio.max_sessions\)"):
        sessions.create("e", "e", "2025-11-25", {})
    assert len(sessions) == 3


def test_a_malformed_response_of_the_child_reaches_a_client_as_the_proxys_error():
    from mcp_tasks_proxy.upstream.stdio.responses import _well_formed

    for bad in ({"id": 2}, {"id": 2, "result": 5}, {"id": 2, "result": {}, "error": {}}, {"id": 2, "error": "boom"}):
        answer = _well_formed({"jsonrpc": "2.0", **bad}, "stdio:x")
        assert answer["error"]["code"] == -32603 and "malformed" in answer["error"]["message"], answer
    good = {"jsonrpc": "2.0", "id": 2, "error": {"code": -32602, "message": "no"}}
    assert _well_formed(good, "stdio:x") is good


# --- the command line ---------------------------------------------------------------------------------------------


async def _run_proxy(*argv: str, env: dict | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *PROXY, *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env or os.environ.copy(),
    )  # fmt: skip


async def test_a_missing_program_is_one_line_and_exit_2():
    process = await _run_proxy("--port", "0", "--", "/nonexistent/mcp-server", "--flag")
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2, err
    assert err.decode().strip().splitlines()[-1].startswith("mcp-tasks-proxy: cannot start stdio:mcp-server"), err
    assert b"Traceback" not in err


async def test_nothing_after_the_double_dash_and_a_missing_cwd_are_one_line_each(tmp_path: Path):
    process = await _run_proxy("--port", "0", "--")
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and err.decode().strip() == (
        "mcp-tasks-proxy: nothing after --: give the stdio server's command there, or leave -- out"
    )
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"upstream: {{command: [python3, server.py], cwd: {tmp_path / 'nowhere'}}}\n")
    process = await _run_proxy("--config", str(policy), "--port", "0")
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2, err
    assert str(tmp_path / "nowhere") in err.decode().strip().splitlines()[-1], err  # names what is missing


async def test_shutdown_stops_a_child_that_ignores_eof_and_sigterm(tmp_path: Path):
    from tests.conftest import free_port, wait_ready

    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text("upstream:\n  stdio: {stop_grace_s: 0.5, term_grace_s: 0.5}\n")
    process = await _run_proxy(
        "--config", str(policy), "--port", str(port), "--", *hostile_command("ignores_eof_and_term")
    )
    await asyncio.get_running_loop().run_in_executor(None, wait_ready, port)
    async with aiohttp.ClientSession() as session:
        message = request("tools/call", {"name": "pid", "arguments": {}, "_meta": meta(tasks=False)})
        from tests.factories import headers_for

        async with session.post(f"http://127.0.0.1:{port}/mcp", json=message, headers=headers_for(message)) as reply:
            child = int((await reply.json())["result"]["content"][0]["text"])
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # SIGKILLed with its group after the graces


async def test_a_childs_notifications_reach_2025_sessions_as_they_subscribed():
    from mcp_tasks_proxy.clients.sessions2025 import FrontSessions

    sessions = FrontSessions(max_sessions=2)
    first, second = sessions.create("a", "a", "2025-11-25", {}), sessions.create("b", "b", "2025-11-25", {})
    streams = first.open_stream(), second.open_stream()
    second.subscribed.add("file:///b")
    sessions.broadcast({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    sessions.broadcast({"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": "file:///b"}})
    assert [streams[0].get_nowait()["method"]] == ["notifications/tools/list_changed"] and streams[0].empty()
    got = [streams[1].get_nowait()["method"], streams[1].get_nowait()["params"]["uri"]]
    assert got == ["notifications/tools/list_changed", "file:///b"]
    assert sessions.end(first.id)  # DELETE
    assert sessions.get(first.id) is None and streams[0].get_nowait() is None  # its GET stream is told to end


async def test_a_response_whose_id_is_no_string_is_dropped_and_reading_goes_on():
    from types import SimpleNamespace

    from mcp_tasks_proxy.upstream.stdio.channel import StdioChannel
    from mcp_tasks_proxy.upstream.stdio.process import ChildSpec

    channel = StdioChannel(ChildSpec(argv=["server"], env={}), max_in_flight=10)
    child = SimpleNamespace(generation=1)
    for bad_id in ([1], {"a": 1}, None, 3, True):  # the proxy's ids are strings: none of these is one of its
        channel._received(child, {"jsonrpc": "2.0", "id": bad_id, "result": {}}, 10)
    assert channel._refused == 5 and channel.in_flight == 0


def test_a_fifth_get_stream_ends_the_oldest_of_its_session():
    from mcp_tasks_proxy.clients.sessions2025 import FrontSessions

    session = FrontSessions(max_sessions=2).create("a", "a", "2025-11-25", {})
    queues = [session.open_stream() for _ in range(5)]
    assert queues[0].get_nowait() is None  # told to end
    assert list(session.streams) == queues[1:]
