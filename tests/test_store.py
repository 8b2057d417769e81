"""The in-memory task store: TTL fixed at creation, bounded size, terminal states that never change."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from mcp_tasks_proxy.store.base import MemoryTaskStore, StoreFullError
from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStateError, TaskStatus, new_task_id, transition

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class FakeTimer:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def record(status: TaskStatus = TaskStatus.WORKING, ttl_ms: int = 60_000) -> TaskRecord:
    return TaskRecord(
        task_id=new_task_id(),
        tool="t",
        status=status,
        created_at=T0,
        last_updated_at=T0,
        ttl_ms=ttl_ms,
        poll_interval_ms=1000,
    )


async def test_ttl_is_fixed_at_creation_and_not_extended_by_updates():
    timer = FakeTimer()
    store = MemoryTaskStore(max_tasks=10, timer=timer)
    rec = record(ttl_ms=10_000)
    await store.create(rec)
    timer.advance(9)
    await store.update(rec.task_id, lambda r: transition(r, TaskStatus.WORKING, now=T0, status_message="still going"))
    timer.advance(0.5)
    assert (await store.get(rec.task_id)).status_message == "still going"
    timer.advance(0.6)  # 10.1 s after creation
    assert await store.get(rec.task_id) is None
    assert await store.update(rec.task_id, lambda r: r) is None
    assert len(store) == 0


async def test_terminal_state_is_never_overwritten():
    store = MemoryTaskStore(max_tasks=10)
    rec = record()
    await store.create(rec)
    await store.update(rec.task_id, lambda r: transition(r, TaskStatus.CANCELLED, now=T0))
    with pytest.raises(TaskStateError):
        await store.update(rec.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={}))
    assert (await store.get(rec.task_id)).status is TaskStatus.CANCELLED


async def test_cap_evicts_the_task_that_finished_first_and_never_a_working_one():
    store = MemoryTaskStore(max_tasks=3)
    working, done_late, done_early = record(), record(), record()
    for rec in (working, done_late, done_early):
        await store.create(rec)
    await store.update(done_early.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={}))
    await store.update(done_late.task_id, lambda r: transition(r, TaskStatus.FAILED, now=T0, error={}))
    newcomer = record()
    await store.create(newcomer)
    assert await store.get(done_early.task_id) is None
    assert await store.get(done_late.task_id) is not None
    assert await store.get(working.task_id) is not None
    another = record()
    await store.create(another)
    assert await store.get(done_late.task_id) is None
    # Now all three are working: a new task is refused, nothing is dropped.
    with pytest.raises(StoreFullError, match="3 tasks are running"):
        await store.create(record())
    for rec in (working, newcomer, another):
        assert (await store.get(rec.task_id)).status is TaskStatus.WORKING


async def test_expired_tasks_free_their_place():
    timer = FakeTimer()
    store = MemoryTaskStore(max_tasks=2, timer=timer)
    await store.create(record(ttl_ms=1000))
    await store.create(record(ttl_ms=1000))
    timer.advance(2)
    await store.create(record())
    await store.create(record())
    assert len(store) == 2


def test_wire_view_carries_only_the_fields_of_its_status():
    rec = record()
    assert set(rec.to_wire()) == {"taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"}
    assert rec.to_wire()["createdAt"] == "2026-12-01T12:00:00.000Z"
    done = transition(rec, TaskStatus.COMPLETED, now=T0, result={"content": []})
    assert done.to_wire()["result"] == {"content": []}
    failed = transition(rec, TaskStatus.FAILED, now=T0, error={"code": 1, "message": "m"}, status_message="why")
    assert failed.to_wire()["error"] == {"code": 1, "message": "m"} and failed.to_wire()["statusMessage"] == "why"
    asking = dataclasses.replace(rec, status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {"method": "roots/list"}})
    assert asking.to_wire()["inputRequests"] == {"k": {"method": "roots/list"}}
