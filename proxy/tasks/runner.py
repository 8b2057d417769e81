"""Background upstream calls: one asyncio task per proxy task, owned by the runner, settled into the store."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import structlog
from multidict import CIMultiDict

from ..config import TaskDefaults, ToolRule
from ..jsonrpc import INTERNAL_ERROR, error_object
from ..upstream import Failed, Finished, Progress, Upstream
from .model import TaskRecord, TaskStateError, TaskStatus, new_task_id, transition, utc_now
from .store import TaskStore

log = structlog.get_logger(__name__)

_CANCELLED_BY_CLIENT = "cancelled at the client's request"
_SHUTDOWN = "the proxy shut down before the upstream call finished"


@dataclasses.dataclass(slots=True)
class ToolCall:
    """What the upstream is asked: the tools/call message (with the proxy's own id) and the client's headers."""

    tool: str
    message: dict[str, Any]
    headers: CIMultiDict[str]


@dataclasses.dataclass(frozen=True, slots=True)
class DirectOutcome:
    """The upstream answered inside the rule's sync window: exactly one of result and error is set."""

    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclasses.dataclass(eq=False, slots=True)
class _Job:
    task_id: str
    call: ToolCall
    rule: ToolRule
    ttl_ms: int
    poll_interval_ms: int
    started_s: float
    is_task: bool = False
    """False while the sync window runs; from then on the outcome goes to the store."""
    created: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    outcome: asyncio.Future[DirectOutcome] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    last_message: str | None = None
    cancel_reason: str | None = None
    runner: asyncio.Task[None] | None = None


class TaskRunner:
    """Starts upstream calls for tasks, follows their events, and records each transition exactly once."""

    def __init__(
        self,
        store: TaskStore,
        upstream: Upstream,
        defaults: TaskDefaults,
        *,
        now: Callable[[], datetime] = utc_now,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._upstream = upstream
        self._defaults = defaults
        self._now = now
        self._timer = timer
        self._jobs: dict[str, _Job] = {}

    @property
    def running(self) -> int:
        return len(self._jobs)

    async def submit(self, call: ToolCall, rule: ToolRule) -> TaskRecord | DirectOutcome:
        """Start the call; return the stored task, or the outcome if it came inside the rule's sync window."""
        job = _Job(
            task_id=new_task_id(),
            call=call,
            rule=rule,
            ttl_ms=rule.ttl_ms or self._defaults.ttl_ms,
            poll_interval_ms=rule.poll_interval_ms or self._defaults.poll_interval_ms,
            started_s=self._timer(),
        )
        call.message["id"] = f"mtp-{secrets.token_hex(8)}"
        call.message["params"].setdefault("_meta", {})["progressToken"] = call.message["id"]
        if rule.sync_window_ms == 0:
            record = await self._create_record(job)  # durable before anyone hears of it (SEP-2663)
            self._spawn(job)
            return record
        self._spawn(job)
        await asyncio.wait([job.outcome], timeout=rule.sync_window_ms / 1000)
        if job.outcome.done():
            return job.outcome.result()
        try:
            return await self._create_record(job)
        except BaseException:
            job.cancel_reason = "the task could not be stored"
            job.runner.cancel()  # type: ignore[union-attr]
            raise

    async def cancel(self, task_id: str) -> TaskRecord | None:
        """Record the cancellation and stop the upstream call; None when the task is unknown.

        A task that already finished keeps its terminal state: cancellation is cooperative (SEP-2663).
        """
        record = await self._transition(task_id, TaskStatus.CANCELLED, status_message=_CANCELLED_BY_CLIENT)
        if record is None:
            record = await self._store.get(task_id)
            if record is None:
                return None
        job = self._jobs.get(task_id)
        if job is not None and job.runner is not None and record.status is TaskStatus.CANCELLED:
            job.cancel_reason = _CANCELLED_BY_CLIENT
            job.runner.cancel()
        return record

    async def aclose(self, grace_s: float = 0.0) -> None:
        """Let running calls finish for up to grace_s, then stop the rest and fail their tasks."""
        pending = [job.runner for job in self._jobs.values() if job.runner is not None]
        if pending and grace_s > 0:
            await asyncio.wait(pending, timeout=grace_s)
        for job in list(self._jobs.values()):
            if job.runner is not None and not job.runner.done():
                job.cancel_reason = _SHUTDOWN
                job.runner.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _create_record(self, job: _Job) -> TaskRecord:
        now = self._now()
        record = TaskRecord(
            task_id=job.task_id,
            tool=job.call.tool,
            status=TaskStatus.WORKING,
            created_at=now,
            last_updated_at=now,
            ttl_ms=job.ttl_ms,
            poll_interval_ms=job.poll_interval_ms,
            status_message=job.last_message,
        )
        job.is_task = True
        await self._store.create(record)
        job.created.set()
        log.info("task_transition", task_id=job.task_id, tool=job.call.tool, to=record.status.value, duration_ms=0)
        return record

    def _spawn(self, job: _Job) -> None:
        job.runner = asyncio.create_task(self._run(job), name=f"mcp-task:{job.task_id}")
        self._jobs[job.task_id] = job
        job.runner.add_done_callback(lambda _: self._jobs.pop(job.task_id, None))

    async def _run(self, job: _Job) -> None:
        structlog.contextvars.bind_contextvars(task_id=job.task_id, tool=job.call.tool)
        events = self._upstream.call_tool(job.call.message, job.call.headers)
        try:
            async with asyncio.timeout(job.rule.timeout_s):
                async for event in events:
                    if isinstance(event, Progress):
                        await self._progress(job, event)
                    elif isinstance(event, Finished):
                        await self._settle(job, TaskStatus.COMPLETED, result=event.result)
                    elif isinstance(event, Failed):
                        await self._settle(
                            job, TaskStatus.FAILED, error=event.error, status_message=event.status_message
                        )
        except TimeoutError:
            reason = f"the upstream call exceeded its {job.rule.timeout_s:g} s limit (timeout_s)"
            error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._upstream.url})
            await self._settle(job, TaskStatus.FAILED, error=error, status_message=reason)
        except asyncio.CancelledError:
            if job.cancel_reason == _SHUTDOWN:
                error = error_object(INTERNAL_ERROR, f"Proxy failure: {_SHUTDOWN}")
                await self._settle(job, TaskStatus.FAILED, error=error, status_message=_SHUTDOWN)
            elif job.cancel_reason == _CANCELLED_BY_CLIENT:
                await self._upstream.notify_cancelled(job.call.message["id"], job.call.headers, _CANCELLED_BY_CLIENT)
            elif job.cancel_reason is None:
                raise
        except Exception:
            log.exception("task_runner_error")
            error = error_object(INTERNAL_ERROR, "Proxy failure: internal error while following the upstream call")
            await self._settle(job, TaskStatus.FAILED, error=error, status_message="internal proxy error")
        finally:
            await events.aclose()

    async def _progress(self, job: _Job, event: Progress) -> None:
        message = event.describe()
        if message is None:
            return
        job.last_message = message
        if job.is_task and job.created.is_set():

            def apply(record: TaskRecord) -> TaskRecord:
                if record.status is not TaskStatus.WORKING:
                    return record
                return transition(record, TaskStatus.WORKING, now=self._now(), status_message=message)

            try:
                record = await self._store.update(job.task_id, apply)
            except TaskStateError:
                return
            if record is None:
                self._abandon(job)

    async def _settle(self, job: _Job, status: TaskStatus, **fields: Any) -> None:
        if not job.is_task:
            outcome = DirectOutcome(result=fields.get("result"), error=fields.get("error"))
            if not job.outcome.done():
                job.outcome.set_result(outcome)
            return
        await job.created.wait()
        if await self._transition(job.task_id, status, job=job, **fields) is None:
            log.info("task_outcome_dropped", task_id=job.task_id, outcome=status.value)

    def _abandon(self, job: _Job) -> None:
        # The record expired or was evicted while the call ran: nobody can read the outcome any more.
        log.warning("task_record_gone", task_id=job.task_id)
        job.cancel_reason = "the task record is gone"
        if job.runner is not None:
            job.runner.cancel()

    async def _transition(
        self, task_id: str, to: TaskStatus, *, job: _Job | None = None, **fields: Any
    ) -> TaskRecord | None:
        """Apply one status change; None when the task is gone or already terminal (then it stays as it is)."""
        previous: list[TaskStatus] = []

        def apply(record: TaskRecord) -> TaskRecord:
            previous.append(record.status)
            return transition(record, to, now=self._now(), **fields)

        try:
            record = await self._store.update(task_id, apply)
        except TaskStateError:
            return None
        if record is None:
            return None
        job = job or self._jobs.get(task_id)
        duration_ms = round((self._timer() - job.started_s) * 1000, 1) if job is not None else None
        log.info(
            "task_transition",
            task_id=task_id,
            tool=record.tool,
            **{"from": previous[-1].value},
            to=to.value,
            duration_ms=duration_ms,
        )
        return record
