"""Where task records live. The in-memory store serves one process; the interface is what a shared store implements."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog
from sortedcontainers import SortedList

from ..tasks.model import TaskRecord

log = structlog.get_logger(__name__)

Updater = Callable[[TaskRecord], TaskRecord]
EventHandler = Callable[[dict[str, Any]], Awaitable[None]]


class StoreFullError(Exception):
    """No room for a new task: the cap is reached and every stored task is still running."""


class TaskIdTaken(Exception):
    """A task with this id exists already (a durable call's id, derived from its request, sent twice at once)."""


class StoreUnavailable(Exception):
    """The store did not answer (Redis down or too slow); the request that needed it fails with -32603."""


class RecordCorrupt(StoreUnavailable):
    """One stored value is not what the proxy writes there; the store itself answers."""


class TaskStore(Protocol):
    shared: bool
    """True when several replicas share the store (then leases and cross-replica events matter)."""
    failures: Mapping[str, int]
    """Calls to the store that failed (unreachable, timed out, refused, corrupt), by operation, since the start."""

    async def create(self, record: TaskRecord, context: bytes | None = None) -> None:
        """Store a new record; it expires ttl_ms after this call, whatever updates follow. A shared store keeps
        `context` (the call, sealed: sealing.py) beside it until the task ends, for another replica to run it again."""

    async def call_context(self, task_id: str) -> bytes | None:
        """The sealed call kept with a running task, or None."""

    async def listeners(self) -> int:
        """How many replicas (this one included) receive the events published now."""

    def advertise(self, url: str) -> None:
        """Where the other replicas reach this one, kept with its lease (proxy/front/session_routing.py); before
        start()."""

    async def replica_url(self, replica_id: str) -> str | None:
        """Where that replica said it is reached, while its lease is current; None once it is gone."""

    async def claim_session(self, tag: str, replica_id: str, ttl_ms: int) -> None:
        """Record that the 2025 session `tag` (a hash of its id) lives on that replica."""

    async def session_owner(self, tag: str) -> str | None:
        """The replica a session lives on, or None when none recorded it."""

    async def forget_session(self, tag: str) -> None:
        """The session ended (DELETE, or its replica is gone)."""

    async def forget_call_context(self, task_id: str) -> None:
        """Drop the sealed call kept with a task before it ends (nothing will run it again)."""

    async def put_credential(self, task_id: str, sealed: bytes, ttl_ms: int) -> None:
        """Keep the owner's newest credential for a running task (sealed: sealing.py), for the replica that runs it;
        a store that is not shared has no other replica to tell."""

    async def credential(self, task_id: str) -> bytes | None:
        """The credential kept by put_credential, or None."""

    async def rate(self, name: str, interval_us: int, tolerance_us: int, count: int = 1, unused: int = 0) -> int | None:
        """Count up to `count` requests against a rate limit shared by every replica, after giving back `unused`
        it counted before: how many were counted (as many as it allows now), or when none is allowed, minus the
        microseconds until one would be; None for a store no other replica shares (the limit is then the
        replica's own)."""

    async def take_slots(
        self,
        names: list[str],
        wanted: list[tuple[int, int]],
        lease: str,
        life_us: int,
        *,
        force: bool = False,
        releasing: Sequence[tuple[str, str]] = (),
    ) -> int | None:
        """Take slots of concurrency limits shared by every replica, all or none: for each name, (limit, how
        many), after giving back the leases `releasing` (name, member). 0 when taken, else the 1-based index of
        a name with too few free; None for a store no other replica shares (the limits are then the replica's
        own)."""

    async def keep_slots(self, held: list[tuple[str, str]], life_us: int) -> int | None:
        """Renew the slots' leases `held` (name, member) for life_us, or release them (life_us 0): how many were
        found; None for a store no other replica shares."""

    async def alias(self, name: str, task_id: str, ttl_ms: int) -> None:
        """Let `name` find the task for ttl_ms: a request that joined a task made for an idempotency key (its own
        derived id is not the task's)."""

    async def aliased(self, name: str) -> str | None:
        """The task `name` finds, or None."""

    async def get(self, task_id: str) -> TaskRecord | None:
        """The record, or None when unknown or expired."""

    async def update(self, task_id: str, updater: Updater) -> TaskRecord | None:
        """Atomically replace the record with updater(record); None when the task is gone.

        The updater may raise (TaskStateError for a terminal record); the record then stays as it was.
        """

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers."""

    async def shared_secret(self, name: str, candidate: str) -> str:
        """The value of `name` that every replica sharing the store agrees on: the one stored, else `candidate`,
        stored now by whichever replica comes first."""

    async def eviction_risk(self) -> str | None:
        """Why the store may drop task records on its own (a setting of its server), or None."""

    async def start(
        self, replica_id: str, on_event: EventHandler, on_resync: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Begin delivering events published by any replica to `on_event`, and keep this replica's lease.

        `on_resync` runs after every (re)subscription: events published while the subscription was down are lost,
        and the runner then re-reads what its tasks wait for."""

    async def publish(self, event: dict[str, Any]) -> None:
        """Send an event (a cancel, answers for an input round) to every replica, this one included."""

    async def index_add(self, index: str, task_id: str, score: int, ttl_ms: int) -> None:
        """Add a task to a named list (one caller's 2025 tasks, for tasks/list), ordered by `score`."""

    async def index_page(self, index: str, after: tuple[int, str] | None, limit: int) -> list[tuple[str, int]]:
        """Up to `limit` (task id, score) of the list past `after` (a score and task id), in (score, id) order. It
        may name tasks that are gone (expired, evicted): the reader drops those with index_remove."""

    async def index_remove(self, index: str, task_ids: list[str]) -> None: ...

    async def sizes(self, task_ids: list[str]) -> list[int]:
        """The stored size in bytes of each task's record, 0 for one that is gone or kept as objects (the memory
        store): what reading it would decode, for a reader that bounds what one request reads."""

    async def running_task_ids(self) -> list[str]:
        """Ids of tasks not yet terminal, for finding those whose replica is gone."""

    async def still_running(self, task_ids: list[str]) -> set[str]:
        """Which of these tasks are not terminal yet."""

    async def is_alive(self, replica_id: str) -> bool:
        """Whether that replica's lease is current."""

    def healthy_for(self) -> float:
        """Seconds since a call to the store last failed: the lost-replica sweep waits until every live replica
        has had time to renew its lease."""

    async def aclose(self) -> None: ...


class MemoryTaskStore:
    """Records in a dict, each with a deadline fixed at creation, under a cap on how many are kept.

    At the cap, the task that finished longest ago is evicted (and logged); running tasks are never evicted,
    so a full store of running tasks refuses new ones with StoreFullError instead.
    """

    shared = False
    failures: Mapping[str, int] = {}  # nothing to fail

    def __init__(self, *, max_tasks: int, timer: Callable[[], float] = time.monotonic) -> None:
        self._on_event: EventHandler | None = None
        self._max_tasks = max_tasks
        self._timer = timer
        self._records: dict[str, TaskRecord] = {}
        self._deadlines: dict[str, float] = {}
        self._expiry_heap: list[tuple[float, str]] = []
        self._finished: OrderedDict[str, None] = OrderedDict()  # terminal task ids, oldest finish first
        self._indexes: dict[str, _Index] = {}
        self._index_of: dict[str, str] = {}  # so that a dropped task leaves its list too: bounded by the records
        self._aliases: dict[str, tuple[str, float]] = {}  # name -> (task id, deadline), at most max_tasks

    def __len__(self) -> int:
        self._expire()
        return len(self._records)

    async def create(self, record: TaskRecord, context: bytes | None = None) -> None:
        # `context` is for other replicas to take the call over: a store in this process dies with its calls.
        self._expire()
        if self._live(record.task_id) is not None:
            raise TaskIdTaken(record.task_id)
        if len(self._records) >= self._max_tasks:
            if not self._finished:
                raise StoreFullError(f"task capacity reached: {self._max_tasks} tasks are running")
            evicted, _ = self._finished.popitem(last=False)
            self._drop(evicted)
            log.info("task_evicted", task_id=evicted, reason="capacity")
        deadline = self._timer() + record.ttl_ms / 1000
        self._records[record.task_id] = record
        self._deadlines[record.task_id] = deadline
        heapq.heappush(self._expiry_heap, (deadline, record.task_id))
        if record.is_terminal:
            self._finished[record.task_id] = None

    async def get(self, task_id: str) -> TaskRecord | None:
        return self._live(task_id)

    async def call_context(self, task_id: str) -> bytes | None:
        return None

    async def listeners(self) -> int:
        return 1

    def advertise(self, url: str) -> None:
        return None  # one process: nobody to tell

    async def replica_url(self, replica_id: str) -> str | None:
        return None

    async def claim_session(self, tag: str, replica_id: str, ttl_ms: int) -> None:
        return None  # one process holds every session

    async def session_owner(self, tag: str) -> str | None:
        return None

    async def forget_session(self, tag: str) -> None:
        return None

    async def forget_call_context(self, task_id: str) -> None:
        return None

    async def put_credential(self, task_id: str, sealed: bytes, ttl_ms: int) -> None:
        return None  # one replica: the runner gave the credential to the call itself

    async def credential(self, task_id: str) -> bytes | None:
        return None

    async def rate(self, name: str, interval_us: int, tolerance_us: int, count: int = 1, unused: int = 0) -> int | None:
        return None

    async def take_slots(
        self,
        names: list[str],
        wanted: list[tuple[int, int]],
        lease: str,
        life_us: int,
        *,
        force: bool = False,
        releasing: Sequence[tuple[str, str]] = (),
    ) -> int | None:
        return None

    async def keep_slots(self, held: list[tuple[str, str]], life_us: int) -> int | None:
        return None

    async def alias(self, name: str, task_id: str, ttl_ms: int) -> None:
        now = self._timer()
        if len(self._aliases) >= self._max_tasks:  # bounded like the records: the expired go first, then the oldest
            for stale in [key for key, (_, deadline) in self._aliases.items() if deadline <= now]:
                del self._aliases[stale]
            while len(self._aliases) >= self._max_tasks:
                del self._aliases[next(iter(self._aliases))]
        self._aliases[name] = (task_id, now + ttl_ms / 1000)

    async def aliased(self, name: str) -> str | None:
        found = self._aliases.get(name)
        return found[0] if found is not None and found[1] > self._timer() else None

    async def update(self, task_id: str, updater: Updater) -> TaskRecord | None:
        current = self._live(task_id)
        if current is None:
            return None
        new = updater(current)
        self._records[task_id] = new
        if new.is_terminal and not current.is_terminal:
            self._finished[task_id] = None
        return new

    async def ping(self) -> None:
        return None

    async def shared_secret(self, name: str, candidate: str) -> str:
        return candidate  # one process: nobody to agree with

    async def eviction_risk(self) -> str | None:
        return None  # it evicts only finished tasks, past tasks.max_tasks (task_evicted says so)

    async def start(
        self, replica_id: str, on_event: EventHandler, on_resync: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._on_event = on_event  # in-process: no event is ever lost, so nothing to resync

    async def publish(self, event: dict[str, Any]) -> None:
        if self._on_event is not None:
            await self._on_event(event)

    async def index_add(self, index: str, task_id: str, score: int, ttl_ms: int) -> None:
        if task_id in self._records:
            members = self._indexes.get(index)
            if members is None:
                members = self._indexes[index] = _Index()
            members.add(task_id, score)
            self._index_of[task_id] = index

    async def index_page(self, index: str, after: tuple[int, str] | None, limit: int) -> list[tuple[str, int]]:
        self._expire()
        members = self._indexes.get(index)
        return members.page(after, limit) if members is not None else []

    async def index_remove(self, index: str, task_ids: list[str]) -> None:
        members = self._indexes.get(index)
        if members is not None:
            for task_id in task_ids:
                members.remove(task_id)

    async def sizes(self, task_ids: list[str]) -> list[int]:
        return [0] * len(task_ids)  # nothing is decoded to read a record

    async def running_task_ids(self) -> list[str]:
        return [task_id for task_id, record in self._records.items() if not record.is_terminal]

    async def still_running(self, task_ids: list[str]) -> set[str]:
        records = {task_id: self._live(task_id) for task_id in task_ids}
        return {task_id for task_id, record in records.items() if record is not None and not record.is_terminal}

    async def is_alive(self, replica_id: str) -> bool:
        return True  # one process: its own tasks are the only ones

    def healthy_for(self) -> float:
        return float("inf")

    async def aclose(self) -> None:
        self._records.clear()
        self._indexes.clear()
        self._index_of.clear()
        self._deadlines.clear()
        self._expiry_heap.clear()
        self._finished.clear()

    def _live(self, task_id: str) -> TaskRecord | None:
        deadline = self._deadlines.get(task_id)
        if deadline is None:
            return None
        if deadline <= self._timer():
            self._drop(task_id)
            return None
        return self._records[task_id]

    def _drop(self, task_id: str) -> None:
        index = self._index_of.pop(task_id, None)
        if index is not None:
            members = self._indexes.get(index)
            if members is not None:
                members.remove(task_id)
                if not members:
                    del self._indexes[index]
        self._records.pop(task_id, None)
        self._deadlines.pop(task_id, None)
        self._finished.pop(task_id, None)

    def _expire(self) -> None:
        now = self._timer()
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, task_id = heapq.heappop(heap)
            if self._deadlines.get(task_id, now + 1) <= now:
                self._drop(task_id)
        # The heap keeps entries of evicted tasks until their deadline; bound it by the live set.
        if len(heap) > 2 * self._max_tasks:
            self._expiry_heap = [(d, t) for d, t in heap if t in self._deadlines]
            heapq.heapify(self._expiry_heap)


class _Index:
    """One named list of task ids, kept in (score, id) order: a page is found by bisection, not by sorting the list
    again for every page (2.7 ms a page at 10,000 tasks)."""

    def __init__(self) -> None:
        self._scores: dict[str, int] = {}
        self._order: SortedList[tuple[int, str]] = SortedList()

    def __len__(self) -> int:
        return len(self._scores)

    def add(self, task_id: str, score: int) -> None:
        self.remove(task_id)
        self._scores[task_id] = score
        self._order.add((score, task_id))

    def remove(self, task_id: str) -> None:
        score = self._scores.pop(task_id, None)
        if score is not None:
            self._order.remove((score, task_id))

    def page(self, after: tuple[int, str] | None, limit: int) -> list[tuple[str, int]]:
        start = 0 if after is None else self._order.bisect_right(after)
        return [(task_id, score) for score, task_id in self._order.islice(start, start + limit)]
