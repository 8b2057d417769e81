"""Where the Redis store keeps what, all under one prefix (several deployments may share one Redis)."""

from __future__ import annotations

from dataclasses import dataclass

TASK_KEY_PREFIX = "mcp-tasks-proxy:"


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = TASK_KEY_PREFIX

    @property
    def running(self) -> str:
        """A set of the ids of unfinished tasks, for finding those of a replica whose lease lapsed."""
        return f"{self.prefix}running"

    @property
    def events(self) -> str:
        """The pub/sub channel between replicas."""
        return f"{self.prefix}events"

    @property
    def readyz(self) -> str:
        return f"{self.prefix}readyz"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}task:{task_id}"

    def context(self, task_id: str) -> str:
        """A running task's call, sealed (sealing.py): apart from the record, which every poll reads."""
        return f"{self.prefix}call:{task_id}"

    def credential(self, task_id: str) -> str:
        """A running task's owner's newest credential, sealed: what its later upstream requests carry."""
        return f"{self.prefix}credential:{task_id}"

    def rate(self, name: str) -> str:
        """A rate limit's next theoretical arrival time (limits.rates), for one caller, tool or both."""
        return f"{self.prefix}rate:{name}"

    def slots(self, name: str) -> str:
        """A concurrency limit's leases (limits.rates), for one caller, tool or both: a sorted set by expiry."""
        return f"{self.prefix}slots:{name}"

    def alias(self, name: str) -> str:
        """Another id that finds a task (a request that joined a keyed durable call)."""
        return f"{self.prefix}alias:{name}"

    def session(self, tag: str) -> str:
        """The replica a 2025 session lives on (proxy/front/session_routing.py)."""
        return f"{self.prefix}session:{tag}"

    def lease(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}"

    def index(self, name: str) -> str:
        return f"{self.prefix}index:{name}"

    def shared(self, name: str) -> str:
        """A value every replica agrees on (the principal key)."""
        return f"{self.prefix}{name}"
