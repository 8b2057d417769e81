"""Input rounds of a task: the upstream's questions put in the task's record (each round's keys unique), the client's
answers taken by tasks/update, and the call resumed with them (a modern server: the next attempt; a legacy one: the
answers posted back on the open call)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import structlog

from ..jsonrpc import INTERNAL_ERROR, MISSING_REQUIRED_CLIENT_CAPABILITY, error_object
from ..upstream.events import InputNeeded
from .job import Job, RoundLimit
from .model import TaskRecord, TaskStatus, stamp_after, transition
from .recovery import Recovery
from .runner_state import RunnerState
from .settlement import NotTheOwner, Settlement, owned
from .sync_rounds import SyncRounds

log = structlog.get_logger(__name__)


class InputRounds:
    """Asks the client what the upstream asks, through the task, and brings the answers back to the call."""

    def __init__(
        self,
        state: RunnerState,
        settlement: Settlement,
        recovery: Recovery,
        rounds: SyncRounds,
        *,
        input_wait_s: float = 300.0,
    ) -> None:
        self._state = state
        self._settlement = settlement
        self._recovery = recovery
        self._rounds = rounds
        self._input_wait_s = input_wait_s
        self._unanswered: set[asyncio.Task[None]] = set()

    async def ask_client(self, job: Job, requests: dict[str, Any]) -> dict[str, Any] | None:
        """Put the upstream's input requests in the task and wait for tasks/update to answer them all.

        Returns the answers under the upstream's own keys; None when the task ended meanwhile.
        """
        refusal = _refuse_undeclared(requests, job.call.capabilities)
        if refusal is not None:
            error, reason = refusal
            await self._settlement.settle(job, TaskStatus.FAILED, error=error, status_message=reason)
            return None
        key_map: dict[str, str] = {}
        task_requests: dict[str, Any] = {}
        for upstream_key, input_request in requests.items():
            task_key = job.unique_key(upstream_key)
            key_map[task_key] = upstream_key
            task_requests[task_key] = input_request
        job.answered = answered = asyncio.Event()  # before the record says input_required: no answer is missed
        job.waiting_input = True
        self._state.metrics.input_rounds.labels(job.call.tool).inc()

        def this_round(record: TaskRecord) -> bool:
            # Keys are unique per round: a record that asks for them, or holds answers to them, is this round's.
            return record.input_requests == task_requests or any(
                key in (record.collected_responses or {}) for key in task_requests
            )

        waiting = await self._settlement.until_stored(
            job,
            lambda: self._settlement.transition(
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
                await asyncio.wait_for(answered.wait(), timeout=max(self._settlement.remaining_s(job), 0))
                record = await self._settlement.until_stored(job, lambda: self._state.store.get(job.task_id))
                if record is None or record.status is not TaskStatus.INPUT_REQUIRED:
                    break
                answered.clear()  # a stale wake-up (an earlier round's event, echoed late): this round still waits
        except TimeoutError:
            self._settlement.abandon(job)
            return None
        finally:
            job.round_open = False
        job.waiting_input = False
        if record is None or record.status is not TaskStatus.WORKING or not this_round(record):
            return None
        collected = record.collected_responses or {}
        return {key_map[key]: answer for key, answer in collected.items() if key in key_map}

    async def open_questions(self, job: Job, needed: InputNeeded) -> None:
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
            await self._settlement.settle(job, TaskStatus.FAILED, error=refusal, status_message=reason)
            if job.runner is asyncio.current_task():
                raise RoundLimit
            job.stop("too many input rounds")
            return
        assert needed.reply is not None
        if not job.waiting_input:
            job.waiting_input = True
            self._state.metrics.input_rounds.labels(job.call.tool).inc()
            # The call stays open upstream, holding its session or child, only as long as input_wait_s says.
            job.input_waits += 1
            # (By task id: a call that ends sooner is not kept for the timer.)
            loop = asyncio.get_running_loop()
            loop.call_later(self._input_wait_s, self._check_answered, job.task_id, job.input_waits)
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
                now=self._state.now(),
                input_requests={**(record.input_requests or {}), **added},
                collected_responses=record.collected_responses or {},
                status_message="waiting for the client's input",
            )

        record = await self._settlement.until_stored(job, lambda: self._settlement.update_live(job, apply))
        if record is not None and previous and previous[-1] is not TaskStatus.INPUT_REQUIRED:
            log.info(
                "task_transition",
                task_id=job.task_id,
                tool=record.tool,
                **{"from": previous[-1].value},
                to=record.status.value,
            )
        if record is not None:
            await self._settlement.announce(job.task_id)

    def _check_answered(self, task_id: str, wait: int) -> None:
        job = self._state.jobs.get(task_id)
        if job is not None and self._still_waiting(job, wait):
            task = asyncio.ensure_future(self._unanswered_input(job, wait))
            self._unanswered.add(task)
            task.add_done_callback(self._unanswered.discard)

    @staticmethod
    def _still_waiting(job: Job, wait: int) -> bool:
        return job.waiting_input and job.input_waits == wait and not job.settled and job.runner is not None

    async def _unanswered_input(self, job: Job, wait: int) -> None:
        """A legacy call's questions left unanswered past input_wait_s: the task fails and the call is cancelled
        upstream, so that it no longer holds its session or child."""
        if not self._still_waiting(job, wait):  # answered since the timer fired
            return
        reason = f"the client did not answer the input requests within {self._input_wait_s:g} s (upstream.input_wait_s)"
        error = error_object(INTERNAL_ERROR, f"Input not given: {reason}", {"reason": "input_not_given"})
        log.info("task_input_not_given", task_id=job.task_id, tool=job.call.tool, wait_s=self._input_wait_s)
        await self._settlement.settle(job, TaskStatus.FAILED, error=error, status_message=reason)
        job.stop("the client did not answer the input requests")

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
            owned(record, principal)
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
                    last_updated_at=stamp_after(record, self._state.now()),
                )
            resumed.append(record.status)
            return transition(
                record,
                TaskStatus.WORKING,
                now=self._state.now(),
                input_requests=None,
                collected_responses=collected,
                status_message="input received; resuming the call",
            )

        try:
            record = await self._state.store.update(task_id, apply)
        except NotTheOwner:
            return None
        if record is None:
            return None
        if resumed:
            log.info("task_transition", task_id=task_id, tool=record.tool, **{"from": resumed[0].value}, to="working")
        if accepted:
            # The replica holding the call posts legacy answers upstream, or starts the next MRTR round, once.
            event = {"type": "input", "taskId": task_id, "answers": dict(accepted), "resumed": bool(resumed)}
            await self._recovery.tell_owner(event)
        return record


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
