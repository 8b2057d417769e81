"""Several proxy replicas (real processes) sharing tasks in a real redis-server."""

from __future__ import annotations

import os
import secrets
import signal

import pytest
import redis.asyncio as redis

from tests.conftest import Replica, eventually, start_redis, stop, task_reaches
from tests.factories import McpClient, meta
from tests.test_durable import Client2025, events_of


def gate_tag() -> str:
    return secrets.token_hex(6)


async def gate_is(upstream_client: McpClient, tag: str, state: str) -> bool:
    reply = await upstream_client.call_tool("gate_state", {"tag": tag}, tasks=False)
    return reply.result["structuredContent"]["result"] == state


async def test_any_replica_answers_and_cancels(replicas, session, mcp_upstream, upstream_client):
    a, b = McpClient(session, replicas(mcp_upstream).url), McpClient(session, replicas(mcp_upstream).url)
    tag = gate_tag()
    created = await a.call_tool("gated", {"tag": tag})
    task_id = created.result["taskId"]
    # Written before CreateTaskResult went out: the other replica finds it at once.
    assert (await b.get_task(task_id)).result["status"] == "working"
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call starting")
    ack = await b.cancel_task(task_id)  # B does not hold the call; A does, and must stop it
    assert ack.result == {"resultType": "complete"}
    await eventually(lambda: gate_is(upstream_client, tag, "cancelled"), what="A stopping the upstream call")
    assert (await a.get_task(task_id)).result["status"] == "cancelled"

    done = await a.call_tool("slow_report", {"topic": "t", "seconds": 0})
    finished = await task_reaches(b, done.result["taskId"], "completed")
    assert finished.result["result"]["content"][0]["text"].startswith("Report on t")


async def test_input_answered_on_another_replica(replicas, session, mcp_upstream, legacy_upstream):
    # A modern upstream's MRTR round, and a legacy upstream's request on its stream: answered through B.
    for upstream, tool, key_answer in [
        (mcp_upstream, "one_question", {"action": "accept", "content": {"answer": "via B"}}),
        (legacy_upstream, "ask_name", {"action": "accept", "content": {"name": "via B"}}),
    ]:
        a, b = McpClient(session, replicas(upstream).url), McpClient(session, replicas(upstream).url)
        created = await a.call("tools/call", {"name": tool, "arguments": {}, "_meta": meta(elicitation={})})
        task_id = created.result["taskId"]
        asking = await task_reaches(b, task_id, "input_required")
        (key,) = asking.result["inputRequests"]
        await b.call("tasks/update", {"taskId": task_id, "inputResponses": {key: key_answer}})
        done = await task_reaches(b, task_id, "completed")
        assert "via B" in done.result["result"]["content"][0]["text"]


async def test_killed_replica_tasks_fail_and_finished_ones_survive(replicas, session, mcp_upstream):
    doomed = replicas(mcp_upstream)
    a, b = McpClient(session, doomed.url), McpClient(session, replicas(mcp_upstream).url)
    finished = await a.call_tool("slow_report", {"topic": "kept", "seconds": 0})
    await task_reaches(a, finished.result["taskId"], "completed")
    running = await a.call_tool("gated", {"tag": gate_tag()})
    os.kill(doomed.process.pid, signal.SIGKILL)
    doomed.process.wait()
    failed = await task_reaches(b, running.result["taskId"], "failed")
    assert "replica running this task was lost" in failed.result["statusMessage"]
    assert "its tool rule is not idempotent" in failed.result["statusMessage"]
    assert failed.result["error"]["code"] == -32603
    assert failed.result["error"]["data"] == {"outcome": "unknown"}  # it may or may not have run upstream
    # A new replica reads every stored task, finished ones included.
    c = McpClient(session, replicas(mcp_upstream).url)
    kept = await c.get_task(finished.result["taskId"])
    assert kept.result["status"] == "completed"
    assert kept.result["result"]["content"][0]["text"].startswith("Report on kept")


async def test_sigterm_lets_running_tasks_finish_within_the_grace(replicas, session, mcp_upstream, upstream_client):
    leaving = replicas(mcp_upstream)
    a, b = McpClient(session, leaving.url), McpClient(session, replicas(mcp_upstream).url)
    finishing, stuck = gate_tag(), gate_tag()
    finish_task = await a.call_tool("gated", {"tag": finishing})
    stuck_task = await a.call_tool("gated", {"tag": stuck})
    await eventually(lambda: gate_is(upstream_client, finishing, "started"), what="the first call starting")
    await eventually(lambda: gate_is(upstream_client, stuck, "started"), what="the second call starting")
    leaving.process.send_signal(signal.SIGTERM)
    await upstream_client.call_tool("release", {"tag": finishing}, tasks=False)
    assert leaving.process.wait(timeout=60) == 0
    assert (await task_reaches(b, finish_task.result["taskId"], "completed", "failed")).result["status"] == "completed"
    failed = await task_reaches(b, stuck_task.result["taskId"], "failed")
    assert "shut down" in failed.result["statusMessage"]


async def test_redis_going_away_gives_quick_errors_and_not_ready_then_recovers(replicas, session, mcp_upstream):
    process, url = start_redis()
    try:
        replica = replicas(mcp_upstream, store_url=url, prefix="away:")
        client = McpClient(session, replica.url)
        created = await client.call_tool("slow_report", {"topic": "t", "seconds": 0})
        task_id = created.result["taskId"]
        await task_reaches(client, task_id, "completed")
        ready_url = replica.url.replace("/mcp", "/readyz")
        os.kill(process.pid, signal.SIGSTOP)
        try:
            reply = await client.get_task(task_id)
            assert reply.status == 503
            assert reply.error["code"] == -32603 and "Task store unavailable" in reply.error["message"]
            async with session.get(ready_url) as response:
                assert response.status == 503
                body = await response.json()
            assert body["status"] == "not ready" and body["upstream"] == "ok"
        finally:
            os.kill(process.pid, signal.SIGCONT)

        async def recovered():
            reply = await client.get_task(task_id)
            return reply.status == 200 and reply.result["status"] == "completed"

        await eventually(recovered, what="the replica recovering by itself")
        async with session.get(ready_url) as response:
            assert response.status == 200
    finally:
        stop(process)


async def test_a_transition_on_one_replica_reaches_a_listener_on_another(
    replicas, session, mcp_upstream, upstream_client
):
    a, b = McpClient(session, replicas(mcp_upstream).url), replicas(mcp_upstream)
    tag = gate_tag()
    task_id = (await a.call_tool("gated", {"tag": tag})).result["taskId"]
    message = {
        "jsonrpc": "2.0", "id": "listen-b", "method": "subscriptions/listen",
        "params": {"notifications": {"taskIds": [task_id]}, "_meta": meta()},
    }  # fmt: skip
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "subscriptions/listen"}  # fmt: skip
    async with session.post(b.url, json=message, headers=headers) as response:
        body = b""
        while b'"status":"working"' not in body:
            body += await response.content.readany()
        await upstream_client.call_tool("release", {"tag": tag}, tasks=False)
        body += await response.read()  # the stream ends once the granted task is terminal
    assert b'"status":"completed"' in body and b'"id":"listen-b","result"' in body


async def test_a_durable_call_resumes_is_answered_and_cancelled_on_another_replica(
    replicas, session, legacy_upstream, legacy_client
):
    """A 2025-era client's durable call, started on A: its stream resumes on B (Last-Event-ID), the server's question
    is answered through B, and another call of it is cancelled through B (notifications/cancelled)."""
    a, b = replicas(legacy_upstream).url, replicas(legacy_upstream).url
    on_a = Client2025(session, a)
    await on_a.initialize({"elicitation": {}})
    on_b = Client2025(session, b)
    on_b.headers = dict(on_a.headers)  # the same client, its connection now landing on B
    async with on_a.call("ask_name", {}) as response:
        async for event, _ in events_of(response):
            last_event_id = event.id  # the priming event; then A's connection is gone
            break
    final = None
    async with on_b.resume(last_event_id) as resumed:
        assert resumed.status == 200
        async for _, message in events_of(resumed):
            if message and message.get("method") == "elicitation/create":
                assert await on_b.answer(message["id"], {"action": "accept", "content": {"name": "via B"}}) == 202
            final = message
    assert final["result"]["content"][0]["text"] == "hello via B"

    tag = gate_tag()
    async with on_a.call("gated", {"tag": tag}, request_id="stop-me") as response:
        async for _, _message in events_of(response):
            break

        async def state(expected):
            return await legacy_client.call_tool("gate_state", {"tag": tag}) == expected

        await eventually(lambda: state("started"), what="the call reaching the server")
        assert await on_b.notify("notifications/cancelled", {"requestId": "stop-me"}) == 202
        await eventually(lambda: state("cancelled"), what="A stopping the call B was told to cancel")


async def test_sep_1686_tasks_are_listed_and_finished_through_another_replica(replicas, session, legacy_upstream):
    a, b = replicas(legacy_upstream).url, replicas(legacy_upstream).url
    on_a = Client2025(session, a)
    await on_a.initialize({"elicitation": {}})
    on_b = Client2025(session, b)
    on_b.headers = dict(on_a.headers)
    made = []
    for n in range(2):
        message = {"jsonrpc": "2.0", "id": n + 1, "method": "tools/call",
                   "params": {"name": "ask_name", "arguments": {}, "task": {}}}  # fmt: skip
        async with session.post(a, json=message, headers=on_a.headers) as response:
            made.append((await response.json())["result"]["task"]["taskId"])
    listing = {"jsonrpc": "2.0", "id": 9, "method": "tasks/list", "params": {}}
    async with session.post(b, json=listing, headers=on_b.headers) as response:
        listed = (await response.json())["result"]["tasks"]
    assert [task["taskId"] for task in listed] == made
    result = {"jsonrpc": "2.0", "id": 10, "method": "tasks/result", "params": {"taskId": made[0]}}
    final = None
    async with session.post(b, json=result, headers=on_b.headers) as response:
        async for _, message in events_of(response):
            if message and message.get("method") == "elicitation/create":
                await on_b.answer(message["id"], {"action": "accept", "content": {"name": "via B"}})
            final = message
    assert final["id"] == 10 and final["result"]["content"][0]["text"] == "hello via B"


async def test_a_lost_replicas_sep_1686_task_is_polled_and_finished_through_another_with_sessions_routed(
    replicas, session, legacy_upstream, legacy_client
):
    """The session is A's (listen.advertise_url routes it there); A dies mid-call. B answered the client's tasks/get
    with 404 (the session's replica is gone), and the client never saw the outcome B's run wrote. Now B answers
    from the task's record: working while A's lease decides, then the result of the call run again."""
    tools = [{"match": "gated", "idempotent": True}]
    doomed = replicas(legacy_upstream, tools=tools, advertise=True)
    on_a = Client2025(session, doomed.url)
    await on_a.initialize()
    on_b = Client2025(session, replicas(legacy_upstream, tools=tools, advertise=True).url)
    on_b.headers = dict(on_a.headers)
    tag = gate_tag()
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "gated", "arguments": {"tag": tag}, "task": {}}}  # fmt: skip
    async with session.post(on_a.url, json=message, headers=on_a.headers) as response:
        task_id = (await response.json())["result"]["task"]["taskId"]

    async def arrived(count: int) -> bool:
        return await legacy_client.call_tool("gate_arrivals", {"tag": tag}) == str(count)

    await eventually(lambda: arrived(1), what="the first run")
    killed(doomed)
    poll = {"jsonrpc": "2.0", "id": 2, "method": "tasks/get", "params": {"taskId": task_id}}
    async with session.post(on_b.url, json=poll, headers=on_b.headers) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["result"]["status"] == "working"
    await eventually(lambda: arrived(2), what="the call running again on B")
    await legacy_client.call_tool("release", {"tag": tag})
    result = {"jsonrpc": "2.0", "id": 3, "method": "tasks/result", "params": {"taskId": task_id}}
    async with session.post(on_b.url, json=result, headers=on_b.headers) as response:
        final = await response.json()
    assert final["result"]["content"][0]["text"] == f"gate {tag} opened", final
    # The session lives in the server both replicas share, not in A: B serves its other requests now, the same
    # every time (a sidecar's server goes with its pod, and says 404: test_any_replica).
    listing = {"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": {}}
    for _ in range(2):
        async with session.post(on_b.url, json=listing, headers=on_b.headers) as response:
            answer = await response.text()  # JSON or one event, as the server chooses
            assert response.status == 200 and '"name":"gated"' in answer.replace(" ", ""), answer
    assert await on_b.notify("notifications/roots/list_changed") == 202


# --- takeover: a lost or stopping replica's calls run again elsewhere, where that is safe --------------------------


async def arrivals(upstream_client: McpClient, tag: str) -> int:
    reply = await upstream_client.call_tool("gate_arrivals", {"tag": tag}, tasks=False)
    return int(reply.result["structuredContent"]["result"])


async def release_gate(upstream_client: McpClient, tag: str) -> None:
    await upstream_client.call_tool("release", {"tag": tag}, tasks=False)


def killed(replica: Replica) -> None:
    os.kill(replica.process.pid, signal.SIGKILL)
    replica.process.wait()


async def one_running_one_queued(on_a: McpClient, on_b: McpClient, upstream_client: McpClient):
    """Two calls of a tool that runs one at a time, through A: the first running upstream, the second queued behind
    it (as B reads it). Their gate tags and task ids: (first, first task, second, second task)."""
    first, second = gate_tag(), gate_tag()
    running = (await on_a.call_tool("gated", {"tag": first})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, first, "started"), what="the first call")
    queued = (await on_a.call_tool("gated", {"tag": second})).result["taskId"]
    await eventually(lambda: _says(on_b, queued, "queued"), what="the second call queued")
    return first, running, second, queued


async def test_a_lost_replicas_idempotent_call_runs_again_on_another_and_completes(
    replicas, session, mcp_upstream, upstream_client
):
    tools = [{"match": "gated", "idempotent": True}]
    doomed = replicas(mcp_upstream, tools=tools)
    a, b = McpClient(session, doomed.url), McpClient(session, replicas(mcp_upstream, tools=tools).url)
    tag = gate_tag()
    task_id = (await a.call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the first run")
    killed(doomed)
    await eventually(lambda: _is(arrivals(upstream_client, tag), 2), what="the call running again on B")
    running = await b.get_task(task_id)
    assert running.result["status"] == "working"
    # Its progress says which run it is.
    assert running.result["statusMessage"].startswith("attempt 2 of 3, after a lost proxy replica: ")
    await release_gate(upstream_client, tag)  # both runs wait at the gate: the one B runs answers
    done = await task_reaches(b, task_id, "completed")
    assert done.result["result"]["content"][0]["text"] == f"gate {tag} opened"
    assert await arrivals(upstream_client, tag) == 2


async def test_a_queued_call_of_a_lost_replica_runs_elsewhere_whatever_its_rule(
    replicas, session, mcp_upstream, upstream_client
):
    # Not idempotent, one call at a time: the running one may have taken effect, the queued one never left.
    tools = [{"match": "gated", "max_concurrency": 1}]
    doomed = replicas(mcp_upstream, tools=tools)
    a, b = McpClient(session, doomed.url), McpClient(session, replicas(mcp_upstream, tools=tools).url)
    _, running, second, queued = await one_running_one_queued(a, b, upstream_client)
    killed(doomed)
    lost = await task_reaches(b, running, "failed")
    assert lost.result["error"]["data"] == {"outcome": "unknown"}
    await eventually(lambda: gate_is(upstream_client, second, "started"), what="the queued call on B")
    await release_gate(upstream_client, second)
    await task_reaches(b, queued, "completed")
    assert await arrivals(upstream_client, second) == 1


async def test_a_call_that_loses_every_replica_it_runs_on_stops_at_its_attempts(
    replicas, session, mcp_upstream, upstream_client
):
    tools = [{"match": "gated", "idempotent": True, "retry": {"attempts": 2}}]
    first, second = replicas(mcp_upstream, tools=tools), replicas(mcp_upstream, tools=tools)
    tag = gate_tag()
    task_id = (await McpClient(session, first.url).call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the first run")
    killed(first)
    await eventually(lambda: _is(arrivals(upstream_client, tag), 2), what="the second run")
    third = McpClient(session, replicas(mcp_upstream, tools=tools).url)
    killed(second)  # a call that kills its replica (a poison input) must not go on to kill them all
    failed = await task_reaches(third, task_id, "failed")
    assert "it ran 2 times already" in failed.result["statusMessage"]
    assert failed.result["error"]["data"] == {"outcome": "unknown"}
    assert await arrivals(upstream_client, tag) == 2


async def test_sigterm_hands_idempotent_calls_over_at_once_and_keeps_the_others(
    replicas, session, mcp_upstream, upstream_client
):
    # A lease of a minute: only the hand-over can move the call before the test's time is up.
    tools = [{"match": "gated", "idempotent": True}, {"match": "slow_report"}]
    leaving = replicas(mcp_upstream, tools=tools, lease_s=60)
    a, b = McpClient(session, leaving.url), McpClient(session, replicas(mcp_upstream, tools=tools, lease_s=60).url)
    tag = gate_tag()
    moved = (await a.call_tool("gated", {"tag": tag})).result["taskId"]
    stays = (await a.call_tool("slow_report", {"topic": "t", "seconds": 1})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call on A")
    leaving.process.send_signal(signal.SIGTERM)
    await eventually(lambda: _is(arrivals(upstream_client, tag), 2), timeout_s=20, what="B running the call")
    assert (await b.get_task(moved)).result["status"] == "working"
    await release_gate(upstream_client, tag)
    await task_reaches(b, moved, "completed")
    # The one that may not run twice finished on A within the grace.
    assert (await task_reaches(b, stays, "completed")).result["result"]["content"][0]["text"].startswith("Report")
    assert leaving.process.wait(timeout=20) == 0


async def test_without_the_operators_key_no_call_is_kept_and_a_lost_one_is_unknown(
    replicas, session, mcp_upstream, upstream_client
):
    tools = [{"match": "gated", "idempotent": True}]
    doomed = replicas(mcp_upstream, tools=tools, security={})  # the replicas agree on a key kept in Redis
    a, b = McpClient(session, doomed.url), McpClient(session, replicas(mcp_upstream, tools=tools, security={}).url)
    tag = gate_tag()
    task_id = (await a.call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call")
    killed(doomed)
    failed = await task_reaches(b, task_id, "failed")
    assert "no principal key of the operator's" in failed.result["statusMessage"]
    assert failed.result["error"]["data"] == {"outcome": "unknown"}
    assert await arrivals(upstream_client, tag) == 1


async def _is(value, expected) -> bool:
    return await value == expected


async def _says(client: McpClient, task_id: str, words: str) -> bool:
    return words in ((await client.get_task(task_id)).result.get("statusMessage") or "")


@pytest.mark.parametrize("advertise", [False, True], ids=["sessions-unrouted", "sessions-routed"])
async def test_a_durable_calls_stream_resumed_on_another_replica_follows_the_run_after_a_lost_one(
    replicas, session, mcp_upstream, upstream_client, advertise
):
    """A 2025-era client's durable call (no tasks) on A, an idempotent tool: A dies, B runs the call again, and the
    client's stream, resumed on B with its Last-Event-ID, ends with the answer of B's run. With sessions routed to
    their replica (listen.advertise_url), B answered 404 for the lost replica's session, and the client lost the
    call: a request about a recorded call is answered from its record by any replica."""
    tools = [{"match": "gated", "idempotent": True}]
    doomed = replicas(mcp_upstream, tools=tools, advertise=advertise)
    on_a = Client2025(session, doomed.url)
    await on_a.initialize()
    on_b = Client2025(session, replicas(mcp_upstream, tools=tools, advertise=advertise).url)
    on_b.headers = dict(on_a.headers)  # the same client, its connection now landing on B
    tag = gate_tag()
    async with on_a.call("gated", {"tag": tag}) as response:
        async for event, _ in events_of(response):
            last_event_id = event.id  # the priming event; then A's connection is gone
            break
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the first run")
    killed(doomed)
    await eventually(lambda: _is(arrivals(upstream_client, tag), 2), what="the call running again on B")
    await release_gate(upstream_client, tag)
    final = None
    async with on_b.resume(last_event_id) as resumed:
        assert resumed.status == 200
        async for _, message in events_of(resumed):
            if message and "result" in message:
                final = message
    assert final["result"]["content"][0]["text"] == f"gate {tag} opened"


async def test_a_lost_replicas_call_that_the_2025_server_runs_as_its_own_task_is_followed_not_run_again(
    replicas, session, everything_upstream
):
    """server-everything runs simulate-research-query as a SEP-1686 task of its own. The rule is not idempotent, so
    running it again is not allowed: the replica that takes the task over follows the server's task instead."""
    tools = [{"match": "simulate-research-query"}]
    doomed = replicas(everything_upstream, tools=tools)
    b = replicas(everything_upstream, tools=tools)
    a_client, b_client = McpClient(session, doomed.url), McpClient(session, b.url)
    arguments = {"topic": "tides", "ambiguous": False}
    created = await a_client.call_tool("simulate-research-query", arguments)
    task_id = created.result["taskId"]

    store = redis.Redis.from_url(doomed.store_url)

    async def server_task_kept() -> bool:
        # Kept in the task's record, not only logged: a replica lost between the two leaves nothing to follow, and
        # its task ends "unknown" (the right outcome then, and not what this test is about).
        stored = await store.get(doomed.keys.task(task_id))
        return stored is not None and b'"upstream_task"' in stored

    try:
        await eventually(server_task_kept, what="the server's task kept in the record")
    finally:
        await store.aclose()
    killed(doomed)
    done = await task_reaches(b_client, task_id, "completed", "failed")
    assert done.result["status"] == "completed", (done.result.get("statusMessage"), done.result.get("error"))
    assert "tides" in done.result["result"]["content"][0]["text"].lower()
    follows = [line for line in b.log.read_text().splitlines() if "upstream_task_followed" in line]
    assert len(follows) == 1


async def test_a_queued_call_taken_over_is_marked_sent_before_it_runs_so_a_second_loss_does_not_run_it_again(
    replicas, session, mcp_upstream, upstream_client
):
    tools = [{"match": "gated", "max_concurrency": 1}]  # not idempotent: it may run once
    a, b = replicas(mcp_upstream, tools=tools), replicas(mcp_upstream, tools=tools)
    on_a, on_b = McpClient(session, a.url), McpClient(session, b.url)
    _, _, second, queued = await one_running_one_queued(on_a, on_b, upstream_client)
    killed(a)
    await eventually(lambda: gate_is(upstream_client, second, "started"), what="B running the queued call")
    c = McpClient(session, replicas(mcp_upstream, tools=tools).url)
    killed(b)  # now it was sent: C must not send it again
    lost = await task_reaches(c, queued, "failed")
    assert lost.result["error"]["data"] == {"outcome": "unknown"}
    assert await arrivals(upstream_client, second) == 1


async def test_a_paused_owner_does_not_send_a_queued_call_another_replica_took_over(
    replicas, session, mcp_upstream, upstream_client
):
    tools = [{"match": "gated", "max_concurrency": 1}]
    a, b = replicas(mcp_upstream, tools=tools), replicas(mcp_upstream, tools=tools)
    on_a, on_b = McpClient(session, a.url), McpClient(session, b.url)
    first, _, second, queued = await one_running_one_queued(on_a, on_b, upstream_client)
    os.kill(a.process.pid, signal.SIGSTOP)  # paused, not dead: a long GC, a VM migration, a partition
    try:
        await eventually(lambda: gate_is(upstream_client, second, "started"), what="B running the queued call")
        await release_gate(upstream_client, first)  # A's slot frees upstream while A is paused
    finally:
        os.kill(a.process.pid, signal.SIGCONT)

    async def a_stood_down() -> bool:
        return "task_taken_over_elsewhere" in a.log.read_text()

    await eventually(a_stood_down, what="A finding the call taken over when it gets the slot")
    assert await arrivals(upstream_client, second) == 1
    await release_gate(upstream_client, second)
    await task_reaches(on_b, queued, "completed")


async def test_sigterm_keeps_an_idempotent_call_that_has_no_run_left_and_a_lone_replica_keeps_all(
    replicas, session, mcp_upstream, upstream_client
):
    # attempts: 1 says "never send it twice": it finishes on the replica that is stopping, within its grace.
    tools = [{"match": "gated", "idempotent": True, "retry": {"attempts": 1}}]
    leaving = replicas(mcp_upstream, tools=tools, lease_s=60)
    other = McpClient(session, replicas(mcp_upstream, tools=tools, lease_s=60).url)
    tag = gate_tag()
    task_id = (await McpClient(session, leaving.url).call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call")
    leaving.process.send_signal(signal.SIGTERM)

    async def draining() -> bool:
        return "tasks_draining" in leaving.log.read_text()

    await eventually(draining, what="the replica draining")
    await release_gate(upstream_client, tag)
    assert (await task_reaches(other, task_id, "completed")).result["result"]["content"][0]["text"].endswith("opened")
    assert await arrivals(upstream_client, tag) == 1
    assert "tasks_handed_over" not in leaving.log.read_text()

    # Alone (no other replica listens), a stopping replica hands nothing over: its calls have the grace.
    prefix = f"alone-{gate_tag()}:"
    alone = replicas(mcp_upstream, tools=[{"match": "gated", "idempotent": True}], prefix=prefix)
    lone_tag = gate_tag()
    client = McpClient(session, alone.url)
    lone = (await client.call_tool("gated", {"tag": lone_tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, lone_tag, "started"), what="the lone replica's call")
    alone.process.send_signal(signal.SIGTERM)

    async def alone_draining() -> bool:
        return "tasks_draining" in alone.log.read_text()

    await eventually(alone_draining, what="the lone replica draining")
    assert "tasks_handed_over" not in alone.log.read_text()
    await release_gate(upstream_client, lone_tag)
    assert alone.process.wait(timeout=20) == 0
    assert await arrivals(upstream_client, lone_tag) == 1
    later = McpClient(session, replicas(mcp_upstream, prefix=prefix).url)
    assert (await later.get_task(lone)).result["status"] == "completed"  # written before it exited


def _logged(replica: Replica, event: str):
    async def check() -> bool:
        return f'"event":"{event}"' in replica.log.read_text()

    return check


async def test_a_handed_over_call_that_the_2025_server_runs_as_its_own_task_is_followed_not_cancelled(
    replicas, session, everything_upstream
):
    tools = [{"match": "simulate-research-query", "idempotent": True}]
    leaving, staying = replicas(everything_upstream, tools=tools), replicas(everything_upstream, tools=tools)
    created = await McpClient(session, leaving.url).call_tool(
        "simulate-research-query", {"topic": "tides", "ambiguous": False}
    )
    task_id = created.result["taskId"]
    await eventually(_logged(leaving, "upstream_task_created"), what="the server making a task of the call")
    leaving.process.send_signal(signal.SIGTERM)
    done = await task_reaches(McpClient(session, staying.url), task_id, "completed", "failed")
    assert done.result["status"] == "completed", done.result.get("error")
    assert '"event":"upstream_task_cancelled"' not in leaving.log.read_text()


async def test_a_lost_replicas_server_task_that_waits_for_an_answer_asked_through_it_ends_unknown_at_once(
    replicas, session, everything_upstream
):
    """The server asked its question on the lost replica's stream and will not ask again on another: following the
    task would wait until timeout_s (an hour by default). Not idempotent: it ends "unknown" at the takeover."""
    tools = [{"match": "simulate-research-query"}]
    doomed, staying = replicas(everything_upstream, tools=tools), replicas(everything_upstream, tools=tools)
    on_doomed = McpClient(session, doomed.url)
    created = await on_doomed.call(
        "tools/call",
        {"name": "simulate-research-query", "arguments": {"topic": "python", "ambiguous": True},
         "_meta": meta(elicitation={})},
    )  # fmt: skip
    task_id = created.result["taskId"]
    await task_reaches(on_doomed, task_id, "input_required")
    killed(doomed)
    lost = await task_reaches(McpClient(session, staying.url), task_id, "failed")
    assert lost.result["error"]["data"] == {"outcome": "unknown"}
    assert "waits for an answer" in lost.result["statusMessage"]


async def test_a_server_task_is_followed_whatever_the_rules_attempts(replicas, session, everything_upstream):
    tools = [{"match": "simulate-research-query", "retry": {"attempts": 1}}]  # "never send it twice"
    doomed, staying = replicas(everything_upstream, tools=tools), replicas(everything_upstream, tools=tools)
    created = await McpClient(session, doomed.url).call_tool(
        "simulate-research-query", {"topic": "tides", "ambiguous": False}
    )
    await eventually(_logged(doomed, "upstream_task_created"), what="the server making a task of the call")
    killed(doomed)
    done = await task_reaches(McpClient(session, staying.url), created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result.get("statusMessage")


async def test_replicas_stopped_together_finish_their_calls_within_the_grace(
    replicas, session, mcp_upstream, upstream_client
):
    """Scale to zero: each stopping replica offers its idempotent call to the other, which takes nothing (it is
    stopping too): the call goes on where it runs and finishes within the grace, as without a hand-over."""
    tools = [{"match": "gated", "idempotent": True}]
    prefix = f"together-{gate_tag()}:"
    a, b = replicas(mcp_upstream, tools=tools, prefix=prefix), replicas(mcp_upstream, tools=tools, prefix=prefix)
    tag = gate_tag()
    task_id = (await McpClient(session, a.url).call_tool("gated", {"tag": tag})).result["taskId"]
    await eventually(lambda: gate_is(upstream_client, tag, "started"), what="the call")
    a.process.send_signal(signal.SIGTERM)
    b.process.send_signal(signal.SIGTERM)
    await eventually(_logged(a, "tasks_draining"), what="A draining")
    await release_gate(upstream_client, tag)
    assert a.process.wait(timeout=20) == 0 and b.process.wait(timeout=20) == 0
    later = McpClient(session, replicas(mcp_upstream, tools=tools, prefix=prefix).url)
    assert (await later.get_task(task_id)).result["status"] == "completed"
    assert await arrivals(upstream_client, tag) == 1


async def test_a_replica_told_to_stop_while_it_starts_stops_gracefully(replicas, mcp_upstream):
    """The socket takes connections before the replica has started (its store may be slow to answer): a SIGTERM
    then, from an orchestrator or a probe's failure, is a graceful stop, not the signal's default death."""
    redis_process, url = start_redis()
    try:
        os.kill(redis_process.pid, signal.SIGSTOP)  # a store that does not answer: the start waits on it
        starting = replicas(mcp_upstream, store_url=url, wait_started=False)
        starting.process.send_signal(signal.SIGTERM)
        assert starting.process.wait(timeout=30) == 0
        assert '"event":"proxy_stopped"' in starting.log.read_text()
    finally:
        os.kill(redis_process.pid, signal.SIGCONT)
        stop(redis_process)
