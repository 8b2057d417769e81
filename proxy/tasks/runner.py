"""Background upstream calls: one asyncio task per proxy task, owned by the runner, settled into the store.

The runner is what the rest of the proxy calls; its parts do the work: admission.py (limits, sync window, start),
attempts.py (the call against the gateway), input_rounds.py (questions and answers through the task),
settlement.py (durable transitions, listeners told), recovery.py (events across replicas, reconciliation, the
lost-replica sweep). They share one RunnerState."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from ..clients.idempotency import key_reused
from ..config import LimitsConfig, TaskDefaults, ToolRule
from ..jsonrpc import INTERNAL_ERROR, JsonRpcError
from ..metrics import Metrics
from ..store.base import TaskIdTaken, TaskStore
from .admission import Admission
from .attempts import SHUTDOWN, Attempts
from .credentials import Credentials
from .hints import RepeatHints
from .input_rounds import InputRounds
from .job import TAKEN_OVER, DirectOutcome, Slots, ToolCall
from .model import TaskRecord, TaskStatus, utc_now
from .recovery import CANCELLED_BY_CLIENT, Recovery
from .runner_state import RunnerState
from .sealing import CallSeal
from .settlement import NotTheOwner, Settlement
from .sync_rounds import SyncRounds
from .takeover import Takeover

if TYPE_CHECKING:
    from ..upstream.gateway import Gateway

log = structlog.get_logger(__name__)

_TAKEN_MEANWHILE_S = 2.0
"""At the end of a shutdown's grace, the longest spent reading which calls another replica took just now."""


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
        round_wait_s: float = 20.0,
        input_wait_s: float = 300.0,
        metrics: Metrics | None = None,
        rule_for: Callable[[str], ToolRule | None] = lambda tool: None,
        seal: CallSeal | None = None,
        credentials_follow: bool = False,
        slots_for: Callable[[str, str], Slots | None] | None = None,
    ) -> None:
        self._state = RunnerState(
            store=store,
            upstream=upstream,
            metrics=metrics or Metrics(),
            now=now,
            timer=timer,
            # Unique per process, so a restarted replica never claims a dead one's tasks as its own.
            replica_id=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
            seal=seal if store.shared else None,
        )
        if slots_for is not None:
            self._state.slots_for = slots_for
        self._defaults = defaults
        self._rounds = SyncRounds(round_wait_s=round_wait_s, upstream_url=upstream.url, owner=self._state.replica_id)
        self._settlement = Settlement(self._state)
        self._recovery = Recovery(
            self._state,
            self._settlement,
            reap_interval_s=reap_interval_s,
            reconcile_interval_s=reconcile_interval_s,
        )
        self._input_rounds = InputRounds(
            self._state, self._settlement, self._recovery, self._rounds, input_wait_s=input_wait_s
        )
        hints = RepeatHints(upstream, lambda: limits().max_result_bytes)
        self.credentials = Credentials(self._state, follow=credentials_follow)
        attempts = Attempts(self._state, self._settlement, self._input_rounds, hints, self.credentials)
        self._admission = Admission(self._state, attempts, self._rounds, defaults, limits)
        running_limit = lambda: limits().max_running_tasks  # noqa: E731
        self._takeover = Takeover(
            self._state, self._settlement, self._admission, hints, rule_for, running_limit, lease_s=lease_s
        )
        self._recovery.sweep = self._takeover.sweep
        self.stopping = asyncio.Event()
        """Set when the proxy is told to stop: streams that would wait forever (subscriptions/listen) end then."""
        self._closing: asyncio.Future[None] | None = None
        self.replica_id = self._state.replica_id
        self.watchers = self._state.watchers
        self.precedence = self._state.precedence
        self._state.metrics.watch_running(self._running_by_status)

    @property
    def accepting(self) -> bool:
        """False once shutdown began: no new task is taken."""
        return self._state.accepting

    @property
    def running(self) -> int:
        return len(self._state.jobs)

    def _running_by_status(self) -> dict[str, int]:
        counts = {"working": 0, "input_required": 0}
        for job in list(self._state.jobs.values()):
            if job.is_task:
                counts["input_required" if job.waiting_input else "working"] += 1
        return counts

    async def start(self) -> None:
        """Subscribe to events from every replica; with a shared store, also look for lost replicas' tasks."""
        await self._recovery.start()

    def default_ttl_ms(self) -> int:
        return self._defaults().ttl_ms

    async def submit(self, call: ToolCall, rule: ToolRule) -> TaskRecord | DirectOutcome:
        """Start the call; return the stored task, or the outcome if it came inside the rule's sync window."""
        return await self._admission.submit(call, rule)

    async def submit_keyed(self, call: ToolCall, rule: ToolRule, key: str) -> TaskRecord:
        """A call with an idempotency key, whose task id (call.task_id) derives from it: the task made for the key
        before, running or finished, else a new one. Never a sync window: the outcome is kept for a retry to find.
        Raises the JSON-RPC error of a key used for another request (call.fingerprint differs)."""
        assert call.task_id is not None and call.fingerprint is not None
        existing = await self._keyed(call, key)
        if existing is not None:
            return existing
        try:
            unwindowed = rule if rule.sync_window_ms == 0 else rule.model_copy(update={"sync_window_ms": 0})
            outcome = await self.submit(call, unwindowed)
        except TaskIdTaken:  # the same key, submitted at the same moment here or on another replica
            existing = await self._keyed(call, key)
            if existing is None:  # that one failed to start (a full store, a limit): nothing runs for the key
                raise JsonRpcError(
                    INTERNAL_ERROR,
                    "Cannot create a task: a request with the same idempotency key, sent at the same time, could not "
                    "start its task; send it again",
                ) from None
            return existing
        assert isinstance(outcome, TaskRecord)  # no sync window
        return outcome

    async def _keyed(self, call: ToolCall, key: str) -> TaskRecord | None:
        task_id = call.task_id or ""
        job = self._state.jobs.get(task_id)
        if job is not None:
            await job.wait_stored()  # being created on this replica: its record is there once that ends
        record = await self._state.store.get(task_id)
        if record is None:
            return None
        if record.fingerprint != call.fingerprint or record.principal != call.principal:
            raise key_reused(key)
        return record

    async def resume(self, call: ToolCall) -> TaskRecord | DirectOutcome | None:
        """An MRTR retry that names a call parked inside its sync window; None when it names none."""
        return await self._admission.resume(call)

    async def cancel(self, task_id: str, principal: str | None = None) -> TaskRecord | None:
        """Record the cancellation and stop the upstream call; None when the task is unknown (or, with `principal`,
        not that principal's: ownership is checked in the same atomic update).

        A task that already finished keeps its terminal state: cancellation is cooperative (SEP-2663).
        """
        try:
            record = await self._settlement.transition(
                task_id, TaskStatus.CANCELLED, principal=principal, status_message=CANCELLED_BY_CLIENT
            )
        except NotTheOwner:
            return None
        if record is None:
            current = await self._state.store.get(task_id)
            return current if current is not None and (principal is None or current.principal == principal) else None
        # Whichever replica holds the upstream call stops it; this one may not be it.
        await self._recovery.tell_owner({"type": "cancel", "taskId": task_id})
        return record

    async def deliver_input(
        self, task_id: str, responses: dict[str, Any], principal: str | None = None
    ) -> TaskRecord | None:
        """tasks/update: keep answers to outstanding keys; once none is outstanding, the task resumes. None when the
        task is unknown (or, with `principal`, not that principal's)."""
        return await self._input_rounds.deliver_input(task_id, responses, principal)

    async def reconcile(self) -> int:
        """Act on what the records say, for events this replica may have missed; returns how many jobs were acted
        on."""
        return await self._recovery.reconcile()

    def stop_taking_over(self) -> None:
        """The proxy is stopping: no other replica's task is taken from now on (aclose hands this one's over)."""
        self._takeover.taking = False
        self.stopping.set()

    async def reap_lost(self) -> int:
        """Take over the running tasks whose replica's lease lapsed (killed, partitioned) or that it handed over:
        run again those that may be, fail the others; returns how many."""
        return await self._takeover.sweep()

    def end_round(self, caller: str | None) -> bool:
        """End a sync window's parked MRTR round (SyncRounds.end_round)."""
        return self._rounds.end_round(caller)

    async def aclose(self, grace_s: float = 0.0) -> None:
        """Hand the calls that may run again to the other replicas, let the rest finish for up to grace_s, then
        stop them and fail their tasks. Once: a second call waits for the first (the proxy starts it when told to
        stop, so that the streams waiting for these tasks end with them, and awaits it again at cleanup)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(grace_s))
        await self._closing

    async def _close(self, grace_s: float) -> None:
        self.stopping.set()
        self._state.accepting = False
        self._rounds.drain()  # their calls are stopped below with every other one
        self._recovery.stop()
        if self._state.seal is not None:
            await self._takeover.release()
        jobs = self._state.jobs
        pending = [job.runner for job in jobs.values() if job.runner is not None and not job.runner.done()]
        if pending:
            log.info("tasks_draining", running=len(pending), grace_s=grace_s)
        if pending and grace_s > 0:
            await asyncio.wait(pending, timeout=grace_s)
        if self._state.seal is not None:
            await self._recovery.taken_meanwhile(_TAKEN_MEANWHILE_S)
        stopped = 0
        for job in list(jobs.values()):
            if job.runner is not None and not job.runner.done() and job.cancel_reason != TAKEN_OVER:
                job.cancel_reason = SHUTDOWN
                job.runner.cancel()
                stopped += 1
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            log.info("tasks_drained", finished=len(pending) - stopped, failed_at_shutdown=stopped)
