"""What a stdio child writes, read: an answer goes to the request it answers, the child's own requests and
notifications to stdio/child_initiated.py, and a line that is no message fails the call it answered when its id can
be told, and is counted by reason either way. What the channel (stdio/channel.py) sends is its own concern.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from ...jsonrpc import INTERNAL_ERROR, error_object
from .child_initiated import ChildInitiated
from .exchange import Exchange
from .in_flight import InFlight
from .process import ChildProcess, Unreadable

log = structlog.get_logger(__name__)

_LOGGED_DROPS = 10
_LOGGED_UNREADABLE = 200
"""Unreadable lines logged one by one per channel; past that one in a thousand (a flood must not flood)."""
_ID_IN_LINE = re.compile(rb'"id"\s*:\s*"(m\d+\.\d+)"')
"""An id of the proxy's in the raw bytes of a line nothing else can read (its head or tail)."""


class ChildLines:
    """The lines of one channel's child (every run of it), each to where it goes."""

    def __init__(
        self,
        name: str,
        pending: InFlight,
        initiated: ChildInitiated,
        background: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.name = name
        self._pending = pending  # the channel's own: what it sends is put there, what is read here is taken out
        self._initiated = initiated
        self._background = background
        """Runs a write of the proxy's own (an answer to a ping, a refusal) beside the calls, bounded."""
        self._refused = 0
        self.unreadable: collections.Counter[str] = collections.Counter()
        """Lines of the child's (all its runs) that could not be read, by reason (UNREADABLE_REASONS)."""

    def received(self, child: ChildProcess, message: dict[str, Any], size: int) -> None:
        method = message.get("method")
        if not isinstance(method, str):  # no request of the child's: an answer, or nothing at all
            why = _not_a_response(message)
            if why is not None:  # the call it names, if any, would wait for an answer that has come and gone
                self.unreadable_line(child, Unreadable("not_jsonrpc", why, b"", b"", size, (message.get("id"),)))
                return
            child_id = message.get("id")  # the proxy's ids are strings: any other is no request of the proxy's
            exchange = self._pending.pop(child_id) if isinstance(child_id, str) else None
            if exchange is None:
                self.drop("a response to no request in flight", message)
                return
            exchange.deliver(message, size)
            return
        if "id" not in message:
            dropped = self._initiated.notification(message, size)
            if dropped is not None:
                self.drop(dropped, message)
            return
        if method == "ping":
            self._background(self._initiated.answer(child.generation, message["id"], {"result": {}}))
            return
        refused = self._initiated.request(child, message, size)
        if refused is not None:
            self._refuse(child, message, refused)

    def _refuse(self, child: ChildProcess, message: dict[str, Any], why: str) -> None:
        self._refused += 1
        if self._refused <= _LOGGED_DROPS or self._refused % 1000 == 0:
            log.info(
                "upstream_request_refused",
                upstream=self.name,
                upstream_method=message["method"],
                reason=why,
                count=self._refused,
            )
        error = error_object(INTERNAL_ERROR, f"The proxy cannot relay this {message['method']} request: {why}")
        self._background(self._initiated.answer(child.generation, message["id"], {"error": error}))

    def unreadable_line(self, child: ChildProcess, line: Unreadable) -> None:
        """A line that is no message may have been a call's answer: the call it names fails at once (it would wait
        for an answer that has come and gone); otherwise the line is only logged. Counted either way."""
        self.unreadable[line.reason] += 1
        failed = []
        for exchange in self._answered_by(line):
            self._pending.pop(exchange.child_id)
            failed.append(exchange.child_id)
            message = f"Upstream failure: the stdio server's answer could not be read: {line.detail}"
            error = error_object(INTERNAL_ERROR, message, {"upstream": self.name, "reason": line.reason})
            exchange.deliver({"jsonrpc": "2.0", "id": exchange.child_id, "error": error}, 0)
        count = sum(self.unreadable.values())
        if count <= _LOGGED_UNREADABLE or count % 1000 == 0:
            # A line that looks like a message is an answer's, a tool result: never logged. A banner is shown.
            shown = None if line.head.startswith((b"{", b"[")) else line.head[:200].decode("utf-8", "replace")
            log.warning(
                "upstream_line_unreadable",
                upstream=self.name,
                pid=child.pid,
                reason=line.reason,
                detail=line.detail,
                bytes=line.size,
                failed_calls=failed,
                line=shown,
                count=count,
            )

    def _answered_by(self, line: Unreadable) -> list[Exchange]:
        """The calls in flight an unreadable line answered: those of the ids it was read with, else the first id of
        the proxy's found in its head, then in its tail (where an answer's top-level id is, whatever the key order)."""
        if line.ids is not None:
            ids = {child_id for child_id in line.ids if isinstance(child_id, str)}
            return [self._pending[child_id] for child_id in ids if child_id in self._pending]
        for edge in (line.head, line.tail):
            match = _ID_IN_LINE.search(edge)
            exchange = self._pending.get(match.group(1).decode()) if match else None
            if exchange is not None:
                return [exchange]
        return []

    def drop(self, what: str, message: Any) -> None:
        self._refused += 1
        if self._refused <= _LOGGED_DROPS or self._refused % 1000 == 0:
            log.warning("upstream_message_dropped", upstream=self.name, reason=what, count=self._refused)


def _not_a_response(message: dict[str, Any]) -> str | None:
    """Why a message that is no request is no JSON-RPC response either (None when it is one): exactly one of result
    and error. What they hold is for whoever reads the answer to judge (a tool result, an error object)."""
    if message.get("method") is not None:
        return "its method is not a string"
    if ("result" in message) == ("error" in message):
        return "it has both a result and an error" if "result" in message else "it has neither a result nor an error"
    return None
