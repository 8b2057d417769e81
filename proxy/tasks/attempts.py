"""A job's call against the gateway: its upstream attempts (one per MRTR round), their events followed, the outcome
handed to settlement; and how a stopped call ends (cancelled upstream, or failed at shutdown)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
from collections.abc import Awaitable
from typing import Any

import structlog

from .. import tracing
from ..jsonrpc import INTERNAL_ERROR, dumps, error_object
from ..upstream.events import Failed, Finished, InputNeeded, Progress
from .credentials import Credentials
from .hints import RepeatHints
from .input_rounds import InputRounds
from .job import Job, RoundLimit
from .model import TaskStatus
from .retries import Outcome, may_retry, retried
from .runner_state import RunnerState
from .settlement import Settlement

log = structlog.get_logger(__name__)

_HINT_LOOKUP_S = 30.0
"""The longest wait for the upstream's tools/list when a rule trusts its hints (idempotent: hint)."""

_UPSTREAM_ID_PREFIX = f"mtp-{secrets.token_hex(4)}-"
_upstream_numbers = itertools.count(1)
"""The ids of the proxy's upstream attempts: unique per process (the random part tells replicas apart), without
drawing random bytes for every call. (Task ids, bearer handles, stay 128 random bits each.)"""

SHUTDOWN = "the proxy shut down before the upstream call finished"
"""The cancel reason of the calls still running when the grace period of shutdown ends: their tasks fail."""


class Attempts:
    """Runs a job's upstream call, one attempt per round, until one ends it."""

    def __init__(
        self,
        state: RunnerState,
        settlement: Settlement,
        input_rounds: InputRounds,
        hints: RepeatHints,
        credentials: Credentials,
    ) -> None:
        self._state = state
        self._settlement = settlement
        self._input_rounds = input_rounds
        self._hints = hints
        self._credentials = credentials

    async def run(self, job: Job) -> None:
        """The job's own asyncio task: the call (in one of its tool's slots when the rule limits them); stopped, it
        is cancelled upstream, or its task fails when the proxy shuts down."""
        structlog.contextvars.bind_contextvars(task_id=job.task_id, tool=job.call.tool)
        if not self._state.accepting:
            # Started after the proxy began to stop (its record was being written when TaskRunner.aclose looked,
            # so no call was there to wait for or stop): nothing is sent, and the task fails as those stopped do.
            await self._fail_at_shutdown(job)
            return
        try:
            limited = job.call.slots
            if limited is not None and not limited.held and await limited.take() is not None:  # it queues
                await self._settlement.queue(job, f"queued: past the concurrency limit {limited.full!r}")
                await limited.wait(None, patient=True)  # admitted: it waits whatever its limits say
            if job.slots is None or job.holds_slot:
                # (A call taken over from a lost replica may still be marked queued, slots or not.)
                if not job.queued or await self._settlement.unqueue(job):
                    await self._drive(job)
            else:
                if job.slots.locked():
                    await self._settlement.queue(job, f"queued: {job.call.tool} runs a limited number of calls at once")
                async with job.slots:
                    if not job.queued or await self._settlement.unqueue(job):
                        if job.sealed:  # kept in case it queued; it did not
                            await self._settlement.drop_unneeded_call(job)
                        await self._drive(job)
        except asyncio.CancelledError:
            if job.cancel_reason == SHUTDOWN:
                if job.unwritten is not None:  # the outcome was in hand; only its write was interrupted
                    status, fields = job.unwritten
                    await self._settlement.settle(job, status, **fields)
                else:
                    await self._fail_at_shutdown(job)
            elif job.cancel_reason is None:
                raise
            elif job.upstream_busy and job.call.client_session is None:  # (taken over: another replica runs it)
                # (A call on a client's own session posts its cancellation itself as its stream closes.)
                await self._state.upstream.notify_cancelled(job.upstream_id, job.call.headers, job.cancel_reason)
        except Exception:
            log.exception("task_runner_error")
            error = error_object(INTERNAL_ERROR, "Proxy failure: internal error while following the upstream call")
            await self._settlement.settle(job, TaskStatus.FAILED, error=error, status_message="internal proxy error")

    async def _fail_at_shutdown(self, job: Job) -> None:
        error = error_object(INTERNAL_ERROR, f"Proxy failure: {SHUTDOWN}")
        await self._settlement.settle(job, TaskStatus.FAILED, error=error, status_message=SHUTDOWN)

    async def _drive(self, job: Job) -> None:
        """Run upstream attempts until one ends the call; MRTR input_required answers start the next round."""
        message = job.call.message
        input_rounds = 0
        loop = asyncio.get_running_loop()
        while True:
            # For the round, its retries included; never past the task's TTL, after which nobody can read its
            # outcome (the memory store has dropped the record: no reconcile stops the call as with Redis).
            deadline = loop.time() + min(job.rule.timeout_s, max(self._settlement.remaining_s(job), 0))
            needed = await self._attempt(job, message, deadline)
            if isinstance(needed, Failed):  # transient, and the rule may let it be sent again
                if not await self._repeatable(job, needed, deadline):
                    await self._fail(job, needed)
                    return
                again = functools.partial(self._again, job, message, deadline)
                needed, made = await retried(
                    job, needed, deadline - loop.time(), again, self._settlement.progress, self._count_retry
                )
                if isinstance(needed, Failed):
                    await self._fail(job, needed, made)
                    return
            if needed is None:
                return  # the attempt settled the call
            if not job.is_task:
                # Inside the sync window, before any task exists: the client answers the MRTR round itself.
                await self._settlement.settle(job, TaskStatus.COMPLETED, result=needed.result)
                return
            input_rounds += 1
            if input_rounds > job.max_input_rounds:
                reason = f"the upstream asked for input more than {job.max_input_rounds} times (max_input_rounds)"
                data = {"upstream": self._state.upstream.url}
                error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", data)
                await self._settlement.settle(job, TaskStatus.FAILED, error=error, status_message=reason)
                return
            if needed.input_requests:
                responses = await self._input_rounds.ask_client(job, needed.input_requests)
                if responses is None:
                    return
            else:
                # A state-only round (load shedding, SEP-2322): retry at once, after a short backoff.
                responses = None
                await asyncio.sleep(min(0.05 * 2 ** (input_rounds - 1), 0.25))
            message = retry_message(job.call.message, responses, needed.request_state)

    def _attempt(self, job: Job, message: dict[str, Any], deadline: float, number: int = 1) -> Awaitable[Outcome]:
        """One upstream call; None once the outcome is settled, the InputNeeded when the upstream wants input, a
        Failed (not settled) when it failed transiently and the rule lets it be sent again.
        (No coroutine of its own without tracing: each frame is held for as long as the call runs.)"""
        if not tracing.TRACER.enabled:
            return self._call_upstream(job, message, deadline)
        return self._traced_call(job, message, deadline, number)

    async def _again(self, job: Job, message: dict[str, Any], deadline: float, number: int) -> Outcome:
        outcome = await self._attempt(job, sent_again(message), deadline, number)
        if isinstance(outcome, Failed) and not await self._repeatable(job, outcome, deadline):
            await self._fail(job, outcome, number)
            return None
        return outcome

    async def _fail(self, job: Job, failed: Failed, attempts: int | None = None) -> None:
        """Write a transient failure that will not be sent again; the status says how many attempts there were."""
        status = failed.status_message if attempts is None else f"{failed.status_message} ({_attempts(attempts)})"
        await self._settlement.settle(job, TaskStatus.FAILED, error=failed.error, status_message=status)

    async def _repeatable(self, job: Job, failed: Failed, deadline: float) -> bool:
        if failed.transient == "unsent" or job.rule.idempotent is True:
            return True
        # idempotent: hint. The upstream just failed: its tools/list may hang too, so within the round's time.
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            with self._state.deadlines.limit(min(max(remaining, 0), _HINT_LOOKUP_S)):
                return await self._hints.may_repeat(job.call, job.task_id)
        except TimeoutError:
            return False

    def _count_retry(self, reason: str) -> None:
        self._state.metrics.upstream_retries.labels(reason).inc()

    async def _traced_call(self, job: Job, message: dict[str, Any], deadline: float, number: int) -> Outcome:
        with tracing.TRACER.upstream_call(job.span, job.call.tool, attempt=number, run=job.run) as span:
            outcome = await self._call_upstream(job, message, deadline)
            if isinstance(outcome, Failed):  # transient: another attempt may follow
                tracing.TRACER.failed_attempt(span, outcome.transient or "failed")
            return outcome

    async def _call_upstream(
        self, job: Job, message: dict[str, Any], deadline: float, *, credential_retried: bool = False
    ) -> Outcome:
        if self._state.precedence.pending and job.is_task:  # the creations being answered first (precedence.py)
            await self._state.precedence.give_way()  # (not in a sync window: its creation waits for this call)
        if self._credentials.follow and (job.run > 1 or message is not job.call.message):
            # A later request of the call (the call as created goes with the token it was created with): the owner
            # may have shown a newer token on another replica since.
            await self._credentials.refresh(job)
        used = job.call.headers.get("Authorization")
        job.upstream_id = message["id"]
        job.upstream_busy = True
        events = self._state.upstream.call_tool(
            message,
            job.call.headers,
            job.call.capabilities,
            max_bytes=job.max_result_bytes,
            on_request=functools.partial(self._input_rounds.open_questions, job),
            session=job.call.client_session,
            follow=job.follow,  # kept for every attempt: a retry follows again, it never sends the call
            detached=job.is_detached,
            caller=job.call.caller,
        )
        started_s = self._state.timer()
        outcome = "cancelled"
        settle: tuple[TaskStatus, dict[str, Any]] | None = None
        transient: Failed | None = None
        refused: Failed | None = None
        try:
            with self._state.deadlines.limit(deadline - asyncio.get_running_loop().time()):
                async for event in events:
                    if isinstance(event, Progress):
                        if event.upstream_task is not None:
                            await self._settlement.upstream_task(job, event.upstream_task)
                        await self._settlement.progress(job, event)
                    elif isinstance(event, InputNeeded):
                        if event.reply is None:
                            outcome = "input_required"
                            return event  # a modern upstream: the next round is a new attempt
                        await self._input_rounds.open_questions(job, event)  # a legacy one waits on this very stream
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
                            self._state.metrics.upstream_errors.labels("task").inc()
                        if event.refused_credentials and self._credentials.follow:
                            refused = event  # the call did not run: with a newer credential it is sent again
                        elif may_retry(job, event):
                            transient = event
                        else:
                            settle = (TaskStatus.FAILED, {"error": event.error, "status_message": event.status_message})
                        break
        except RoundLimit:
            outcome = "failed"  # already written; closing the events cancels the call upstream
        except TimeoutError:
            outcome = "timeout"
            self._state.metrics.upstream_errors.labels("task").inc()
            if self._settlement.remaining_s(job) <= 0:
                reason = f"the task's time to live ({job.ttl_ms} ms, ttl_ms) ended while its upstream call still ran"
            else:
                reason = f"the upstream call exceeded its {job.rule.timeout_s:g} s limit (timeout_s)"
            error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._state.upstream.url})
            settle = (TaskStatus.FAILED, {"error": error, "status_message": reason})
        finally:
            job.upstream_busy = False
            spent_s = self._state.timer() - started_s
            self._state.metrics.upstream_seconds.labels(job.call.tool, outcome).observe(spent_s)
            error_type = "" if outcome in ("completed", "input_required") else outcome
            self._state.metrics.observe_upstream_operation(job.call.tool, error_type, spent_s)
            await events.aclose()
        if refused is not None:
            await self._credentials.refresh(job)
            if not credential_retried and job.call.headers.get("Authorization") != used:
                log.info("upstream_credential_refused", retry="with the owner's newer credential")
                return await self._call_upstream(job, sent_again(message), deadline, credential_retried=True)
            reason = (
                "the upstream refused the owner's newest credential too (HTTP 401)"
                if credential_retried
                else "the upstream refused the task's credential (HTTP 401), and its owner has shown no newer one "
                "since it was sent"
            )
            settle = (TaskStatus.FAILED, {"error": refused.error, "status_message": reason})
        if settle is not None:
            # Outside the call's timeout: an outcome in hand is written however long the store takes (it is retried
            # until the TTL), never turned into a timeout failure.
            status, fields = settle
            await self._settlement.settle(job, status, **fields)
        return transient


def _attempts(count: int) -> str:
    return "1 attempt" if count == 1 else f"{count} attempts"


def sent_again(message: dict[str, Any]) -> dict[str, Any]:
    """The same request with a new id (and progress token): an attempt after a transient failure."""
    return retry_message(message, None, None, keep_client_round=True)


def retry_message(
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
    upstream_id = f"{_UPSTREAM_ID_PREFIX}{next(_upstream_numbers):x}"
    # The proxy's own progress token: progress feeds statusMessage and must not be mistaken across attempts.
    params["_meta"] = {**(params.get("_meta") or {}), "progressToken": upstream_id}
    return {"jsonrpc": "2.0", "id": upstream_id, "method": "tools/call", "params": params}
