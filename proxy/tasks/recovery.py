"""Tasks across replicas: events between them (cancellation, answers, changes, tasks handed over), reconciliation
from the records for the events a replica missed, and the timer of the sweep for lost replicas' tasks (takeover.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from ..store.base import StoreUnavailable
from .job import Job
from .model import TaskRecord, TaskStatus, owned_by
from .runner_state import RunnerState
from .settlement import Settlement

log = structlog.get_logger(__name__)

CANCELLED_BY_CLIENT = "cancelled at the client's request"


class Recovery:
    """Keeps this replica's calls in step with what the records and the other replicas say."""

    def __init__(
        self,
        state: RunnerState,
        settlement: Settlement,
        *,
        reap_interval_s: float,
        reconcile_interval_s: float,
    ) -> None:
        self._state = state
        self._settlement = settlement
        self._reap_interval_s = reap_interval_s
        self._reconcile_interval_s = reconcile_interval_s
        self._reaper: asyncio.Task[None] | None = None
        self._reconciler: asyncio.Task[None] | None = None
        self._sweep_now = asyncio.Event()
        self.sweep: Callable[[], Awaitable[int]] | None = None
        """The lost replicas' tasks taken over (takeover.py), set by the runner once its parts exist."""

    async def start(self) -> None:
        """Subscribe to events from every replica; with a shared store, also look for lost replicas' tasks."""
        store = self._state.store
        if store.shared:
            self._reaper = asyncio.ensure_future(self._reap_forever())
            self._reconciler = asyncio.ensure_future(self._reconcile_forever())
        await store.start(self._state.replica_id, self._on_event, self._resync)

    def stop(self) -> None:
        for loop_task in (self._reaper, self._reconciler):
            if loop_task is not None:
                loop_task.cancel()

    async def tell_owner(self, event: dict[str, Any]) -> None:
        """Publish an event for the replica running the task. What the event says is already in the record, so a
        failed publish loses nothing: the owner's reconciliation reads it from there (an acknowledged request
        stays acknowledged)."""
        if self._state.store.shared and event["taskId"] in self._state.jobs:
            await self._on_event(event)  # ours: act now, whatever becomes of the publish (acting twice is harmless)
        try:
            await self._state.store.publish(event)
        except StoreUnavailable:
            log.warning("task_event_not_published", task_id=event["taskId"], event_type=event["type"])

    async def _on_event(self, event: dict[str, Any]) -> None:
        """An event from any replica (this one included) about a task whose call may run here."""
        if event.get("type") in ("changed", "input"):
            self._state.watchers.changed(str(event.get("taskId")))
        elif event.get("type") == "released":  # a replica stopping handed tasks over: take them now
            self._sweep_now.set()
            return
        elif event.get("type") == "taken" and event.get("owner") != self._state.replica_id:
            # Another replica took over a task this one still runs (released at shutdown, or this replica was
            # thought lost): that replica goes on with it, this one stops without a word upstream about a task.
            taken = self._state.jobs.get(str(event.get("taskId")))
            if taken is not None and not taken.settled:
                log.warning("task_taken_over_elsewhere", task_id=taken.task_id, tool=taken.call.tool)
                follows = event.get("follows")
                taken.taken_over(follows if isinstance(follows, str) else None)
            return
        job = self._state.jobs.get(str(event.get("taskId")))
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
                    job.waiting_input = False  # legacy: nothing outstanding; modern: InputRounds.ask_client clears it
                if job.answered is not None:
                    job.answered.set()

    def _stop_cancelled(self, job: Job, reason: str = CANCELLED_BY_CLIENT) -> None:
        """The task was cancelled (or failed) elsewhere: stop its upstream call, unless it already settled here."""
        if job.runner is not None and not job.runner.done() and not job.settled:
            job.cancel_reason = reason
            job.runner.cancel()

    async def _resync(self) -> None:
        """After every (re)subscription to the store's events: whatever was published meanwhile was lost to this
        replica, so its listeners re-read their tasks and its calls re-read what they wait for."""
        for task_id in self._state.watchers.watched():
            self._state.watchers.changed(task_id)
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
        store = self._state.store
        jobs = [job for job in self._state.jobs.values() if job.is_task and job.stored and not job.settled]
        if not jobs:
            return 0
        running = await store.still_running([job.task_id for job in jobs])
        acted = 0
        for job in jobs:
            ended = job.task_id not in running
            if not ended and not (job.round_open or job.replies):
                continue
            record = await store.get(job.task_id)
            if record is None or record.is_terminal:
                if record is None or record.status is TaskStatus.CANCELLED:
                    self._stop_cancelled(job)
                else:
                    self._stop_cancelled(job, reason="the task ended on another replica")
                acted += 1
                continue
            if not owned_by(record, self._state.replica_id):
                # Taken over while this replica was thought lost (paused, cut off), or after it released the task
                # at shutdown: the run there is the task's now.
                job.taken_over(record.upstream_task)
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

    async def taken_meanwhile(self, limit_s: float) -> None:
        """At the end of a shutdown's grace: the calls another replica took over just now (its "taken" event not
        seen yet) stop as taken over rather than fail, and a server task that replica follows is left running.
        Bounded by `limit_s`: a store that does not answer leaves them to fail as at any shutdown."""
        jobs = [job for job in self._state.jobs.values() if job.sealed and job.stored and not job.settled]
        if not jobs:
            return
        with contextlib.suppress(TimeoutError, StoreUnavailable), self._state.deadlines.limit(limit_s):
            records = await asyncio.gather(
                *(self._state.store.get(job.task_id) for job in jobs), return_exceptions=True
            )
            for job, record in zip(jobs, records, strict=True):
                if isinstance(record, TaskRecord) and not owned_by(record, self._state.replica_id):
                    job.taken_over(record.upstream_task)

    async def _reap_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sweep_now.wait(), self._reap_interval_s)
            self._sweep_now.clear()
            try:
                if self.sweep is not None:
                    await self.sweep()
            except StoreUnavailable:
                pass  # logged by the store; the next sweep tries again
            except Exception as exc:  # the sweep must outlive any one pass
                log.warning("task_sweep_failed", error=type(exc).__name__)
