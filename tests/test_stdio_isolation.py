"""One caller's call on a shared stdio child must not hold back another's, on real stdio children.

- A question a caller leaves open (a task never answered, an MRTR round never retried, a 2025 stream left open)
  keeps its child waiting on that caller: other callers' calls go to another copy of the server, started on demand
  (upstream.stdio.max_children), so their own questions reach them instead of being refused as ambiguous.
- A cancelled call frees its max_concurrency slot at once, whether or not the child ever answers it (the hostile
  child's sleep never does); what does hold a slot without a cancel, a parked MRTR round, is bounded by
  upstream.round_wait_s.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog

from mcp_tasks_proxy.front.context import gateway_key
from tests.conftest import eventually, task_reaches
from tests.factories import meta, request
from tests.test_standalone_stream import roots_round
from tests.test_stdio import (
    everything_command,
    hostile_command,
    legacy_command,
    open_2025_session,
    stdio_proxy,
    text_of,
    tool_text,
)

ELICIT = {"elicitation": {}}
ROOTS = {"roots": {}}
ASK_NAME = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "ask_name", "arguments": {}}}


# --- an open question holds its child, not everyone ----------------------------------------------------------------


async def _until_question(response) -> None:
    """Read a 2025 client's event stream up to the server's question (which the client then never answers)."""
    while b"elicitation/create" not in await response.content.readline():
        pass


async def _abandon_a_question(proxy, how: str):
    """Alice gets ask_name's elicitation and never answers it; what to close at the end."""
    if how == "task":  # 2026 client with the extension: the task goes input_required, no tasks/update ever
        created = await proxy.client.call("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(**ELICIT)})
        await task_reaches(proxy.client, created.result["taskId"], "input_required")
        return None
    if how in ("sync_no_rule", "kept_alive"):  # 2026 client without it: an MRTR input_required, never retried
        message = request("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)})
        reply = await proxy.client.send(message)
        assert reply.result["resultType"] == "input_required", reply.message
        return None
    headers = await open_2025_session(proxy, capabilities=ELICIT)  # a 2025-11-25 client (its own session)
    response = await proxy.client.session.post(proxy.url, json=ASK_NAME, headers=headers)
    await _until_question(response)
    if how == "durable_2025":  # the durable call goes on without its client
        response.close()
        return None
    return response  # relayed_2025: the client keeps its stream open and never answers


@pytest.mark.parametrize("how", ["task", "sync_no_rule", "kept_alive", "relayed_2025", "durable_2025"])
async def test_an_abandoned_question_does_not_refuse_another_clients_question(make_proxy, how):
    rules = [{"match": "ask_roots_standalone"}]
    if how in ("task", "kept_alive", "durable_2025"):
        rules.append({"match": "ask_name"})  # a rule names the tool; else the call passes through
    proxy = await stdio_proxy(make_proxy, legacy_command(), tools=rules)
    held = await _abandon_a_question(proxy, how)
    try:
        # Bob, another client, calls a tool that asks him for his roots: his question must reach him.
        created = await proxy.client.call(
            "tools/call", {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(**ROOTS)}
        )
        bob = await task_reaches(proxy.client, created.result["taskId"], "input_required", "completed", "failed")
        # It was: completed, "roots refused: -32603 The proxy cannot relay this roots/list request: 2 calls are in
        # flight on the stdio server and the request names none of them".
        assert bob.result["status"] == "input_required", text_of(bob)
        assert len(proxy.app[gateway_key].relay.pool.channels) == 2  # a second copy, for Bob
    finally:
        if held is not None:
            held.close()


async def test_everything_with_default_settings_answers_roots_not_a_wrong_result(make_proxy):
    proxy = await stdio_proxy(make_proxy, everything_command(), tools=[])  # no rule: every call passes through
    alice = request(
        "tools/call",
        {"name": "trigger-sampling-request", "arguments": {"prompt": "hi"}, "_meta": meta(tasks=False, sampling={})},
    )
    assert (await proxy.client.send(alice)).result["resultType"] == "input_required"  # never retried
    bob = request("tools/call", {"name": "get-roots-list", "arguments": {}, "_meta": meta(tasks=False, **ROOTS)})
    reply = await proxy.client.send(bob)
    # It was, for the next 60 s (server-everything's own 60 s timeout of its sampling request): "The client supports
    # roots but no roots are currently configured" - its syncRoots swallows the proxy's refusal.
    assert reply.result.get("resultType") == "input_required", json.dumps(reply.message)[:300]


# --- a cancelled call's max_concurrency slot -----------------------------------------------------------------------

SLEEP_RULE = {"match": "sleep", "max_concurrency": 1, "on_limit": "refuse"}


async def _refused(proxy) -> bool:
    reply = await proxy.client.call_tool("sleep", {"seconds": 0.01})
    return "max_concurrency" in json.dumps(reply.message.get("error", {}))


async def _start_and_cancel(proxy, how: str) -> None:
    """A call of the hostile child's sleep (which never answers a cancelled request), cancelled as `how` says."""
    long = {"name": "sleep", "arguments": {"seconds": 60}}
    pool = proxy.app[gateway_key].relay.pool

    async def in_the_child():
        return pool.in_flight > 0

    if how == "task_cancel":
        created = await proxy.client.call("tools/call", {**long, "_meta": meta()})
        await eventually(in_the_child, what="the call in the child")
        await proxy.client.cancel_task(created.result["taskId"])
        return
    if how in ("kept_alive_closed", "sync_window_closed"):
        message = request("tools/call", {**long, "_meta": meta(tasks=how == "sync_window_closed")})
        pending = asyncio.ensure_future(proxy.client.send(message))
        await eventually(in_the_child, what="the call in the child")
        pending.cancel()  # a 2026 client cancels by closing its request
        await asyncio.gather(pending, return_exceptions=True)
        return
    headers = await open_2025_session(proxy)
    if how == "sep1686_cancel":  # the proxy's own SEP-1686 task (the child has no tasks of its own)
        call = request("tools/call", {**long, "task": {"ttl": 60000}})
        async with proxy.client.session.post(proxy.url, json=call, headers=headers) as response:
            task_id = json.loads(await response.text())["result"]["task"]["taskId"]
        await eventually(in_the_child, what="the call in the child")
        cancel = request("tasks/cancel", {"taskId": task_id})
        (await proxy.client.session.post(proxy.url, json=cancel, headers=headers)).release()
        return
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": long}  # a durable call
    pending = asyncio.ensure_future(proxy.client.session.post(proxy.url, json=call, headers=headers))
    await eventually(in_the_child, what="the call in the child")
    if how == "durable_cancelled":
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}
        (await proxy.client.session.post(proxy.url, json=cancel, headers=headers)).release()
    else:  # durable_deleted
        (await proxy.client.session.delete(proxy.url, headers=headers)).release()
    (await asyncio.wait_for(pending, 30)).release()


@pytest.mark.parametrize(
    "how",
    [
        "task_cancel",
        "kept_alive_closed",
        "sync_window_closed",
        "durable_cancelled",
        "durable_deleted",
        "sep1686_cancel",
    ],
)
async def test_a_cancelled_call_frees_its_slot_once_the_child_call_is_dropped(make_proxy, how):
    rule = {**SLEEP_RULE, "sync_window_ms": 5000} if how == "sync_window_closed" else SLEEP_RULE
    proxy = await stdio_proxy(make_proxy, hostile_command("ok"), tools=[rule])
    await _start_and_cancel(proxy, how)
    pool = proxy.app[gateway_key].relay.pool

    async def dropped():
        return pool.in_flight == 0  # the hostile child never answers: only the proxy can let go of the call

    await eventually(dropped, what="the proxy letting go of the cancelled call")
    assert not await _refused(proxy)


async def test_a_parked_mrtr_round_holds_the_slot_and_the_question_until_round_wait_s(make_proxy):
    """The hold that exists: no cancellation is possible, the client just never retries its MRTR round."""
    proxy = await stdio_proxy(
        make_proxy,
        legacy_command(),
        tools=[{"match": "ask_name", "max_concurrency": 1, "on_limit": "refuse"}],
        upstream={"round_wait_s": 3},
    )
    message = request("tools/call", {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)})
    assert (await proxy.client.send(message)).result["resultType"] == "input_required"
    again = await proxy.client.send(request("tools/call", {**message["params"]}))
    assert "max_concurrency" in again.error["message"]  # refused until round_wait_s

    async def freed():
        reply = await proxy.client.send(request("tools/call", {**message["params"]}))
        return "result" in reply.message

    await eventually(freed, what="the parked round dropped after round_wait_s")


async def test_with_one_copy_at_most_an_open_question_still_makes_others_ambiguous(make_proxy):
    """max_children: 1 keeps one copy whatever happens, and the old refusal with it: the bound is the operator's."""
    rules = [{"match": "ask_roots_standalone"}, {"match": "ask_name"}]
    proxy = await stdio_proxy(make_proxy, legacy_command(), tools=rules, upstream={"stdio": {"max_children": 1}})
    await _abandon_a_question(proxy, "task")
    created = await proxy.client.call(
        "tools/call", {"name": "ask_roots_standalone", "arguments": {}, "_meta": meta(**ROOTS)}
    )
    bob = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert "2 calls are in flight on the stdio server" in text_of(bob)
    assert len(proxy.app[gateway_key].relay.pool.channels) == 1


async def test_the_childs_own_task_is_followed_on_the_copy_that_made_it(make_proxy):
    """A second copy started for another caller: the task it made is polled there, though the first is less busy."""
    rules = [{"match": name} for name in ("simulate-research-query", "trigger-sampling-request", "trigger-long-*")]
    proxy = await stdio_proxy(make_proxy, everything_command(), tools=rules)
    alice = await proxy.client.call(
        "tools/call", {"name": "trigger-sampling-request", "arguments": {"prompt": "hi"}, "_meta": meta(sampling={})}
    )
    await task_reaches(proxy.client, alice.result["taskId"], "input_required")  # copy 1 waits on Alice
    with structlog.testing.capture_logs() as logs:
        research = await proxy.client.call(
            "tools/call", {"name": "simulate-research-query", "arguments": {"topic": "t"}, "_meta": meta()}
        )
        for _ in range(2):  # copy 2 becomes the busier one: a poll without its call's route would go to copy 1
            await proxy.client.call_tool("trigger-long-running-operation", {"duration": 20, "steps": 2})
        done = await task_reaches(proxy.client, research.result["taskId"], "completed", "failed", "input_required")
    assert done.result["status"] in ("completed", "input_required"), done.result
    assert [line["event"] for line in logs if line["event"] == "upstream_task_created"] == ["upstream_task_created"]
    assert len(proxy.app[gateway_key].relay.pool.channels) == 2


# --- each copy serves one caller -----------------------------------------------------------------------------------

ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
ALICES_ROOTS = {"roots": [{"uri": "file:///home/alice", "name": "alice"}]}


async def test_the_roots_one_caller_gave_never_reach_another(make_proxy):
    """server-everything keeps the roots it was given: on a copy shared by callers, Bob was served Alice's."""
    proxy = await stdio_proxy(make_proxy, everything_command(), tools=[])
    assert "file:///home/alice" in await roots_round(proxy.client, "get-roots-list", ALICES_ROOTS, headers=ALICE)
    bobs = await roots_round(proxy.client, "get-roots-list", headers=BOB)
    assert "alice" not in bobs and "file:///srv/project" in bobs, bobs
    owners = {channel.owner for channel in proxy.app[gateway_key].relay.pool.channels}
    assert len(owners) == 2, owners


async def test_shared_copies_serve_one_callers_roots_to_the_next(make_proxy):
    """What share_children: true leaks, as the docs say (for servers that keep nothing of a caller)."""
    proxy = await stdio_proxy(make_proxy, everything_command(), tools=[], upstream={"stdio": {"share_children": True}})
    assert "file:///home/alice" in await roots_round(proxy.client, "get-roots-list", ALICES_ROOTS, headers=ALICE)
    bob = request("tools/call", {"name": "get-roots-list", "arguments": {}, "_meta": meta(tasks=False, **ROOTS)})
    reply = await proxy.client.send(bob, headers=BOB)
    assert "file:///home/alice" in json.dumps(reply.message), reply.message


async def test_an_idle_copy_of_another_caller_is_restarted_for_a_caller_with_none(make_proxy):
    proxy = await stdio_proxy(make_proxy, legacy_command(), tools=[], upstream={"stdio": {"max_children": 1}})
    pool = proxy.app[gateway_key].relay.pool
    alices = await tool_text(proxy, "pid", headers=ALICE)
    with structlog.testing.capture_logs() as logs:
        bobs = await tool_text(proxy, "pid", headers=BOB)  # answered by the new run, never the old one
    assert [line["event"] for line in logs if line["event"] == "stdio_child_reassigned"] == ["stdio_child_reassigned"]
    assert bobs != alices and str(pool.channels[0].pid) == bobs
    assert len(pool.channels) == 1


async def test_concurrent_calls_that_may_be_asked_share_one_session_with_a_stdio_child(make_proxy):
    """Over stdio the proxy's sessions all name the child's one: a caller's calls, however many may be asked
    something at once, use one (they were a session each, and failed past upstream.max_sessions)."""
    proxy = await stdio_proxy(make_proxy, legacy_command(), tools=[], upstream={"max_sessions": 1})
    ask = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)}
    for _ in range(3):  # each round left open: the next call goes to another copy, and to the same session
        reply = await proxy.client.call("tools/call", ask)
        assert reply.result.get("resultType") == "input_required", reply.message
    assert proxy.app[gateway_key].legacy.session_count() == 1


async def test_a_caller_waits_for_a_copy_while_every_one_is_busy_then_is_refused_saying_why(make_proxy):
    proxy = await stdio_proxy(
        make_proxy,
        hostile_command("ok"),
        tools=[],
        upstream={"stdio": {"max_children": 1, "start_timeout_s": 2, "stop_grace_s": 0.1}},
    )
    held = asyncio.ensure_future(proxy.client.call_tool("sleep", {"seconds": 30}, tasks=False, headers=ALICE))
    pool = proxy.app[gateway_key].relay.pool

    async def in_the_child():
        return pool.in_flight > 0

    await eventually(in_the_child, what="Alice's call in the only copy")
    refused = await proxy.client.call_tool("sleep", {"seconds": 0}, tasks=False, headers=BOB)
    message = refused.message["error"]["message"]
    assert "serves another caller's calls" in message and "upstream.stdio.max_children" in message, message
    assert not held.done()  # Alice's call was never touched
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    reply = await proxy.client.call_tool("sleep", {"seconds": 0}, tasks=False, headers=BOB)
    assert "result" in reply.message, reply.message  # once Alice's copy is idle, it is restarted for Bob


@pytest.mark.parametrize("who", ["another caller", "the same caller"])
async def test_a_round_nobody_retried_yields_its_copy_to_a_call_that_needs_it(make_proxy, who):
    """Every copy held by a parked MRTR round (MRTR lets a client read a round and never retry): a call that needs
    one ends the oldest round rather than wait behind it for round_wait_s, or be refused as ambiguous."""
    proxy = await stdio_proxy(
        make_proxy, legacy_command(), tools=[], upstream={"stdio": {"max_children": 1}, "round_wait_s": 600}
    )
    ask = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, **ELICIT)}
    first = await proxy.client.call("tools/call", ask, headers=ALICE)
    assert first.result["resultType"] == "input_required"
    second = BOB if who == "another caller" else ALICE
    again = await proxy.client.call("tools/call", ask, headers=second)
    assert again.result["resultType"] == "input_required", again.message  # its own question reached it
    late = {**ask, "requestState": first.result["requestState"], "inputResponses": {}}
    assert (await proxy.client.call("tools/call", late, headers=ALICE)).error["code"] == -32602
