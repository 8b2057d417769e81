"""A legacy server's requests on its session's standalone (GET) stream, outside any call's own stream.

tests/legacy_server.py (`mcp` 1.x) sends roots/list there with no related request, as server-everything does. The
proxy ties such a request to the one call in flight and makes it that call's input round; when it cannot tell the
call, it answers the server at once with an error that says why, so nothing waits for a client that never sees it.
"""

from __future__ import annotations

import secrets

import pytest

from mcp_tasks_proxy.front.context import gateway_key
from tests.conftest import LegacyClient, eventually, python_steps, task_reaches
from tests.factories import meta
from tests.schemas import validate_response

ROOTS = {"roots": [{"uri": "file:///srv/project", "name": "project"}]}


@pytest.fixture
async def proxy(make_proxy, legacy_upstream):
    rules = [{"match": "ask_roots_standalone", "task": "optional"}, {"match": "gated", "task": "optional"}]
    return await make_proxy(legacy_upstream, tools=rules, tasks={"poll_interval_ms": 50})


async def test_a_standalone_request_becomes_the_tasks_input_round(proxy):
    params = {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(roots={})}
    created = await proxy.client.call("tools/call", params)
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    validate_response(asking.message, "GetTaskResult")
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: ROOTS}})
    done = await task_reaches(proxy.client, task_id, "completed")
    validate_response(done.message, "GetTaskResult")
    assert done.result["result"]["content"][0]["text"] == "file:///srv/project"


async def roots_round(client, tool: str, roots: dict = ROOTS, **kw) -> str:
    """A synchronous call of `tool` whose one MRTR round must be roots/list: answered with `roots`, the tool's
    text."""
    params = {"name": tool, "arguments": {}, "_meta": meta(tasks=False, roots={})}
    first = await client.call("tools/call", params, **kw)
    validate_response(first.message, "InputRequiredResult", "core")
    ((key, question),) = first.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    retry = {**params, "inputResponses": {key: roots}, "requestState": first.result["requestState"]}
    done = await client.call("tools/call", retry, **kw)
    return done.result["content"][0]["text"]


async def test_a_standalone_request_becomes_a_synchronous_mrtr_round(proxy):
    assert await roots_round(proxy.client, "ask_roots_standalone") == "file:///srv/project"


async def test_a_client_without_roots_gets_the_request_declined(proxy):
    created = await proxy.client.call("tools/call", {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta()})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"].startswith("roots refused: -32601")


async def _gated_call(proxy, legacy_upstream) -> tuple[str, str, LegacyClient]:
    """A call (that declares no kind of question) waiting upstream: its task id, its gate, and a client to open it."""
    gate = secrets.token_hex(6)
    waiting = await proxy.client.call_tool("gated", {"tag": gate})
    legacy = LegacyClient(proxy.client.session, legacy_upstream)

    async def started():
        return await legacy.call_tool("gate_state", {"tag": gate}) == "started"

    await eventually(started, what="the first call waiting upstream")
    return waiting.result["taskId"], gate, legacy


async def test_a_call_that_may_be_asked_has_a_session_of_its_own(proxy, legacy_upstream):
    """Another call of the same caller in flight: the question still names its call, on the session made for it."""
    waiting, gate, legacy = await _gated_call(proxy, legacy_upstream)
    params = {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(roots={})}
    created = await proxy.client.call("tools/call", params)
    asking = await task_reaches(proxy.client, created.result["taskId"], "input_required")
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    await proxy.client.call("tasks/update", {"taskId": created.result["taskId"], "inputResponses": {key: ROOTS}})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"] == "file:///srv/project"
    assert len(proxy.app[gateway_key].legacy.sessions) == 2
    await legacy.call_tool("release", {"tag": gate})
    await task_reaches(proxy.client, waiting, "completed")


async def test_a_request_no_call_can_be_told_for_is_refused_at_once(proxy, legacy_upstream):
    """Two calls in flight on the session, neither of which may be asked anything, and no related-task metadata:
    the server hears why, immediately."""
    waiting, gate, legacy = await _gated_call(proxy, legacy_upstream)
    params = {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta()}
    created = await proxy.client.call("tools/call", params)
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    text = done.result["result"]["content"][0]["text"]
    assert text.startswith("roots refused: -32603"), text
    assert "2 calls are in flight" in text
    await legacy.call_tool("release", {"tag": gate})
    assert (await task_reaches(proxy.client, waiting, "completed")).result["status"] == "completed"


async def test_the_proxy_session_keeps_one_standalone_stream_open(proxy, legacy_upstream):
    """The stream is opened with the session, before any call, and not once per call."""
    await proxy.client.call("tools/list", tasks=False)
    for _ in range(3):
        await proxy.client.call("tools/call", {"name": "add", "arguments": {"a": 1, "b": 1}, "_meta": meta()})
    sessions = list(proxy.app[gateway_key].legacy.sessions.all())
    assert len(sessions) == 1
    assert sessions[0].reader is not None and not sessions[0].reader.done()


async def test_callers_who_share_a_credential_but_not_a_principal_never_share_a_session(make_proxy, legacy_upstream):
    """With principal: header, users behind one gateway credential are separate: a standalone request is tied to
    the one call in flight on its own caller's session, never to another caller's call."""
    rules = [{"match": "ask_roots_standalone", "task": "optional"}, {"match": "gated", "task": "optional"}]
    proxy = await make_proxy(
        legacy_upstream,
        tools=rules,
        tasks={"poll_interval_ms": 50},
        security={"principal": "header", "principal_header": "X-User"},
    )
    gate = secrets.token_hex(6)
    await proxy.client.call_tool("gated", {"tag": gate}, headers={"X-User": "alice"})
    legacy = LegacyClient(proxy.client.session, legacy_upstream)

    async def started():
        return await legacy.call_tool("gate_state", {"tag": gate}) == "started"

    await eventually(started, what="alice's call waiting upstream")
    params = {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(roots={})}
    created = await proxy.client.call("tools/call", params, headers={"X-User": "bob"})
    asking = await task_reaches(proxy.client, created.result["taskId"], "input_required", headers={"X-User": "bob"})
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    update = {"taskId": created.result["taskId"], "inputResponses": {key: ROOTS}}
    await proxy.client.call("tasks/update", update, headers={"X-User": "bob"})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", headers={"X-User": "bob"})
    assert done.result["result"]["content"][0]["text"] == "file:///srv/project"
    await legacy.call_tool("release", {"tag": gate})


def test_a_standalone_request_finds_its_call_without_a_step_per_call_on_the_session():
    # Counted, not timed: a 2025 server's request on its standalone stream was tied to its call by a scan of every
    # call on the proxy's session with it (one caller's: 10,000 may be in flight). Python steps are counted while
    # 200 requests are tied; the calls are registered as upstream/era2025.py does, the task decision after.
    from mcp_tasks_proxy.upstream.routing import CallRoute, CallsInFlight, route_for

    calls = CallsInFlight()
    routes = []
    for number in range(10_000):
        route = CallRoute({}, None)
        calls[f"mtp-{number}"] = route
        route.upstream_task = number % 2 == 1 or number >= 9_000  # decided after it is registered, as era2025.py does
        if number % 2 and number < 9_000:
            route.name_task(f"task-{number}")  # once the server made it, as legacy_tasks.py does
        routes.append(route)
    calls["mtp-1-result"] = routes[1]  # a follow-up request of one call: still one call

    def tie(task_id: str | None) -> tuple[CallRoute | None, str]:
        meta = {} if task_id is None else {"_meta": {"io.modelcontextprotocol/related-task": {"taskId": task_id}}}
        return route_for(calls, {"jsonrpc": "2.0", "id": 1, "method": "elicitation/create", "params": meta})

    with python_steps() as steps:  # (a thousand calls wait for the server to make their task: they cost nothing)
        found = [tie(f"task-{number}") for number in range(1, 9_000, 90)]
        unknown = [tie("task-0") for _ in range(50)]  # a call that runs no task of the server's
        untold = [tie(None) for _ in range(50)]
    counted = steps[0]
    assert [route for route, _ in found] == [routes[number] for number in range(1, 9_000, 90)]
    assert unknown == [(None, "it names task 'task-0', which no call of this proxy session follows")] * 50
    assert untold == [(None, "10000 calls are in flight on this proxy session and the request names none of them")] * 50
    assert counted < 200 * 80, counted  # a few dozen lines a request, not some per call on the session

    for number in range(2, 10_000):
        calls.pop(f"mtp-{number}")
    assert all(not route.watchers for route in routes[2:])  # a call gone from the session is in no index of it
    assert calls.pop("mtp-1") is routes[1] and len(calls) == 2  # its follow-up keeps the call in flight
    calls.pop("mtp-1-result")
    assert tie(None) == (routes[0], "") and tie("task-1")[0] is routes[0]  # the one call left, its task not named
