"""A new call's way in: the policy's concurrency limits, its job, its sync window (the outcome if it comes inside,
else a task stored before anyone hears of it), an MRTR retry resuming a parked call, and the job's end."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import structlog

from .. import tracing
from ..config import LimitsConfig, TaskDefaults, ToolRule
from ..store.base import TaskIdTaken
from .attempts import Attempts, retry_message, sent_again
from .job import DirectOutcome, Job, ToolCall
from .model import TaskRecord, TaskStatus, new_task_id
from .runner_state import RunnerState
from .sync_rounds import SyncRounds

log = structlog.get_logger(__name__)

_RUNNER_PREFIX = "mcp-task:"
"""A job's asyncio task is named by it and the task id: the job is found again from the task alone."""
_DONE_CONTEXT = contextvars.Context()
"""The context the jobs' done callbacks run in (they log nothing): one for all, not a copy each."""


class ShuttingDown(Exception):
    """The proxy is stopping: it finishes what runs and takes no new task."""


class LimitReached(Exception):
    """A concurrency limit of the policy refuses this task; the message names the limit."""

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.data = data or None


class Admission:
    """Admits calls within the policy's limits and starts them; forgets each job when its call ends."""

    def __init__(
        self,
        state: RunnerState,
        attempts: Attempts,
        rounds: SyncRounds,
        defaults: Callable[[], TaskDefaults],
        limits: Callable[[], LimitsConfig],
    ) -> None:
        self._state = state
        self._attempts = attempts
        self._rounds = rounds
        self._defaults = defaults
        self._limits = limits
        self._slots: dict[tuple[str, int], tuple[asyncio.Semaphore, int]] = {}
        """Each limited tool's slots and how many jobs in the table use them: kept while one does, so that a rule
        matching any name (`match: "*"` with max_concurrency) keeps no entry per name a client ever sent."""
        self._per_caller: dict[str, int] = {}
        """Jobs in the table per caller, kept as they come and go: limits.max_tasks_per_principal is checked on
        every creation, and a count over the table would cost each one a pass over every running call."""
        self._on_runner_done = self._runner_done

    async def submit(self, call: ToolCall, rule: ToolRule) -> TaskRecord | DirectOutcome:
        """Start the call; return the stored task, or the outcome if it came inside the rule's sync window."""
        if not self._state.accepting:
            raise ShuttingDown("the proxy is shutting down and takes no new tasks")
        resumed = await self.resume(call)
        if resumed is not None:
            return resumed
        defaults = self._defaults()  # the policy in force now; the job keeps these values through any reload
        limits = self._limits()
        if call.slots is not None and not call.slots.held:
            # A new call (not a retry that found its call running): its concurrency slots now, or refused, or
            # waited for by its job (queued).
            await call.slots.admit()
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
            started_s=self._state.timer(),
            max_input_rounds=rule.max_input_rounds or defaults.max_input_rounds,
            max_result_bytes=limits.max_result_bytes,
            slots=slots,
            holds_slot=holds_slot,
            sealed=self._may_take_over(call, rule),
        )
        if job.task_id in self._state.jobs:  # a caller-fixed id (a durable call's) whose call runs here already
            if job.holds_slot and job.slots is not None:
                job.slots.release()
            if call.slots is not None:  # its request follows the call that runs: it needs no slot of its own
                call.slots.release()
            raise TaskIdTaken(job.task_id)
        call.message = retry_message(call.message, None, None, keep_client_round=True)
        if call.slots is not None:  # the request's concurrency slots are the job's from now on (released in _forget)
            call.slots.passed = True
        # Known before its record exists, so that no lost-replica sweep takes a task being created for a stray.
        self._enter(job)
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
        job = self._rounds.claim(call, legacy_upstream=self._state.upstream.known_era == "legacy")
        if job is None:
            return None
        if job.final is not None:
            return job.final
        await self._rounds.answer(job, call)
        if job.sync_requests:  # some are still unanswered: ask for those again (SEP-2322 SHOULD)
            return self._rounds.offer(job)
        return await self._within_window(job)

    def adopt(self, call: ToolCall, rule: ToolRule, record: TaskRecord) -> Job:
        """A job for a task another replica began (takeover.py), in this replica's table; `start` runs it."""
        defaults = self._defaults()
        limits = self._limits()
        age_s = (self._state.now() - record.created_at).total_seconds()
        call.message = sent_again(call.message)
        job = Job(
            task_id=record.task_id,
            call=call,
            rule=rule,
            ttl_ms=record.ttl_ms,
            poll_interval_ms=record.poll_interval_ms,
            started_s=self._state.timer() - max(age_s, 0),  # its TTL runs from its creation
            is_task=True,
            stored=True,
            max_input_rounds=rule.max_input_rounds or defaults.max_input_rounds,
            max_result_bytes=limits.max_result_bytes,
            slots=self._slots_of(call.tool, rule),  # queued behind this replica's own calls of the tool
            sealed=True,
            queued=record.queued,  # still never sent: marked sent before it is
        )
        # Keys asked before are not asked again under the same name (SEP-2663: unique within the task).
        job.issued_keys = {*(record.input_requests or {}), *(record.collected_responses or {})}
        self._enter(job)
        return job

    def start(self, job: Job) -> None:
        self._spawn(job)

    def forget(self, job: Job) -> None:
        self._forget(job)

    def _may_take_over(self, call: ToolCall, rule: ToolRule) -> bool:
        """Whether the call is kept, sealed, for another replica to run or follow if this one is lost: with a seal
        (a shared store and the operator's key), for a rule that may run it again or queue it. Not a kept-alive
        call: its client's one connection ends with this replica, and nothing could find the task again."""
        if self._state.seal is None or call.on_progress is not None:
            return False
        # In front of a 2025 server that other replicas reach, any call: if it becomes the server's own task,
        # another replica follows that task instead of running anything again.
        return (
            rule.idempotent is not False
            or rule.max_concurrency is not None
            or (call.slots is not None and not call.slots.held)  # it queues: unsent, another replica may run it
            or self._state.upstream.tasks_reach_replicas
        )

    def _slots_of(self, tool: str, rule: ToolRule) -> asyncio.Semaphore | None:
        """The tool's slots under this rule: the ones its jobs in the table use, else new ones, kept once a job
        that uses them enters the table (`_enter`, in the same step: no other call comes between)."""
        if rule.max_concurrency is None:
            return None
        kept = self._slots.get((tool, rule.max_concurrency))
        return kept[0] if kept is not None else asyncio.Semaphore(rule.max_concurrency)

    def _admit(self, call: ToolCall, rule: ToolRule, limits: LimitsConfig) -> asyncio.Semaphore | None:
        """Apply the policy's concurrency limits to a new task; returns the tool's slots when it has a limit."""
        if len(self._state.jobs) >= limits.max_running_tasks:
            raise LimitReached(
                f"this proxy replica already runs {limits.max_running_tasks} background calls "
                "(limits.max_running_tasks); try again later",
                limit="max_running_tasks",
            )
        if limits.max_tasks_per_principal is not None:
            mine = self._per_caller.get(call.caller, 0)
            if mine >= limits.max_tasks_per_principal:
                raise LimitReached(
                    f"this caller already has {mine} tasks running, the most allowed "
                    "(limits.max_tasks_per_principal); wait for one to finish",
                    limit="max_tasks_per_principal",
                )
        slots = self._slots_of(call.tool, rule)
        if slots is None:
            return None
        if rule.on_limit == "refuse" and slots.locked():
            raise LimitReached(
                f"tool {call.tool!r} runs at most {rule.max_concurrency} calls at once (max_concurrency), and this "
                "policy refuses more instead of queueing them (on_limit: refuse); try again later",
                limit="max_concurrency",
            )
        return slots

    async def _create_record(self, job: Job) -> TaskRecord:
        now = self._state.now()
        record = TaskRecord(
            task_id=job.task_id,
            tool=job.call.tool,
            status=TaskStatus.WORKING,
            created_at=now,
            last_updated_at=now,
            ttl_ms=job.ttl_ms,
            poll_interval_ms=job.poll_interval_ms,
            status_message=job.last_message,
            owner=self._state.replica_id,
            principal=job.call.principal,
            stream=job.call.stream,
            fingerprint=job.call.fingerprint,
            queued=job.queued,
        )
        if tracing.TRACER.enabled:
            job.span = tracing.TRACER.start_task(job.task_id, job.call.tool)
            record = dataclasses.replace(record, trace=tracing.TRACER.traceparent(job.span))
        job.is_task = True
        seal = self._state.seal
        context = seal.seal(job.task_id, job.call) if job.sealed and seal is not None else None
        await self._state.store.create(record, context)
        job.mark_stored()
        self._state.metrics.tasks_created.labels(job.call.tool).inc()
        log.info("task_transition", task_id=job.task_id, tool=job.call.tool, to=record.status.value, duration_ms=0)
        return record

    def _enter(self, job: Job) -> None:
        jobs = self._state.jobs
        replaced = jobs.get(job.task_id)
        if replaced is not None:
            # Not expected (submit refuses an id in the table, the takeover sweep skips one), but should it happen
            # the replaced job leaves the counts here: its _forget will not find it in the table.
            self._uncount(replaced)
        jobs[job.task_id] = job
        caller = job.call.caller
        self._per_caller[caller] = self._per_caller.get(caller, 0) + 1
        if job.slots is not None:
            key = (job.call.tool, job.rule.max_concurrency)
            slots, users = self._slots.get(key, (job.slots, 0))
            self._slots[key] = (slots, users + 1)

    def _uncount(self, job: Job) -> None:
        """`job` left the table: it no longer counts against its caller, nor keeps its tool's slots."""
        caller = job.call.caller
        left = self._per_caller[caller] - 1
        if left:
            self._per_caller[caller] = left
        else:
            del self._per_caller[caller]  # no entry outlives its caller's last job
        if job.slots is not None:
            key = (job.call.tool, job.rule.max_concurrency)
            slots, users = self._slots[key]
            if users > 1:
                self._slots[key] = (slots, users - 1)
            else:
                del self._slots[key]  # nothing holds or waits for them: the next call makes new ones

    def _spawn(self, job: Job) -> None:
        job.runner = asyncio.create_task(self._attempts.run(job), name=f"{_RUNNER_PREFIX}{job.task_id}")
        # One bound method and one context for every job: a closure and a copied context each cost 300 bytes
        # for as long as the call runs.
        job.runner.add_done_callback(self._on_runner_done, context=_DONE_CONTEXT)

    def _runner_done(self, runner: asyncio.Task[None]) -> None:
        job = self._state.jobs.get(runner.get_name()[len(_RUNNER_PREFIX) :])
        if job is not None and job.runner is runner:
            self._forget(job)

    def _forget(self, job: Job) -> None:
        if job.stored_event is not None and not job.stored:
            job.stored_event.set()  # its creation failed: whoever waits for the record finds none
        if job.span is not None:  # the call ended without this replica writing a terminal status
            tracing.TRACER.end_task(job.span, "ended elsewhere")  # type: ignore[union-attr]
            job.span = None
        if self._state.jobs.get(job.task_id) is job:  # never another job under the same id
            del self._state.jobs[job.task_id]
            self._uncount(job)
        if job.holds_slot and job.slots is not None:
            job.holds_slot = False
            job.slots.release()
        if job.call.slots is not None:
            job.call.slots.release()
