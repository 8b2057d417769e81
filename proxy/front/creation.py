"""Task creation, for both readers: a 2026 client's task-creating tools/call (`route`'s "create"), the call a task or
a kept-alive call runs, the runner's refusals as JSON-RPC errors, and the answer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from multidict import MultiMapping

from ..clients import idempotency
from ..clients.envelope import (
    META_CLIENT_CAPABILITIES,
    check_modern_request,
    check_reencodable,
    meta_of,
    params_of,
    without_tasks_declaration,
)
from ..config import ToolRule
from ..jsonrpc import ERROR_HTTP_STATUS, INTERNAL_ERROR, INVALID_PARAMS, JsonRpcError, error_response, result_response
from ..security import Identity, caller_of
from ..store.base import StoreFullError
from ..tasks.admission import LimitReached
from ..tasks.job import DirectOutcome, Slots, ToolCall
from ..tasks.model import TaskRecord
from ..tasks.runner import TaskRunner
from ..upstream.http.headers import call_headers
from .context import RequestInfo


async def create(
    runner: TaskRunner,
    identity: Identity,
    message: dict[str, Any],
    headers: MultiMapping[str],
    body: bytes,
    remote: str | None,
    rule: ToolRule,
    info: RequestInfo,
) -> tuple[dict[str, Any], int]:
    """A 2026 client's task-creating tools/call (`route`'s "create", on either reader): the checks, then its task
    or its answer within the sync window, as the JSON-RPC answer and its HTTP status."""
    # Before anything else, as the reference ladder orders them: headers that disagree with the body say nothing
    # reliable about what the client wants.
    check_modern_request(message, headers)
    check_reencodable(message, body)  # the call goes upstream encoded again, from the background
    info.mode = "task"  # after the checks: a refusal is counted as "local"
    call, key = tool_call(message, headers, remote, identity, info.claim)
    outcome = await create_task(runner, identity, call, rule, key)
    return task_answer(message["id"], outcome, info)


def tool_call(
    message: dict[str, Any], headers: MultiMapping[str], remote: str | None, identity: Identity, slots: Slots | None
) -> tuple[ToolCall, str | None]:
    """The call a task (or a kept-alive call) runs for this tools/call, and the client's idempotency key. `slots`:
    the request's under the concurrency limits, which the call takes over."""
    params = params_of(message)
    arguments = params.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise JsonRpcError(INVALID_PARAMS, "Invalid params: arguments must be an object")
    # An MRTR retry (requestState) continues a call: it is no new request for a key to name.
    continued = params.get("requestState") is not None
    key = idempotency.key_of(message, headers) if not continued else None
    forwarded = without_tasks_declaration(idempotency.without_key(message))  # the proxy's key, never the upstream's
    capabilities = meta_of(forwarded).get(META_CLIENT_CAPABILITIES)
    principal = identity.principal(headers)
    call = ToolCall(
        tool=params["name"],
        message=forwarded,
        headers=call_headers(headers, identity.principal_header),
        capabilities=capabilities if isinstance(capabilities, dict) else {},
        principal=principal,
        credential=identity.credential(headers),
        caller=caller_of(principal, remote),
        slots=slots,
    )
    return call, key


async def create_task(
    runner: TaskRunner, identity: Identity, call: ToolCall, rule: ToolRule, key: str | None
) -> TaskRecord | DirectOutcome:
    """Submit a task-creating tools/call (dispatch's and the lane's): its task, or its answer within the sync
    window."""
    try:  # (not `with refusals()`: a generator's context manager costs every creation about 1 µs)
        if key is None:
            return await runner.submit(call, rule)
        call.task_id = identity.keyed_task_id(call.principal, call.tool, key, "task")
        call.fingerprint = idempotency.fingerprint(call.tool, params_of(call.message).get("arguments"))
        return await runner.submit_keyed(call, rule, key)
    except (StoreFullError, LimitReached) as exc:
        raise refused(exc) from exc


def task_answer(request_id: Any, outcome: TaskRecord | DirectOutcome, info: RequestInfo) -> tuple[dict[str, Any], int]:
    """The JSON-RPC answer to a task-creating tools/call, and its HTTP status."""
    if isinstance(outcome, TaskRecord):
        info.task_id = outcome.task_id
        return result_response(request_id, {**outcome.to_wire(), "resultType": "task"}), 200
    info.mode = "sync_window"
    if outcome.result is not None:
        return result_response(request_id, outcome.result), 200
    assert outcome.error is not None
    return error_response(request_id, outcome.error), ERROR_HTTP_STATUS.get(outcome.error.get("code"), 200)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """The runner's refusals of a new call (a full store, a limit) as the JSON-RPC error every caller gets."""
    try:
        yield
    except (StoreFullError, LimitReached) as exc:
        raise refused(exc) from exc


def refused(exc: StoreFullError | LimitReached) -> JsonRpcError:
    return JsonRpcError(INTERNAL_ERROR, f"Cannot create a task: {exc}", getattr(exc, "data", None))
