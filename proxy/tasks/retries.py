"""Sending a call again after a transient failure (events.Failed.transient), as far as its rule allows.

A request that never left is sent again for every rule; one that may have reached the server without an answer
coming back only for a rule marked `idempotent`. The waits are tenacity's exponential backoff with jitter, a longer
Retry-After from the server honoured, and the attempts and waits together stay within the round's timeout. The
loop is built only once a first attempt has failed so: a call that goes well holds nothing for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_result,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential_jitter,
)

from ..upstream.events import Failed, InputNeeded, Progress
from .job import Job

log = structlog.get_logger(__name__)

MAX_RETRY_AFTER_S = 3600.0

Outcome = InputNeeded | Failed | None
"""What an attempt ends with: input needed (the next round), a transient failure not yet written, or None (the
outcome is written)."""


def may_retry(job: Job, failed: Failed) -> bool:
    """Whether the rule may let this failure be followed by another attempt (for `idempotent: hint`, once the
    upstream's annotations say so: hints.py)."""
    if failed.transient is None or job.rule.retry.attempts < 2:
        return False
    return failed.transient == "unsent" or job.rule.idempotent is not False


async def retried(
    job: Job,
    first: Failed,
    budget_s: float,
    attempt: Callable[[int], Awaitable[Outcome]],
    progress: Callable[[Job, Progress], Awaitable[None]],
    count: Callable[[str], None],
) -> tuple[Outcome, int]:
    """The attempts after `first`, until one ends otherwise, the rule's attempts are used up or the next wait
    would end past `budget_s` (what is left of the round's timeout); then the last failure, unwritten. With the
    outcome, how many attempts were made. `attempt(n)` makes attempt n (2, 3, ...), within the time left."""
    policy = job.rule.retry
    backoff = wait_exponential_jitter(
        multiplier=policy.backoff_ms / 1000, max=policy.max_backoff_ms / 1000, jitter=policy.backoff_ms / 1000
    )

    def wait(state: RetryCallState) -> float:
        failed = state.outcome.result() if state.outcome is not None else first
        # Honoured up to an hour: past the round's timeout it ends the retries anyway, and a round without one
        # (timeout_s: .inf) must not sleep for as long as an upstream says.
        return max(backoff(state), min(failed.retry_after_s or 0.0, MAX_RETRY_AFTER_S))

    async def announce(state: RetryCallState) -> None:
        failed = state.outcome.result() if state.outcome is not None else first
        waited = state.upcoming_sleep
        reason = failed.transient or "unsent"
        count(reason)
        log.info(
            "upstream_retry",
            task_id=job.task_id,
            tool=job.call.tool,
            attempt=state.attempt_number + 1,
            of=policy.attempts,
            reason=reason,
            wait_ms=round(waited * 1000),
        )
        note = f"attempt {state.attempt_number} of {policy.attempts} failed ({failed.status_message}); retrying"
        await progress(job, Progress(note))

    async def once(number: list[int]) -> Outcome:
        number[0] += 1
        if number[0] == 1:
            return first  # made before this loop: its failure starts it
        return await attempt(number[0])

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.attempts) | stop_before_delay(budget_s),
        wait=wait,
        retry=retry_if_result(lambda outcome: isinstance(outcome, Failed)),
        before_sleep=announce,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome is not None else first,
    )
    made = [0]
    outcome = await retrying(once, made)
    return outcome, made[0]
