"""The reference server-everything (npm, 2025-11-25, with SEP-1686 tasks) behind the proxy, for 2026-07-28 clients.

Two of its behaviours a proxy must get right: `get-roots-list` sends `roots/list` on the session's standalone GET
stream, not on the call's; `simulate-research-query` requires task augmentation (`execution.taskSupport:
required`), reports its stages as task status messages and asks its elicitation on the `tasks/result` stream.
"""

from __future__ import annotations

import structlog

from tests.conftest import eventually, task_reaches
from tests.factories import meta
from tests.schemas import validate, validate_response
from tests.test_standalone_stream import ROOTS, roots_round


async def everything_proxy(make_proxy, url):
    rules = [{"match": "get-roots-list", "task": "optional"}, {"match": "simulate-research-query", "task": "optional"}]
    return await make_proxy(url, tools=rules, tasks={"poll_interval_ms": 50})


async def test_tools_list_has_the_2026_tool_shape(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    listed = await proxy.client.call("tools/list", {"_meta": meta(tasks=False, roots={})})
    tools = {tool["name"]: tool for tool in listed.result["tools"]}
    assert "simulate-research-query" in tools and "get-roots-list" in tools
    for tool in tools.values():
        validate(tool, "Tool", "core")
        assert "taskSupport" not in tool.get("execution", {}), tool


async def test_roots_asked_on_the_standalone_stream_reach_a_synchronous_client(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    text = await roots_round(proxy.client, "get-roots-list")
    assert "file:///srv/project" in text, text


async def test_roots_asked_on_the_standalone_stream_become_a_tasks_input(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    created = await proxy.client.call(
        "tools/call", {"name": "get-roots-list", "arguments": {}, "_meta": meta(roots={})}
    )
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == "roots/list"
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: ROOTS}})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert "file:///srv/project" in done.result["result"]["content"][0]["text"]


async def test_an_abandoned_question_and_given_roots_stay_with_their_caller(make_proxy, everything_upstream):
    """Alice leaves her task's roots question unanswered (a client that cannot answer it): Bob's own question still
    reaches him. It was refused for as long as hers stayed open ("2 calls are in flight on this proxy session"), and
    server-everything answered Bob "no roots are currently configured". Then the roots each gave stay theirs."""
    proxy = await everything_proxy(make_proxy, everything_upstream)
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    params = {"name": "get-roots-list", "arguments": {}, "_meta": meta(roots={})}
    abandoned = await proxy.client.call("tools/call", params)
    await task_reaches(proxy.client, abandoned.result["taskId"], "input_required")
    assert "file:///srv/project" in await roots_round(proxy.client, "get-roots-list")  # the same (anonymous) caller
    alices = {"roots": [{"uri": "file:///home/alice", "name": "alice"}]}
    assert "file:///home/alice" in await roots_round(proxy.client, "get-roots-list", alices, headers=alice)
    bobs = await roots_round(proxy.client, "get-roots-list", headers=bob)
    assert "file:///srv/project" in bobs and "alice" not in bobs, bobs


async def test_a_tool_that_requires_a_task_upstream_runs_as_the_proxys_task(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    arguments = {"topic": "tides", "ambiguous": False}
    created = await proxy.client.call("tools/call", {"name": "simulate-research-query", "arguments": arguments,
                                                     "_meta": meta()})  # fmt: skip
    validate_response(created.message, "CreateTaskResult")
    task_id = created.result["taskId"]
    seen: set[str] = set()

    async def finished():
        reply = await proxy.client.get_task(task_id)
        seen.add(reply.result.get("statusMessage") or "")
        return reply if reply.result["status"] not in ("working", "input_required") else None

    done = await eventually(finished, what="the upstream task finishing")
    validate_response(done.message, "GetTaskResult")
    assert done.result["status"] == "completed", done.result
    result = done.result["result"]
    assert not result.get("isError"), result
    assert "tides" in result["content"][0]["text"]
    assert "io.modelcontextprotocol/related-task" not in result.get("_meta", {})
    # The upstream task's stages arrive as the proxy task's status messages.
    assert any("Analyzing" in message or "Gathering" in message for message in seen), seen


async def test_a_required_task_tool_answers_a_synchronous_client(make_proxy, everything_upstream):
    proxy = await make_proxy(everything_upstream)  # no policy at all: the proxy still has to drive the task
    params = {"name": "simulate-research-query", "arguments": {"topic": "owls"}, "_meta": meta(tasks=False)}
    reply = await proxy.client.call("tools/call", params)
    result = reply.result
    assert not result.get("isError"), result
    assert "owls" in result["content"][0]["text"]


async def test_the_upstream_tasks_elicitation_becomes_the_proxy_tasks_input(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    arguments = {"topic": "python", "ambiguous": True}
    created = await proxy.client.call("tools/call", {"name": "simulate-research-query", "arguments": arguments,
                                                     "_meta": meta(elicitation={})})  # fmt: skip
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    validate_response(asking.message, "GetTaskResult")
    ((key, question),) = asking.result["inputRequests"].items()
    assert question["method"] == "elicitation/create"
    assert "io.modelcontextprotocol/related-task" not in question["params"].get("_meta", {})
    field = next(iter(question["params"]["requestedSchema"]["properties"]))
    choices = question["params"]["requestedSchema"]["properties"][field]
    choice = (choices.get("enum") or [c["const"] for c in choices.get("oneOf", [])] or ["the language"])[0]
    answer = {"action": "accept", "content": {field: choice}}
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: answer}})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert "python" in done.result["result"]["content"][0]["text"].lower()


async def test_cancelling_the_proxy_task_cancels_the_upstream_task(make_proxy, everything_upstream):
    proxy = await everything_proxy(make_proxy, everything_upstream)
    with structlog.testing.capture_logs() as logs:
        created = await proxy.client.call("tools/call", {"name": "simulate-research-query",
                                                         "arguments": {"topic": "bees"}, "_meta": meta()})  # fmt: skip
        task_id = created.result["taskId"]

        async def upstream_task_made():
            return [line for line in logs if line["event"] == "upstream_task_created"]

        (made,) = await eventually(upstream_task_made, what="the upstream task being created")
        await proxy.client.cancel_task(task_id)

        async def upstream_cancelled():
            return [line for line in logs if line["event"] == "upstream_task_cancelled"]

        (cancelled,) = await eventually(upstream_cancelled, what="tasks/cancel reaching the upstream")
    assert cancelled["upstream_task_id"] == made["upstream_task_id"] and cancelled["answered"] is True
    assert (await proxy.client.get_task(task_id)).result["status"] == "cancelled"
