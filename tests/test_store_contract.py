"""One contract for every task store: the in-memory one and Redis (a real redis-server on loopback)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import signal
import time
from datetime import UTC, datetime

import pytest
import redis.asyncio as redis_client

from mcp_tasks_proxy.store.base import MemoryTaskStore, StoreUnavailable, TaskIdTaken
from mcp_tasks_proxy.store.redis_store import RedisTaskStore
from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStateError, TaskStatus, new_task_id, transition
from tests.conftest import eventually, start_redis, stop

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def record(ttl_ms: int = 60_000, **fields) -> TaskRecord:
    return TaskRecord(
        task_id=new_task_id(),
        tool="t",
        status=TaskStatus.WORKING,
        created_at=T0,
        last_updated_at=T0,
        ttl_ms=ttl_ms,
        poll_interval_ms=1000,
        owner="replica-a",
        **fields,
    )


def redis_store(url: str, key_prefix: str | None = None) -> RedisTaskStore:
    return RedisTaskStore(url, key_prefix=key_prefix or f"test-{secrets.token_hex(4)}:", lease_s=2, timeout_s=2)


@pytest.fixture(params=["memory", "redis"])
async def store(request, redis_url):
    if request.param == "memory":
        yield MemoryTaskStore(max_tasks=1000)
        return
    store = redis_store(redis_url)
    yield store
    await store.aclose()


async def test_round_trip_keeps_every_field(store):
    rec = record(status_message="hi", collected_responses={"k": {"action": "accept"}}, input_requests=None)
    await store.create(rec)
    assert await store.get(rec.task_id) == rec
    assert await store.get("nope") is None
    assert await store.update("nope", lambda r: r) is None


async def test_terminal_state_is_never_overwritten(store):
    rec = record()
    await store.create(rec)
    done = await store.update(rec.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={"a": 1}))
    assert done.status is TaskStatus.COMPLETED
    with pytest.raises(TaskStateError):
        await store.update(rec.task_id, lambda r: transition(r, TaskStatus.CANCELLED, now=T0))
    assert await store.get(rec.task_id) == done


async def test_concurrent_updates_are_all_applied(store):
    rec = record(collected_responses={})
    await store.create(rec)

    def add(n: int):
        def apply(r: TaskRecord) -> TaskRecord:
            return dataclasses.replace(r, collected_responses={**r.collected_responses, str(n): {}})

        return apply

    await asyncio.gather(*(store.update(rec.task_id, add(n)) for n in range(30)))
    final = await store.get(rec.task_id)
    assert sorted(final.collected_responses, key=int) == [str(n) for n in range(30)]


async def test_running_ids_list_unfinished_tasks_only(store):
    working, finished = record(), record()
    await store.create(working)
    await store.create(finished)
    await store.update(finished.task_id, lambda r: transition(r, TaskStatus.FAILED, now=T0, error={}))
    running = await store.running_task_ids()
    assert working.task_id in running and finished.task_id not in running


async def test_events_reach_the_subscriber(store):
    received = []

    async def on_event(event):
        received.append(event)

    await store.start("replica-a", on_event)
    await store.publish({"type": "cancel", "taskId": "x"})

    async def delivered():
        return received == [{"type": "cancel", "taskId": "x"}]

    await eventually(delivered, what="the published event")
    assert await store.is_alive("replica-a")


async def test_redis_ttl_is_fixed_at_creation(redis_url):
    store = redis_store(redis_url)
    try:
        rec = record(ttl_ms=60_000)
        await store.create(rec)
        raw = redis_client.Redis.from_url(redis_url)
        key = store._keys.task(rec.task_id)
        before = await raw.pttl(key)
        await asyncio.sleep(0.05)
        await store.update(rec.task_id, lambda r: transition(r, TaskStatus.WORKING, now=T0, status_message="x"))
        after = await raw.pttl(key)
        assert 0 < after < before <= 60_000  # the update kept the deadline; it did not start it again
        short = record(ttl_ms=300)
        await store.create(short)

        async def expired():
            return await store.get(short.task_id) is None

        await eventually(expired, what="Redis expiring the record")
        assert short.task_id not in await store.running_task_ids()
        await raw.aclose()
    finally:
        await store.aclose()


async def test_two_replicas_racing_leave_exactly_one_terminal_state(redis_url):
    prefix = f"test-{secrets.token_hex(4)}:"
    first, second = redis_store(redis_url, prefix), redis_store(redis_url, prefix)
    try:
        for _ in range(10):
            rec = record()
            await first.create(rec)
            results = await asyncio.gather(
                first.update(rec.task_id, lambda r: transition(r, TaskStatus.CANCELLED, now=T0)),
                second.update(rec.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={})),
                return_exceptions=True,
            )
            winners = [r for r in results if isinstance(r, TaskRecord)]
            losers = [r for r in results if isinstance(r, TaskStateError)]
            assert len(winners) == 1 and len(losers) == 1
            assert (await first.get(rec.task_id)).status is winners[0].status
    finally:
        await first.aclose()
        await second.aclose()


async def test_redis_that_stops_answering_gives_a_quick_clear_error_and_recovers():
    process, url = start_redis()
    store = RedisTaskStore(url, key_prefix="pause:", lease_s=2, timeout_s=0.5)
    try:
        rec = record()
        await store.create(rec)
        os.kill(process.pid, signal.SIGSTOP)  # Redis hangs: requests must not
        try:
            with pytest.raises(StoreUnavailable, match="did not answer"):
                await asyncio.wait_for(store.get(rec.task_id), timeout=30)
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.ping(), timeout=30)
        finally:
            os.kill(process.pid, signal.SIGCONT)

        async def back():
            try:
                return await store.get(rec.task_id) == rec
            except StoreUnavailable:
                return False

        await eventually(back, what="the store recovering by itself")
    finally:
        await store.aclose()
        stop(process)


async def test_a_sealed_call_lives_with_its_running_task_and_goes_when_it_ends(redis_url):
    store = redis_store(redis_url)
    try:
        rec = record(queued=True, attempt=2)
        await store.create(rec, b"sealed call")
        assert await store.get(rec.task_id) == rec  # the takeover fields round-trip
        assert await store.call_context(rec.task_id) == b"sealed call"
        # A create refused for a taken id writes nothing: neither its call over the first one's, nor a running id.
        with pytest.raises(TaskIdTaken):
            await store.create(dataclasses.replace(rec, status=TaskStatus.COMPLETED), b"another call")
        assert await store.call_context(rec.task_id) == b"sealed call"
        await store.update(rec.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={}))
        assert await store.call_context(rec.task_id) is None  # the client's credentials, sealed, leave with it
        assert rec.task_id not in await store.running_task_ids()
        taken = record()
        await store.create(taken)
        await store.update(taken.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={}))
        with pytest.raises(TaskIdTaken):  # a finished task's id, taken again: not listed as running again
            await store.create(taken)
        assert taken.task_id not in await store.running_task_ids()
        assert await store.call_context("unknown") is None
    finally:
        await store.aclose()


async def test_the_memory_store_keeps_no_call_for_another_replica():
    store = MemoryTaskStore(max_tasks=10)
    rec = record()
    await store.create(rec, b"sealed call")
    assert await store.get(rec.task_id) == rec
    assert await store.call_context(rec.task_id) is None


async def test_an_alias_finds_its_task_until_it_expires(store):
    await store.alias("joined-request", "task-1", 100)
    assert await store.aliased("joined-request") == "task-1"
    assert await store.aliased("another") is None

    async def expired() -> bool:
        return await store.aliased("joined-request") is None

    await eventually(expired, timeout_s=5, what="the alias expiring")


async def test_the_memory_stores_aliases_are_bounded_by_its_task_cap():
    store = MemoryTaskStore(max_tasks=3)
    for n in range(10):
        await store.alias(f"request-{n}", f"task-{n}", 60_000)
    assert await store.aliased("request-9") == "task-9"
    assert await store.aliased("request-0") is None  # the oldest made room
    assert len(store._aliases) <= 3


async def test_a_named_list_pages_in_order_and_follows_moves_and_removals(store):
    # tasks/list of SEP-1686 clients (tasks2025.py): pages past a (score, id) cursor, a task added again moves to
    # its new score, a removed one is gone. The memory store found each page by sorting the whole list again.
    base = int(time.time() * 1_000_000) + 60_000_000  # Redis scores are expiry times (µs): in the future
    records = [record() for _ in range(30)]
    for number, rec in enumerate(records):
        await store.create(rec)
        await store.index_add("caller", rec.task_id, base + number // 3, 60_000)  # three tasks share each score
    await store.index_add("caller", records[0].task_id, base + 5000, 60_000)  # moved to the end
    await store.index_remove("caller", [records[1].task_id, "never-listed"])
    expected = sorted(
        [(base + number // 3, rec.task_id) for number, rec in enumerate(records) if number > 1]
        + [(base + 5000, records[0].task_id)]
    )
    seen, after = [], None
    while page := await store.index_page("caller", after, 4):
        assert len(page) <= 4
        seen += [(score, task_id) for task_id, score in page]
        after = (page[-1][1], page[-1][0])
    assert seen == expected
    assert await store.index_page("nobody", None, 4) == []


async def test_sizes_say_what_reading_each_record_would_decode(store):
    rec = record(status_message="x" * 1000)
    await store.create(rec)
    sizes = await store.sizes([rec.task_id, "gone"])
    if isinstance(store, MemoryTaskStore):
        assert sizes == [0, 0]  # records are kept as objects: reading one decodes nothing
    else:
        assert sizes[0] > 1000 and sizes[1] == 0
    assert await store.sizes([]) == []


async def test_running_ids_of_more_tasks_than_a_connection_pool_holds(store):
    """The running set is checked against the records in pipelines: asked a command apiece at once, 300 running
    tasks took 300 of redis-py's connections, past its pool's 100 ("Too many connections")."""
    records = [record() for _ in range(300)]
    for rec in records:
        await store.create(rec)
    assert set(await store.running_task_ids()) == {rec.task_id for rec in records}
