"""One background call as the runner holds it: what was asked, under which rule, and where it stands."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from multidict import CIMultiDict

from ..config import ToolRule
from ..upstream.events import UpstreamTask
from .model import TaskStatus


class Slots(Protocol):
    """A call's slots under the policy's concurrency limits (proxy/front/concurrency.py's Claim): taken as its
    background call starts (admit), or waited for by the call's job when its limit queues."""

    held: bool
    passed: bool
    """Its job holds it, and gives it back when it ends."""

    @property
    def full(self) -> str | None:
        """The limit that had no free slot when last asked."""

    async def take(self, *, force: bool = False) -> Any: ...

    async def admit(self) -> bool: ...

    async def wait(self, timeout_s: float | None, *, patient: bool = False) -> None: ...

    def release(self) -> None: ...


@dataclasses.dataclass(slots=True)
class ToolCall:
    """What the upstream is asked: the tools/call message (with the proxy's own id) and the client's headers."""

    tool: str
    message: dict[str, Any]
    headers: CIMultiDict[str]
    capabilities: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The client capabilities the task-creating request declared; they bound what input may be asked."""
    principal: str = ""
    """Who asked (a keyed hash): the task's owner."""
    credential: str = ""
    """The caller's credential (a keyed hash, whatever security.principal says): an MRTR handle is bound to it."""
    caller: str = ""
    """Who the call counts against for per-caller limits (security.Identity.caller)."""
    task_id: str | None = None
    """The task's id when the caller fixes it (a durable call's, derived from its request, or one derived from an
    idempotency key); else a random one."""
    fingerprint: str | None = None
    """With an idempotency key: the request's fingerprint, kept in the record (proxy/clients/idempotency.py)."""
    stream: dict[str, Any] | None = None
    """A durable call's client, kept in its record (TaskRecord.stream)."""
    client_session: Any = None
    """A 2025-era client's own upstream session (a LegacySession): its call goes there, verbatim."""
    on_progress: Callable[[Any], None] | None = None
    """Told of every progress event of the call (a kept-alive call relays them to its client)."""
    slots: Slots | None = None
    """Its request's slots under limits.rates' concurrency, which the job takes over: held, or to wait for."""


@dataclasses.dataclass(frozen=True, slots=True)
class DirectOutcome:
    """The upstream answered inside the rule's sync window: exactly one of result and error is set."""

    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclasses.dataclass(eq=False, slots=True)
class Job:
    task_id: str
    call: ToolCall
    rule: ToolRule
    ttl_ms: int
    poll_interval_ms: int
    started_s: float
    is_task: bool = False
    """False while the sync window runs; from then on the outcome goes to the store."""
    # Events and futures are made only when something waits on them: ten thousand working tasks should cost as
    # little as possible, and most jobs never have a sync window, an input round or a question to wait for.
    stored: bool = False
    """The task's record exists (creation finished)."""
    stored_event: asyncio.Event | None = None
    outcome: asyncio.Future[DirectOutcome] | None = None
    """Only while a sync window runs: the outcome, when it comes inside the window."""
    max_input_rounds: int = 10
    max_result_bytes: int = 16 * 1024 * 1024
    slots: asyncio.Semaphore | None = None
    """The tool's max_concurrency slots, when its rule sets one."""
    holds_slot: bool = False
    """A slot was taken at admission (on_limit: refuse); it is given back when the job ends."""
    settled: bool = False
    """This replica wrote the task's terminal state: nothing from outside may cancel the call any more."""
    round_open: bool = False
    """A modern input round is recorded (input_required); a record found working again means it was answered."""
    unwritten: tuple[TaskStatus, dict[str, Any]] | None = None
    """The outcome while its write is under way (retried while the store is unavailable)."""
    last_message: str | None = None
    cancel_reason: str | None = None
    runner: asyncio.Task[None] | None = None
    upstream_id: str = ""
    """The JSON-RPC id of the upstream attempt in flight (each MRTR round has its own)."""
    upstream_busy: bool = False
    span: Any = None
    """The task's OpenTelemetry span (proxy/tracing.py) while it is open on this replica; None without tracing."""
    waiting_input: bool = False
    input_waits: int = 0
    """How many times a legacy call began to wait for answers: tells a wait's timer whether it is still that wait."""
    answered: asyncio.Event | None = None
    """Made for each modern input round; set when tasks/update has answered every outstanding input request."""
    issued_keys: set[str] | None = None
    replies: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = dataclasses.field(default_factory=dict)
    """Legacy upstreams: how to post the answer to each outstanding task key back on the open call."""
    sync_requests: dict[str, Any] | None = None
    """A legacy server's questions asked inside the sync window: the client answers them as an MRTR round, by key,
    while the call waits upstream (parked)."""
    final: DirectOutcome | None = None
    """The outcome, when it came while no sync window was waiting for it (the call was parked for an MRTR round)."""
    questions_asked: int = 0
    """A legacy server's questions so far: bounded by max_input_rounds, as a modern server's rounds are."""
    question_lock: asyncio.Lock | None = None
    queued: bool = False
    """Waiting for one of its tool's slots: not sent upstream yet (kept in the record for a takeover)."""
    follow: UpstreamTask | None = None
    """A 2025 server's own task for this call, made through a lost replica: followed, not sent again."""
    run: int = 1
    """Which run of the call this is (TaskRecord.attempt): a run after a lost replica says so in every message."""
    sealed: bool = False
    """Its call is kept in the store, sealed, for another replica to run it again (proxy/tasks/takeover.py)."""
    upstream_task: str | None = None
    """The 2025 server's own task for this run, as sealed in the record: a replica taking the call over that
    names it follows that task (`detached`); one that names none runs the call again."""
    detached: bool = False
    """Stopped because another replica follows the server's own task: that task is left running."""

    def mark_stored(self) -> None:
        self.stored = True
        if self.stored_event is not None:
            self.stored_event.set()

    async def wait_stored(self) -> None:
        if not self.stored:
            if self.stored_event is None:
                self.stored_event = asyncio.Event()
            await self.stored_event.wait()

    def unique_key(self, upstream_key: str) -> str:
        """A key never used before in this task (SEP-2663), even when the upstream reuses one across rounds."""
        if self.issued_keys is None:
            self.issued_keys = set()
        candidate, n = upstream_key, 1
        while candidate in self.issued_keys:
            n += 1
            candidate = f"{upstream_key}-{n}"
        self.issued_keys.add(candidate)
        return candidate

    def stop(self, reason: str) -> None:
        """Cancel the call's own asyncio task, unless it is the one asking (it then ends by itself)."""
        if self.runner is not None and not self.runner.done() and self.runner is not asyncio.current_task():
            self.cancel_reason = reason
            self.runner.cancel()

    def taken_over(self, follows: str | None) -> None:
        """Another replica took the task over: this run stops, without settling. When that replica follows the
        server's own task this run made (`follows`, its sealed form), the task is left running for it; else it is
        cancelled with the rest of this run."""
        if self.settled:
            return
        self.detached = self.upstream_task is not None and follows == self.upstream_task
        self.stop(TAKEN_OVER)

    def is_detached(self) -> bool:
        return self.detached


TAKEN_OVER = "taken over by another proxy replica"


class RoundLimit(Exception):
    """Raised inside a call's own task when a legacy server asked too often: the outcome is written, the call ends."""
