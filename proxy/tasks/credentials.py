"""Credentials that follow the caller. With a principal that survives a token refresh (security.principal jwt or
header), a request from a task's owner that carries a newer Authorization gives it to the task's call: its later
upstream requests (the next input round, a retry, a run on another replica, notifications/cancelled) carry it. On
the replica that runs the call it is given at once; from another replica it goes through the shared store, sealed
(sealing.py), and the running replica takes it before each later request. An upstream 401 is tried once more with
the freshest credential the owner has shown (attempts.py)."""

from __future__ import annotations

import hashlib

import structlog
from cachetools import LRUCache
from multidict import MultiMapping

from ..store.base import StoreUnavailable
from .job import Job
from .model import TaskRecord
from .runner_state import RunnerState

log = structlog.get_logger(__name__)

_WRITTEN_KEPT = 10_000


class Credentials:
    def __init__(self, state: RunnerState, *, follow: bool) -> None:
        self._state = state
        self.follow = follow
        """Whether a task's owner is the same caller across credentials (principal jwt or header)."""
        self._written: LRUCache[str, str] = LRUCache(_WRITTEN_KEPT)
        """What this replica last stored for a task (a hash): a poll with the same token writes nothing."""

    async def shown(self, record: TaskRecord, headers: MultiMapping[str]) -> None:
        """The task's owner called with `headers` (the request was checked to be the owner's)."""
        value = headers.get("Authorization")
        if not self.follow or not value or record.is_terminal:
            return
        job = self._state.jobs.get(record.task_id)
        if job is not None:
            self._give(job, value)
            return
        seal = self._state.seal
        if seal is None:
            return  # no other replica runs it, or none could read a credential this one stored
        digest = hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()
        if self._written.get(record.task_id) == digest:
            return
        sealed = seal.seal_credential(record.task_id, record.principal, value)
        try:
            await self._state.store.put_credential(record.task_id, sealed, record.ttl_ms)
        except StoreUnavailable as exc:
            log.warning("task_credential_not_kept", task_id=record.task_id, reason=str(exc))
            return
        self._written[record.task_id] = digest

    async def refresh(self, job: Job) -> bool:
        """Take the newest credential another replica kept for the job's task; whether the call's changed."""
        seal = self._state.seal
        if not self.follow or seal is None:
            return False
        try:
            sealed = await self._state.store.credential(job.task_id)
        except StoreUnavailable as exc:
            log.warning("task_credential_unavailable", task_id=job.task_id, reason=str(exc))
            return False
        if sealed is None:
            return False
        value = seal.unseal_credential(job.task_id, sealed, job.call.principal)
        return value is not None and self._give(job, value)

    def _give(self, job: Job, value: str) -> bool:
        if job.call.headers.get("Authorization") == value:
            return False
        job.call.headers["Authorization"] = value
        log.info("task_credential_refreshed", task_id=job.task_id, tool=job.call.tool)
        return True
