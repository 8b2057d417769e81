"""What a stdio child writes on its own, tied to the call in flight it is for.

A request the child sends (elicitation, sampling, roots) names no call on stdio, so it is tied as on a legacy
standalone stream (routing.py): its related-task, else the one call in flight. It is shown to that call's caller
under an id of the proxy's, and the caller's answer goes back to the run of the child that asked. A notification is
tied by its progress token, its subscription id, or (a log line) its related-task; list changes and resource updates
concern every client.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from ...jsonrpc import INTERNAL_ERROR, dumps, error_object
from ..routing import related_task_id
from .exchange import MAX_QUEUED_REQUESTS, Exchange
from .in_flight import InFlight
from .process import ChildProcess

log = structlog.get_logger(__name__)

SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"


class ChildInitiated:
    """One channel's side of what its child starts: the child's open requests, and where its notifications go."""

    def __init__(self, name: str, index: int, pending: InFlight, current: Callable[[], ChildProcess | None]) -> None:
        self._name = name
        self._index = index
        self._pending = pending
        """The channel's exchanges in flight, by the child's id of them."""
        self._current = current
        """The run of the child that is up, if any."""
        self._asked: dict[str, tuple[int, Any]] = {}
        """The child's own requests not yet answered: the id they are shown under → (generation, the child's id)."""
        self._asked_numbers = itertools.count(1)
        self.on_notification: list[Callable[[dict[str, Any]], None]] = []
        """Told the child's notifications that concern every client: list changes, resource updates (any other that
        names no call is dropped: nothing says whose it is)."""

    @property
    def open_questions(self) -> int:
        """Requests of the child's shown to a caller and not answered yet: the child waits on that caller."""
        return len(self._asked)

    def request(self, child: ChildProcess, message: dict[str, Any], size: int) -> str | None:
        """Show a request of the child's to the caller of the call it is for; why not, when it cannot be."""
        exchange, why = self._tie(message)
        # Shown under an id of the proxy's: the ids of several children (or of two runs of one) never meet.
        shown_id = f"c{self._index}.{next(self._asked_numbers)}"
        if exchange is not None and exchange.deliver({**message, "id": shown_id}, size):
            self._asked[shown_id] = (child.generation, message["id"])
            return None
        return why or f"its call has {MAX_QUEUED_REQUESTS} requests waiting already"

    def notification(self, message: dict[str, Any], size: int) -> str | None:
        """Deliver a notification of the child's to the call it is for, or to every client; why not when it names
        no call (None too for those dropped on purpose)."""
        if message["method"] == "notifications/progress":
            params = message.get("params")
            token = params.get("progressToken") if isinstance(params, dict) else None
            exchange = self._pending.get(token) if isinstance(token, str) else None
            if exchange is not None and exchange.token is not None:
                exchange.deliver({**message, "params": {**params, "progressToken": exchange.token}}, size)
            return None
        if message["method"] == "notifications/cancelled":
            return None  # the child gave up a request of its own: its answer, if any, will be dropped
        params = message.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        subscription = meta.get(SUBSCRIPTION_ID) if isinstance(meta, dict) else None
        if isinstance(subscription, str) and subscription in self._pending:
            exchange = self._pending[subscription]  # a 2026 subscriptions/listen stream's notification
            meta = {**meta, SUBSCRIPTION_ID: exchange.caller_id}
            exchange.deliver({**message, "params": {**params, "_meta": meta}}, size)
            return None
        if message["method"] == "notifications/message":
            # A log line may say something about one caller's call, and on stdio nothing says whose: it reaches a
            # client only when its related-task names the call; otherwise it is dropped, never guessed.
            exchange, _ = self._tie(message) if related_task_id(message) is not None else (None, "")
            if exchange is not None:
                exchange.deliver(message, size)
            return None
        if message["method"].endswith("/list_changed") or message["method"] == "notifications/resources/updated":
            for callback in list(self.on_notification):
                callback(message)
            return None
        return f"a {message['method']} notification that names no call"

    def owns(self, shown_id: Any) -> bool:
        return isinstance(shown_id, str) and shown_id in self._asked

    async def respond(self, shown_id: Any, answer: dict[str, Any]) -> bool:
        """Answer a request of the child's, by the id it was shown under (once; never one that a previous run of the
        child sent). False when dropped."""
        asked = self._asked.pop(shown_id, None) if isinstance(shown_id, str) else None
        if asked is None:
            return False
        return await self.answer(asked[0], asked[1], answer)

    async def answer(self, generation: int, request_id: Any, answer: dict[str, Any]) -> bool:
        """Write an answer to the child's request `request_id`, if the run that asked is still the one up."""
        child = self._current()
        if child is None or generation != child.generation:
            return False
        try:
            await child.write(dumps({"jsonrpc": "2.0", "id": request_id, **answer}) + b"\n")
        except ConnectionError as exc:
            log.warning("upstream_answer_not_delivered", upstream=self._name, reason=str(exc))
            return False
        return True

    def abandon(self, exchange: Exchange) -> list[Coroutine[Any, Any, bool]]:
        """The answers to the child's requests still open when the call they were shown to ended: the child must not
        wait on them."""
        answers = []
        for shown_id in exchange.asked:
            asked = self._asked.pop(shown_id, None)
            if asked is not None:
                error = error_object(INTERNAL_ERROR, "The request's call has ended at the proxy")
                answers.append(self.answer(asked[0], asked[1], {"error": error}))
        return answers

    def clear(self) -> None:
        """The child's run ended: nothing it asked can be answered."""
        self._asked.clear()

    def _tie(self, message: dict[str, Any]) -> tuple[Exchange | None, str]:
        """The open call a request of the child's is for (the newest exchange of it), or None and why not."""
        in_flight = self._pending
        task_id = related_task_id(message)
        if task_id is not None:
            exchange = in_flight.newest_of_task(task_id)
            if exchange is not None:
                return exchange, ""
            # The one call in flight, when it is a server task being made: its id is not known yet. Any other call
            # (another caller's, on the one child) must never get a question that names some task.
            exchange = in_flight.the_one_asking()
            route = exchange.route if exchange is not None else None
            if route is not None and route.upstream_task and route.upstream_task_id is None:
                return exchange, ""
            return None, f"it names task {task_id!r}, which no call in flight follows"
        exchange = in_flight.the_one_asking()
        if exchange is not None:
            return exchange, ""
        calls = in_flight.calls_asking
        if not calls:
            return None, "no call is in flight on the stdio server"
        return None, f"{calls} calls are in flight on the stdio server and the request names none of them"
