"""Whether the Redis server's maxmemory-policy may evict task records, said once per policy seen."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from redis.exceptions import ResponseError

from .redis_link import REDIS_ERRORS, RedisLink, text

log = structlog.get_logger(__name__)


class EvictionPolicyCheck:
    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._policy_said: str | None = None
        self._policy_unknown_said = False

    async def risk(self) -> str | None:
        """Why this Redis may lose task records under memory pressure, or None. Every maxmemory-policy but
        noeviction evicts keys (volatile-*: those with a TTL, which task records and replica leases all have), and a
        running task whose record or whose owner's lease is evicted is lost while its call goes on. Read with INFO,
        else CONFIG GET (managed services often disable CONFIG); when neither may be read, that is said once. A
        Redis out of reach is no risk to report: ping says it."""
        refused: list[str] = []
        policy: Any = None
        for what, read in (
            ("INFO memory", lambda: self._link.redis.info("memory")),
            ("CONFIG GET", lambda: self._link.redis.config_get("maxmemory-policy")),
        ):
            try:
                answer = await asyncio.wait_for(read(), self._link.timeout_s)
            except ResponseError as exc:
                refused.append(f"{what}: {exc}")
                continue
            except (*REDIS_ERRORS, OSError, TimeoutError):
                return None
            policy = (
                answer.get("maxmemory_policy", answer.get("maxmemory-policy")) if isinstance(answer, dict) else None
            )
            if policy is not None:
                break
        if policy is None:
            if not self._policy_unknown_said:
                self._policy_unknown_said = True
                log.warning(
                    "store_eviction_policy_unknown",
                    reason="; ".join(refused) or "neither INFO nor CONFIG GET names it",
                    advice="make sure Redis runs with maxmemory-policy noeviction",
                )
            return None
        policy = text(policy)
        if policy == "noeviction":
            self._policy_said = policy
            return None
        evicts = "any key" if policy.startswith("allkeys") else "keys with a TTL"
        risk = (
            f"Redis maxmemory-policy is {policy}: under memory pressure it evicts {evicts}, task records and replica "
            "leases included, and running tasks are lost; set maxmemory-policy noeviction"
        )
        if self._policy_said != policy:
            self._policy_said = policy
            log.warning("store_eviction_policy", policy=policy, risk=risk)
        return risk
