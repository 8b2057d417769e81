"""A translated 2025 session's GET stream (clients/translated2025.py): what a `subscriptions/listen` of the proxy's
brings (the server's list changes, updates of the resources the session subscribed to), opened again when the
session's subscriptions change, and a while after the server ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from ..jsonrpc import JsonRpcError, UpstreamError, dumps
from ..upstream.stdio.responses import serve_stream
from .sessions2025 import FrontSession
from .translation2025 import META_SUBSCRIPTION_ID, as_2026, headers_2026

if TYPE_CHECKING:
    from ..upstream.gateway import Relay

log = structlog.get_logger(__name__)


async def session_stream(
    request: web.Request, front: FrontSession, relay: Relay, max_bytes: Callable[[], int]
) -> web.StreamResponse:
    queue = front.open_stream()
    listening = asyncio.ensure_future(_listen(request, front, queue, relay, max_bytes))
    try:
        return await serve_stream(request, front, queue)
    finally:
        listening.cancel()


async def _listen(
    request: web.Request,
    front: FrontSession,
    queue: asyncio.Queue[Any],
    relay: Relay,
    max_bytes: Callable[[], int],
) -> None:
    """What the session's GET stream carries, from a subscriptions/listen of the proxy's, opened again when the
    session's subscriptions change, and after _RELISTEN_S when the server ends it."""
    while True:
        changed = front.resubscribed
        message = _listen_request(front)
        try:
            messages = await relay.open_listen(
                request, dumps(message), limit=max_bytes(), headers=headers_2026(message, request.headers)
            )
        except (JsonRpcError, UpstreamError) as exc:
            log.info("translated_listen_refused", reason=str(exc))
            messages = None
        waiting = asyncio.ensure_future(changed.wait())
        try:
            if messages is not None:
                following = asyncio.ensure_future(_follow(messages, queue))
                await asyncio.wait([following, waiting], return_when=asyncio.FIRST_COMPLETED)
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await following
            if not changed.is_set():
                await asyncio.wait([waiting], timeout=_RELISTEN_S)
        finally:
            waiting.cancel()


def _listen_request(front: FrontSession) -> dict[str, Any]:
    notifications: dict[str, Any] = dict.fromkeys(_LIST_CHANGES, True)
    if front.subscribed:
        notifications["resourceSubscriptions"] = sorted(front.subscribed)
    listen = {"jsonrpc": "2.0", "id": f"mtp-listen-{front.id[:8]}", "method": "subscriptions/listen",
              "params": {"notifications": notifications}}  # fmt: skip
    return as_2026(listen, front)


_LIST_CHANGES = ("toolsListChanged", "promptsListChanged", "resourcesListChanged")
_RELAYED = frozenset({"notifications/tools/list_changed", "notifications/prompts/list_changed",
                      "notifications/resources/list_changed", "notifications/resources/updated"})  # fmt: skip
_RELISTEN_S = 5.0
"""How long after the server ends a session's subscription the proxy asks for it again."""


async def _follow(messages: AsyncGenerator[dict[str, Any], None], queue: asyncio.Queue[Any]) -> None:
    """The subscription's notifications a 2025 client knows, without the 2026 subscription id, into the stream's
    queue (its oldest dropped when it is full: they say "something changed")."""
    try:
        async for message in messages:
            if message.get("method") not in _RELAYED:
                continue  # the acknowledgement, the listen's end
            params = message.get("params")
            params = dict(params) if isinstance(params, dict) else {}
            meta = params.pop("_meta", None)
            if isinstance(meta, dict) and (rest := {k: v for k, v in meta.items() if k != META_SUBSCRIPTION_ID}):
                params["_meta"] = rest
            if queue.full():
                queue.get_nowait()
            queue.put_nowait({"jsonrpc": "2.0", "method": message["method"], **({"params": params} if params else {})})
    finally:
        await messages.aclose()
