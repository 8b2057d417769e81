"""Takeover's guards, in process against a real redis-server: what a record says is checked before anything runs
again, and a call is marked sent before it is sent, whatever the store's timing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from datetime import UTC, datetime

import pytest
import redis.asyncio as redis_client
from multidict import CIMultiDict

from mcp_tasks_proxy.config import TaskDefaults, ToolRule
from mcp_tasks_proxy.store.base import MemoryTaskStore
from mcp_tasks_proxy.store.redis_store import RedisTaskStore
from mcp_tasks_proxy.tasks.attempts import SHUTDOWN
from mcp_tasks_proxy.tasks.job import TAKEN_OVER, ToolCall
from mcp_tasks_proxy.tasks.model import RELEASED, TaskRecord, TaskStatus, from_json, new_task_id, to_json
from mcp_tasks_proxy.tasks.runner import TaskRunner
from mcp_tasks_proxy.tasks.sealing import CallSeal
from mcp_tasks_proxy.upstream.events import Finished, UpstreamTask, UpstreamUnavailable
from mcp_tasks_proxy.upstream.gateway import Gateway
from tests.conftest import eventually


class SlowCreate(RedisTaskStore):
    """Fault injection: every task's record takes 0.3 s to be made (a slow Redis round trip)."""

    async def create(self, record, context=None):
        await asyncio.sleep(0.3)
        await super().create(record, context)


class GatedUpstream:
    """Fault injection: each call waits at its own gate; records what was sent."""

    url = "http://upstream.invalid/mcp"
    known_era = "modern"
    tasks_reach_replicas = False

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []

    def call_tool(
        self, message, headers, capabilities, *, max_bytes, on_request, session, follow, detached=None, caller=""
    ):
        tag = message["params"]["arguments"]["tag"]
        self.sent.append(tag)
        gate = self.gates.setdefault(tag, asyncio.Event())

        async def events():
            await gate.wait()
            yield Finished(result={"content": [], "isError": False})

        return events()

    async def notify_cancelled(self, request_id, headers, reason) -> None:
        self.cancelled.append(reason)


def call(tag: str) -> ToolCall:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "arguments": {"tag": tag}}}
    return ToolCall(tool="t", message=message, headers=CIMultiDict())


async def test_a_call_that_gets_its_slot_while_its_record_is_made_is_marked_sent_before_it_is(redis_url):
    prefix = f"race-{secrets.token_hex(3)}:"
    store = SlowCreate(redis_url, key_prefix=prefix, lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", max_concurrency=1, sync_window_ms=50)
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    try:
        first = asyncio.ensure_future(runner.submit(call("first"), rule))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(runner.submit(call("second"), rule))
        await asyncio.sleep(0.15)  # second's window is over; its record (queued) is being made
        upstream.gates["first"].set()  # first ends: second gets the slot before its record exists
        await first
        record = await second

        async def sent() -> bool:
            return upstream.sent == ["first", "second"]

        while not await sent():
            await asyncio.sleep(0.01)
        stored = await store.get(record.task_id)
        assert stored is not None and stored.queued is False  # sent: a takeover must not run it again as unsent
        upstream.gates["second"].set()
    finally:
        await runner.aclose()
        await store.aclose()


@pytest.mark.parametrize(
    ("field", "value"),
    [("attempt", "2"), ("attempt", 0), ("attempt", -3), ("attempt", True), ("queued", "no"), ("queued", 1),
     ("upstream_task", 5), ("owner", ["a"])],
)  # fmt: skip
def test_a_record_whose_takeover_fields_are_not_what_the_proxy_writes_does_not_read(field, value):
    now = datetime.now(UTC)
    record = TaskRecord(new_task_id(), "t", TaskStatus.WORKING, now, now, 60_000, 1000, owner="r")
    data = json.loads(to_json(record))
    data[field] = value
    with pytest.raises(ValueError):
        from_json(json.dumps(data))


async def test_one_bad_record_of_a_lost_replica_does_not_stop_the_sweep_for_the_others(redis_url):
    prefix = f"sweep-{secrets.token_hex(3)}:"
    writer = redis_client.from_url(redis_url)
    now = datetime.now(UTC)

    def lost(**fields) -> TaskRecord:
        return TaskRecord(new_task_id(), "t", TaskStatus.WORKING, now, now, 600_000, 50, owner="ghost", **fields)

    bad = lost()
    data = json.loads(to_json(bad))
    data["attempt"] = "2"
    records = [lost() for _ in range(10)]
    try:
        await writer.set(prefix + "task:" + bad.task_id, json.dumps(data), px=600_000)
        for record in records:
            await writer.set(prefix + "task:" + record.task_id, to_json(record), px=600_000)
        await writer.sadd(prefix + "running", bad.task_id, *(record.task_id for record in records))
        store = RedisTaskStore(redis_url, key_prefix=prefix, lease_s=0.01, timeout_s=2)
        rule = ToolRule(match="t", idempotent=True)
        runner = TaskRunner(
            store, GatedUpstream(), TaskDefaults, lease_s=0.01, seal=CallSeal(b"k"), rule_for=lambda tool: rule
        )
        try:
            await asyncio.sleep(0.05)  # the store healthy for longer than a lease
            assert await runner.reap_lost() == len(records)
            for record in records:  # no call was kept for them: each ends "unknown", none is left working
                ended = await store.get(record.task_id)
                assert ended.status is TaskStatus.FAILED and ended.error["data"] == {"outcome": "unknown"}
            assert json.loads(await writer.get(prefix + "task:" + bad.task_id))["status"] == "working"
        finally:
            await runner.aclose()
            await store.aclose()
    finally:
        await writer.aclose()


class FlakyProbe:
    """Fault injection: the first era probe of a replica that just started finds the upstream away."""

    url = "http://upstream.invalid/mcp"

    def __init__(self) -> None:
        self.probes = 0

    async def probe(self, headers):
        self.probes += 1
        if self.probes == 1:
            raise UpstreamUnavailable("connection refused")
        return "legacy"


class FollowingLegacy:
    """Fault injection: a 2025 server side that records whether each call followed a task or was sent."""

    class link:  # noqa: N801 (an attribute holder, as the real link)
        tasks_reach_replicas = True

    def __init__(self) -> None:
        self.calls: list = []

    def call(self, message, headers, capabilities, *, max_bytes, on_request, follow, detached=None, caller=""):
        self.calls.append(follow)

        async def events():
            yield Finished({"content": [], "isError": False})

        return events()


async def test_a_follow_that_fails_before_it_reaches_the_upstream_follows_again_and_never_sends_the_call(redis_url):
    store = RedisTaskStore(redis_url, key_prefix=f"follow-{secrets.token_hex(3)}:", lease_s=0.01, timeout_s=2)
    seal = CallSeal(b"k")
    rule = ToolRule(match="t", retry={"backoff_ms": 1})  # not idempotent: it may only be followed
    now = datetime.now(UTC)
    task_id = new_task_id()
    made = UpstreamTask("upstream-task-1", "session-1", "2025-11-25")
    record = TaskRecord(
        task_id, "t", TaskStatus.WORKING, now, now, 600_000, 50, owner="ghost",
        upstream_task=seal.seal_upstream_task(task_id, made, ""),
    )  # fmt: skip
    await store.create(record, seal.seal(task_id, call("x")))
    legacy = FollowingLegacy()
    gateway = Gateway(FlakyProbe(), legacy, relay=None, protocol="auto")
    runner = TaskRunner(store, gateway, TaskDefaults, lease_s=0.01, seal=seal, rule_for=lambda tool: rule)
    try:
        await asyncio.sleep(0.05)
        assert await runner.reap_lost() == 1
        while not (await store.get(task_id)).is_terminal:
            await asyncio.sleep(0.02)
        assert legacy.calls == [made]  # the probe failed first; the retry followed the server's task
        assert (await store.get(task_id)).status is TaskStatus.COMPLETED
    finally:
        await runner.aclose()
        await store.aclose()


async def test_a_replica_that_was_thought_lost_does_not_write_its_outcome_over_the_new_owners(redis_url):
    store = RedisTaskStore(redis_url, key_prefix=f"zombie-{secrets.token_hex(3)}:", lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", idempotent=True)
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    try:
        record = await runner.submit(call("paused"), rule)
        while "paused" not in upstream.sent:
            await asyncio.sleep(0.01)
        # Meanwhile another replica took it over (this one was paused past its lease): the record names that one.
        await store.update(record.task_id, lambda r: dataclasses.replace(r, owner="replica-b", attempt=2))
        upstream.gates["paused"].set()
        while record.task_id in runner._state.jobs:
            await asyncio.sleep(0.01)
        after = await store.get(record.task_id)
        assert after.status is TaskStatus.WORKING and after.owner == "replica-b"  # replica-b's run writes it
    finally:
        await runner.aclose()
        await store.aclose()


async def test_a_call_of_a_rule_that_may_not_run_again_leaves_no_credentials_in_the_store_once_sent(redis_url):
    prefix = f"kept-{secrets.token_hex(3)}:"
    store = RedisTaskStore(redis_url, key_prefix=prefix, lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", max_concurrency=1)  # kept in case it queues; not idempotent
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    reader = redis_client.from_url(redis_url)
    try:
        record = await runner.submit(call("sent"), rule)
        while "sent" not in upstream.sent:
            await asyncio.sleep(0.01)
        assert not await reader.exists(f"{prefix}call:{record.task_id}")
        upstream.gates["sent"].set()
    finally:
        await reader.aclose()
        await runner.aclose()
        await store.aclose()


def lease_key(prefix: str, replica_id: str) -> str:
    return f"{prefix}replica:{replica_id}"


async def test_a_call_released_by_a_live_replica_that_may_not_run_here_is_left_to_it_until_that_replica_is_gone(
    redis_url,
):
    prefix = f"left-{secrets.token_hex(3)}:"
    store = RedisTaskStore(redis_url, key_prefix=prefix, lease_s=0.01, timeout_s=2)
    seal = CallSeal(b"k")
    rule = ToolRule(match="t")  # not idempotent: only its own replica may go on with it
    now = datetime.now(UTC)
    task_id = new_task_id()
    record = TaskRecord(task_id, "t", TaskStatus.WORKING, now, now, 600_000, 50, owner="released:replica-a")
    await store.create(record, seal.seal(task_id, call("x")))
    writer = redis_client.from_url(redis_url)
    await writer.set(lease_key(prefix, "replica-a"), "1", px=60_000)  # replica-a is stopping, not gone
    runner = TaskRunner(store, GatedUpstream(), TaskDefaults, lease_s=0.01, seal=seal, rule_for=lambda tool: rule)
    try:
        await asyncio.sleep(0.05)  # the store answered for longer than a lease: leases are known
        assert await runner.reap_lost() == 0
        left = await store.get(task_id)
        assert left.status is TaskStatus.WORKING and left.owner == "released:replica-a"  # it still runs there
        await writer.delete(lease_key(prefix, "replica-a"))  # gone before its call ended
        assert await runner.reap_lost() == 1
        ended = await store.get(task_id)
        assert ended.status is TaskStatus.FAILED and ended.error["data"]["outcome"] == "unknown"
    finally:
        await writer.aclose()
        await runner.aclose()
        await store.aclose()


async def test_a_call_run_again_elsewhere_names_no_server_task_and_its_first_run_is_stopped_not_detached(redis_url):
    store = RedisTaskStore(redis_url, key_prefix=f"rerun-{secrets.token_hex(3)}:", lease_s=0.01, timeout_s=2)
    seal = CallSeal(b"k")
    rule = ToolRule(match="t", idempotent=True)
    now = datetime.now(UTC)
    task_id = new_task_id()
    made = UpstreamTask("upstream-task-1", "session-1", "2025-11-25")
    # A server task this replica cannot open (sealed under another principal key): the call runs again instead.
    unreadable = CallSeal(b"other").seal_upstream_task(task_id, made, "")
    record = TaskRecord(
        task_id, "t", TaskStatus.WORKING, now, now, 600_000, 50, owner="ghost", upstream_task=unreadable
    )  # fmt: skip
    await store.create(record, seal.seal(task_id, call("again")))
    upstream = GatedUpstream()
    runner = TaskRunner(store, upstream, TaskDefaults, lease_s=0.01, seal=seal, rule_for=lambda tool: rule)
    try:
        await asyncio.sleep(0.05)
        assert await runner.reap_lost() == 1
        taken = await store.get(task_id)
        assert taken.attempt == 2 and taken.upstream_task is None  # the old server task is followed by nobody
        upstream.gates["again"].set()
    finally:
        await runner.aclose()
        await store.aclose()


async def running_job(runner: TaskRunner, upstream: GatedUpstream, tag: str, rule: ToolRule):
    record = await runner.submit(call(tag), rule)
    while tag not in upstream.sent:
        await asyncio.sleep(0.01)
    return record, runner._state.jobs[record.task_id]


@pytest.mark.parametrize(("follows", "detached"), [("sealed-server-task", True), ("another", False), (None, False)])
async def test_a_taken_event_leaves_the_server_task_running_only_when_the_taker_follows_that_very_task(
    redis_url, follows, detached
):
    store = RedisTaskStore(redis_url, key_prefix=f"taken-{secrets.token_hex(3)}:", lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", idempotent=True)
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    try:
        record, job = await running_job(runner, upstream, "taken", rule)
        job.upstream_task = "sealed-server-task"  # as settlement keeps it once the server made its task
        await runner._recovery._on_event({"type": "taken", "taskId": record.task_id, "owner": "b", "follows": follows})
        await asyncio.wait_for(asyncio.shield(job.runner), 5)
        assert job.detached is detached
        assert job.cancel_reason == TAKEN_OVER
        assert (await store.get(record.task_id)).status is TaskStatus.WORKING  # not settled by this replica
    finally:
        await runner.aclose()
        await store.aclose()


async def test_reconciliation_does_not_stop_a_call_its_own_replica_released_and_nobody_took(redis_url):
    store = RedisTaskStore(redis_url, key_prefix=f"own-{secrets.token_hex(3)}:", lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", idempotent=True)
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    try:
        record, job = await running_job(runner, upstream, "mine", rule)
        job.round_open = True  # waits for an answer: reconciliation reads its record
        me = runner._state.replica_id
        await store.update(record.task_id, lambda r: dataclasses.replace(r, owner=RELEASED + me))
        assert await runner.reconcile() == 0
        assert not job.runner.done() and job.cancel_reason is None
        await store.update(record.task_id, lambda r: dataclasses.replace(r, owner="replica-b"))  # now taken
        assert await runner.reconcile() == 1
        assert job.cancel_reason == TAKEN_OVER
    finally:
        await runner.aclose()
        await store.aclose()


async def test_a_call_taken_just_before_the_grace_ends_stops_as_taken_over_not_failed_at_shutdown(redis_url):
    store = RedisTaskStore(redis_url, key_prefix=f"late-{secrets.token_hex(3)}:", lease_s=10, timeout_s=2)
    upstream = GatedUpstream()
    rule = ToolRule(match="t", idempotent=True)
    runner = TaskRunner(store, upstream, TaskDefaults, seal=CallSeal(b"k"), rule_for=lambda tool: rule)
    try:
        record, job = await running_job(runner, upstream, "late", rule)
        job.upstream_task = "sealed-server-task"
        # Taken by replica-b, whose "taken" event this replica has not seen.
        await store.update(
            record.task_id,
            lambda r: dataclasses.replace(r, owner="replica-b", upstream_task="sealed-server-task"),
        )
        await runner.aclose(grace_s=0.05)
        assert job.cancel_reason == TAKEN_OVER and job.detached  # the server task is left to replica-b
        after = await store.get(record.task_id)
        assert after.status is TaskStatus.WORKING and after.owner == "replica-b"
    finally:
        await runner.aclose()
        await store.aclose()


async def test_a_lost_replicas_task_is_not_taken_while_a_run_of_it_still_ends_here(redis_url):
    """This replica ran the task before another took it, and that run is still ending here when the other replica
    is lost in turn: the sweep leaves the task to a later sweep rather than start a second job under its id (which
    would also leave the first one's place in the per-caller counts for ever)."""
    store = RedisTaskStore(redis_url, key_prefix=f"twice-{secrets.token_hex(3)}:", lease_s=0.01, timeout_s=2)
    seal = CallSeal(b"k")
    rule = ToolRule(match="t", idempotent=True)
    now = datetime.now(UTC)
    task_id = new_task_id()
    record = TaskRecord(task_id, "t", TaskStatus.WORKING, now, now, 600_000, 50, owner="ghost")
    await store.create(record, seal.seal(task_id, call("again")))
    upstream = GatedUpstream()
    runner = TaskRunner(store, upstream, TaskDefaults, lease_s=0.01, seal=seal, rule_for=lambda tool: rule)
    admission = runner._admission
    try:
        earlier = admission.adopt(call("earlier"), rule, record)  # the run this replica still ends
        admission.start(earlier)
        await asyncio.sleep(0.05)  # the store answered for longer than a lease: "ghost" is known to be gone
        assert await runner.reap_lost() == 0
        assert runner._state.jobs == {task_id: earlier}
        assert "again" not in upstream.sent
        assert admission._per_caller == {"": 1}
        upstream.gates["earlier"].set()

        async def ended() -> bool:
            return not runner._state.jobs

        await eventually(ended, what="the earlier run leaving the table")
        assert admission._per_caller == {}
        # The counts follow the table whoever enters a job: one entered under the id of another takes its place.
        admission.adopt(call("first"), rule, record)
        second = admission.adopt(call("second"), rule, record)
        assert admission._per_caller == {"": 1}
        admission.forget(second)
        assert admission._per_caller == {} and runner._state.jobs == {}
    finally:
        await runner.aclose()
        await store.aclose()


async def test_a_task_whose_record_is_written_while_the_proxy_stops_sends_nothing_and_fails():
    """The proxy begins to stop while a task's record is being written (a slow store): when the record is in, the
    call is not sent after the runner has closed; the task fails as the calls stopped at shutdown do."""

    class SlowMemory(MemoryTaskStore):
        async def create(self, record, context=None):
            await asyncio.sleep(0.2)
            await super().create(record, context)

    store = SlowMemory(max_tasks=100)
    upstream = GatedUpstream()
    runner = TaskRunner(store, upstream, TaskDefaults)
    creation = asyncio.ensure_future(runner.submit(call("late"), ToolRule(match="t")))
    await asyncio.sleep(0.05)  # the record is being written
    await runner.aclose(grace_s=0)
    record = await creation  # the client hears of its task: the record was made

    async def settled() -> bool:
        stored = await store.get(record.task_id)
        return stored is not None and stored.status is TaskStatus.FAILED

    await eventually(settled, what="the task failing at shutdown")
    assert upstream.sent == []
    assert (await store.get(record.task_id)).status_message == SHUTDOWN

    async def forgotten() -> bool:
        return not runner._state.jobs

    await eventually(forgotten, what="the job leaving the table")


async def test_a_replica_told_to_stop_takes_no_call_another_hands_over(redis_url):
    """Scale to zero: a replica that is stopping (told so before its connections' grace, aiohttp's on_shutdown)
    takes nothing from another stopping replica: what it took it would hand over again, or run a second time."""
    prefix = f"stopping-{secrets.token_hex(3)}:"
    store = RedisTaskStore(redis_url, key_prefix=prefix, lease_s=0.01, timeout_s=2)
    seal = CallSeal(b"k")
    rule = ToolRule(match="t", idempotent=True)
    now = datetime.now(UTC)
    task_id = new_task_id()
    record = TaskRecord(task_id, "t", TaskStatus.WORKING, now, now, 600_000, 50, owner=f"{RELEASED}replica-a")
    await store.create(record, seal.seal(task_id, call("handed")))
    upstream = GatedUpstream()
    runner = TaskRunner(store, upstream, TaskDefaults, lease_s=0.01, seal=seal, rule_for=lambda tool: rule)
    try:
        await asyncio.sleep(0.05)
        runner.stop_taking_over()
        assert await runner.reap_lost() == 0
        assert upstream.sent == [] and (await store.get(task_id)).owner == f"{RELEASED}replica-a"
    finally:
        await runner.aclose()
        await store.aclose()
