"""Whether the upstream says a tool may run again, for rules with `idempotent: hint`: the tool's annotations in the
upstream's tools/list (readOnlyHint or idempotentHint), read with the caller's credential and kept for a minute.

Opt-in because annotations are hints from a server the proxy does not otherwise trust (MCP says so of them): a
wrong "idempotent" runs a side effect twice. The operator who writes `hint` trusts this server's word.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from cachetools import TTLCache

from ..upstream.events import UpstreamUnavailable
from ..upstream.gateway import Gateway
from ..upstream.tools import list_tools
from .job import ToolCall

log = structlog.get_logger(__name__)

_CACHED_S = 60.0
_CACHED_CALLERS = 1024


class RepeatHints:
    def __init__(self, gateway: Gateway, max_bytes: Callable[[], int]) -> None:
        self._gateway = gateway
        self._max_bytes = max_bytes
        self._safe: TTLCache[str, frozenset[str]] = TTLCache(maxsize=_CACHED_CALLERS, ttl=_CACHED_S)
        """Per caller's credential (a keyed hash): the tools the upstream says may run again."""

    async def may_repeat(self, call: ToolCall, task_id: str) -> bool:
        safe = self._safe.get(call.credential)
        if safe is None:
            try:
                tools = await list_tools(self._gateway, max_bytes=self._max_bytes(), credentials=call.headers)
            except UpstreamUnavailable as exc:
                log.info("tool_hints_unknown", task_id=task_id, tool=call.tool, reason=str(exc))
                return False  # unknown is no
            safe = self._safe[call.credential] = frozenset(
                tool["name"] for tool in tools if _says_repeatable(tool.get("annotations"))
            )
        return call.tool in safe


def _says_repeatable(annotations: object) -> bool:
    """readOnlyHint (nothing changes) or idempotentHint (the same call changes nothing more), each strictly true."""
    if not isinstance(annotations, dict):
        return False
    return annotations.get("readOnlyHint") is True or annotations.get("idempotentHint") is True
