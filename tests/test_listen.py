"""subscriptions/listen with notifications.taskIds: task state pushed instead of polled."""

from __future__ import annotations

import json
import secrets

import aiohttp
import pytest

from mcp_tasks_proxy.clients import listen
from mcp_tasks_proxy.front.context import runner_key
from mcp_tasks_proxy.upstream.http.sse import SseParser
from tests.conftest import eventually
from tests.factories import headers_for, meta, request
from tests.schemas import validate

SUB = "io.modelcontextprotocol/subscriptionId"


class Subscription:
    """Reads a listen stream message by message, keeping comments (keep-alives) apart."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.parser = SseParser()
        self.pending: list[dict] = []
        self.raw = b""

    async def next(self) -> dict | None:
        while not self.pending:
            chunk = await self.response.content.readany()
            if not chunk:
                return None
            self.raw += chunk
            self.pending.extend(json.loads(e.data) for e in self.parser.feed(chunk) if e.data)
        return self.pending.pop(0)


async def subscribe(proxy, task_ids, *, tasks=True, headers=None, **filters):
    message = request(
        "subscriptions/listen", {"notifications": {"taskIds": task_ids, **filters}, "_meta": meta(tasks=tasks)}
    )
    response = await proxy.client.session.post(
        proxy.url, data=json.dumps(message), headers={**headers_for(message), **(headers or {})}
    )
    return message, response


@pytest.fixture
async def proxy(make_proxy, mcp_upstream):
    return await make_proxy(mcp_upstream, tools=[{"match": t} for t in ("gated", "slow_report", "one_question")])


async def test_ack_then_every_transition_then_a_clean_close(proxy, upstream_client):
    gate = secrets.token_hex(6)
    mine = (await proxy.client.call_tool("gated", {"tag": gate}, headers={"Authorization": "Bearer me"})).result
    theirs = (
        await proxy.client.call_tool("slow_report", {"topic": "t"}, headers={"Authorization": "Bearer them"})
    ).result
    message, response = await subscribe(
        proxy, [mine["taskId"], theirs["taskId"], "unknown"], headers={"Authorization": "Bearer me"}
    )
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    stream = Subscription(response)
    ack = await stream.next()
    validate(ack, "SubscriptionsAcknowledgedNotification", "core")
    assert ack["params"]["notifications"] == {"taskIds": [mine["taskId"]]}  # only the caller's own task
    assert ack["params"]["_meta"] == {SUB: message["id"]}
    current = await stream.next()
    validate(current, "TaskStatusNotification", "tasks")
    assert current["params"]["status"] == "working"
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    done = await stream.next()
    while done["params"]["status"] == "working":  # the tool's progress, a new statusMessage each, may come first
        assert done["params"]["statusMessage"], done
        done = await stream.next()
    validate(done, "TaskStatusNotification", "tasks")
    assert done["params"]["_meta"] == {SUB: message["id"]}
    polled = await proxy.client.get_task(mine["taskId"], headers={"Authorization": "Bearer me"})
    expected = {k: v for k, v in polled.result.items() if k != "resultType"}
    assert {k: v for k, v in done["params"].items() if k != "_meta"} == expected  # what tasks/get says, exactly
    final = await stream.next()
    validate(final, "SubscriptionsListenResultResponse", "core")
    assert final["id"] == message["id"] and final["result"]["_meta"] == {SUB: message["id"]}
    assert await stream.next() is None  # every granted task is terminal: the stream ends
    response.release()


async def test_a_tasks_progress_reaches_the_listener_as_it_comes(proxy):
    """Each new statusMessage (the tool's progress) is a change of the task: on the replica that runs it, the listener
    gets it at once, not at the stream's next keep-alive tick (15 s, longer than this whole call)."""
    created = await proxy.client.call_tool("slow_report", {"topic": "tides", "seconds": 3})
    _, response = await subscribe(proxy, [created.result["taskId"]])
    stream = Subscription(response)
    await stream.next()  # the acknowledgement
    seen = []
    while (notification := await stream.next())["method"] == "notifications/tasks":
        seen.append((notification["params"]["status"], notification["params"].get("statusMessage")))
        if notification["params"]["status"] == "completed":
            break
    steps = [message for status, message in seen if status == "working" and message and "step" in message]
    assert len(set(steps)) >= 2, seen  # several steps, each as it came
    assert seen[-1][0] == "completed"
    response.release()


async def test_input_required_reaches_the_listener(proxy):
    created = await proxy.client.call(
        "tools/call", {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})}
    )
    task_id = created.result["taskId"]
    _, response = await subscribe(proxy, [task_id])
    stream = Subscription(response)
    await stream.next()
    notification = await stream.next()
    while notification["params"]["status"] != "input_required":
        notification = await stream.next()
    assert list(notification["params"]["inputRequests"]) == ["q"]
    await proxy.client.call(
        "tasks/update", {"taskId": task_id, "inputResponses": {"q": {"action": "accept", "content": {"answer": "x"}}}}
    )
    statuses = []
    while (event := await stream.next()) is not None and "method" in event:
        statuses.append(event["params"]["status"])
    assert statuses[-1] == "completed"
    response.release()


async def test_task_ids_need_the_extension(proxy):
    _, response = await subscribe(proxy, ["x"], tasks=False)
    body = await response.json()
    assert response.status == 400 and body["error"]["code"] == -32021
    message = request("subscriptions/listen", {"notifications": "all", "_meta": meta()})
    bad = await proxy.client.send(message)
    assert bad.status == 400 and bad.error["code"] == -32602


async def test_upstream_notifications_are_merged_into_one_stream(proxy, upstream_client):
    gate = secrets.token_hex(6)
    task = (await proxy.client.call_tool("gated", {"tag": gate})).result
    message, response = await subscribe(proxy, [task["taskId"]], toolsListChanged=True)
    stream = Subscription(response)
    ack = await stream.next()
    assert ack["params"]["notifications"] == {"toolsListChanged": True, "taskIds": [task["taskId"]]}
    await stream.next()  # the task's current state
    await upstream_client.call_tool("announce_tools_changed", tasks=False)
    changed = await stream.next()
    assert changed["method"] == "notifications/tools/list_changed"
    assert changed["params"]["_meta"] == {SUB: message["id"]}
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)
    done = await stream.next()
    assert done["method"] == "notifications/tasks" and done["params"]["status"] == "completed"
    response.close()  # with an upstream part, the stream lasts until the client leaves


async def test_keepalives_and_cleanup_when_the_client_leaves(proxy, monkeypatch):
    monkeypatch.setattr(listen, "KEEPALIVE_S", 0.05)
    task = (await proxy.client.call_tool("gated", {"tag": secrets.token_hex(6)})).result
    async with aiohttp.ClientSession() as session:
        message = request("subscriptions/listen", {"notifications": {"taskIds": [task["taskId"]]}, "_meta": meta()})
        async with session.post(proxy.url, data=json.dumps(message), headers=headers_for(message)) as response:
            stream = Subscription(response)
            await stream.next()
            await stream.next()
            while b": keep-alive" not in stream.raw:
                stream.raw += await response.content.readany()
    watchers = proxy.app[runner_key].watchers

    async def unwatched():
        return not watchers._queues

    await eventually(unwatched, what="the listener being removed after the client left")


async def test_a_record_that_changed_hands_is_never_sent_to_the_listener(proxy, upstream_client):
    """Defect 8: the loop re-read records without re-checking the principal. Whatever the store answers later (an
    id re-created by someone else after expiry, a store that mixed replies up), only the listener's own task goes
    out."""
    import dataclasses

    from mcp_tasks_proxy.front.context import store_key

    gate = secrets.token_hex(6)
    me = {"Authorization": "Bearer me"}
    task_id = (await proxy.client.call_tool("gated", {"tag": gate}, headers=me)).result["taskId"]
    message, response = await subscribe(proxy, [task_id], headers=me)
    stream = Subscription(response)
    assert (await stream.next())["params"]["notifications"] == {"taskIds": [task_id]}
    assert (await stream.next())["params"]["status"] == "working"
    store = proxy.app[store_key]
    await store.update(task_id, lambda record: dataclasses.replace(record, principal="someone-else"))
    await upstream_client.call_tool("release", {"tag": gate}, tasks=False)  # the task completes: a change event
    final = await stream.next()
    assert "method" not in final and final["id"] == message["id"], final  # the stream ends, the record unsent
    # (Its "waiting at gate" progress may have gone out while it was the listener's; its result never does.)
    assert b"opened" not in stream.raw and await stream.next() is None
    response.release()


async def test_a_subscription_names_at_most_a_bounded_number_of_tasks(proxy):
    """Each task id is watched and read from the store while the stream is open: past the bound, -32602 names it."""
    message, response = await subscribe(proxy, [f"task-{n}" for n in range(listen.MAX_TASK_IDS + 1)])
    answer = await response.json()
    assert answer["error"]["code"] == -32602 and answer["error"]["data"] == {"maxTaskIds": listen.MAX_TASK_IDS}
    assert str(listen.MAX_TASK_IDS) in answer["error"]["message"]
