"""A lost replica's calls, taken over by another: run again where that is safe, else ended "outcome unknown".

A call runs again when it was never sent (it waited for a slot of its tool), or when its rule says the tool may run
twice (`idempotent: true`, or `hint` and the upstream's annotations agree), at most `retry.attempts` runs in all: a
call that kills every replica it runs on (memory, a crash) does not take them all down. Running it again needs the
call itself, which the owner kept in the store sealed (sealing.py); without an operator's principal key there is
none, and the task fails as before. The claim is one atomic update of the record (its owner still the lost one),
so among replicas sweeping at once exactly one takes each task.

At shutdown a replica hands its idempotent and queued calls over at once (`release`): their records name a released
owner, which the other replicas' sweeps take without waiting for the lease to lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable

import structlog

from .. import tracing
from ..config import ToolRule
from ..jsonrpc import INTERNAL_ERROR, error_object
from ..store.base import RecordCorrupt, StoreUnavailable
from ..upstream.events import UpstreamTask
from .admission import Admission
from .hints import RepeatHints
from .job import Job, ToolCall
from .model import RELEASED, TaskRecord, TaskStatus, transition
from .runner_state import RunnerState
from .settlement import Settlement, run_note

log = structlog.get_logger(__name__)


_HINT_LOOKUP_S = 10.0
_RELEASE_S = 5.0
"""The longest a replica shutting down spends handing calls over, before its grace period begins."""


class NoRoom(Exception):
    """This replica runs as many calls as it may (limits.max_running_tasks): the task is left for another sweep."""


class _NotLost(Exception):
    """The record changed since it was read: another replica took it, or it ended."""


class Takeover:
    def __init__(
        self,
        state: RunnerState,
        settlement: Settlement,
        admission: Admission,
        hints: RepeatHints,
        rule_for: Callable[[str], ToolRule | None],
        max_running: Callable[[], int],
        *,
        lease_s: float,
    ) -> None:
        self._lease_s = lease_s
        self._state = state
        self._settlement = settlement
        self._admission = admission
        self._hints = hints
        self._rule_for = rule_for
        self._max_running = max_running
        self.taking = True
        """False once this replica is stopping: what it took now it would hand over again, or run twice."""

    async def sweep(self) -> int:
        """Take over the running tasks whose replica's lease lapsed (killed, partitioned) or that it released at
        shutdown: run again those that may be, fail the others; returns how many were taken or failed."""
        if not self.taking:
            return 0
        store = self._state.store
        # The store was out of reach within a lease: a live replica may not have renewed its lease since, so only
        # the tasks handed over are taken.
        leases_known = store.healthy_for() >= self._lease_s
        swept = 0
        alive: dict[str, bool] = {}
        for task_id in await store.running_task_ids():
            if not self.taking:
                break  # told to stop during the sweep
            try:
                swept += await self._sweep_one(task_id, leases_known, alive)
            except RecordCorrupt:
                continue  # logged by the store; the others are still taken over
            except StoreUnavailable:
                raise  # the store is away: the next pass tries them all again
            except Exception:  # one task's trouble must not stop the sweep for the others
                log.exception("task_sweep_failed", task_id=task_id)
        return swept

    async def _sweep_one(self, task_id: str, leases_known: bool, alive: dict[str, bool]) -> int:
        store = self._state.store
        record = await store.get(task_id)
        if record is None or record.is_terminal or record.owner is None:
            return 0
        if task_id in self._state.jobs:
            # A call for it still runs here: this replica's own, or an earlier run of it that another replica took
            # and that is still ending. Never a second job under one id: the next sweep looks again.
            return 0
        owner = record.owner.removeprefix(RELEASED)
        # A released call still runs on its replica until another takes it: one that may not be taken here is
        # left to it, unless that replica is gone too.
        released = owner != record.owner
        if owner == self._state.replica_id:
            owner_alive = False  # ours, but no call runs for it here any more
        elif not leases_known:
            owner_alive = None if released else True  # unknown: only a call handed over may be taken
        else:
            if owner not in alive:
                alive[owner] = await store.is_alive(owner)
            owner_alive = alive[owner]
        if owner_alive and not released:
            return 0
        try:
            why_not = await self.take(record)
        except NoRoom:
            return 0  # another replica, or the next sweep
        if why_not is None:
            return 1
        if owner_alive is not False:
            return 0  # its replica still runs it, or may
        return int(await self._fail_unknown(record, why_not))

    async def _fail_unknown(self, record: TaskRecord, why_not: str) -> bool:
        owner = record.owner or ""
        reason = (
            f"the proxy replica running this task was lost ({owner.removeprefix(RELEASED)}); the call may or may not "
            f"have taken effect upstream, and is not run again: {why_not}"
        )
        # "unknown", as payment APIs say it: a retry with the task's idempotency key gets this same answer, and
        # only a new key runs the call again.
        error = error_object(INTERNAL_ERROR, f"Proxy failure: {reason}", {"outcome": "unknown"})
        failed = await self._settlement.transition(
            record.task_id,
            TaskStatus.FAILED,
            error=error,
            status_message=reason,
            unless=lambda current: current.owner != owner,  # taken by another replica meanwhile
        )
        if failed is None or failed.status is not TaskStatus.FAILED:
            return False
        self._state.metrics.tasks_taken_over.labels("unknown").inc()
        return True

    async def take(self, record: TaskRecord) -> str | None:
        """Run the lost replica's call here; None once it runs, else why it may not (then it fails "unknown").
        Raises NoRoom when this replica is full, StoreUnavailable when the store does not answer."""
        state = self._state
        rule = self._rule_for(record.tool)
        if rule is None:
            return "no tool rule of the policy names it any more"
        if state.seal is None:
            return "the replicas have no principal key of the operator's to keep calls with (security.principal_key)"
        follow = None
        # A server task waiting for an answer asked through the lost replica would wait for it forever: the server
        # does not ask again on another stream.
        if record.upstream_task is not None and not record.queued and record.status is TaskStatus.WORKING:
            follow = state.seal.unseal_upstream_task(record.task_id, record.upstream_task, record.principal)
        if not record.queued and follow is None:  # it would run again
            if rule.idempotent is False:
                if record.upstream_task is not None and record.status is not TaskStatus.WORKING:
                    return "its upstream task waits for an answer that was asked through the lost replica"
                if record.upstream_task is not None:
                    return "its upstream task could not be read (kept under another principal key)"
                return "its tool rule is not idempotent"
            if record.attempt >= rule.retry.attempts:
                return f"it ran {_runs(record.attempt)} already, the most its rule allows (retry.attempts)"
        if len(state.jobs) >= self._max_running():
            raise NoRoom
        sealed = await state.store.call_context(record.task_id)
        call = state.seal.unseal(record.task_id, sealed, record.principal, record.tool) if sealed is not None else None
        if call is None:
            return "its call was not kept for another replica"
        hinted = record.queued or follow is not None or rule.idempotent != "hint"
        if not hinted and not await self._hinted(call, record.task_id):
            return "the upstream does not mark its tool idempotent or read-only (idempotent: hint)"
        return await self._claim(record, call, rule, follow)

    async def _hinted(self, call: ToolCall, task_id: str) -> bool:
        try:
            with self._state.deadlines.limit(_HINT_LOOKUP_S):
                return await self._hints.may_repeat(call, task_id)
        except TimeoutError:
            return False

    async def _claim(
        self, record: TaskRecord, call: ToolCall, rule: ToolRule, follow: UpstreamTask | None
    ) -> str | None:
        state = self._state
        attempt = record.attempt if record.queued or follow is not None else record.attempt + 1
        if record.queued:
            message = "queued again on another proxy replica: the one it waited on was lost"
        elif follow is not None:
            message = "following the upstream's own task for the call, after a lost proxy replica"
        else:
            message = f"{run_note(attempt, rule.retry.attempts)}: running again"
        lost_owner = record.owner

        def claim(current: TaskRecord) -> TaskRecord:
            # Taken by another replica, ended, or changed since it was decided on (sent meanwhile, run again).
            unchanged = (current.queued, current.attempt, current.upstream_task) == (
                record.queued,
                record.attempt,
                record.upstream_task,
            )
            if current.is_terminal or current.owner != lost_owner or not unchanged:
                raise _NotLost
            return transition(
                current,
                TaskStatus.WORKING,
                now=state.now(),
                owner=state.replica_id,
                attempt=attempt,
                status_message=message,
                input_requests=None,
                collected_responses=None,
                # Kept only when followed: the replica it was taken from leaves that task running for this one
                # (Job.taken_over), and cancels any other.
                upstream_task=current.upstream_task if follow is not None else None,
            )

        job = self._admission.adopt(call, rule, record)  # in the table first: no sweep here takes it twice
        try:
            claimed = await state.store.update(record.task_id, claim)
        except _NotLost:
            claimed = None
        except BaseException:
            self._admission.forget(job)
            raise
        if claimed is None:
            self._admission.forget(job)
            return None  # taken by another replica, or ended: nothing is left to do with it
        job.last_message = message
        if follow is not None:
            job.follow = follow  # nothing runs again: the server's task is followed
            job.upstream_task = claimed.upstream_task
        else:
            job.run = attempt
        slots = state.slots_for(call.tool, call.caller)
        if slots is not None:
            if not job.queued:  # it ran on the lost replica, whose slots lapse: counted here from now on
                try:
                    await slots.take(force=True)
                except BaseException:  # (stopped meanwhile: the job must not stay in the table unstarted)
                    self._admission.forget(job)
                    raise
            slots.passed = True  # (one still queued waits for its slots here, as it did there)
            job.call.slots = slots
        if tracing.TRACER.enabled:
            job.span = tracing.TRACER.start_task(job.task_id, job.call.tool)
        self._admission.start(job)
        state.metrics.tasks_taken_over.labels("run_again").inc()
        log.info(
            "task_taken_over",
            task_id=record.task_id,
            tool=record.tool,
            lost_owner=lost_owner,
            attempt=attempt,
            queued=record.queued,
            follows=follow is not None,
        )
        await self._settlement.announce(record.task_id)
        with contextlib.suppress(StoreUnavailable):
            # The replica it was taken from, if it is only paused or stopping: it stops its own run.
            await state.store.publish(
                {"type": "taken", "taskId": record.task_id, "owner": state.replica_id, "follows": job.upstream_task}
            )
        return None

    async def release(self) -> int:
        """At shutdown: offer the calls that may run again elsewhere (queued ones, and idempotent ones with a run
        left) to the other replicas now; returns how many. Each goes on here until a replica takes it (that one
        says so: the call stops here, recovery.py) or ends within the grace as before: when every replica is
        stopping, nobody takes them and nothing changes. Bounded in time: a store that does not answer leaves every
        call to the grace."""
        state = self._state
        jobs = [job for job in state.jobs.values() if self._may_hand_over(job)]
        if not jobs:
            return 0
        try:
            with state.deadlines.limit(_RELEASE_S):
                if await state.store.listeners() < 2:  # this replica's own subscription is one
                    return 0
                handed = await asyncio.gather(*(self._hand_over(job) for job in jobs), return_exceptions=True)
        except (TimeoutError, StoreUnavailable):
            log.warning("tasks_not_handed_over", reason="the store did not answer")
            return 0
        released = sum(1 for done in handed if done is True)
        if released:
            state.metrics.tasks_taken_over.labels("released").inc(released)
            log.info("tasks_handed_over", tasks=released)
            with contextlib.suppress(StoreUnavailable):  # the others' next sweep finds them anyway
                await state.store.publish({"type": "released", "taskId": ""})
        return released

    @staticmethod
    def _may_hand_over(job: Job) -> bool:
        if not (job.sealed and job.is_task and job.stored and not job.settled):
            return False
        if job.queued:
            return True
        # An idempotent call with a run left: the next replica counts this one, as after a loss.
        return job.rule.idempotent is True and job.run < job.rule.retry.attempts

    async def _hand_over(self, job: Job) -> bool:
        state = self._state

        def release(current: TaskRecord) -> TaskRecord:
            if current.is_terminal or current.owner != state.replica_id:
                raise _NotLost
            return dataclasses.replace(current, owner=RELEASED + state.replica_id)

        try:
            released = await state.store.update(job.task_id, release)
        except _NotLost:
            return False
        return released is not None


def _runs(count: int) -> str:
    return "once" if count == 1 else f"{count} times"
