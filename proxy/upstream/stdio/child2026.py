"""A 2026-07-28 server over stdio: every request carries its own `_meta` envelope, so many clients multiplex on the
one child with nothing but ids to keep apart (the channel's). Cancellation is `notifications/cancelled`, sent when a
call's exchange is closed before its answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import structlog
from multidict import MultiMapping

from ...jsonrpc import JsonRpcError
from ..era2026 import discover_probe, interpret, is_discover_result
from ..events import (
    AnswerTooLarge,
    Event,
    Failed,
    Progress,
    RequestUnsent,
    UpstreamUnavailable,
    cut_failure,
    failure_reason,
    proxy_failure,
    too_large,
)
from ..routing import CallRoute
from .exchange import ChildGone, carries_exit_status, child_exited, own_answer
from .pool import StdioPool

log = structlog.get_logger(__name__)


class StdioModern:
    def __init__(self, pool: StdioPool, *, start_timeout_s: float) -> None:
        self.pool = pool
        self._start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        return self.pool.name

    async def probe(self, client_headers: MultiMapping[str]) -> Literal["modern", "legacy"]:
        """server/discover as the stdio transport says: a DiscoverResult means modern; any error, or no answer in
        time, means 2025 (initialize follows). The first request also fixes a dual-era child's era for its life."""
        answer = None
        try:
            answer = await own_answer(self.pool, discover_probe(), timeout_s=self._start_timeout_s, prepared=False)
        except ChildGone as exc:
            raise UpstreamUnavailable(str(exc)) from exc
        except (TimeoutError, AnswerTooLarge):
            log.info("upstream_probe_unanswered", upstream=self.url, wait_s=self._start_timeout_s)
        ping = {"jsonrpc": "2.0", "id": "mtp-ping", "method": "ping"}  # a 2025 server answers (or refuses) it
        if answer is None and not await self.answers(self._start_timeout_s, ping):
            # Silent to both: still starting (an npx download), not 2025. The next request probes again.
            raise UpstreamUnavailable(f"the stdio server answers nothing yet ({self._start_timeout_s:g} s)")
        if answer is not None and carries_exit_status(answer):
            raise UpstreamUnavailable(failure_reason(answer["error"]))  # _unavailable() adds the prefix
        return "modern" if is_discover_result(answer) else "legacy"

    async def answers(self, timeout_s: float, message: dict[str, Any] | None = None) -> bool:
        """Whether the child answers `message` (default server/discover, as /readyz asks) within `timeout_s`."""
        try:
            answer = await own_answer(self.pool, message or discover_probe(), timeout_s=timeout_s, prepared=False)
        except (ChildGone, TimeoutError, AnswerTooLarge):
            return False
        return not carries_exit_status(answer)

    async def call_tool(
        self,
        message: dict[str, Any],
        client_headers: MultiMapping[str],
        capabilities: dict[str, Any],
        *,
        max_bytes: int,
        caller: str = "",
    ) -> AsyncIterator[Event]:
        """One request and what the child writes for it, as events, on a child of `caller`'s; closing early cancels
        it in the child."""
        try:
            route = CallRoute(capabilities, None, caller=caller) if caller else None
            exchange = await self.pool.request(message, route=route, wait_s=self._start_timeout_s)
        except ChildGone as exc:  # ChildUnavailable: nothing written; else written, then the pipe broke
            unsent = isinstance(exc, RequestUnsent)
            yield proxy_failure(str(exc), self.url, transient="unsent" if unsent else "unanswered")
            return
        except JsonRpcError as exc:  # a requestState of the proxy's that is not this caller's, or not valid
            yield Failed(exc.to_error(), exc.message)
            return
        try:
            async for answer in exchange.messages(max_bytes):
                if child_exited(exchange, answer):  # with the call in it, which may have run or not
                    yield cut_failure(answer["error"])
                    return
                event = interpret(answer, message["id"], "stdio", exchange.last_size, self.url)
                if event is not None:
                    yield event
                    if not isinstance(event, Progress):
                        return
        except AnswerTooLarge:
            yield too_large(max_bytes)
        finally:
            exchange.close()

    async def notify_cancelled(self, request_id: str, client_headers: MultiMapping[str], reason: str) -> None:
        """Closing the call's exchange told the child already."""

    async def takes_2025_sessions(self, client_headers: MultiMapping[str]) -> bool:
        """Never: a 2025 client's initialize would fix the one child's era, and its capabilities, for every client."""
        return False
