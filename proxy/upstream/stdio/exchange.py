"""One request of the proxy's to a stdio child, under an id of the proxy's, and what the child writes back for it.

What the child writes for the request (progress, its own requests, the response) is queued on the Exchange with the
caller's own id and progress token put back, within bounds, until the caller reads it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ...jsonrpc import INTERNAL_ERROR, error_object
from ..events import AnswerTooLarge, RequestUnsent
from ..routing import CallRoute, may_ask

_MAX_QUEUED_NOTIFICATIONS = 64
"""Notifications (progress, logs) of one call not yet read; past it the oldest is dropped."""
MAX_QUEUED_REQUESTS = 16
"""Server requests tied to one call and not yet taken; past it the child is refused at once."""


class ChildGone(ConnectionError):
    """The child exited (or could not be written to) while a call waited on it."""


def carries_exit_status(answer: dict[str, Any]) -> bool:
    """Whether `answer` is an error that names a child's exit status (the channel's, when its child exited)."""
    error = answer.get("error")
    data = error.get("data") if isinstance(error, dict) else None
    return isinstance(data, dict) and "exitStatus" in data


def child_exited(exchange: Exchange, answer: dict[str, Any]) -> bool:
    """Whether `answer` is the one the channel made when the child exited with the request in it: nothing was read
    for it (a child's own answer has a size), and it carries the exit status."""
    return exchange.last_size == 0 and carries_exit_status(answer)


class ChildUnavailable(ChildGone, RequestUnsent):
    """No child took the request: none runs, or too many calls wait. Nothing was written to any child."""


class ExchangeOwner(Protocol):
    """The channel an exchange was sent on (a Protocol: the channel imports this module)."""

    index: int

    def forget(self, exchange: Exchange, *, cancel_reason: str | None) -> None: ...


class Exchange:
    """One request to the child and what comes back for it, up to its response."""

    def __init__(self, channel: ExchangeOwner, child_id: str, request: dict[str, Any], route: CallRoute | None) -> None:
        self._channel = channel
        self.channel_index = channel.index
        self.child_id = child_id
        self.caller_id = request.get("id")
        self.method = request.get("method")
        self.route = route
        self.token: Any = None
        """The caller's progress token, when it asked for progress (the child sees `child_id` instead)."""
        self.may_ask = may_ask(self.method)
        self._items: collections.deque[tuple[dict[str, Any], int]] = collections.deque()
        self._notifications = 0
        self._requests = 0
        self.last_size = 0
        """The size of the last message read, as the child wrote it."""
        self._ready = asyncio.Event()
        self.answered = False
        self.closed = False
        self.on_close: Callable[[], Any] | None = None
        self.asked: list[str] = []
        """The child's requests delivered to this call (by shown id): refused at its end if still unanswered."""
        self.seal_state: Callable[[str], str] | None = None
        """Wraps the requestState of an input_required answer (a 2026 child's own, which only it can read)."""

    def deliver(self, message: dict[str, Any], size: int) -> bool:
        """Queue what the child wrote for this call; False when the bound refuses a request of the child's."""
        method = message.get("method")
        if method is None:
            message = {**message, "id": self.caller_id}
            self.answered = True
            result = message.get("result")
            if self.seal_state is not None and isinstance(result, dict) and isinstance(result.get("requestState"), str):
                message["result"] = {**result, "requestState": self.seal_state(result["requestState"])}
        elif "id" in message:
            if self._requests >= MAX_QUEUED_REQUESTS:
                return False
            self._requests += 1
            self.asked.append(message["id"])
        else:
            if self._notifications >= _MAX_QUEUED_NOTIFICATIONS:
                for index, (queued, _) in enumerate(self._items):
                    if queued.get("method") is not None and "id" not in queued:
                        del self._items[index]
                        self._notifications -= 1
                        break
            self._notifications += 1
        self._items.append((message, size))
        self._ready.set()
        return True

    async def messages(self, max_bytes: int) -> AsyncIterator[dict[str, Any]]:
        """What the child wrote for this call, the response last; AnswerTooLarge for one over `max_bytes`."""
        while True:
            while not self._items:
                self._ready.clear()
                await self._ready.wait()
            message, size = self._items.popleft()
            method = message.get("method")
            if method is not None and "id" in message:
                self._requests -= 1
            elif method is not None:
                self._notifications -= 1
            if size > max_bytes:
                raise AnswerTooLarge(f"a message over {max_bytes} bytes")
            self.last_size = size
            yield message
            if method is None:
                return

    def close(self, reason: str = "cancelled by the client", *, tell_child: bool = True) -> None:
        """Done with it: when its response has not come, the child is told to stop (notifications/cancelled),
        unless `tell_child` is False (initialize, which MCP forbids to cancel)."""
        if self.closed:
            return
        self.closed = True
        if self.on_close is not None:
            self.on_close()
        unanswered = not self.answered
        self._channel.forget(self, cancel_reason=reason if unanswered and tell_child else None)
        if unanswered:  # closed by someone else (a cancel, an ended session): whoever still reads it is done too
            error = error_object(INTERNAL_ERROR, f"Request cancelled: {reason}")
            self.deliver({"jsonrpc": "2.0", "id": self.child_id, "error": error}, 0)


OWN_ANSWER_MAX_BYTES = 4 * 1024 * 1024
"""The largest answer to a request of the proxy's own (initialize, discover, ping, tools/list, tasks/get) it reads."""


async def own_answer(
    sender: Any,
    message: dict[str, Any],
    *,
    timeout_s: float,
    wait_s: float | None = None,
    prepared: bool = True,
    tell_child: bool = True,
    route: CallRoute | None = None,
) -> dict[str, Any]:
    """The child's response to a request of the proxy's own, sent through `sender` (a StdioChannel or StdioPool;
    `wait_s`, default `timeout_s`, for a child that is restarting), read within `timeout_s`. Raises ChildGone,
    TimeoutError, or AnswerTooLarge past OWN_ANSWER_MAX_BYTES."""
    exchange = await sender.request(
        message, route=route, wait_s=timeout_s if wait_s is None else wait_s, prepared=prepared
    )
    try:
        async with asyncio.timeout(timeout_s):
            async for answer in exchange.messages(OWN_ANSWER_MAX_BYTES):
                if answer.get("method") is None:
                    return answer
    finally:
        exchange.close(tell_child=tell_child)
    raise ChildGone("the stdio server gave no answer")  # pragma: no cover - messages() ends with the answer
