"""The task record, its statuses, and the one function through which every status change goes."""

from __future__ import annotations

import dataclasses
import functools
import re
import secrets
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from ..jsonrpc import dumps, loads


class TaskStatus(StrEnum):
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})


class TaskStateError(Exception):
    """A transition out of a terminal state was attempted; terminal states never change."""

    def __init__(self, task_id: str, current: TaskStatus, requested: TaskStatus) -> None:
        super().__init__(f"task {task_id} is {current}; cannot become {requested}")
        self.task_id = task_id
        self.current = current
        self.requested = requested


RELEASED = "released:"
"""The owner prefix of a task its replica handed over at shutdown: any replica may take it now."""


def owned_by(record: TaskRecord, replica_id: str) -> bool:
    """The record names this replica as the one running its call (released by it at shutdown included)."""
    return record.owner == replica_id or record.owner == RELEASED + replica_id


def new_task_id() -> str:
    # Task ids are bearer handles (SEP-2663): 128 random bits, URL- and header-safe.
    return secrets.token_urlsafe(16)


_TASK_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")


def is_task_id(value: object) -> bool:
    """Whether `value` could be an id this proxy made. Anything else is unknown without asking the store, so a
    hostile id (a lone surrogate, control characters, megabytes) never reaches a store key."""
    return isinstance(value, str) and _TASK_ID.fullmatch(value) is not None


def utc_now() -> datetime:
    return datetime.now(UTC)


@functools.lru_cache(maxsize=2048)
def format_time(moment: datetime) -> str:
    """ISO 8601 in UTC to the millisecond. Cached: a task's two times are formatted at its creation and at every
    tasks/get, and most tasks are polled many times unchanged (2,048 entries, about 0.5 MB at most)."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclasses.dataclass(frozen=True, slots=True)
class TaskRecord:
    task_id: str
    tool: str
    status: TaskStatus
    created_at: datetime
    last_updated_at: datetime
    ttl_ms: int
    poll_interval_ms: int
    status_message: str | None = None
    result: dict[str, Any] | None = None
    """The upstream's CallToolResult, when completed (also when its isError is true)."""
    error: dict[str, Any] | None = None
    """A JSON-RPC error object, when failed."""
    input_requests: dict[str, Any] | None = None
    """Outstanding input requests by task-unique key, when input_required."""
    collected_responses: dict[str, Any] | None = None
    """Answers received through tasks/update for this round, by task key; never on the wire."""
    owner: str | None = None
    """The replica that holds the live upstream call; never on the wire."""
    principal: str = ""
    """Who created the task (a keyed hash, "" for none); only they may see it. Never on the wire."""
    stream: dict[str, Any] | None = None
    """A durable call's client (proxy/clients/durable.py): its request id, session and progress token. Never on the
    wire."""
    trace: str | None = None
    """The W3C traceparent of the task's span (proxy/tracing.py), for requests about it to link to; not on the wire."""
    fingerprint: str | None = None
    """With an idempotency key: the request's tool and arguments, hashed (proxy/clients/idempotency.py). Not on the
    wire."""
    queued: bool = False
    """The call waits for one of its tool's slots (max_concurrency) and was not sent upstream yet. Not on the wire."""
    attempt: int = 1
    """Which run of the call this is: another replica runs it again after the owner was lost (takeover.py)."""
    upstream_task: str | None = None
    """The 2025 server's own task for the call and its session, sealed (sealing.py): a replica taking the task over
    follows it. Not on the wire."""

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def to_wire(self) -> dict[str, Any]:
        """The DetailedTask view (SEP-2663): what tasks/get answers and CreateTaskResult starts from."""
        wire: dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status.value,
            "createdAt": format_time(self.created_at),
            "lastUpdatedAt": format_time(self.last_updated_at),
            "ttlMs": self.ttl_ms,
            "pollIntervalMs": self.poll_interval_ms,
        }
        if self.status_message is not None:
            wire["statusMessage"] = self.status_message
        if self.status is TaskStatus.COMPLETED:
            wire["result"] = self.result
        elif self.status is TaskStatus.FAILED:
            wire["error"] = self.error
        elif self.status is TaskStatus.INPUT_REQUIRED:
            wire["inputRequests"] = self.input_requests or {}
        return wire


_FIELDS = dataclasses.fields(TaskRecord)


def to_json(record: TaskRecord) -> bytes:
    """The stored form: JSON (never pickle), every field, times in ISO 8601."""
    # Shallow: asdict() would deep-copy the result, which can be megabytes, only to serialise it.
    data = {field.name: getattr(record, field.name) for field in _FIELDS}
    data["created_at"] = record.created_at.isoformat()
    data["last_updated_at"] = record.last_updated_at.isoformat()
    data["status"] = record.status.value
    # Records stay as replicas of an earlier version read them, unless what they would not know of is used.
    if record.trace is None:
        del data["trace"]
    if record.fingerprint is None:
        del data["fingerprint"]
    if not record.queued:
        del data["queued"]
    if record.attempt == 1:
        del data["attempt"]
    if record.upstream_task is None:
        del data["upstream_task"]
    return dumps(data)


_FIELD_NAMES = frozenset(field.name for field in _FIELDS)


def from_json(text: str | bytes) -> TaskRecord:
    data = loads(text)
    if not _FIELD_NAMES.issuperset(data):  # written by a later version: its extra fields are not this one's
        data = {key: value for key, value in data.items() if key in _FIELD_NAMES}
    data["created_at"] = datetime.fromisoformat(data["created_at"])
    data["last_updated_at"] = datetime.fromisoformat(data["last_updated_at"])
    data["status"] = TaskStatus(data["status"])
    # What decides whether a call runs again is checked, not trusted: a string attempt would stop every sweep, a
    # truthy "queued" would run a call twice, a negative attempt without end.
    attempt = data.get("attempt", 1)
    if type(attempt) is not int or attempt < 1:
        raise ValueError("attempt is not a whole number from 1")
    if type(data.get("queued", False)) is not bool:
        raise ValueError("queued is not true or false")
    if not isinstance(data.get("upstream_task"), str | None) or not isinstance(data.get("owner"), str | None):
        raise ValueError("upstream_task or owner is not text")
    return TaskRecord(**data)


def transition(record: TaskRecord, to: TaskStatus, *, now: datetime, **fields: Any) -> TaskRecord:
    """Return the record moved to `to`, stamped with `now`; refuses to leave a terminal state."""
    if record.is_terminal:
        raise TaskStateError(record.task_id, record.status, to)
    if to in TERMINAL:
        # What the call said while it ran ("input received; resuming the call", "2 of 3") is stale once it ended.
        fields.setdefault("status_message", None)
    return dataclasses.replace(record, status=to, last_updated_at=stamp_after(record, now), **fields)


def stamp_after(record: TaskRecord, now: datetime) -> datetime:
    """`now`, or just after the record's last update when a replica's clock is behind: every update moves
    lastUpdatedAt forward, which durable streams read as the record's revision (proxy/clients/durable_stream.py)."""
    return max(now, record.last_updated_at + _TICK)


_TICK = timedelta(microseconds=1)
