"""Many callers on one stdio child: the proxy owns the child's id space, and routes what the child writes back.

Each request sent is an Exchange (stdio/exchange.py) with an id of the proxy's (`m<generation>.<n>`, so callers' ids
never collide) and, when it asked for progress, a progress token of the same value; the child's response goes back
to it. What the child sends on its own (its requests, notifications) is tied to a call by stdio/child_initiated.py.
Everything is bounded: the calls in flight, the progress and requests queued per call, the line length
(stdio/process.py). A line the proxy cannot read fails the call it answered when its id can be told (`_unreadable`),
and is counted by reason either way.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import structlog

from ...jsonrpc import INTERNAL_ERROR, dumps, error_object
from ..events import RequestUnsent
from ..routing import CallRoute
from .child_initiated import ChildInitiated
from .exchange import ChildGone, ChildUnavailable, Exchange
from .in_flight import InFlight
from .process import UNREADABLE_REASONS, ChildProcess, ChildSpec, Supervisor, Unreadable

log = structlog.get_logger(__name__)

_LOGGED_DROPS = 10
_LOGGED_UNREADABLE = 200
"""Unreadable lines logged one by one per channel; past that one in a thousand (a flood must not flood)."""
_MAX_BACKGROUND_WRITES = 1024
_ID_IN_LINE = re.compile(rb'"id"\s*:\s*"(m\d+\.\d+)"')
"""An id of the proxy's in the raw bytes of a line nothing else can read (its head or tail)."""


class StdioChannel:
    """The proxy's side of one supervised child's stdin and stdout."""

    def __init__(self, spec: ChildSpec, *, max_in_flight: int, index: int = 0) -> None:
        self.spec = spec
        self.name = spec.name
        self.index = index
        self._max_in_flight = max_in_flight
        self._numbers = itertools.count(1)
        self._pending = InFlight()
        self.prepare: Callable[[StdioChannel], Awaitable[Any]] | None = None
        """Run once per run of the child before any request of a caller's (a 2025 child's initialize)."""
        self._prepared: dict[int, asyncio.Task[Any]] = {}
        self._writes: set[asyncio.Task[Any]] = set()
        self._starting = 0
        """Requests past the in-flight check and not yet in _pending (waiting for the child, or for its handshake)."""
        self.reserved = 0
        """Calls the pool has sent this child's way and not yet written (exclusive dispatch)."""
        self.owner: str | None = None
        """The caller this child serves (stdio/pool.py), until it is restarted for another; None: nobody yet."""
        self.last_used = 0.0
        """When its last exchange ended (the event loop's clock): the idle child used least recently is restarted
        first for another caller."""
        self.on_forget: list[Callable[[Exchange], None]] = []
        """Told each exchange that ends (its answer read, or given up)."""
        self._refused = 0
        self.unreadable: collections.Counter[str] = collections.Counter()
        """Lines of the child's (all its runs) that could not be read, by reason (UNREADABLE_REASONS)."""
        self.on_start: list[Callable[[ChildProcess], None]] = []
        self.supervisor = Supervisor(
            spec,
            on_start=self._started,
            on_exit=self._exited,
            on_message=self._received,
            on_unreadable=self._unreadable,
            on_kill=lambda child: self._running.clear(),
        )
        self._running = asyncio.Event()
        self._initiated = ChildInitiated(self.name, index, self._pending, lambda: self.supervisor.child)
        self.on_notification = self._initiated.on_notification
        """Told the child's notifications that concern every client: list changes, resource updates."""

    @property
    def generation(self) -> int:
        child = self.supervisor.child
        return child.generation if child is not None else 0

    @property
    def pid(self) -> int | None:
        child = self.supervisor.child
        return child.pid if child is not None else None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def idle(self) -> bool:
        """Running, with nothing in flight, on its way, or asked and unanswered: restarting it loses no call in
        flight (a 2025 server's own task between two polls is lost with it; docs/how-it-works.md)."""
        return (
            self.supervisor.child is not None
            and not self._pending
            and not self._starting
            and not self.reserved
            and not self.open_questions
        )

    async def start(self) -> None:
        await self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()
        self._fail_all("the proxy is shutting down", None)

    async def running(self, timeout_s: float) -> ChildProcess:
        """The child, once one runs (a restart may be under way); ChildUnavailable past `timeout_s`."""
        if not self._running.is_set():  # (wait_for wraps the wait in a task of its own: only when there is a wait)
            try:
                await asyncio.wait_for(self._running.wait(), timeout_s)
            except TimeoutError:
                raise ChildUnavailable(f"the stdio server is not running ({self.supervisor.state})") from None
        child = self.supervisor.child
        if child is None:  # pragma: no cover - cleared and set in the same step
            raise ChildUnavailable(f"the stdio server is not running ({self.supervisor.state})")
        return child

    @property
    def open_questions(self) -> int:
        """Requests of the child's shown to a caller and not answered yet: the child waits on that caller."""
        return self._initiated.open_questions

    @property
    def asking(self) -> int:
        """Exchanges in flight during which the child may ask something."""
        return self._pending.asking

    async def prepared(self, wait_s: float) -> Any:
        """The running child, prepared (its prepare hook run once for this run of it); what the hook returned."""
        child = await self.running(wait_s)
        if self.prepare is None:
            return None
        task = self._prepared.get(child.generation)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._prepared[child.generation] = asyncio.ensure_future(self.prepare(self))
            task.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, even with no waiter
        return await asyncio.shield(task)

    async def request(
        self,
        message: dict[str, Any],
        *,
        route: CallRoute | None = None,
        wait_s: float = 30.0,
        prepared: bool = True,
        seal_state: Callable[[str], str] | None = None,
    ) -> Exchange:
        """Send one request under an id of the proxy's; read the answer from the Exchange, then close it. Unless
        `prepared` is False (the prepare hook's own requests), the child is prepared first."""
        if len(self._pending) + self._starting >= self._max_in_flight:
            raise ChildUnavailable(f"{self._max_in_flight} calls are in flight on the stdio server (upstream.stdio)")
        self._starting += 1  # counted before the first await: a burst cannot pass the check together
        try:
            if prepared:
                await self.prepared(wait_s)
            child = await self.running(wait_s)
        finally:
            self._starting -= 1
        child_id = f"m{child.generation}.{next(self._numbers)}"
        exchange = Exchange(self, child_id, message, route)
        exchange.seal_state = seal_state
        sent = {**message, "id": child_id}
        params = message.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        if isinstance(meta, dict) and "progressToken" in meta:
            exchange.token = meta["progressToken"]
            sent["params"] = {**params, "_meta": {**meta, "progressToken": child_id}}
        self._pending.add(exchange)
        try:
            await child.write(dumps(sent) + b"\n")
        except RequestUnsent as exc:  # nothing written
            self._pending.pop(child_id)
            raise ChildUnavailable(str(exc)) from exc
        except ConnectionError as exc:  # written, then the pipe broke: the child may have read it
            self._pending.pop(child_id)
            raise ChildGone(str(exc)) from exc
        except BaseException:
            self._pending.pop(child_id)
            raise
        return exchange

    async def notify(self, message: dict[str, Any]) -> None:
        """A notification of the proxy's to the child (dropped when none runs: nothing would read it)."""
        child = self.supervisor.child
        if child is None:
            return
        try:
            await child.write(dumps(message) + b"\n")
        except ConnectionError as exc:
            log.info("upstream_notification_not_delivered", upstream=self.name, reason=str(exc))

    def owns(self, shown_id: Any) -> bool:
        return self._initiated.owns(shown_id)

    async def respond(self, shown_id: Any, answer: dict[str, Any]) -> bool:
        return await self._initiated.respond(shown_id, answer)

    def forget(self, exchange: Exchange, *, cancel_reason: str | None) -> None:
        self.last_used = asyncio.get_running_loop().time()
        for callback in self.on_forget:
            callback(exchange)
        for answer in self._initiated.abandon(exchange):
            self._background(answer)
        if self._pending.get(exchange.child_id) is exchange:
            self._pending.pop(exchange.child_id)
            if cancel_reason is not None:
                cancel = {
                    "jsonrpc": "2.0",
                    "method": "notifications/cancelled",
                    "params": {"requestId": exchange.child_id, "reason": cancel_reason},
                }
                self._background(self.notify(cancel))

    # --- what the child writes ------------------------------------------------------------------------------------

    def _started(self, child: ChildProcess) -> None:
        self._running.set()
        for callback in list(self.on_start):
            callback(child)

    def _exited(self, child: ChildProcess, status: int) -> None:
        self._running.clear()
        self._fail_all(f"the stdio server exited with status {status}", child, status)

    def _fail_all(self, reason: str, child: ChildProcess | None, status: int | None = None) -> None:
        data: dict[str, Any] = {"upstream": self.name}
        if status is not None:
            data["exitStatus"] = status
        if child is not None:
            data["stderr"] = list(child.stderr_tail)
        error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", data)
        pending = self._pending.clear()  # cleared, not replaced: the ChildInitiated reads the same one
        for exchange in pending:
            exchange.deliver({"jsonrpc": "2.0", "id": exchange.child_id, "error": error}, 0)
        self._initiated.clear()
        self._prepared.clear()

    def _received(self, child: ChildProcess, message: dict[str, Any], size: int) -> None:
        method = message.get("method")
        if not isinstance(method, str):  # no request of the child's: an answer, or nothing at all
            why = _not_a_response(message)
            if why is not None:  # the call it names, if any, would wait for an answer that has come and gone
                self._unreadable(child, Unreadable("not_jsonrpc", why, b"", b"", size, (message.get("id"),)))
                return
            child_id = message.get("id")  # the proxy's ids are strings: any other is no request of the proxy's
            exchange = self._pending.pop(child_id) if isinstance(child_id, str) else None
            if exchange is None:
                self._drop("a response to no request in flight", message)
                return
            exchange.deliver(message, size)
            return
        if "id" not in message:
            dropped = self._initiated.notification(message, size)
            if dropped is not None:
                self._drop(dropped, message)
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

    def _unreadable(self, child: ChildProcess, line: Unreadable) -> None:
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

    def _background(self, write: Coroutine[Any, Any, Any]) -> None:
        """A write of the proxy's own (an answer to a ping, a refusal, a cancellation) beside the calls; at most
        _MAX_BACKGROUND_WRITES at once, so that a child that floods and stops reading cannot grow them."""
        if len(self._writes) >= _MAX_BACKGROUND_WRITES:
            write.close()
            self._drop("a write of the proxy's own, with too many waiting for the child to read", None)
            return
        task = asyncio.ensure_future(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _drop(self, what: str, message: Any) -> None:
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


def unreadable_counts(channels: Iterable[StdioChannel]) -> dict[str, int]:
    """The lines these channels' children wrote that could not be read, by reason (every reason, zero included)."""
    counts = dict.fromkeys(UNREADABLE_REASONS, 0)
    for channel in channels:
        for reason, count in channel.unreadable.items():
            counts[reason] += count
    return counts
