"""Background upstream calls: one asyncio task per proxy task, owned by the runner, settled into the store."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from .. import tracing
from ..config import LimitsConfig, TaskDefaults, ToolRule
from ..jsonrpc import (
    INTERNAL_ERROR,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    dumps,
    error_object,
)
from ..metrics import Metrics
from ..upstream.events import Finished, InputNeeded, Progress

if TYPE_CHECKING:
    from ..upstream.gateway import Gateway
from .job import DirectOutcome, Job, RoundLimit, ToolCall
from .model import TaskRecord, TaskStateError, TaskStatus, new_task_id, stamp_after, transition, utc_now
from .store import StoreUnavailable, TaskIdTaken, TaskStore
from .sync_rounds import SyncRounds

log = structlog.get_logger(__name__)

_CANCELLED_BY_CLIENT = "cancelled at the client's request"
_SHUTDOWN = "the proxy shut down before the upstream call finished"
_SHUTDOWN_WRITE_S = 5.0
"""On shutdown, how long a task's last write may wait for an unavailable store."""


class TaskWatchers:
    """Who listens (subscriptions/listen on this replica) for changes of which task."""

    def __init__(self) -> None:
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        self._progress: set[asyncio.Queue[str]] = set()
        """Queues that also want progress (a durable call's stream); listen streams want transitions only."""

    def watch(self, task_ids: list[str], *, progress: bool = False) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for task_id in task_ids:
            self._queues.setdefault(task_id, set()).add(queue)
        if progress:
            self._progress.add(queue)
        return queue

    def unwatch(self, task_ids: list[str], queue: asyncio.Queue[str]) -> None:
        for task_id in task_ids:
            queues = self._queues.get(task_id)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._queues[task_id]
        self._progress.discard(queue)

    def changed(self, task_id: str) -> None:
        for queue in self._queues.get(task_id, ()):
            queue.put_nowait(task_id)

    def progressed(self, task_id: str) -> None:
        for queue in self._queues.get(task_id, ()):
            if queue in self._progress:
                queue.put_nowait(task_id)

    def watched(self) -> list[str]:
        return list(self._queues)


class _NotTheOwner(Exception):
    """The task belongs to another principal: for its caller, it does not exist."""


class _AlreadyMade(Exception):
    """A retried change finds the record already changed: it is left as it is."""

    def __init__(self, record: TaskRecord) -> None:
        self.record = record


def _owned(record: TaskRecord, principal: str | None) -> TaskRecord:
    if principal is not None and record.principal != principal:
        raise _NotTheOwner
    return record


class ShuttingDown(Exception):
    """The proxy is stopping: it finishes what runs and takes no new task."""


class LimitReached(Exception):
    """A concurrency limit of the policy refuses this task; the message names the limit."""

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.data = data or None


class TaskRunner:
    """Starts upstream calls for tasks, follows their events, and records each transition exactly once."""

    def __init__(
        self,
        store: TaskStore,
        upstream: Gateway,
        defaults: Callable[[], TaskDefaults],
        limits: Callable[[], LimitsConfig] = LimitsConfig,
        *,
        now: Callable[[], datetime] = utc_now,
        timer: Callable[[], float] = time.monotonic,
        reap_interval_s: float = 5.0,
        reconcile_interval_s: float = 5.0,
        lease_s: float = 0.0,
        input_wait_s: float = 300.0,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._store = store
        self._upstream = upstream
        self._defaults = defaults
        self._limits = limits
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._now = now
        self._timer = timer
        self._jobs: dict[str, Job] = {}
        self._reap_interval_s = reap_interval_s
        self._reconcile_interval_s = reconcile_interval_s
        self._lease_s = lease_s
        self._reaper: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self.accepting = True
        """False once shutdown began: no new task is taken."""
        # Unique per process, so a restarted replica never claims a dead one's tasks as its own.
        self.replica_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._metrics.watch_running(self._running_by_status)
        self.watchers = TaskWatchers()
        self._rounds = SyncRounds(input_wait_s=input_wait_s, upstream_url=upstream.url)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def _running_by_status(self) -> dict[str, int]:
        counts = {"working": 0, "input_required": 0}
        for job in list(self._jobs.values()):
            if job.is_task:
                counts["input_required" if job.waiting_input else "working"] += 1
        return counts

    async def start(self) -> None:
        """Subscribe to events from every replica; with a shared store, also look for lost replicas' tasks."""
        if self._store.shared:
            self._reaper = asyncio.ensure_future(self._reap_forever())
            self._reconciler = asyncio.ensure_future(self._reconcile_forever())
        await self._store.start(self.replica_id, self._on_event, self._resync)

    def default_ttl_ms(self) -> int:
        return self._defaults().ttl_ms

    async def submit(self, call: ToolCall, rule: ToolRule) -> TaskRecord | DirectOutcome:
        """Start the call; return the stored task, or the outcome if it came inside the rule's sync window."""
        if not self.accepting:
            raise ShuttingDown("the proxy is shutting down and takes no new tasks")
        resumed = await self.resume(call)
        if resumed is not None:
            return resumed
        defaults = self._defaults()  # the policy in force now; the job keeps these values through any reload
        limits = self._limits()
        slots = self._admit(call, rule, limits)
        holds_slot = False
        if slots is not None and rule.on_limit == "refuse":
            # Taken now, in the same step as the check (acquire returns at once when a slot is free), so that a
            # burst cannot be admitted past the limit before the first of its calls starts.
            await slots.acquire()
            holds_slot = True
        job = Job(
            task_id=call.task_id or new_task_id(),
            call=call,
            rule=rule,
            ttl_ms=rule.ttl_ms or defaults.ttl_ms,
            poll_interval_ms=rule.poll_interval_ms or defaults.poll_interval_ms,
            started_s=self._timer(),
            max_input_rounds=rule.max_input_rounds or defaults.max_input_rounds,
            max_result_bytes=limits.max_result_bytes,
            slots=slots,
            holds_slot=holds_slot,
        )
        if job.task_id in self._jobs:  # a caller-fixed id (a durable call's) whose call runs here already
            if job.holds_slot and job.slots is not None:
                job.slots.release()
            raise TaskIdTaken(job.task_id)
        call.message = _retry_message(call.message, None, None, keep_client_round=True)
        # Known before its record exists, so that no lost-replica sweep takes a task being created for a stray.
        self._jobs[job.task_id] = job
        if rule.sync_window_ms == 0:
            try:
                record = await self._create_record(job)  # durable before anyone hears of it (SEP-2663)
            except BaseException:
                self._forget(job)
                raise
            self._spawn(job)
            return record
        self._spawn(job)
        return await self._within_window(job)

    async def _within_window(self, job: Job) -> TaskRecord | DirectOutcome:
        """Wait out the rule's sync window: the outcome if it comes inside (an answer, or an MRTR round for the
        client), else the call becomes a task, stored before anyone hears of it."""
        if job.final is not None:
            return job.final
        job.outcome = asyncio.get_running_loop().create_future()
        if job.sync_requests:  # asked while the client's retry was on its way: this is the next round
            job.outcome.set_result(self._rounds.offer(job))
        try:
            await asyncio.wait([job.outcome], timeout=job.rule.sync_window_ms / 1000)
        except asyncio.CancelledError:
            # The client closed its request inside the window: as for any 2026 call, that cancels the upstream work.
            job.cancel_reason = "the client closed its request"
            job.outcome = None  # a question being gathered now finds no window to answer
            job.runner.cancel()  # type: ignore[union-attr]
            raise
        if job.outcome.done():
            return job.outcome.result()
        job.outcome = None
        if job.sync_requests:  # asked inside the window, while the questions sent with it were being gathered
            return self._rounds.offer(job)
        try:
            return await self._create_record(job)
        except BaseException:
            job.cancel_reason = "the task could not be stored"
            job.runner.cancel()  # type: ignore[union-attr]
            raise

    async def resume(self, call: ToolCall) -> TaskRecord | DirectOutcome | None:
        """An MRTR retry that names a call parked inside its sync window: the answers go upstream on the open
        call, then the window runs again. None when it names none (the call is a new one)."""
        job = self._rounds.claim(call, legacy_upstream=self._upstream.known_era == "legacy")
        if job is None:
            return None
        if job.final is not None:
            return job.final
        await self._rounds.answer(job, call)
        if job.sync_requests:  # some are still unanswered: ask for those again (SEP-2322 SHOULD)
            return self._rounds.offer(job)
        return await self._within_window(job)

    def _admit(self, call: ToolCall, rule: ToolRule, limits: LimitsConfig) -> asyncio.Semaphore | None:
        """Apply the policy's concurrency limits to a new task; returns the tool's slots when it has a limit."""
        if len(self._jobs) >= limits.max_running_tasks:
            raise LimitReached(
                f"this proxy replica already runs {limits.max_running_tasks} background calls "
                "(limits.max_running_tasks); try again later",
                limit="max_running_tasks",
            )
        if limits.max_tasks_per_principal is not None:
            mine = sum(1 for job in self._jobs.values() if job.call.caller == call.caller)
            if mine >= limits.max_tasks_per_principal:
                raise LimitReached(
                    f"this caller already has {mine} tasks running, the most allowed "
                    "(limits.max_tasks_per_principal); wait for one to finish",
                    limit="max_tasks_per_principal",
                )
        if rule.max_concurrency is None:
            return None
        slots = self._slots.setdefault((call.tool, rule.max_concurrency), asyncio.Semaphore(rule.max_concurrency))
        if rule.on_limit == "refuse" and slots.locked():
            raise LimitReached(
                f"tool {call.tool!r} runs at most {rule.max_concurrency} calls at once (max_concurrency), and this "
                "policy refuses more instead of queueing them (on_limit: refuse); try again later",
                limit="max_concurrency",
            )
        return slots

    async def cancel(self, task_id: str, principal: str | None = None) -> TaskRecord | None:
        """Record the cancellation and stop the upstream call; None when the task is unknown (or, with `principal`,
        not that principal's: ownership is checked in the same atomic update).

        A task that already finished keeps its terminal state: cancellation is cooperative (SEP-2663).
        """
        try:
            record = await self._transition(
                task_id, TaskStatus.CANCELLED, principal=principal, status_message=_CANCELLED_BY_CLIENT
            )
        except _NotTheOwner:
            return None
        if record is None:
            current = await self._store.get(task_id)
            return current if current is not None and (principal is None or current.principal == principal) else None
        # Whichever replica holds the upstream call stops it; this one may not be it.
        await self._tell_owner({"type": "cancel", "taskId": task_id})
        return record

    async def _tell_owner(self, event: dict[str, Any]) -> None:
        """Publish an event for the replica running the task. What the event says is already in the record, so a
        failed publish loses nothing: the owner's reconciliation reads it from there (an acknowledged request
        stays acknowledged)."""
        if self._store.shared and event["taskId"] in self._jobs:
            await self._on_event(event)  # ours: act now, whatever becomes of the publish (acting twice is harmless)
        try:
            await self._store.publish(event)
        except StoreUnavailable:
            log.warning("task_event_not_published", task_id=event["taskId"], event_type=event["type"])

    async def _on_event(self, event: dict[str, Any]) -> None:
        """An event from any replica (this one included) about a task whose call may run here."""
        if event.get("type") in ("changed", "input"):
            self.watchers.changed(str(event.get("taskId")))
        job = self._jobs.get(str(event.get("taskId")))
        if job is None:
            return
        if event.get("type") == "cancel":
            self._stop_cancelled(job)
        elif event.get("type") == "input":
            answers = event.get("answers") if isinstance(event.get("answers"), dict) else {}
            for key, answer in answers.items():
                reply = job.replies.pop(key, None)
                if reply is not None:
                    await reply(answer)  # legacy: the open call gets each answer as soon as it is given
            if event.get("resumed"):
                if job.replies == {}:
                    job.waiting_input = False  # legacy: nothing outstanding; modern: _ask_client clears it
                if job.answered is not None:
                    job.answered.set()

    def _stop_cancelled(self, job: Job, reason: str = _CANCELLED_BY_CLIENT) -> None:
        """The task was cancelled (or failed) elsewhere: stop its upstream call, unless it already settled here."""
        if job.runner is not None and not job.runner.done() and not job.settled:
            job.cancel_reason = reason
            job.runner.cancel()

    async def _resync(self) -> None:
        """After every (re)subscription to the store's events: whatever was published meanwhile was lost to this
        replica, so its listeners re-read their tasks and its calls re-read what they wait for."""
        for task_id in self.watchers.watched():
            self.watchers.changed(task_id)
        with contextlib.suppress(StoreUnavailable):  # logged by the store; the slow timer tries again
            await self.reconcile()

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            try:
                await self.reconcile()
            except StoreUnavailable:
                pass  # logged by the store
            except Exception as exc:  # the timer must outlive any one pass
                log.warning("task_reconcile_failed", error=type(exc).__name__)

    async def reconcile(self) -> int:
        """Act on what the records say, for events this replica may have missed (a dropped subscription, a failed
        publish): tasks cancelled or ended elsewhere stop their call; answers given elsewhere reach the call that
        waits for them. Returns how many jobs were acted on. Cheap: one set lookup for all running tasks, and a
        read only of those that wait for input or ended."""
        jobs = [job for job in self._jobs.values() if job.is_task and job.stored and not job.settled]
        if not jobs:
            return 0
        running = await self._store.still_running([job.task_id for job in jobs])
        acted = 0
        for job in jobs:
            ended = job.task_id not in running
            if not ended and not (job.round_open or job.replies):
                continue
            record = await self._store.get(job.task_id)
            if record is None or record.is_terminal:
                if record is None or record.status is TaskStatus.CANCELLED:
                    self._stop_cancelled(job)
                else:
                    self._stop_cancelled(job, reason="the task ended on another replica")
                acted += 1
                continue
            collected = record.collected_responses or {}
            for key in [key for key in job.replies if key in collected]:
                reply = job.replies.pop(key, None)
                if reply is not None:
                    await reply(collected[key])  # legacy: posted back on the open call
                    acted += 1
            if record.status is TaskStatus.WORKING:
                if not job.replies:
                    job.waiting_input = False
                if job.round_open and job.answered is not None and not job.answered.is_set():
                    job.answered.set()  # modern: the round was answered; the next one starts
                    acted += 1
        if acted:
            log.info("tasks_reconciled", jobs=acted)
        return acted

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval_s)
            with contextlib.suppress(StoreUnavailable):  # logged by the store; the next sweep tries again
                await self.reap_lost()

    async def reap_lost(self) -> int:
        """Fail the running tasks whose replica's lease lapsed (killed, partitioned); returns how many."""
        if self._store.healthy_for() < self._lease_s:
            # The store was out of reach within a lease: a live replica may not have renewed its lease since.
            return 0
        reaped = 0
        alive: dict[str, bool] = {}
        for task_id in await self._store.running_task_ids():
            record = await self._store.get(task_id)
            if record is None or record.is_terminal or record.owner is None:
                continue
            if record.owner == self.replica_id:
                if task_id in self._jobs:
                    continue
                owner_alive = False  # ours, but no call runs for it here any more
            else:
                if record.owner not in alive:
                    alive[record.owner] = await self._store.is_alive(record.owner)
                owner_alive = alive[record.owner]
            if owner_alive:
                continue
            reason = f"the proxy replica running this task was lost ({record.owner})"
            error = error_object(INTERNAL_ERROR, f"Proxy failure: {reason}")
            if await self._transition(task_id, TaskStatus.FAILED, error=error, status_message=reason) is not None:
                reaped += 1
        return reaped

    async def aclose(self, grace_s: float = 0.0) -> None:
        """Let running calls finish for up to grace_s, then stop the rest and fail their tasks."""
        self.accepting = False
        self._rounds.drain()  # their calls are stopped below with every other one
        for loop_task in (self._reaper, self._reconciler):
            if loop_task is not None:
                loop_task.cancel()
        pending = [job.runner for job in self._jobs.values() if job.runner is not None and not job.runner.done()]
        if pending:
            log.info("tasks_draining", running=len(pending), grace_s=grace_s)
        if pending and grace_s > 0:
            await asyncio.wait(pending, timeout=grace_s)
        stopped = 0
        for job in list(self._jobs.values()):
            if job.runner is not None and not job.runner.done():
                job.cancel_reason = _SHUTDOWN
                job.runner.cancel()
                stopped += 1
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            log.info("tasks_drained", finished=len(pending) - stopped, failed_at_shutdown=stopped)

    async def _create_record(self, job: Job) -> TaskRecord:
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
            owner=self.replica_id,
            principal=job.call.principal,
            stream=job.call.stream,
        )
        if tracing.TRACER.enabled:
            job.span = tracing.TRACER.start_task(job.task_id, job.call.tool)
            record = dataclasses.replace(record, trace=tracing.TRACER.traceparent(job.span))
        job.is_task = True
        await self._store.create(record)
        job.mark_stored()
        self._metrics.tasks_created.labels(job.call.tool).inc()
        log.info("task_transition", task_id=job.task_id, tool=job.call.tool, to=record.status.value, duration_ms=0)
        return record

    def _spawn(self, job: Job) -> None:
        job.runner = asyncio.create_task(self._run(job), name=f"mcp-task:{job.task_id}")
        job.runner.add_done_callback(lambda _: self._forget(job))

    def _forget(self, job: Job) -> None:
        if job.span is not None:  # the call ended without this replica writing a terminal status
            tracing.TRACER.end_task(job.span, "ended elsewhere")  # type: ignore[union-attr]
            job.span = None
        if self._jobs.get(job.task_id) is job:  # never another job under the same id
            del self._jobs[job.task_id]
        if job.holds_slot and job.slots is not None:
            job.holds_slot = False
            job.slots.release()

    async def _run(self, job: Job) -> None:
        structlog.contextvars.bind_contextvars(task_id=job.task_id, tool=job.call.tool)
        try:
            if job.slots is None or job.holds_slot:
                await self._drive(job)
            else:
                if job.slots.locked():
                    await self._progress(
                        job, Progress(f"queued: {job.call.tool} runs a limited number of calls at once")
                    )
                async with job.slots:
                    await self._drive(job)
        except asyncio.CancelledError:
            if job.cancel_reason == _SHUTDOWN:
                if job.unwritten is not None:  # the outcome was in hand; only its write was interrupted
                    status, fields = job.unwritten
                    await self._settle(job, status, **fields)
                else:
                    error = error_object(INTERNAL_ERROR, f"Proxy failure: {_SHUTDOWN}")
                    await self._settle(job, TaskStatus.FAILED, error=error, status_message=_SHUTDOWN)
            elif job.cancel_reason is None:
                raise
            elif job.upstream_busy and job.call.client_session is None:
                # (A call on a client's own session posts its cancellation itself as its stream closes.)
                await self._upstream.notify_cancelled(job.upstream_id, job.call.headers, job.cancel_reason)
        except Exception:
            log.exception("task_runner_error")
            error = error_object(INTERNAL_ERROR, "Proxy failure: internal error while following the upstream call")
            await self._settle(job, TaskStatus.FAILED, error=error, status_message="internal proxy error")

    async def _drive(self, job: Job) -> None:
        """Run upstream attempts until one ends the call; MRTR input_required answers start the next round."""
        message = job.call.message
        input_rounds = 0
        while True:
            needed = await self._attempt(job, message)
            if needed is None:
                return  # the attempt settled the call
            if not job.is_task:
                # Inside the sync window, before any task exists: the client answers the MRTR round itself.
                await self._settle(job, TaskStatus.COMPLETED, result=needed.result)
                return
            input_rounds += 1
            if input_rounds > job.max_input_rounds:
                reason = f"the upstream asked for input more than {job.max_input_rounds} times (max_input_rounds)"
                error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._upstream.url})
                await self._settle(job, TaskStatus.FAILED, error=error, status_message=reason)
                return
            if needed.input_requests:
                responses = await self._ask_client(job, needed.input_requests)
                if responses is None:
                    return
            else:
                # A state-only round (load shedding, SEP-2322): retry at once, after a short backoff.
                responses = None
                await asyncio.sleep(min(0.05 * 2 ** (input_rounds - 1), 0.25))
            message = _retry_message(job.call.message, responses, needed.request_state)

    async def _attempt(self, job: Job, message: dict[str, Any]) -> InputNeeded | None:
        """One upstream call; None once the outcome is settled, the InputNeeded when the upstream wants input."""
        if not tracing.TRACER.enabled:
            return await self._call_upstream(job, message)
        with tracing.TRACER.upstream_call(job.span, job.call.tool):
            return await self._call_upstream(job, message)

    async def _call_upstream(self, job: Job, message: dict[str, Any]) -> InputNeeded | None:
        job.upstream_id = message["id"]
        job.upstream_busy = True
        events = self._upstream.call_tool(
            message,
            job.call.headers,
            job.call.capabilities,
            max_bytes=job.max_result_bytes,
            on_request=lambda needed: self._open_questions(job, needed),
            session=job.call.client_session,
        )
        started_s = self._timer()
        outcome = "cancelled"
        settle: tuple[TaskStatus, dict[str, Any]] | None = None
        try:
            async with asyncio.timeout(job.rule.timeout_s):
                async for event in events:
                    if isinstance(event, Progress):
                        await self._progress(job, event)
                    elif isinstance(event, InputNeeded):
                        if event.reply is None:
                            outcome = "input_required"
                            return event  # a modern upstream: the next round is a new attempt
                        await self._open_questions(job, event)  # a legacy one waits on this very stream
                    elif isinstance(event, Finished):
                        outcome = "completed"
                        size = event.size or len(dumps(event.result))
                        if size > job.max_result_bytes:
                            reason = (
                                f"the result of {size} bytes exceeds limits.max_result_bytes ({job.max_result_bytes})"
                            )
                            error = error_object(INTERNAL_ERROR, f"Proxy failure: {reason}")
                            settle = (TaskStatus.FAILED, {"error": error, "status_message": reason})
                        else:
                            settle = (TaskStatus.COMPLETED, {"result": event.result})
                        break
                    else:
                        outcome = "failed"
                        if event.unread:  # unreachable, or the stream cut: the upstream failed, not the tool
                            self._metrics.upstream_errors.labels("task").inc()
                        settle = (TaskStatus.FAILED, {"error": event.error, "status_message": event.status_message})
                        break
        except RoundLimit:
            outcome = "failed"  # already written; closing the events cancels the call upstream
        except TimeoutError:
            outcome = "timeout"
            self._metrics.upstream_errors.labels("task").inc()
            reason = f"the upstream call exceeded its {job.rule.timeout_s:g} s limit (timeout_s)"
            error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._upstream.url})
            settle = (TaskStatus.FAILED, {"error": error, "status_message": reason})
        finally:
            job.upstream_busy = False
            self._metrics.upstream_seconds.labels(job.call.tool, outcome).observe(self._timer() - started_s)
            await events.aclose()
        if settle is not None:
            # Outside the call's timeout: an outcome in hand is written however long the store takes (it is retried
            # until the TTL), never turned into a timeout failure.
            status, fields = settle
            await self._settle(job, status, **fields)
        return None

    async def _ask_client(self, job: Job, requests: dict[str, Any]) -> dict[str, Any] | None:
        """Put the upstream's input requests in the task and wait for tasks/update to answer them all.

        Returns the answers under the upstream's own keys; None when the task ended meanwhile.
        """
        refusal = _refuse_undeclared(requests, job.call.capabilities)
        if refusal is not None:
            error, reason = refusal
            await self._settle(job, TaskStatus.FAILED, error=error, status_message=reason)
            return None
        key_map: dict[str, str] = {}
        task_requests: dict[str, Any] = {}
        for upstream_key, input_request in requests.items():
            task_key = job.unique_key(upstream_key)
            key_map[task_key] = upstream_key
            task_requests[task_key] = input_request
        job.answered = answered = asyncio.Event()  # before the record says input_required: no answer is missed
        job.waiting_input = True
        self._metrics.input_rounds.labels(job.call.tool).inc()

        def this_round(record: TaskRecord) -> bool:
            # Keys are unique per round: a record that asks for them, or holds answers to them, is this round's.
            return record.input_requests == task_requests or any(
                key in (record.collected_responses or {}) for key in task_requests
            )

        waiting = await self._until_stored(
            job,
            lambda: self._transition(
                job.task_id,
                TaskStatus.INPUT_REQUIRED,
                job=job,
                # A retried write whose first attempt did land must not wipe answers given since.
                unless=this_round,
                input_requests=task_requests,
                collected_responses={},
                status_message="waiting for the client's input",
            ),
        )
        if waiting is None:
            return None
        job.round_open = True
        try:
            while True:
                # Nobody can answer after the record expires, so the wait is bounded by the task's TTL.
                await asyncio.wait_for(answered.wait(), timeout=max(self._remaining_s(job), 0))
                record = await self._until_stored(job, lambda: self._store.get(job.task_id))
                if record is None or record.status is not TaskStatus.INPUT_REQUIRED:
                    break
                answered.clear()  # a stale wake-up (an earlier round's event, echoed late): this round still waits
        except TimeoutError:
            self._abandon(job)
            return None
        finally:
            job.round_open = False
        job.waiting_input = False
        if record is None or record.status is not TaskStatus.WORKING or not this_round(record):
            return None
        collected = record.collected_responses or {}
        return {key_map[key]: answer for key, answer in collected.items() if key in key_map}

    async def _open_questions(self, job: Job, needed: InputNeeded) -> None:
        """A legacy server's request joins the task's outstanding inputRequests; the call's stream stays open."""
        if not job.is_task:
            self._rounds.ask(job, needed)
            return
        if job.question_lock is None:
            job.question_lock = asyncio.Lock()
        async with job.question_lock:  # questions from the standalone stream come concurrently: one at a time
            await self._add_questions(job, needed)

    async def _add_questions(self, job: Job, needed: InputNeeded) -> None:
        await job.wait_stored()  # the window may just have closed: the record is being written
        refusal = self._rounds.past_round_limit(job)
        if refusal is not None:
            reason = refusal["message"].removeprefix("Upstream failure: ")
            await self._settle(job, TaskStatus.FAILED, error=refusal, status_message=reason)
            if job.runner is asyncio.current_task():
                raise RoundLimit
            job.stop("too many input rounds")
            return
        assert needed.reply is not None
        if not job.waiting_input:
            job.waiting_input = True
            self._metrics.input_rounds.labels(job.call.tool).inc()
        added: dict[str, Any] = {}
        for upstream_key, input_request in needed.input_requests.items():
            task_key = job.unique_key(upstream_key)
            job.replies[task_key] = needed.reply
            added[task_key] = input_request
        previous: list[TaskStatus] = []

        def apply(record: TaskRecord) -> TaskRecord:
            previous.append(record.status)
            return transition(
                record,
                TaskStatus.INPUT_REQUIRED,
                now=self._now(),
                input_requests={**(record.input_requests or {}), **added},
                collected_responses=record.collected_responses or {},
                status_message="waiting for the client's input",
            )

        record = await self._until_stored(job, lambda: self._update_live(job, apply))
        if record is not None and previous and previous[-1] is not TaskStatus.INPUT_REQUIRED:
            log.info(
                "task_transition",
                task_id=job.task_id,
                tool=record.tool,
                **{"from": previous[-1].value},
                to=record.status.value,
            )
        if record is not None:
            await self._announce(job.task_id)

    async def deliver_input(
        self, task_id: str, responses: dict[str, Any], principal: str | None = None
    ) -> TaskRecord | None:
        """tasks/update: keep answers to outstanding keys; once none is outstanding, the task resumes.

        Answers to keys that are not outstanding are ignored (SEP-2663). None when the task is unknown (or, with
        `principal`, not that principal's).
        """
        resumed: list[TaskStatus] = []
        accepted: dict[str, Any] = {}

        def apply(record: TaskRecord) -> TaskRecord:
            accepted.clear()
            _owned(record, principal)
            if record.status is not TaskStatus.INPUT_REQUIRED:
                return record
            outstanding = dict(record.input_requests or {})
            collected = dict(record.collected_responses or {})
            for key, answer in responses.items():
                if key in outstanding:
                    del outstanding[key]
                    collected[key] = answer
                    accepted[key] = answer
            if len(outstanding) == len(record.input_requests or {}):
                return record
            if outstanding:
                return dataclasses.replace(
                    record,
                    input_requests=outstanding,
                    collected_responses=collected,
                    last_updated_at=stamp_after(record, self._now()),
                )
            resumed.append(record.status)
            return transition(
                record,
                TaskStatus.WORKING,
                now=self._now(),
                input_requests=None,
                collected_responses=collected,
                status_message="input received; resuming the call",
            )

        try:
            record = await self._store.update(task_id, apply)
        except _NotTheOwner:
            return None
        if record is None:
            return None
        if resumed:
            log.info("task_transition", task_id=task_id, tool=record.tool, **{"from": resumed[0].value}, to="working")
        if accepted:
            # The replica holding the call posts legacy answers upstream, or starts the next MRTR round, once.
            event = {"type": "input", "taskId": task_id, "answers": dict(accepted), "resumed": bool(resumed)}
            await self._tell_owner(event)
        return record

    async def _progress(self, job: Job, event: Progress) -> None:
        if job.call.on_progress is not None:
            job.call.on_progress(event)
        message = event.describe()
        if message is None:
            return
        job.last_message = message
        if job.is_task and job.stored:

            def apply(record: TaskRecord) -> TaskRecord:
                if record.status is not TaskStatus.WORKING:
                    return record
                return transition(record, TaskStatus.WORKING, now=self._now(), status_message=message)

            # Best effort (a failure is logged by the store): a later message or the outcome replaces it anyway.
            with contextlib.suppress(StoreUnavailable):
                if await self._update_live(job, apply) is not None:
                    # Streams on this replica (a durable call's progress) see it now, not at their next tick; no
                    # publish: other replicas' listeners read it at theirs, which spares Redis a message per step.
                    self.watchers.progressed(job.task_id)

    async def _update_live(self, job: Job, apply: Callable[[TaskRecord], TaskRecord]) -> TaskRecord | None:
        """Update a running job's record; None when it ended meanwhile (the job is stopped if the record is gone)."""
        try:
            record = await self._store.update(job.task_id, apply)
        except TaskStateError:
            return None
        if record is None:
            self._abandon(job)
        return record

    async def _settle(self, job: Job, status: TaskStatus, **fields: Any) -> None:
        if not job.is_task:
            outcome = DirectOutcome(result=fields.get("result"), error=fields.get("error"))
            if job.outcome is not None and not job.outcome.done():
                job.outcome.set_result(outcome)
            else:  # parked for an MRTR round: the client's retry gets it
                job.final = outcome
            return
        await job.wait_stored()
        job.settled = True  # from here the call is over: a late cancel or reconciliation must not stop this write
        job.unwritten = (status, fields)
        written = await self._until_stored(job, lambda: self._transition(job.task_id, status, job=job, **fields))
        job.unwritten = None
        if written is None:
            log.info("task_outcome_dropped", task_id=job.task_id, outcome=status.value)

    def _remaining_s(self, job: Job) -> float:
        """Time left before the task's record expires (its TTL runs from creation)."""
        return job.started_s + job.ttl_ms / 1000 - self._timer()

    async def _until_stored(self, job: Job, write: Callable[[], Awaitable[Any]]) -> Any:
        """A store call the task cannot go on without (its outcome, an input round): retried with backoff while the
        store is unavailable, until the task's TTL ends (then nobody could read it anyway, and None is returned).
        The job stays in this replica's table meanwhile, and its lease is renewed on its own: no sweep fails it."""
        try:
            return await write()  # the usual case, without the retry machinery (it costs allocations per call)
        except StoreUnavailable:
            pass
        limit_s = max(self._remaining_s(job), 0)
        if not self.accepting:
            limit_s = min(limit_s, _SHUTDOWN_WRITE_S)  # shutting down: a bounded wait, then it is lost with the store
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(StoreUnavailable),
            wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.2),
            stop=stop_after_delay(limit_s),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await write()
        except RetryError:
            log.warning("task_store_write_abandoned", task_id=job.task_id, reason="the task's TTL ended")
        return None

    def _abandon(self, job: Job) -> None:
        # The record expired or was evicted while the call ran: nobody can read the outcome any more.
        log.warning("task_record_gone", task_id=job.task_id)
        job.cancel_reason = "the task record is gone"
        if job.runner is not None:
            job.runner.cancel()

    async def _transition(
        self,
        task_id: str,
        to: TaskStatus,
        *,
        job: Job | None = None,
        principal: str | None = None,
        unless: Callable[[TaskRecord], bool] | None = None,
        **fields: Any,
    ) -> TaskRecord | None:
        """Apply one status change; None when the task is gone or already terminal (then it stays as it is).

        With `principal`, another principal's task raises _NotTheOwner and is left unchanged. With `unless`, a record
        for which it is true is left as it is (the change was already made) and returned."""
        previous: list[TaskStatus] = []

        def apply(record: TaskRecord) -> TaskRecord:
            _owned(record, principal)
            if unless is not None and unless(record):
                raise _AlreadyMade(record)
            previous.append(record.status)
            return transition(record, to, now=self._now(), **fields)

        try:
            record = await self._store.update(task_id, apply)
        except TaskStateError:
            return None
        except _AlreadyMade as made:
            return made.record
        if record is None:
            return None
        job = job or self._jobs.get(task_id)
        duration_ms = round((self._timer() - job.started_s) * 1000, 1) if job is not None else None
        if record.is_terminal:
            if job is not None and job.span is not None:
                code = record.error.get("code") if record.error else None
                tracing.TRACER.end_task(job.span, to.value, error_code=code)  # type: ignore[union-attr]
                job.span = None
            self._metrics.tasks_finished.labels(record.tool, to.value).inc()
            if duration_ms is not None:
                self._metrics.task_seconds.labels(record.tool, to.value).observe(duration_ms / 1000)
            if record.error is not None:
                self._metrics.errors.labels(str(record.error.get("code"))).inc()
        log.info(
            "task_transition",
            task_id=task_id,
            tool=record.tool,
            **{"from": previous[-1].value},
            to=to.value,
            duration_ms=duration_ms,
        )
        await self._announce(task_id)
        return record

    async def _announce(self, task_id: str) -> None:
        """Tell every replica's listeners (subscriptions/listen) that the task changed."""
        with contextlib.suppress(StoreUnavailable):  # a missed notification is caught up by polling
            await self._store.publish({"type": "changed", "taskId": task_id})


def _retry_message(
    original: dict[str, Any], responses: dict[str, Any] | None, state: str | None, *, keep_client_round: bool = False
) -> dict[str, Any]:
    """The tools/call for the next upstream attempt: a new id, the same name, arguments and _meta.

    `keep_client_round` keeps the inputResponses/requestState a client sent itself (an MRTR retry before any
    task existed); later rounds carry the proxy's answers and the upstream's requestState byte for byte.
    """
    params = dict(original["params"])
    if not keep_client_round:
        params.pop("inputResponses", None)
        params.pop("requestState", None)
        if responses is not None:
            params["inputResponses"] = responses
        if state is not None:
            params["requestState"] = state
    upstream_id = f"mtp-{secrets.token_hex(8)}"
    # The proxy's own progress token: progress feeds statusMessage and must not be mistaken across attempts.
    params["_meta"] = {**(params.get("_meta") or {}), "progressToken": upstream_id}
    return {"jsonrpc": "2.0", "id": upstream_id, "method": "tools/call", "params": params}


def _refuse_undeclared(requests: dict[str, Any], capabilities: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The -32021 error (and a status message) when an input request needs a capability the client lacks.

    Capability honesty (SEP-2322): a client is never shown a request of a kind it did not declare.
    """
    required: dict[str, Any] = {}
    for request in requests.values():
        method = request.get("method") if isinstance(request, dict) else None
        params = request.get("params") if isinstance(request, dict) else None
        params = params if isinstance(params, dict) else {}
        if method == "elicitation/create":
            mode = params.get("mode", "form")
            declared = capabilities.get("elicitation")
            if not isinstance(declared, dict):
                required.setdefault("elicitation", {})[mode] = {}
            elif mode == "url" and "url" not in declared:
                required.setdefault("elicitation", {})["url"] = {}
            elif mode == "form" and declared and "form" not in declared:
                required.setdefault("elicitation", {})["form"] = {}  # {} alone means form; {url} alone does not
        elif method == "sampling/createMessage":
            if "sampling" not in capabilities:
                required["sampling"] = {}
        elif method == "roots/list":
            if "roots" not in capabilities:
                required["roots"] = {}
        else:
            reason = f"the upstream asked for input of an unknown kind ({method!r})"
            return error_object(INTERNAL_ERROR, f"Upstream failure: {reason}"), reason
    if not required:
        return None
    kinds = ", ".join(sorted(required))
    reason = f"the upstream asked for input ({kinds}) that the client did not declare in its capabilities"
    error = error_object(
        MISSING_REQUIRED_CLIENT_CAPABILITY,
        f"Missing required client capability: {kinds}",
        {"requiredCapabilities": required},
    )
    return error, reason
