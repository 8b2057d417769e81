"""Synchronous calls from 2026-07-28 clients to a legacy upstream.

Progress is relayed on the response's event stream as it comes. When the legacy server asks for input on the
call's stream, the client gets an MRTR `input_required` result whose `requestState` is a handle to the upstream
call, which stays open in the proxy (proxy/clients/parking.py): the client's retry posts the answers back upstream and
goes on reading the same call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import structlog
from aiohttp import web
from multidict import MultiMapping

from ..clients.envelope import META_CLIENT_CAPABILITIES, meta_of, params_of
from ..clients.parking import ParkedCalls, invalid_state
from ..jsonrpc import (
    ERROR_HTTP_STATUS,
    INTERNAL_ERROR,
    dumps,
    error_object,
    error_response,
    result_response,
)
from ..security import Identity, caller_of
from .era2025 import LegacyUpstream
from .events import Event, Failed, Finished, InputNeeded, Progress
from .http.sse import message_event

log = structlog.get_logger(__name__)

_TOKEN_PREFIX = "mtp1"
# The ids of the proxy's requests on its shared session: unique per process (the random part tells processes
# apart), without drawing random bytes for every call.
_ID_PREFIX = f"mtp-{secrets.token_hex(4)}-"
_call_numbers = itertools.count(1)
_GATHER_S = 0.05
"""After a first server request, how long to wait for the ones sent with it, so they go out in one round."""


_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)

_MAX_QUEUED_PROGRESS = 64
"""Progress a call keeps while no client reads it (parked for an answer); later progress is dropped until then."""


class _Feed:
    """The queue of one call's events, bounded: progress while nobody reads is dropped past a few, and a legacy
    server's questions count against max_input_rounds (as on the task path); past it the call fails."""

    def __init__(self, max_questions: int, upstream_url: str) -> None:
        self._events: asyncio.Queue[Event] | None = None
        self.closed = False
        """A terminal event is queued: the call is over, whatever the server still sends."""
        self.over_limit = False
        """The call failed here, past max_input_rounds, while the server still runs it."""
        self._questions = 0
        self._max_questions = max_questions
        self._upstream_url = upstream_url
        self.split = True
        """Events go through the queue, from the task that reads the call to the one that follows it. False while
        the request's own task does both (SyncBridge._drive): then `take_over` runs on the first question that
        comes from elsewhere (the session's standalone stream), in the task that brings it."""
        self.take_over: Callable[[], Awaitable[None]] | None = None

    @property
    def queue(self) -> asyncio.Queue[Event]:
        """Made when first used: a call that only finishes, read and answered by one task, needs none (an
        asyncio.Queue is two deques and an Event, 0.7 µs, and more for the collector to look at)."""
        if self._events is None:
            self._events = asyncio.Queue()
        return self._events

    async def put(self, event: Event) -> None:
        if self.closed:
            return
        self._queue(event)
        if not self.split:
            self.split = True
            if self.take_over is not None:
                await self.take_over()

    def _queue(self, event: Event) -> None:
        if isinstance(event, Progress):
            if self.queue.qsize() < _MAX_QUEUED_PROGRESS:
                self.queue.put_nowait(event)
            return
        if isinstance(event, InputNeeded):
            self._questions += 1
            if self._questions > self._max_questions:
                reason = f"the upstream asked for input more than {self._max_questions} times (max_input_rounds)"
                error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": self._upstream_url})
                event = Failed(error, reason)
                self.over_limit = True
        self.closed = isinstance(event, (Finished, Failed))
        self.queue.put_nowait(event)


@dataclasses.dataclass(eq=False)
class _Call:
    """One legacy call in flight: its events arrive in `feed`, fed by `pump`, while any client waits or not."""

    feed: _Feed
    pump: asyncio.Task[None]
    replies: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = dataclasses.field(default_factory=dict)
    requests: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Outstanding input requests by key, as the client was shown them."""
    caller: str = ""
    """Whose call it is (security.caller_of): the upstream session or stdio child it holds is theirs."""


def _abandon(call: _Call, why: str) -> None:
    log.info("legacy_call_abandoned", reason=why)
    call.pump.cancel()  # closing the call's events posts notifications/cancelled upstream


class SyncBridge:
    def __init__(
        self,
        legacy: LegacyUpstream,
        identity: Identity,
        *,
        round_wait_s: float,
        max_bytes: Callable[[], int],
        max_questions: Callable[[], int],
        max_parked: int = 10_000,
        owner: Callable[[], str] | None = None,
    ) -> None:
        self._legacy = legacy
        self._max_bytes = max_bytes
        """limits.max_result_bytes as the policy says now: the bound of each upstream answer read for a client."""
        self._max_questions = max_questions
        """tasks.max_input_rounds as the policy says now: a legacy server's questions one call may ask."""
        self._identity = identity
        self._parked: ParkedCalls[_Call] = ParkedCalls(
            prefix=_TOKEN_PREFIX, ttl_s=round_wait_s, on_drop=_abandon, max_parked=max_parked, owner=owner
        )

    def end_round(self, caller: str | None) -> bool:
        """End the round parked longest of `caller`'s (None: anyone's), cancelling its call upstream, for a call
        that needs the stdio child it holds; False when there is none."""
        return self._parked.drop_oldest(lambda call: caller is None or call.caller == caller)

    async def aclose(self) -> None:
        calls = self._parked.drain()
        for call in calls:
            call.pump.cancel()
        await asyncio.gather(*(call.pump for call in calls), return_exceptions=True)

    async def relay(self, headers: MultiMapping[str], message: dict[str, Any], reply: Reply[_R]) -> _R:
        """Carry one modern request (tools/call, prompts/get, resources/read, lists...) to the legacy upstream; the
        answer goes out through `reply` (aiohttp's, or the pass-through lane's)."""
        params = params_of(message)
        state = params.get("requestState")
        if state is not None:
            call = self._claim(state, headers, message)
            answers = params.get("inputResponses")
            if not isinstance(answers, dict):
                answers = {}
            message = _slim(message)  # what follows the answers needs only the envelope
            del params
            try:
                for key, answer in answers.items():
                    respond = call.replies.pop(key, None)
                    if respond is not None and isinstance(answer, dict):
                        call.requests.pop(key, None)
                        await respond(answer)
            except asyncio.CancelledError:
                call.pump.cancel()  # the client left with the call claimed: nobody else can resume it
                raise
            answers = answer = {}  # delivered: not held while the call runs on
            if call.requests:  # some are still unanswered: ask for those again (SEP-2322 SHOULD)
                return await self._ask(headers, message, call, reply)
        else:
            capabilities = meta_of(message).get(META_CLIENT_CAPABILITIES)
            upstream_message = {
                "jsonrpc": "2.0",
                "id": f"{_ID_PREFIX}{next(_call_numbers):x}",  # unique on the shared session, whatever the client's
                "method": message["method"],
                "params": params,
            }
            feed = _Feed(self._max_questions(), self._legacy.url)
            principal = self._identity.principal(headers)
            caller = principal or caller_of(principal, reply.remote())  # (the address only when anonymous)
            events = self._legacy.call(
                upstream_message,
                headers,
                capabilities if isinstance(capabilities, dict) else {},
                max_bytes=self._max_bytes(),
                on_request=feed.put,  # a request for this call on the standalone stream joins its round
                caller=caller,
            )
            # The request as parsed, about ten times its body's size, goes with the POST (era2025.py): the call may
            # run for hours, and answering it needs only the envelope.
            message = _slim(message)
            del params, upstream_message, capabilities
            if reply.separable:
                call = _Call(feed=feed, pump=asyncio.current_task(), caller=caller)  # type: ignore[arg-type]
                return await self._drive(headers, message, call, events, reply)
            call = _Call(feed=feed, pump=asyncio.get_running_loop().create_task(_pump(events, feed)), caller=caller)
        return await self._follow(headers, message, call, reply)

    async def _drive(
        self, headers: MultiMapping[str], message: dict[str, Any], call: _Call, events: AsyncIterator[Event],
        reply: Reply[_R],
    ) -> _R:  # fmt: skip
        """Read a new call and answer it from the request's own task: most calls only finish, and a second task
        with a queue between the two cost a bridged call 5-10 % of its CPU (bench/ab.py, docs/benchmarks.md).

        When input is needed, reading and following split into two tasks. Asked on the call's own stream, the
        events go on in a pump task and this task follows them, as for aiohttp's requests. Asked on the session's
        standalone stream while this task waits on the call's: the task that brings the question follows the call
        and answers the client (`reply.take`), and this one reads on for it, the request already ended for the
        lane."""
        feed = call.feed
        feed.split = False
        # The request's context (its request id in every log line) for a task that takes the call over.
        context = contextvars.copy_context()
        feed.take_over = functools.partial(self._take_over, headers, message, call, reply, context)
        reading: AsyncIterator[Event] | None = events
        try:
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    event = _proxy_fault("the call's events ended without its answer")
                except Exception:
                    log.exception("legacy_call_error")
                    event = _proxy_fault("internal proxy error")
                if feed.split:  # another task follows the call now: this one reads the rest as a pump would
                    await feed.put(event)
                    if not feed.closed:
                        reading = None  # the pump closes it
                        await _pump(events, feed)
                    return 499  # type: ignore[return-value]  # the request was answered and counted there
                if isinstance(event, Progress):
                    if event.raw is not None:
                        await reply.event(event.raw)
                elif isinstance(event, InputNeeded):
                    feed.split, feed.take_over = True, None  # this task follows: nobody else takes over
                    await feed.put(event)  # counted against max_input_rounds: it may come back as Failed
                    call.pump = asyncio.get_running_loop().create_task(_pump(events, feed))
                    reading = None  # the pump reads it, and closes it
                    return await self._follow(headers, message, call, reply)
                else:
                    feed.closed = True  # a question from elsewhere now finds the call over, as a queued answer would
                    if isinstance(event, Finished):
                        return await reply.finish(result_response(message["id"], event.result))
                    assert isinstance(event, Failed)
                    return await self._failed(message, call, event, reply)
        finally:
            feed.take_over = None
            if reading is not None:
                await reading.aclose()  # type: ignore[attr-defined]  # ending early posts notifications/cancelled

    async def _take_over(
        self,
        headers: MultiMapping[str],
        message: dict[str, Any],
        call: _Call,
        reply: Reply[_R],
        context: contextvars.Context,
    ) -> None:
        """A question for a call that the request's own task reads: this task follows the call from here and
        answers the client, in the request's context (not the one of whoever opened the standalone stream); the
        request ends with that answer."""
        for variable, value in context.items():
            variable.set(value)  # this task's own context: the reader that spawned it keeps its own
        answered = reply.take()
        status, reusable = 499, True
        try:
            status = await self._follow(headers, message, call, reply)  # type: ignore[assignment]
        except ConnectionResetError:
            pass  # the client left meanwhile (which cancelled the call): its request ends with that
        except Exception:
            # A fault of the proxy's own: as the lane's boundary does, the client hears of it and the connection
            # ends; the call with it.
            log.exception("unhandled_error")
            call.pump.cancel()
            status, reusable = 200, False
            failure = error_response(message["id"], error_object(INTERNAL_ERROR, "Internal error in the proxy"))
            reply.closing()  # the answer's head says the connection ends, so that no client sends another on it
            with contextlib.suppress(Exception):
                await reply.finish(failure, 200)
        finally:
            answered(status, reusable)

    async def _follow(self, headers: MultiMapping[str], message: dict[str, Any], call: _Call, reply: Reply[_R]) -> _R:
        try:
            while True:
                event = await call.feed.queue.get()
                if isinstance(event, Progress):
                    if event.raw is not None:
                        await reply.event(event.raw)
                elif isinstance(event, InputNeeded):
                    self._add_question(call, event)
                    await asyncio.sleep(_GATHER_S)
                    while not call.feed.queue.empty():
                        more = call.feed.queue.get_nowait()
                        if isinstance(more, InputNeeded):
                            self._add_question(call, more)
                        elif isinstance(more, Progress) and more.raw is not None:
                            await reply.event(more.raw)
                        elif isinstance(more, Failed):  # past max_input_rounds, or the call broke meanwhile
                            return await self._failed(message, call, more, reply)
                        elif isinstance(more, Finished):  # answered without the input: nothing left to ask
                            return await reply.finish(result_response(message["id"], more.result))
                    return await self._ask(headers, message, call, reply)
                elif isinstance(event, Finished):
                    return await reply.finish(result_response(message["id"], event.result))
                elif isinstance(event, Failed):
                    return await self._failed(message, call, event, reply)
        except asyncio.CancelledError:
            # The client closed its request: for a 2026 client that is the cancellation.
            call.pump.cancel()
            raise

    async def _failed(self, message: dict[str, Any], call: _Call, failed: Failed, reply: Reply[_R]) -> _R:
        if call.feed.over_limit:
            call.pump.cancel()  # the server still runs the call: closing its events posts notifications/cancelled
        status = ERROR_HTTP_STATUS.get(failed.error.get("code"), 200)
        return await reply.finish(error_response(message["id"], failed.error), status)

    def _add_question(self, call: _Call, needed: InputNeeded) -> None:
        assert needed.reply is not None
        for key, input_request in needed.input_requests.items():
            call.requests[key] = input_request
            call.replies[key] = needed.reply

    async def _ask(self, headers: MultiMapping[str], message: dict[str, Any], call: _Call, reply: Reply[_R]) -> _R:
        """The call's open questions as an MRTR round, the call parked for the client's retry."""
        binding = self._binding(headers, message)
        token = self._parked.park(call, binding)
        result = {"resultType": "input_required", "inputRequests": dict(call.requests), "requestState": token}
        try:
            return await reply.finish(result_response(message["id"], result))
        except BaseException:
            self._parked.claim(token, binding)  # never delivered: nobody could claim it, and it would hold a slot
            raise

    def _claim(self, token: Any, headers: MultiMapping[str], message: dict[str, Any]) -> _Call:
        """The parked call a requestState names; single use, and only for the caller and request it was made for."""
        call = self._parked.claim(token, self._binding(headers, message))
        if call is None:
            raise invalid_state()
        return call

    def _binding(self, headers: MultiMapping[str], message: dict[str, Any]) -> str:
        params = params_of(message)
        subject = params.get("name", params.get("uri", ""))
        caller = f"{self._identity.credential(headers)}|{self._identity.principal(headers)}"
        return f"{caller}|{message['method']}|{subject}"


def _slim(message: dict[str, Any]) -> dict[str, Any]:
    """What answering a request needs of it once it is sent: its id and method, and the name or URI its parked call
    is bound to (`SyncBridge._binding`)."""
    params = params_of(message)
    bound = {"name": params["name"]} if "name" in params else {"uri": params["uri"]} if "uri" in params else {}
    return {"jsonrpc": "2.0", "id": message["id"], "method": message["method"], "params": bound}


async def _pump(events: AsyncIterator[Event], feed: _Feed) -> None:
    try:
        async for event in events:
            await feed.put(event)
            if feed.closed:
                return  # the call failed here (too many questions): closing its events cancels it upstream
        # The events end with Finished or Failed; should they not, the follower must not wait for ever.
        await feed.put(_proxy_fault("the call's events ended without its answer"))
    except Exception:
        # A fault of the proxy's own while reading the call: the client waiting on the queue must still hear.
        log.exception("legacy_call_error")
        await feed.put(_proxy_fault("internal proxy error"))
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _proxy_fault(reason: str) -> Failed:
    """A fault of the proxy's own while reading a call: the client must still hear of it."""
    return Failed(
        error_object(INTERNAL_ERROR, "Proxy failure: internal error while following the upstream call"), reason
    )


class Reply(Protocol[_R_co]):
    """Where a bridged call's answer goes: progress as events (the first one starts an event stream), then the last
    message, as one JSON body when no event went before it. A `separable` reply may be written by another task than
    the request's (`take` says so, and returns what ends the request with its status)."""

    separable: bool

    async def event(self, message: dict[str, Any]) -> None: ...

    async def finish(self, message: dict[str, Any], status: int = 200) -> _R_co: ...

    def take(self) -> Callable[[int, bool], None]: ...

    def closing(self) -> None:
        """The connection ends after this answer: its head, when not yet written, says so."""

    def remote(self) -> str | None:
        """The client's address: who an anonymous caller is."""


class StreamReply:
    """A bridged call's answer on an aiohttp request: written by the handler's task only, which answers by
    returning."""

    separable = False

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._stream: web.StreamResponse | None = None

    def take(self) -> Callable[[int, bool], None]:
        raise NotImplementedError("aiohttp answers a request by returning from its handler")

    def closing(self) -> None:
        raise NotImplementedError("aiohttp's boundary decides how its connections end")

    def remote(self) -> str | None:
        return self._request.remote

    async def event(self, message: dict[str, Any]) -> None:
        if self._stream is None:
            self._stream = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self._stream.prepare(self._request)
        await self._stream.write(message_event(message))

    async def finish(self, message: dict[str, Any], status: int = 200) -> web.StreamResponse:
        if self._stream is None:
            return web.Response(body=dumps(message), status=status, content_type="application/json")
        await self.event(message)
        await self._stream.write_eof()
        return self._stream
