"""Kept-alive calls: a 2026-07-28 client without the tasks extension, whose long call is answered on a response
stream kept alive until the call ends.

Without an idempotency key the call runs as inside an endless sync window: closing the request cancels it, as for
any 2026 call, and an MRTR round is the upstream's own (or a parked one, proxy/tasks/sync_rounds.py).

With a key the call runs as a task of its own (kind "kept"), so that it outlives its request: the client that lost
the answer sends the call again with the key, on any replica, and waits for the same call
(proxy/clients/durable_stream.py follows its record). Input the call needs comes to the client as an MRTR
`input_required` answer whose `requestState` names the task, MAC'd with the replicas' shared key and bound to the caller
and the tool; the client's retry with that state delivers its answers to the task (as `tasks/update` would) and waits
on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import web

from ..config import ToolRule
from ..jsonrpc import (
    ERROR_HTTP_STATUS,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    JsonRpcError,
    dumps,
    error_object,
    error_response,
    result_response,
)
from ..security import Identity, same_mac
from ..store.base import TaskStore
from ..tasks.job import DirectOutcome, ToolCall
from ..tasks.model import TaskRecord, is_task_id
from ..tasks.runner import TaskRunner
from ..upstream.events import Progress
from ..upstream.http.sse import KEEP_ALIVE, message_event
from . import idempotency
from .durable_stream import STREAM_HEADERS, DurableStream
from .envelope import params_of, progress_token
from .parking import invalid_state

log = structlog.get_logger(__name__)

KIND = "kept"
"""The kind of task a keyed kept-alive call makes (Identity.keyed_task_id): not the same task as a key's of a
client that declares the tasks extension, which is answered otherwise."""
STATE_PREFIX = "mtp1k"
"""requestState of a keyed kept-alive call's input round: `mtp1k.<task id>.<mac>`."""
_MAX_QUEUED_PROGRESS = 64
"""Progress of a kept-alive call not yet written to its client; more is dropped (the next one says as much)."""
_ENDLESS_WINDOW_MS = 30 * 24 * 3600 * 1000
"""A kept-alive call's sync window: longer than any call may take (timeout_s bounds each attempt)."""


class KeptAliveCalls:
    def __init__(self, runner: TaskRunner, store: TaskStore, identity: Identity) -> None:
        self._runner = runner
        self._store = store
        self._identity = identity

    async def serve(
        self, request: web.Request, message: dict[str, Any], call: ToolCall, rule: ToolRule, key: str | None
    ) -> web.StreamResponse:
        """The call (`call`, as it goes upstream), its key's task, or the input round its requestState names."""
        state = params_of(message).get("requestState")
        if isinstance(state, str) and state.startswith(STATE_PREFIX + "."):
            return await self._answered(request, message, call, rule, state)
        if key is None:
            return await self._unkeyed(request, message["id"], call, rule)
        call.task_id = self._identity.keyed_task_id(call.principal, call.tool, key, KIND)
        call.fingerprint = idempotency.fingerprint(call.tool, params_of(message).get("arguments"))
        record = await self._runner.submit_keyed(call, rule, key)
        # (A retry of the key finds the task as it stands: running, waiting for input, or over.)
        log.info("kept_alive_call_keyed", task_id=record.task_id, tool=record.tool, status=record.status.value)
        return await self._follow(request, message, call, rule, record)

    async def _answered(
        self, request: web.Request, message: dict[str, Any], call: ToolCall, rule: ToolRule, state: str
    ) -> web.StreamResponse:
        """The client's retry of an input round: its answers go to the task, and the call is followed on."""
        _, task_id, mac = (state.split(".") + ["", ""])[:3]
        if not (is_task_id(task_id) and same_mac(mac, self._mac(task_id, call))):
            raise invalid_state()
        answers = params_of(message).get("inputResponses")
        if not isinstance(answers, dict) or not all(isinstance(answer, dict) for answer in answers.values()):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: inputResponses must be an object of result objects")
        record = await self._runner.deliver_input(task_id, answers, call.principal)
        if record is None:  # gone (its TTL ended) or another caller's
            raise invalid_state()
        return await self._follow(request, message, call, rule, record)

    async def _follow(
        self, request: web.Request, message: dict[str, Any], call: ToolCall, rule: ToolRule, record: TaskRecord
    ) -> web.StreamResponse:
        kept: dict[str, Any] = {"id": message["id"], "resumable": False, "mrtr": self._state(record.task_id, call)}
        token = progress_token(message)
        if token is not None:
            kept["token"] = token
        stream = DurableStream(self._runner, self._store, keepalive_s=rule.keepalive_s, max_stream_s=rule.max_stream_s)
        return await stream.serve(request, record, None, kept=kept)

    def _state(self, task_id: str, call: ToolCall) -> str:
        return f"{STATE_PREFIX}.{task_id}.{self._mac(task_id, call)}"

    def _mac(self, task_id: str, call: ToolCall) -> str:
        # Bound to who asked and for which tool: a state another caller obtained answers nothing for them.
        return self._identity.mac("kept-input", task_id, call.credential, call.principal, call.tool)

    async def _unkeyed(
        self, request: web.Request, request_id: Any, call: ToolCall, rule: ToolRule
    ) -> web.StreamResponse:
        """Without a key: the call runs as inside a sync window that lasts as long as the call may (its outcome, or
        an MRTR round, is the answer), and the response stream is kept alive meanwhile. Closing the request
        cancels the call, as for any 2026 call."""
        window = rule.model_copy(update={"sync_window_ms": _ENDLESS_WINDOW_MS})
        token = progress_token(call.message)
        progressed: asyncio.Queue[Progress] = asyncio.Queue(maxsize=_MAX_QUEUED_PROGRESS)
        if token is not None:
            call.on_progress = lambda event: None if progressed.full() else progressed.put_nowait(event)
        outcome_of = asyncio.ensure_future(self._runner.submit(call, window))
        response: web.StreamResponse | None = None
        sent = 0.0
        next_progress: asyncio.Future[Progress] | None = None
        try:
            while True:
                next_progress = asyncio.ensure_future(progressed.get())
                done, _ = await asyncio.wait(
                    [outcome_of, next_progress], timeout=rule.keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if outcome_of in done:
                    next_progress.cancel()
                    break
                if response is None:
                    response = web.StreamResponse(headers=STREAM_HEADERS)
                    await response.prepare(request)
                if token is None:
                    await response.write(KEEP_ALIVE)
                    continue
                event = next_progress.result() if next_progress in done else None
                next_progress.cancel()
                # The server's progress as it came, under the client's token; each keep-alive a hair above the last,
                # since every notification must carry a larger value than the one before.
                value = event.progress if event is not None and event.progress is not None else 0.0
                sent = round(max(value, sent + 0.001), 6)
                params: dict[str, Any] = {"progressToken": token, "progress": sent}
                if event is not None and event.total is not None:
                    params["total"] = event.total
                if event is not None and event.message:
                    params["message"] = event.message
                notification = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
                await response.write(message_event(notification))
        except asyncio.CancelledError:
            outcome_of.cancel()  # the client closed its request: inside the window, that cancels the call
            raise
        except ConnectionResetError:
            outcome_of.cancel()
            raise
        finally:
            if next_progress is not None:  # (a wait left pending would be destroyed later, and said so in the log)
                next_progress.cancel()
        if response is None:
            # Answered before the first keep-alive: a plain JSON answer (a refusal raises, as for any call).
            answer, status = _answer_of(request_id, await outcome_of)
            return web.Response(body=dumps(answer), status=status, content_type="application/json")
        try:
            answer, _ = _answer_of(request_id, outcome_of.result())
        except Exception as exc:  # the stream is open: the refusal goes on it, as the call's answer
            reason = str(exc) or type(exc).__name__
            log.warning("durable_call_refused", reason=reason)
            answer = {
                "jsonrpc": "2.0",
                "id": request_id,
                "error": error_object(INTERNAL_ERROR, f"Cannot run the call: {reason}"),
            }
        await response.write(message_event(answer))
        await response.write_eof()
        return response


def _answer_of(request_id: Any, outcome: DirectOutcome | TaskRecord) -> tuple[dict[str, Any], int]:
    """The JSON-RPC answer to a kept-alive call, and its HTTP status when it is the whole response."""
    if isinstance(outcome, TaskRecord):  # the endless window ended after all: nothing this client can follow
        outcome = DirectOutcome(error=error_object(INTERNAL_ERROR, "Proxy failure: the call outlived its window"))
    if outcome.result is not None:
        return result_response(request_id, outcome.result), 200
    assert outcome.error is not None
    return error_response(request_id, outcome.error), ERROR_HTTP_STATUS.get(outcome.error.get("code"), 200)
