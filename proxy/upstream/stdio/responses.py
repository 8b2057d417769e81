"""What a stdio child writes for one client request, as a Streamable HTTP server would answer it: JSON when the
child's answer comes first, else an event stream (progress, a log line or a request of the child's came first).

A request of the child's for the call is shown to a 2025-era client under an id of the proxy's, or declined here
when that client cannot take it; a 2026-07-28 child asks with input_required, never with a request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Callable
from typing import Any

import structlog
from aiohttp import web

from ...clients.envelope import params_of
from ...clients.sessions2025 import FrontSession
from ...jsonrpc import ERROR_HTTP_STATUS, INTERNAL_ERROR, dumps, error_object, error_response
from ..era2025 import declined_answer
from ..events import AnswerTooLarge
from ..http.answer import client_gone_key
from ..http.sse import KEEP_ALIVE, message_event
from .exchange import Exchange
from .pool import StdioPool

log = structlog.get_logger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Rewrite = Callable[[dict[str, Any]], None]


class ResponseWriter:
    """The responses to client requests relayed to one pool of stdio children."""

    def __init__(self, pool: StdioPool, *, max_bytes: Callable[[], int]) -> None:
        self._pool = pool
        self._max_bytes = max_bytes
        self._shown_ids = itertools.count(1)

    async def response(
        self,
        request: web.Request,
        exchange: Exchange,
        front: FrontSession | None,
        capabilities: dict[str, Any],
        *,
        rewrite: Rewrite | None,
        modern: bool,
        observe: Callable[[dict[str, Any], Exchange], None] | None = None,
    ) -> web.StreamResponse:
        """What the child writes for one request, as JSON when its answer comes first, else as an event stream.
        `observe` sees the answer (with the exchange it came on) before the client does."""
        streams = "text/event-stream" in request.headers.get("Accept", "") and rewrite is None
        stream: web.StreamResponse | None = None
        shown: list[str] = []
        try:
            async for message in exchange.messages(self._max_bytes()):
                method = message.get("method")
                if method is None:
                    message = _well_formed(message, self._pool.name)
                    if observe is not None:
                        observe(message, exchange)
                    if rewrite is not None and isinstance(message.get("result"), dict):
                        rewrite(message["result"])
                    if stream is None:
                        return json_response(message, status=_status(message) if modern else 200)
                    await write_event(request, stream, message)
                    await stream.write_eof()
                    return stream
                if "id" in message:
                    message = await self._child_request(message, front, capabilities, streams, shown)
                    if message is None:
                        continue
                elif not streams:
                    continue  # a JSON answer has no room for notifications
                if stream is None:
                    stream = web.StreamResponse(headers=SSE_HEADERS)
                    await stream.prepare(request)
                if not await write_event(request, stream, message):
                    return stream
        except AnswerTooLarge:
            reason = f"the stdio server's answer exceeds limits.max_result_bytes ({self._max_bytes()})"
            error = error_response(exchange.caller_id, error_object(INTERNAL_ERROR, f"Proxy failure: {reason}"))
            if stream is None:
                return json_response(error, status=500 if modern else 200)
            await write_event(request, stream, error)
            return stream
        finally:
            exchange.close()
            if front is not None:
                for shown_id in shown:
                    front.asked.pop(shown_id, None)
        return stream or web.Response(status=502)  # pragma: no cover - messages() ends with the answer

    async def _child_request(
        self,
        message: dict[str, Any],
        front: FrontSession | None,
        capabilities: dict[str, Any],
        streams: bool,
        shown: list[str],
    ) -> dict[str, Any] | None:
        """A request of the child's for this call: shown to the client under an id of the proxy's, or answered here
        (declined) when the client cannot take it. None when answered here."""
        method, params = message["method"], params_of(message)
        answer = declined_answer(method, capabilities, params) if front is not None else None
        if front is None:
            reason = "a 2026-07-28 server asks for input with input_required, never with a request"
            answer = {"error": error_object(INTERNAL_ERROR, f"The proxy cannot relay this {method} request: {reason}")}
        elif answer is None and not streams:
            answer = declined_answer(method, {}, params)  # a JSON answer cannot carry the question
        shown_id = f"mtp-s{next(self._shown_ids)}"
        if answer is None and front is not None and not front.remember_asked(shown_id, message["id"]):
            answer = {"error": error_object(INTERNAL_ERROR, "The proxy cannot relay this request: too many pending")}
        if answer is not None:
            await self._pool.respond(message["id"], answer)
            return None
        shown.append(shown_id)
        return {**message, "id": shown_id}


async def listen_messages(exchange: Exchange, limit: int) -> AsyncGenerator[dict[str, Any], None]:
    try:
        async for message in exchange.messages(limit):
            if message.get("method") is None:
                return
            yield message
    except AnswerTooLarge:
        log.info("upstream_subscription_ended", reason="a notification over limits.max_result_bytes")
    finally:
        exchange.close()


async def write_event(request: web.Request, stream: web.StreamResponse, message: dict[str, Any]) -> bool:
    try:
        await stream.write(message_event(message))
    except ConnectionResetError:
        request[client_gone_key] = True
        return False
    return True


_KEEPALIVE_S = 15.0


async def serve_stream(
    request: web.Request, front: FrontSession, queue: asyncio.Queue[dict[str, Any] | None]
) -> web.StreamResponse:
    """A 2025 session's GET stream of the proxy's (front.open_stream()): what is pushed to `queue`, a keep-alive
    comment when nothing is, until None ends it or the client goes."""
    stream = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await stream.prepare(request)
        while True:
            try:
                message = await asyncio.wait_for(queue.get(), _KEEPALIVE_S)
            except TimeoutError:
                await stream.write(KEEP_ALIVE)
                continue
            if message is None:
                break
            if not await write_event(request, stream, message):
                return stream
        await stream.write_eof()
    except ConnectionResetError:
        request[client_gone_key] = True
    finally:
        front.streams.pop(queue, None)
    return stream


def json_response(message: dict[str, Any], *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(message), status=status, content_type="application/json", headers=headers)


def _well_formed(message: dict[str, Any], upstream: str) -> dict[str, Any]:
    """The child's response as a client may take it: a result object, or an error with an integer code and a
    message; anything else becomes the proxy's -32603 saying so."""
    error, result = message.get("error"), message.get("result")
    if "error" in message and "result" not in message and isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool) and isinstance(error.get("message"), str):
            return message
    elif "result" in message and "error" not in message and isinstance(result, dict):
        return message
    return error_response(message.get("id"), upstream_failure("the stdio server's response is malformed", upstream))


def _status(message: dict[str, Any]) -> int:
    error = message.get("error")
    return ERROR_HTTP_STATUS.get(error.get("code"), 200) if isinstance(error, dict) else 200


def upstream_failure(reason: str, upstream: str) -> dict[str, Any]:
    return error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": upstream})
