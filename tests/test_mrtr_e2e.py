"""Input during a task: a 2026-07-28 upstream's MRTR `input_required` answers become task inputRequests,
answered through tasks/update. The upstream is a real `mcp` 2.x server (tests/upstream_server.py)."""

from __future__ import annotations

import secrets

import pytest

from tests.conftest import eventually, task_reaches
from tests.factories import TASKS, meta
from tests.schemas import validate, validate_response

ELICIT = {"elicitation": {}}
STATE = '{"round": 1, "note": "ünïcode and  spaces"}'


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    rules = [{"match": "*", "task": "optional", "max_input_rounds": 3}]
    return await make_proxy(mcp_upstream, tools=rules, tasks={"poll_interval_ms": 50})


async def start(proxy, tool, arguments=None, **capabilities):
    params = {"name": tool, "arguments": arguments or {}, "_meta": meta(**(capabilities or ELICIT))}
    created = await proxy.client.call("tools/call", params)
    assert created.result["resultType"] == "task", created.message
    return created.result["taskId"]


async def update(proxy, task_id, responses):
    reply = await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": responses})
    assert reply.status == 200, reply.message
    assert reply.result == {"resultType": "complete"}
    validate_response(reply.message, "UpdateTaskResult")
    return reply


async def next_round(proxy, task_id: str, answered_key: str):
    """tasks/get once the task asks again, with a request other than the one just answered."""

    async def asking_anew():
        reply = await proxy.client.get_task(task_id)
        pending = reply.result.get("inputRequests") or {}
        return reply if reply.result["status"] == "input_required" and answered_key not in pending else None

    return await eventually(asking_anew, what="the next input round")


def accept(answer: str) -> dict:
    return {"action": "accept", "content": {"answer": answer}}


async def test_one_round_through_tasks_update(proxy):
    task_id = await start(proxy, "one_question")
    asking = await task_reaches(proxy.client, task_id, "input_required")
    validate_response(asking.message, "GetTaskResult")
    validate(asking.result, "InputRequiredTask")
    assert list(asking.result["inputRequests"]) == ["q"]
    assert asking.result["inputRequests"]["q"]["method"] == "elicitation/create"
    assert "requestState" not in asking.result  # the upstream's state stays inside the proxy

    await update(proxy, task_id, {"q": accept("yes")})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert "statusMessage" not in done.result  # not "input received; resuming the call" any more
    result = done.result["result"]
    assert result["content"][0]["text"] == "you said yes"
    # The retry carried the answer under the upstream's own key and its requestState byte for byte.
    assert result["structuredContent"]["inputResponses"] == {"q": accept("yes")}
    assert result["structuredContent"]["requestState"] == STATE


async def test_key_reused_by_the_upstream_gets_a_new_task_key(proxy):
    task_id = await start(proxy, "same_key_twice")
    first = await task_reaches(proxy.client, task_id, "input_required")
    assert list(first.result["inputRequests"]) == ["q"]
    await update(proxy, task_id, {"q": accept("red")})

    second = await next_round(proxy, task_id, "q")
    (key,) = second.result["inputRequests"]
    assert key != "q"  # keys are unique for the task's whole life
    assert second.result["inputRequests"][key]["params"]["message"] == "Second?"
    await update(proxy, task_id, {"q": accept("stale answer to round one")})  # ignored: not outstanding
    assert (await proxy.client.get_task(task_id)).result["status"] == "input_required"
    await update(proxy, task_id, {key: accept("blue")})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "red then blue"
    assert done.result["result"]["structuredContent"]["inputResponses"] == {"q": accept("blue")}


async def test_partial_answers_keep_the_task_waiting_for_the_rest(proxy):
    task_id = await start(proxy, "two_at_once")
    asking = await task_reaches(proxy.client, task_id, "input_required")
    assert sorted(asking.result["inputRequests"]) == ["a", "b"]
    await update(proxy, task_id, {"a": accept("1"), "not-a-key": accept("ignored")})
    partial = await proxy.client.get_task(task_id)
    assert partial.result["status"] == "input_required"
    assert list(partial.result["inputRequests"]) == ["b"]
    validate(partial.result, "InputRequiredTask")
    await update(proxy, task_id, {"b": accept("2")})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "1+2"


async def test_round_cap_fails_the_task_with_a_message_that_says_so(proxy):
    task_id = await start(proxy, "endless_questions")
    for _ in range(3):
        asking = await task_reaches(proxy.client, task_id, "input_required")
        (key,) = asking.result["inputRequests"]
        await update(proxy, task_id, {key: accept("again")})
    failed = await task_reaches(proxy.client, task_id, "failed")
    validate(failed.result, "FailedTask")
    assert "more than 3 times (max_input_rounds)" in failed.result["statusMessage"]


async def test_state_only_round_is_retried_by_the_proxy_itself(proxy):
    task_id = await start(proxy, "state_only_first")
    done = await task_reaches(proxy.client, task_id, "completed", "input_required")
    assert done.result["status"] == "completed"
    assert done.result["result"]["structuredContent"]["requestState"] == STATE


async def test_cancel_while_input_required(proxy):
    task_id = await start(proxy, "one_question")
    await task_reaches(proxy.client, task_id, "input_required")
    ack = await proxy.client.cancel_task(task_id)
    assert ack.result == {"resultType": "complete"}
    cancelled = await proxy.client.get_task(task_id)
    assert cancelled.result["status"] == "cancelled"
    assert "inputRequests" not in cancelled.result
    await update(proxy, task_id, {"q": accept("too late")})
    assert (await proxy.client.get_task(task_id)).result["status"] == "cancelled"


async def test_upstream_failing_on_the_retry_fails_the_task(proxy):
    task_id = await start(proxy, "fails_on_retry")
    await task_reaches(proxy.client, task_id, "input_required")
    await update(proxy, task_id, {"q": {"action": "accept", "content": {}}})
    failed = await task_reaches(proxy.client, task_id, "failed")
    assert failed.result["error"]["message"] == "the retry failed upstream"


async def test_undeclared_kind_of_input_is_never_shown_to_the_client(proxy):
    # The client declared elicitation only; the upstream asks for sampling.
    task_id = await start(proxy, "asks_sampling")
    failed = await task_reaches(proxy.client, task_id, "failed", "input_required")
    assert failed.result["status"] == "failed"
    assert failed.result["error"]["code"] == -32021
    assert failed.result["error"]["data"] == {"requiredCapabilities": {"sampling": {}}}
    # URL-mode elicitation needs elicitation.url, which form-only {} does not grant.
    task_id = await start(proxy, "asks_url")
    failed = await task_reaches(proxy.client, task_id, "failed", "input_required")
    assert failed.result["error"]["data"] == {"requiredCapabilities": {"elicitation": {"url": {}}}}
    # Declared, the same request reaches the client.
    task_id = await start(proxy, "asks_url", elicitation={"form": {}, "url": {}})
    asking = await task_reaches(proxy.client, task_id, "input_required")
    assert asking.result["inputRequests"]["login"]["params"]["mode"] == "url"


async def test_upstream_sees_the_creating_requests_capabilities_on_every_round(proxy):
    task_id = await start(proxy, "same_key_twice", elicitation={}, sampling={})
    await task_reaches(proxy.client, task_id, "input_required")
    await update(proxy, task_id, {"q": accept("x")})

    second = await next_round(proxy, task_id, "q")
    (key,) = second.result["inputRequests"]
    await update(proxy, task_id, {key: accept("y")})
    done = await task_reaches(proxy.client, task_id, "completed")
    capabilities = done.result["result"]["structuredContent"]["capabilities"]
    assert capabilities["elicitation"] is not None and capabilities["sampling"] is not None
    assert TASKS not in (capabilities.get("extensions") or {})


async def test_update_with_answers_that_are_not_objects_is_minus_32602(proxy):
    task_id = await start(proxy, "one_question")
    await task_reaches(proxy.client, task_id, "input_required")
    reply = await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {"q": "yes"}})
    assert reply.status == 400 and reply.error["code"] == -32602
    assert (await proxy.client.get_task(task_id)).result["status"] == "input_required"


async def test_mrtr_inside_the_sync_window_is_answered_by_the_client_before_any_task(
    make_proxy, mcp_upstream, upstream_client
):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "ask_then_gated", "sync_window_ms": 1500}])
    gate = secrets.token_hex(6)
    params = {"name": "ask_then_gated", "arguments": {"tag": gate}, "_meta": meta(**ELICIT)}
    round_one = await proxy.client.call("tools/call", params)
    assert round_one.result["resultType"] == "input_required"
    assert "taskId" not in round_one.result
    validate(round_one.result, "InputRequiredResult", "core")
    retry = {**params, "inputResponses": {"name": accept("Ada")}, "requestState": round_one.result["requestState"]}
    created = await proxy.client.call("tools/call", retry)
    # The gated attempt outlasts the window: that attempt is the one that becomes the task.
    assert created.result["resultType"] == "task"
    assert "requestState" not in created.result and "inputRequests" not in created.result
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["content"][0]["text"] == "hello Ada"


async def test_mrtr_for_tools_that_are_not_tasks_passes_through_untouched(make_proxy, mcp_upstream, upstream_client):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "one_question", "task": "never"}])
    params = {"name": "one_question", "arguments": {}, "_meta": meta(**ELICIT)}
    via_proxy = await proxy.client.call("tools/call", params)
    assert via_proxy.result["resultType"] == "input_required"
    assert list(via_proxy.result["inputRequests"]) == ["q"]
    retry = {**params, "inputResponses": {"q": accept("direct")}, "requestState": via_proxy.result["requestState"]}
    answered = await proxy.client.call("tools/call", retry)
    assert answered.result["content"][0]["text"] == "you said direct"
