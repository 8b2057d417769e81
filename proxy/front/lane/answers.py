"""Serving one request the lane took: relayed as received, bridged to a 2025-era upstream, or the proxy's own
(tasks/* and task creation), behind the same boundary as aiohttp's (proxy/front/app.py): a wire error for what can be
answered, the request's metrics and log line, and no traceback for anyone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from multidict import CIMultiDict

from ...clients.envelope import tool_name
from ...config import ToolRule
from ...jsonrpc import UpstreamError, result_response
from ...upstream.http.answer import relay_answer
from ...upstream.http.headers import relayed_request_fields
from .. import boundary
from ..context import MCP_PATH, RequestInfo
from ..creation import create
from .writer import LaneReply, LaneWriter, RelayedAnswer

if TYPE_CHECKING:
    from .server import Lane

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class LaneRequest:
    """A whole request the lane serves itself, checked (proxy/front/lane/connection.py)."""

    kind: str
    """"modern" (relayed as received, but for a tasks declaration), "as_is" (a 2025 client's, relayed as
    received), "legacy" (bridged) or "owned" (the proxy's: tasks/*, task creation)."""
    headers: CIMultiDict[str]
    body: bytes
    message: dict[str, Any] | None
    """Let go of (None) once the answer needs no more of it: a relayed stream may last as long as the call."""
    fields: tuple[tuple[bytes, bytes], ...]
    query: bytes
    rule: ToolRule | None
    """The policy's rule for a tools/call's tool, when the request is "owned"."""


async def answer(
    lane: Lane, out: LaneWriter, request: LaneRequest, *, keep_alive: bool, then: Callable[[bool], None]
) -> None:
    """Answer `request` on `out` behind the front door's boundary (proxy/front/boundary.py), then call `then` with
    whether the connection may carry another request."""
    headers, message = request.headers, request.message
    assert message is not None
    boundary.bind_request(headers)
    started = time.perf_counter()
    info = RequestInfo(jsonrpc_id=message["id"], rpc_method=message["method"])
    info.tool = tool_name(message)  # for the log line and the metrics: the message is not kept that long
    boundary.trace(info, headers, message)
    del message  # `request` holds it, for as long as the kind's own answer needs it
    status = 500
    reply = None
    try:
        if boundary.limited(lane.rates, lane.concurrency):
            remote = out.remote()
            await boundary.apply_limits(lane.rates, lane.concurrency, lane.identity, headers, request.message, remote,
                                        info, lane.policy.config.rule_for)  # fmt: skip
        if request.kind == "owned":
            status = await _owned(lane, out, request, info, keep_alive=keep_alive)
        elif request.kind == "legacy":
            info.mode = "legacy"

            def answered_elsewhere(final: int, reusable: bool) -> None:
                _account(lane, info, headers, final, started)
                then(keep_alive and reusable)

            # The bridge may answer the client from another task and read the call on in this one (bridge.py),
            # for as long as it waits parked: the body, parsed, is not held that long.
            request.body = b""
            reply = LaneReply(out, keep_alive, answered_elsewhere)
            status = await lane.bridge.relay(headers, _taken(request), reply)
        else:
            status = await _relay(lane, out, request, keep_alive=keep_alive)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception as exc:  # no client sees a traceback
        if reply is not None and reply.taken:  # answered by another task: the connection may serve another request
            if not isinstance(exc, ConnectionResetError):
                log.exception("unhandled_error", exc_info=exc)
            return
        if out.head_sent:  # mid-answer: the client sees it broken, never a second head
            keep_alive = False
            if isinstance(exc, ConnectionResetError) and out.transport is None:
                status = 499
            else:
                log.exception("unhandled_error", exc_info=exc)
        else:
            answered = boundary.failure(exc, info, lane.metrics, client_gone=out.transport is None)
            if answered is None:
                status = 499
            else:
                error, status, fault = answered
                keep_alive = keep_alive and not fault
                out.error(info.jsonrpc_id, error, status, keep_alive=keep_alive, retry_after=boundary.retry_after(exc))
    finally:
        if reply is None or not reply.taken:
            _account(lane, info, headers, status, started)
    if reply is None or not reply.taken:
        then(keep_alive)


def _taken(request: LaneRequest) -> dict[str, Any]:
    """The request's message, which `request` no longer holds: passed on, never a local of a frame that waits as
    long as the call runs."""
    message, request.message = request.message, None
    assert message is not None
    return message


def _taken_body(request: LaneRequest) -> bytes:
    """The request's body, which `request` no longer holds."""
    body, request.body = request.body, b""
    return body


def _account(lane: Lane, info: RequestInfo, headers: CIMultiDict[str], status: int, started: float) -> None:
    boundary.done(
        info,
        policy=lane.policy,
        metrics=lane.metrics,
        identity=lane.identity,
        headers=headers,
        http_method="POST",
        path=MCP_PATH,
        status=status,
        started=started,
    )


async def _owned(lane: Lane, out: LaneWriter, request: LaneRequest, info: RequestInfo, *, keep_alive: bool) -> int:
    """tasks/* and a task-creating tools/call, as proxy/front/dispatch.py serves them."""
    message = request.message
    assert message is not None
    if request.rule is None:
        info.mode = "local"
        result = await lane.tasks2026.handle(request.headers, message, info)
        out.json(result_response(message["id"], result), 200, keep_alive=keep_alive)
        return 200
    info.tool = message["params"]["name"]
    reply, status = await create(lane.runner, lane.identity, message, request.headers, request.body, out.remote(),
                                 request.rule, info)  # fmt: skip
    out.json(reply, status, keep_alive=keep_alive)
    return status


async def _relay(lane: Lane, out: LaneWriter, request: LaneRequest, *, keep_alive: bool) -> int:
    upstream = lane.gateway.relay.upstream  # type: ignore[attr-defined]  # an HttpRelay: Lane.route
    request_id = request.message["id"]  # type: ignore[index]
    request.message = None  # parsed, about ten times the body's size: not held while the call runs
    try:
        fields = relayed_request_fields(request.fields, request.headers)
        # The body is the POST's alone (it lets go of it once sent): an upstream that answers JSON answers when the
        # tool ends, and this frame waits until then.
        response = await upstream.post(fields, _taken_body(request), query=request.query.decode(), relay=True)
    except (OSError, ValueError) as exc:  # CallError included; ValueError: a header that cannot be sent
        raise UpstreamError(f"upstream unreachable ({exc})", upstream=upstream.url) from exc
    try:
        await relay_answer(response, RelayedAnswer(out, keep_alive), request_id, upstream.url)
        return response.status
    finally:
        response.close()  # pooled when read to its end, else closed: the upstream sees a cancel
