"""Legacy upstreams: a 2025-11-25 server built with `mcp` 1.x behind the proxy, reached by 2026-07-28 clients."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
import pytest

from mcp_tasks_proxy.front.context import gateway_key
from tests.conftest import LegacyClient, eventually, task_reaches
from tests.factories import TASKS, headers_for, meta, request
from tests.schemas import validate, validate_response

ELICIT = {"elicitation": {}}


@pytest.fixture
async def proxy(make_proxy, legacy_upstream):
    rules = [{"match": t, "task": "optional"} for t in ("ask_*", "gated", "slow", "interrupted")]
    return await make_proxy(legacy_upstream, tools=rules, tasks={"poll_interval_ms": 50})


def accept(**content):
    return {"action": "accept", "content": content}


async def test_discover_is_answered_from_the_legacy_initialize(proxy):
    reply = await proxy.client.call("server/discover")
    validate_response(reply.message, "DiscoverResult", "core")
    result = reply.result
    assert result["supportedVersions"] == ["2026-07-28"]
    assert result["capabilities"]["extensions"] == {TASKS: {}}
    assert "tools" in result["capabilities"]
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "legacy-example"


async def test_list_and_read_results_gain_the_2026_fields(proxy):
    tools = await proxy.client.call("tools/list")
    validate_response(tools.message, "ListToolsResult", "core")
    assert {"add", "ask_name", "gated"} <= {tool["name"] for tool in tools.result["tools"]}
    assert tools.result["resultType"] == "complete" and tools.result["cacheScope"] == "private"
    read = await proxy.client.call("resources/read", {"uri": "note://greeting"})
    validate_response(read.message, "ReadResourceResult", "core")
    assert read.result["contents"][0]["text"] == "hello from a legacy resource"


async def test_synchronous_call(proxy):
    reply = await proxy.client.call_tool("add", {"a": 20, "b": 22}, tasks=False)
    validate_response(reply.message, "CallToolResult", "core")
    assert reply.result["structuredContent"] == {"result": 42}


async def test_synchronous_progress_is_relayed_on_the_stream(proxy):
    params = {"name": "slow", "arguments": {"seconds": 0.3}, "_meta": {**meta(tasks=False), "progressToken": "p-1"}}
    reply = await proxy.client.call("tools/call", params)
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    progress = [event for event in reply.events if event.get("method") == "notifications/progress"]
    assert [p["params"]["message"] for p in progress] == [f"legacy step {n} of 3" for n in (1, 2, 3)]
    assert all(p["params"]["progressToken"] == "p-1" for p in progress)
    assert reply.message["result"]["content"][0]["text"] == "slept 0.3 s"


async def test_synchronous_elicitation_becomes_an_mrtr_round(proxy):
    params = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)}
    first = await proxy.client.call("tools/call", params)
    validate_response(first.message, "InputRequiredResult", "core")
    (key,) = first.result["inputRequests"]
    assert first.result["inputRequests"][key]["method"] == "elicitation/create"
    assert "elicitationId" not in first.result["inputRequests"][key]["params"]
    state = first.result["requestState"]
    retry = {**params, "inputResponses": {key: accept(name="Ada")}, "requestState": state}
    done = await proxy.client.call("tools/call", retry)
    assert done.result["content"][0]["text"] == "hello Ada"
    # The handle is single use, and a tampered one is refused.
    for bad in (state, state[:-2] + "xx", "not-a-handle"):
        again = await proxy.client.call("tools/call", {**retry, "requestState": bad})
        assert again.status == 400 and again.error["code"] == -32602


async def test_mrtr_handle_is_bound_to_the_caller(proxy):
    params = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)}
    first = await proxy.client.call("tools/call", params, headers={"Authorization": "Bearer alice"})
    (key,) = first.result["inputRequests"]
    retry = {**params, "inputResponses": {key: accept(name="Mallory")}, "requestState": first.result["requestState"]}
    stolen = await proxy.client.call("tools/call", retry, headers={"Authorization": "Bearer mallory"})
    assert stolen.error["code"] == -32602
    # The refused attempt did not use the handle up: its owner still can.
    mine = await proxy.client.call("tools/call", retry, headers={"Authorization": "Bearer alice"})
    assert mine.result["content"][0]["text"] == "hello Mallory"


async def test_task_turns_an_elicitation_on_the_stream_into_input_requests(proxy):
    params = {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)}
    created = await proxy.client.call("tools/call", params)
    validate_response(created.message, "CreateTaskResult")
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    validate(asking.result, "InputRequiredTask")
    (key,) = asking.result["inputRequests"]
    request_ = asking.result["inputRequests"][key]
    assert request_["method"] == "elicitation/create"
    assert set(request_) == {"method", "params"}  # no jsonrpc, no id
    ack = await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: accept(name="Ada")}})
    assert ack.result == {"resultType": "complete"}
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "hello Ada"
    assert done.result["result"]["resultType"] == "complete"


async def test_concurrent_requests_are_several_keys(proxy):
    created = await proxy.client.call("tools/call", {"name": "ask_two", "arguments": {}, "_meta": meta(**ELICIT)})
    task_id = created.result["taskId"]

    async def both_pending():
        reply = await proxy.client.get_task(task_id)
        return reply if len(reply.result.get("inputRequests") or {}) == 2 else None

    asking = await eventually(both_pending, what="two pending input requests")
    first, second = sorted(asking.result["inputRequests"], key=lambda k: int(k.rsplit("-", 1)[1]))
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {first: accept(name="A")}})
    partial = await proxy.client.get_task(task_id)
    assert partial.result["status"] == "input_required"
    assert list(partial.result["inputRequests"]) == [second]
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {second: accept(name="B")}})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "A & B"


async def test_requests_the_client_did_not_declare_are_declined_upstream(proxy):
    # No sampling declared: the legacy server is told no, and its tool carries on with that.
    created = await proxy.client.call("tools/call", {"name": "ask_model", "arguments": {}, "_meta": meta(**ELICIT)})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "input_required")
    assert done.result["result"]["content"][0]["text"] == "sampling refused: -32601"
    # No elicitation declared: the elicitation is declined.
    created = await proxy.client.call("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta()})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "input_required")
    assert done.result["result"]["content"][0]["text"] == "no name (decline)"


async def test_sampling_and_roots_reach_a_client_that_declared_them(proxy):
    caps = {"sampling": {}, "roots": {}}
    created = await proxy.client.call("tools/call", {"name": "ask_model", "arguments": {}, "_meta": meta(**caps)})
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    ((key, sampling),) = asking.result["inputRequests"].items()
    assert sampling["method"] == "sampling/createMessage"
    answer = {"role": "assistant", "content": {"type": "text", "text": "Paris"}, "model": "m"}
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: answer}})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "model said Paris"

    created = await proxy.client.call("tools/call", {"name": "ask_roots", "arguments": {}, "_meta": meta(**caps)})
    task_id = created.result["taskId"]
    asking = await task_reaches(proxy.client, task_id, "input_required")
    ((key, roots),) = asking.result["inputRequests"].items()
    assert roots["method"] == "roots/list"
    answer = {"roots": [{"uri": "file:///home/user/project", "name": "project"}]}
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: answer}})
    done = await task_reaches(proxy.client, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == "file:///home/user/project"


async def test_progress_and_cancel_reach_the_legacy_server(proxy, legacy_client):
    gate = secrets.token_hex(6)
    created = await proxy.client.call_tool("gated", {"tag": gate})
    task_id = created.result["taskId"]

    async def waiting():
        reply = await proxy.client.get_task(task_id)
        return reply.result.get("statusMessage") == f"waiting at gate {gate}"

    await eventually(waiting, what="legacy progress as statusMessage")
    await proxy.client.cancel_task(task_id)

    async def cancelled_upstream():
        return await legacy_client.call_tool("gate_state", {"tag": gate}) == "cancelled"

    # A legacy server does not take a dropped stream for a cancellation: notifications/cancelled must be posted.
    await eventually(cancelled_upstream, what="notifications/cancelled reaching the legacy server")
    assert (await proxy.client.get_task(task_id)).result["status"] == "cancelled"


async def test_client_closing_a_synchronous_call_cancels_it_upstream(proxy, legacy_client):
    gate = secrets.token_hex(6)
    message = request("tools/call", {"name": "gated", "arguments": {"tag": gate}, "_meta": meta(tasks=False)})

    async def started():
        return await legacy_client.call_tool("gate_state", {"tag": gate}) == "started"

    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(session.post(proxy.url, json=message, headers=headers_for(message)))
        await eventually(started, what="the legacy call starting")
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)

    async def cancelled():
        return await legacy_client.call_tool("gate_state", {"tag": gate}) == "cancelled"

    await eventually(cancelled, what="the legacy call being cancelled")


async def test_a_stream_closed_mid_call_is_resumed_with_last_event_id(proxy):
    created = await proxy.client.call_tool("interrupted")
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result
    assert done.result["result"]["content"][0]["text"] == "finished after a reconnect"
    sync = await proxy.client.call_tool("interrupted", tasks=False)
    assert sync.result["content"][0]["text"] == "finished after a reconnect"


async def test_legacy_clients_still_pass_through_untouched(proxy, legacy_upstream):
    client = LegacyClient(proxy.client.session, proxy.url)
    assert await client.call_tool("add", {"a": 1, "b": 1}) == "2"
    assert "Mcp-Session-Id" in client.headers


async def test_a_question_inside_the_sync_window_is_a_synchronous_mrtr_round(make_proxy, legacy_upstream):
    """SEP-2663 composition: input asked before the task exists is an MRTR round, as with a modern upstream; the
    legacy call waits upstream meanwhile, and becomes a task only if it outlasts the window after the answer."""
    rules = [{"match": "ask_*", "task": "optional", "sync_window_ms": 1500}]
    proxy = await make_proxy(legacy_upstream, tools=rules)
    for seconds, expected in ((0, "complete"), (4, "task")):
        params = {"name": "ask_then_work", "arguments": {"seconds": seconds}, "_meta": meta(**ELICIT)}
        first = await proxy.client.call("tools/call", params)
        validate_response(first.message, "InputRequiredResult", "core")
        (key,) = first.result["inputRequests"]
        assert first.result["inputRequests"][key]["method"] == "elicitation/create"
        retry = {**params, "inputResponses": {key: accept(name="Bo")}, "requestState": first.result["requestState"]}
        second = await proxy.client.call("tools/call", retry)
        assert second.result["resultType"] == expected, second.message
        if expected == "task":
            validate_response(second.message, "CreateTaskResult")
            second = await task_reaches(proxy.client, second.result["taskId"], "completed")
            content = second.result["result"]["content"]
        else:
            content = second.result["content"]
        assert content[0]["text"] == f"hello Bo after {seconds} s"


async def test_a_parked_round_is_single_use_bound_to_its_caller_and_answers_what_is_left(make_proxy, legacy_upstream):
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "ask_*", "task": "optional", "sync_window_ms": 10_000}])
    params = {"name": "ask_two", "arguments": {}, "_meta": meta(**ELICIT)}
    first = await proxy.client.call("tools/call", params, headers={"Authorization": "Bearer alice"})
    assert sorted(first.result["inputRequests"]) == ["elicitation-0", "elicitation-1"], first.result
    state = first.result["requestState"]
    partial = {**params, "inputResponses": {"elicitation-0": accept(name="A")}, "requestState": state}
    stolen = await proxy.client.call("tools/call", partial, headers={"Authorization": "Bearer mallory"})
    assert stolen.status == 400 and stolen.error["data"] == {"reason": "invalid_request_state"}
    # A MAC that is not ASCII (compare_digest refuses such a str): refused as any forgery, not an internal error.
    for mac in ("é", "\ud800"):
        odd = {**partial, "requestState": state.rsplit(".", 1)[0] + "." + mac}
        refused = await proxy.client.call("tools/call", odd, headers={"Authorization": "Bearer alice"})
        assert refused.status == 400 and refused.error["data"] == {"reason": "invalid_request_state"}, refused.message
    # Half the answers: the other question is asked again, with a new handle; the old one is used up.
    second = await proxy.client.call("tools/call", partial, headers={"Authorization": "Bearer alice"})
    assert list(second.result["inputRequests"]) == ["elicitation-1"], second.result
    reused = await proxy.client.call("tools/call", partial, headers={"Authorization": "Bearer alice"})
    assert reused.status == 400 and reused.error["code"] == -32602
    last = {
        **params,
        "inputResponses": {"elicitation-1": accept(name="B")},
        "requestState": second.result["requestState"],
    }
    done = await proxy.client.call("tools/call", last, headers={"Authorization": "Bearer alice"})
    assert done.result["content"][0]["text"] == "A & B"
    # A legacy server has no MRTR state of its own: any other requestState is refused, not sent on.
    forged = await proxy.client.call("tools/call", {**params, "requestState": "opaque", "inputResponses": {}})
    assert forged.status == 400 and forged.error["code"] == -32602


async def test_a_parked_round_nobody_answers_is_cancelled_upstream(make_proxy, legacy_upstream, legacy_client):
    gate = secrets.token_hex(6)
    proxy = await make_proxy(
        legacy_upstream,
        tools=[{"match": "ask_gated", "task": "optional", "sync_window_ms": 10_000}],
        upstream={"round_wait_s": 0.5},
    )
    params = {"name": "ask_gated", "arguments": {"tag": gate}, "_meta": meta(**ELICIT)}
    first = await proxy.client.call("tools/call", params)
    assert first.result["resultType"] == "input_required"

    async def cancelled():
        return await legacy_client.call_tool("gate_state", {"tag": gate}) == "cancelled"

    await eventually(cancelled, what="the unanswered legacy call being cancelled upstream")
    late = {**params, "inputResponses": {}, "requestState": first.result["requestState"]}
    assert (await proxy.client.call("tools/call", late)).error["code"] == -32602


async def _asking_task(make_proxy, legacy_upstream, input_wait_s: float) -> tuple[object, str, str]:
    """A task of ask_gated (a question, then a wait at its gate) under `upstream.input_wait_s`: the proxy, the gate,
    the task id."""
    gate = secrets.token_hex(6)
    proxy = await make_proxy(
        legacy_upstream,
        tools=[{"match": "ask_gated", "task": "optional"}],
        upstream={"input_wait_s": input_wait_s},
        tasks={"poll_interval_ms": 50},
    )
    params = {"name": "ask_gated", "arguments": {"tag": gate}, "_meta": meta(**ELICIT)}
    return proxy, gate, (await proxy.client.call("tools/call", params)).result["taskId"]


async def test_a_task_nobody_answers_fails_after_input_wait_s_and_is_cancelled_upstream(
    make_proxy, legacy_upstream, legacy_client
):
    """A task's question keeps the call open upstream (a session, a stdio child) only for input_wait_s."""
    proxy, gate, task_id = await _asking_task(make_proxy, legacy_upstream, 0.5)
    await task_reaches(proxy.client, task_id, "input_required")
    failed = await task_reaches(proxy.client, task_id, "failed")
    assert "upstream.input_wait_s" in failed.result["statusMessage"]
    assert failed.result["error"]["data"] == {"reason": "input_not_given"}

    async def cancelled():
        return await legacy_client.call_tool("gate_state", {"tag": gate}) == "cancelled"

    await eventually(cancelled, what="the unanswered task's call being cancelled upstream")


async def test_a_task_answered_in_time_runs_on_past_its_input_wait(make_proxy, legacy_upstream, legacy_client):
    proxy, gate, task_id = await _asking_task(make_proxy, legacy_upstream, 0.5)
    waiting = await task_reaches(proxy.client, task_id, "input_required")
    (key,) = waiting.result["inputRequests"]
    await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: accept(name="Ada")}})
    await task_reaches(proxy.client, task_id, "working")
    await asyncio.sleep(1)  # twice the wait the round had: it ended with the answer, the call runs on
    assert (await proxy.client.get_task(task_id)).result["status"] == "working"
    await legacy_client.call_tool("release", {"tag": gate})
    await task_reaches(proxy.client, task_id, "completed")


@pytest.mark.parametrize(("tasks", "times"), [(True, 5), (False, 6)], ids=["task", "sync-window"])
async def test_a_server_that_keeps_asking_is_stopped_at_max_input_rounds(
    make_proxy, legacy_upstream, legacy_client, tasks, times
):
    """Each question of a legacy server counts against max_input_rounds, as a modern server's rounds do."""
    rule = {"match": "ask_again_and_again", "task": "optional", "max_input_rounds": 2,
            "sync_window_ms": 0 if tasks else 60_000}  # fmt: skip
    proxy = await make_proxy(legacy_upstream, tools=[rule], tasks={"poll_interval_ms": 50})
    params = {"name": "ask_again_and_again", "arguments": {"times": times}, "_meta": meta(**ELICIT)}
    reply = await proxy.client.call("tools/call", params)
    answered: set[str] = set()
    for _ in range(2):
        if tasks:
            task_id = reply.result["taskId"]

            async def new_question(task_id=task_id):
                got = await proxy.client.get_task(task_id)
                keys = set(got.result.get("inputRequests") or {}) - answered
                return keys if got.result["status"] == "input_required" and keys else None

            (key,) = await eventually(new_question, what="the next question")
            await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": {key: accept(name="x")}})
        else:
            (key,) = reply.result["inputRequests"]
            retry = {**params, "inputResponses": {key: accept(name="x")}, "requestState": reply.result["requestState"]}
            reply = await proxy.client.call("tools/call", retry)
        answered.add(key)
    if tasks:
        failed = await task_reaches(proxy.client, reply.result["taskId"], "failed")
        error = failed.result["error"]
    else:
        error = reply.error
    assert "more than 2 times (max_input_rounds)" in error["message"], error

    async def cancelled():
        return await legacy_client.call_tool("gate_state", {"tag": f"asked-{times}"}) == "cancelled"

    await eventually(cancelled, what="the call being cancelled upstream")


async def test_made_up_credentials_never_end_a_session_with_a_call_in_flight(make_proxy, legacy_upstream):
    """Issue 25: the proxy's sessions with a 2025 server are one per credential, and credentials cost nothing to
    make up: a flood of them ended the least recently used session, calls in flight and all."""
    proxy = await make_proxy(legacy_upstream, tools=[{"match": "gated"}], upstream={"max_sessions": 2})
    server = LegacyClient(proxy.client.session, legacy_upstream)
    victim = {"Authorization": "Bearer victim"}
    gate = secrets.token_hex(4)
    created = await proxy.client.call_tool("gated", {"tag": gate}, headers=victim)
    await eventually(lambda: _gate_is(server, gate, "started"), what="the victim's call upstream")
    for n in range(6):
        listed = await proxy.client.call("tools/list", headers={"Authorization": f"Bearer made-up-{n}"})
        assert "result" in listed.message, listed.message
    await server.call_tool("release", {"tag": gate})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed", headers=victim)
    assert done.result["status"] == "completed", done.result
    # With every session busy, a new credential is refused a session of its own, with the reason.
    gates = {f"Bearer holder-{n}": secrets.token_hex(4) for n in range(2)}
    held = {}
    for credential, tag in gates.items():
        held[credential] = await proxy.client.call_tool("gated", {"tag": tag}, headers={"Authorization": credential})
        await eventually(lambda tag=tag: _gate_is(server, tag, "started"), what="a call holding a session")
    late = {"Authorization": "Bearer late"}
    refused = await proxy.client.call_tool("gated", {"tag": secrets.token_hex(4)}, headers=late)
    failed = await task_reaches(proxy.client, refused.result["taskId"], "failed", headers=late)
    reason = "cannot open another session with the upstream: all 2 sessions are busy (upstream.max_sessions)"
    # The call never left (no session to send it on): tried again, as every rule allows, and refused each time.
    assert failed.result["statusMessage"] == f"{reason} (3 attempts)", failed.result
    for credential, tag in gates.items():
        await server.call_tool("release", {"tag": tag})
        await task_reaches(
            proxy.client, held[credential].result["taskId"], "completed", headers={"Authorization": credential}
        )


async def _gate_is(server: LegacyClient, gate: str, state: str) -> bool:
    return await server.call_tool("gate_state", {"tag": gate}) == state


async def test_past_max_sessions_a_call_that_may_be_asked_shares_its_callers_session(make_proxy, legacy_upstream):
    """A call whose client may be asked something has a session to itself, while one can be opened: at
    upstream.max_sessions it shares the caller's session (its question on its own stream still reaches it)."""
    proxy = await make_proxy(
        legacy_upstream, tools=[{"match": "ask_name", "task": "optional"}], upstream={"max_sessions": 1}
    )
    params = {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)}
    held = await proxy.client.call("tools/call", params)
    await task_reaches(proxy.client, held.result["taskId"], "input_required")
    second = await proxy.client.call("tools/call", params)
    waiting = await task_reaches(proxy.client, second.result["taskId"], "input_required", "failed")
    assert waiting.result["status"] == "input_required", waiting.message
    assert proxy.app[gateway_key].legacy.session_count() == 1


async def test_one_callers_many_calls_leave_other_callers_a_session(make_proxy, legacy_upstream):
    """upstream.max_sessions_per_caller: past it a caller's asking calls share its sessions, and another caller
    still gets one of its own (one caller's calls held every session, and the others got none)."""
    proxy = await make_proxy(
        legacy_upstream,
        tools=[{"match": "ask_name", "task": "optional"}],
        upstream={"max_sessions": 2, "max_sessions_per_caller": 1},
    )
    params = {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)}
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    for headers in (alice, alice, bob):
        task_id = (await proxy.client.call("tools/call", params, headers=headers)).result["taskId"]
        waiting = await task_reaches(proxy.client, task_id, "input_required", "failed", headers=headers)
        assert waiting.result["status"] == "input_required", waiting.message
    assert proxy.app[gateway_key].legacy.session_count() == 2  # Alice's one, shared by her calls, and Bob's
