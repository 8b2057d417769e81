"""A legacy server's questions inside a task rule's sync window, as synchronous MRTR rounds (SEP-2663: input asked
before the task exists is answered synchronously).

The question is put to the client as an `input_required` result whose `requestState` is a handle to the call, which
stays open upstream, parked (proxy/clients/parking.py). The client's retry names it: its answers are posted back on the
open call, and the runner runs the sync window again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ..clients.envelope import params_of
from ..clients.parking import ParkedCalls, invalid_state
from ..jsonrpc import INTERNAL_ERROR, error_object
from ..upstream.events import InputNeeded
from .job import DirectOutcome, Job, RoundLimit, ToolCall

log = structlog.get_logger(__name__)

_STATE_PREFIX = "mtp1w"
"""requestState of a call parked inside its sync window."""
_GATHER_S = 0.05
"""After a legacy server's first question, how long to wait for the ones sent with it, so they go out in one round."""


def _binding(call: ToolCall) -> str:
    return f"{call.credential}|{call.principal}|tools/call|{call.tool}"


class SyncRounds:
    def __init__(self, *, round_wait_s: float, upstream_url: str, owner: str = "") -> None:
        self._parked: ParkedCalls[Job] = ParkedCalls(
            prefix=_STATE_PREFIX, ttl_s=round_wait_s, on_drop=_drop, owner=(lambda: owner) if owner else None
        )
        self._upstream_url = upstream_url

    def claim(self, call: ToolCall, *, legacy_upstream: bool) -> Job | None:
        """The parked call an MRTR retry resumes; None when its requestState is not the proxy's (a first call, or
        a modern upstream's own state, which goes there untouched). A legacy upstream has no MRTR state, so there
        any other requestState is refused, as are forged, reused and expired handles (-32602)."""
        state = params_of(call.message).get("requestState")
        if state is None or (not self._parked.owns(state) and not legacy_upstream):
            return None
        job = self._parked.claim(state, _binding(call))
        if job is None:
            raise invalid_state()
        return job

    async def answer(self, job: Job, call: ToolCall) -> None:
        """Post the retry's answers back on the open call; keys that are not outstanding are ignored."""
        answers = params_of(call.message).get("inputResponses")
        try:
            for key, answer in (answers if isinstance(answers, dict) else {}).items():
                reply = job.replies.pop(key, None)
                if reply is not None and isinstance(answer, dict):
                    assert job.sync_requests is not None
                    job.sync_requests.pop(key, None)
                    await reply(answer)
        except asyncio.CancelledError:
            # The client left with the call claimed: nobody else can resume it, so it stops here.
            job.stop("the client closed its request")
            raise

    def offer(self, job: Job) -> DirectOutcome:
        """The MRTR input_required answer for the call's outstanding questions; the call is parked meanwhile."""
        assert job.sync_requests is not None
        token = self._parked.park(job, _binding(job.call))
        result = {"resultType": "input_required", "inputRequests": dict(job.sync_requests), "requestState": token}
        return DirectOutcome(result=result)

    def ask(self, job: Job, needed: InputNeeded) -> None:
        """A legacy server's question inside the sync window joins the round the window's answer will offer."""
        assert needed.reply is not None
        refusal = self.past_round_limit(job)
        if refusal is not None:
            outcome = DirectOutcome(error=refusal)
            if job.outcome is not None and not job.outcome.done():
                job.outcome.set_result(outcome)
            else:
                job.final = outcome
            if job.runner is asyncio.current_task():
                raise RoundLimit
            job.stop("too many input rounds")
            return
        if job.sync_requests is None:
            job.sync_requests = {}
        first = not job.sync_requests
        for upstream_key, input_request in needed.input_requests.items():
            key = job.unique_key(upstream_key)
            job.replies[key] = needed.reply
            job.sync_requests[key] = input_request
        if first and job.outcome is not None and not job.outcome.done():
            # Questions sent together go out in one round: a short wait for the others.
            asyncio.get_running_loop().call_later(_GATHER_S, self._offer_if_waiting, job)

    def _offer_if_waiting(self, job: Job) -> None:
        if job.outcome is not None and not job.outcome.done() and job.sync_requests:
            job.outcome.set_result(self.offer(job))

    def past_round_limit(self, job: Job) -> dict[str, Any] | None:
        """The error for a legacy server's question past the rule's max_input_rounds (each question counts, as a
        modern server's round does)."""
        job.questions_asked += 1
        if job.questions_asked <= job.max_input_rounds:
            return None
        reason = f"the upstream asked for input more than {job.max_input_rounds} times (max_input_rounds)"
        return error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._upstream_url})

    def end_round(self, caller: str | None) -> bool:
        """End the round parked longest of `caller`'s (None: anyone's), for a call that needs the stdio child it
        holds; False when there is none."""
        return self._parked.drop_oldest(lambda job: caller is None or job.call.caller == caller)

    def drain(self) -> None:
        self._parked.drain()


def _drop(job: Job, why: str) -> None:
    """A parked call the client never came back for: it is cancelled upstream."""
    log.info("parked_call_dropped", task_id=job.task_id, tool=job.call.tool, reason=why)
    if job.runner is not None and not job.runner.done():
        job.cancel_reason = f"the client did not answer the input round ({why})"
        job.runner.cancel()
