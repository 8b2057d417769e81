"""How a task's changes become durable: status transitions and progress written to the store (an outcome retried
while the store is unavailable), the task's metrics and span closed, and every replica's listeners told."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Any

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
from ..store.base import StoreUnavailable
from ..upstream.events import Progress, UpstreamTask
from .job import DirectOutcome, Job
from .model import TaskRecord, TaskStateError, TaskStatus, owned_by, transition
from .runner_state import RunnerState

log = structlog.get_logger(__name__)

_SHUTDOWN_WRITE_S = 5.0
"""On shutdown, how long a task's last write may wait for an unavailable store."""


class _TakenOver(Exception):
    """The record names another replica as the one running the call: it was taken over."""


class NotTheOwner(Exception):
    """The task belongs to another principal: for its caller, it does not exist."""


class _AlreadyMade(Exception):
    """A retried change finds the record already changed: it is left as it is."""

    def __init__(self, record: TaskRecord) -> None:
        self.record = record


def owned(record: TaskRecord, principal: str | None) -> TaskRecord:
    if principal is not None and record.principal != principal:
        raise NotTheOwner
    return record


def run_note(run: int, attempts: int) -> str:
    """What every status message of a call run again after a lost replica starts with."""
    return f"attempt {run} of {attempts}, after a lost proxy replica"


class Settlement:
    """Records each transition of a task exactly once, and the outcome of a call however long the store takes."""

    def __init__(self, state: RunnerState) -> None:
        self._state = state

    async def progress(self, job: Job, event: Progress) -> None:
        if job.call.on_progress is not None:
            job.call.on_progress(event)
        message = event.describe()
        if message is None:
            return
        if job.run > 1:
            message = f"{run_note(job.run, job.rule.retry.attempts)}: {message}"
        job.last_message = message
        if job.is_task and job.stored:

            def apply(record: TaskRecord) -> TaskRecord:
                if record.status is not TaskStatus.WORKING:
                    return record
                return transition(record, TaskStatus.WORKING, now=self._state.now(), status_message=message)

            # Best effort (a failure is logged by the store): a later message or the outcome replaces it anyway.
            with contextlib.suppress(StoreUnavailable):
                if await self.update_live(job, apply) is not None:
                    # Streams on this replica (a durable call's progress) see it now, not at their next tick; no
                    # publish: other replicas' listeners read it at theirs, which spares Redis a message per step.
                    self._state.watchers.progressed(job.task_id)

    async def upstream_task(self, job: Job, upstream: UpstreamTask) -> None:
        """Keep the 2025 server's own task for the call (sealed), for a replica taking the task over to follow it.
        Best effort: without it a lost replica's task is run again, or ends "unknown", as any other."""
        seal = self._state.seal
        if seal is None or not (
            job.sealed and job.is_task and job.stored and self._state.upstream.tasks_reach_replicas
        ):
            return
        sealed = job.upstream_task = seal.seal_upstream_task(job.task_id, upstream, job.call.principal)

        def apply(record: TaskRecord) -> TaskRecord:
            if record.is_terminal or not owned_by(record, self._state.replica_id):
                return record
            return dataclasses.replace(record, upstream_task=sealed)  # internal: no new revision

        with contextlib.suppress(StoreUnavailable):
            await self.update_live(job, apply)

    async def queue(self, job: Job, message: str) -> None:
        """The call waits for a slot of its tool. A call kept for takeover is marked so in its record (best effort:
        unmarked, it is only not run again elsewhere whatever its rule); any other only says so."""
        job.queued = True
        if not job.sealed:
            await self.progress(job, Progress(message))
            return
        job.last_message = message
        if job.is_task and job.stored:
            with contextlib.suppress(StoreUnavailable):
                await self.update_live(job, functools.partial(self._mark_queued, True, message))
            self._state.watchers.progressed(job.task_id)

    async def unqueue(self, job: Job) -> bool:
        """The call has its slot and is about to be sent: a call kept for takeover is marked sent first, however
        long the store takes, as a replica taking it over runs a call marked queued whatever its rule. False when
        another replica took the task over meanwhile (this one was thought lost): then it must not be sent here."""
        job.queued = False
        if not job.sealed:
            return True
        if job.is_task and not job.stored:
            await job.wait_stored()  # its record is being made, with queued as it was: marked below
        if not job.stored:
            return True  # inside a sync window (its record is made with queued false), or never made
        try:
            marked = await self.until_stored(
                job, lambda: self.update_live(job, functools.partial(self._mark_queued, False, None))
            )
        except _TakenOver:
            log.warning("task_taken_over_elsewhere", task_id=job.task_id, tool=job.call.tool)
            job.settled = True  # nothing of this replica's may write to it any more
            return False
        if marked is None or marked.is_terminal:
            return False  # ended meanwhile (cancelled while it waited): nothing to send
        self._state.watchers.progressed(job.task_id)
        await self.drop_unneeded_call(job)
        return True

    async def drop_unneeded_call(self, job: Job) -> None:
        """Once a call of a rule that may not run it again is sent, no replica will need it: the client's
        credentials leave the store now (kept only while it could have run elsewhere unsent), unless a 2025 server
        may make a task of it, which another replica would follow."""
        if job.rule.idempotent is not False or self._state.upstream.tasks_reach_replicas:
            return
        job.sealed = False
        with contextlib.suppress(StoreUnavailable):
            await self._state.store.forget_call_context(job.task_id)

    def _mark_queued(self, queued: bool, message: str | None, record: TaskRecord) -> TaskRecord:
        if not owned_by(record, self._state.replica_id):
            raise _TakenOver
        if record.is_terminal:
            return record
        # Released at shutdown and taken by nobody yet: sent from here, it is this replica's again.
        owner = self._state.replica_id
        if record.status is not TaskStatus.WORKING or (record.queued == queued and record.owner == owner):
            return record
        return transition(
            record, TaskStatus.WORKING, now=self._state.now(), status_message=message, queued=queued, owner=owner
        )

    async def update_live(self, job: Job, apply: Callable[[TaskRecord], TaskRecord]) -> TaskRecord | None:
        """Update a running job's record; None when it ended meanwhile (the job is stopped if the record is gone)."""
        try:
            record = await self._state.store.update(job.task_id, apply)
        except TaskStateError:
            return None
        if record is None:
            self.abandon(job)
        return record

    async def settle(self, job: Job, status: TaskStatus, **fields: Any) -> None:
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
        if self._state.precedence.pending:  # the creations being answered first (precedence.py)
            await self._state.precedence.give_way()
        elsewhere = self._taken_elsewhere
        written = await self.until_stored(
            job, lambda: self.transition(job.task_id, status, job=job, unless=elsewhere, **fields)
        )
        job.unwritten = None
        if written is None:
            log.info("task_outcome_dropped", task_id=job.task_id, outcome=status.value)

    def _taken_elsewhere(self, record: TaskRecord) -> bool:
        """Another replica took the task over (this one was thought lost): its outcome is that replica's to write,
        and this one's is dropped."""
        return not owned_by(record, self._state.replica_id)

    def remaining_s(self, job: Job) -> float:
        """Time left before the task's record expires (its TTL runs from creation)."""
        return job.started_s + job.ttl_ms / 1000 - self._state.timer()

    async def until_stored(self, job: Job, write: Callable[[], Awaitable[Any]]) -> Any:
        """A store call the task cannot go on without (its outcome, an input round): retried with backoff while the
        store is unavailable, until the task's TTL ends (then nobody could read it anyway, and None is returned).
        The job stays in this replica's table meanwhile, and its lease is renewed on its own: no sweep fails it."""
        try:
            return await write()  # the usual case, without the retry machinery (it costs allocations per call)
        except StoreUnavailable:
            pass
        limit_s = max(self.remaining_s(job), 0)
        if not self._state.accepting:
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

    def abandon(self, job: Job) -> None:
        # The record expired or was evicted while the call ran: nobody can read the outcome any more.
        log.warning("task_record_gone", task_id=job.task_id)
        job.cancel_reason = "the task record is gone"
        if job.runner is not None:
            job.runner.cancel()

    async def transition(
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

        With `principal`, another principal's task raises NotTheOwner and is left unchanged. With `unless`, a record
        for which it is true is left as it is (the change was already made) and returned."""
        previous: list[TaskStatus] = []

        def apply(record: TaskRecord) -> TaskRecord:
            owned(record, principal)
            if unless is not None and unless(record):
                raise _AlreadyMade(record)
            previous.append(record.status)
            return transition(record, to, now=self._state.now(), **fields)

        try:
            record = await self._state.store.update(task_id, apply)
        except TaskStateError:
            return None
        except _AlreadyMade as made:
            return made.record
        if record is None:
            return None
        job = job or self._state.jobs.get(task_id)
        duration_ms = round((self._state.timer() - job.started_s) * 1000, 1) if job is not None else None
        if record.is_terminal:
            metrics = self._state.metrics
            if job is not None and job.span is not None:
                code = record.error.get("code") if record.error else None
                tracing.TRACER.end_task(job.span, to.value, error_code=code)  # type: ignore[union-attr]
                job.span = None
            metrics.tasks_finished.labels(record.tool, to.value).inc()
            if duration_ms is not None:
                metrics.task_seconds.labels(record.tool, to.value).observe(duration_ms / 1000)
            if record.error is not None:
                metrics.errors.labels(str(record.error.get("code"))).inc()
        log.info(
            "task_transition",
            task_id=task_id,
            tool=record.tool,
            **{"from": previous[-1].value},
            to=to.value,
            duration_ms=duration_ms,
        )
        await self.announce(task_id)
        return record

    async def announce(self, task_id: str) -> None:
        """Tell every replica's listeners (subscriptions/listen) that the task changed."""
        with contextlib.suppress(StoreUnavailable):  # a missed notification is caught up by polling
            await self._state.store.publish({"type": "changed", "taskId": task_id})
