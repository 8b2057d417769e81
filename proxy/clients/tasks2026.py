"""SEP-2663 `tasks/get`, `tasks/update` and `tasks/cancel`, answered by the proxy from its own tasks.

Another principal's task answers exactly as an unknown one: nothing reveals that it exists.
"""

from __future__ import annotations

from typing import Any

from multidict import MultiMapping

from .. import TASKS_EXTENSION
from ..jsonrpc import INVALID_PARAMS, METHOD_NOT_FOUND, MISSING_REQUIRED_CLIENT_CAPABILITY, JsonRpcError
from ..security import Identity, PollGuard
from ..store.base import TaskStore
from ..tasks.model import is_task_id
from ..tasks.runner import TaskRunner
from .envelope import TASK_METHODS, check_modern_request, declares_tasks, params_of


def missing_tasks_capability(message: str) -> JsonRpcError:
    return JsonRpcError(
        MISSING_REQUIRED_CLIENT_CAPABILITY,
        message,
        {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
    )


class Tasks2026:
    def __init__(self, runner: TaskRunner, store: TaskStore, identity: Identity, poll_guard: PollGuard) -> None:
        self._runner = runner
        self._store = store
        self._identity = identity
        self._poll_guard = poll_guard

    async def handle(self, headers: MultiMapping[str], message: dict[str, Any], info: Any) -> dict[str, Any]:
        """tasks/get, tasks/update, tasks/cancel (SEP-2663); the removed tasks/result and tasks/list are unknown.
        `info` is the request's log record: the task and tool are written to it."""
        method = message["method"]
        check_modern_request(message, headers)
        if method not in TASK_METHODS:
            raise JsonRpcError(METHOD_NOT_FOUND, f"Method not found: {method}")
        if not declares_tasks(message):
            raise missing_tasks_capability(
                f"{method} needs the {TASKS_EXTENSION} extension declared in this request's "
                '_meta["io.modelcontextprotocol/clientCapabilities"].extensions'
            )
        params = params_of(message)
        task_id = params.get("taskId")
        if not isinstance(task_id, str):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: taskId must be a string")
        responses = params.get("inputResponses")
        if method == "tasks/update" and (
            not isinstance(responses, dict) or not all(isinstance(answer, dict) for answer in responses.values())
        ):
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: inputResponses must be an object of result objects")
        if not is_task_id(task_id):
            raise _not_found()
        info.task_id = task_id
        runner = self._runner
        # Another principal's task answers exactly as an unknown one: nothing reveals that it exists. For update and
        # cancel the owner is checked inside the store's atomic update, which spares a read.
        principal = self._identity.principal(headers)
        if method == "tasks/get":
            record = await self._store.get(task_id)
            if record is None or record.principal != principal:
                raise _not_found()
            info.tool, info.task_trace = record.tool, record.trace
            self._poll_guard.check(task_id, record.poll_interval_ms)
            await runner.credentials.shown(record, headers)
            return {**record.to_wire(), "resultType": "complete"}
        if method == "tasks/update":
            assert isinstance(responses, dict)
            # Answers to keys that are not outstanding are ignored (SEP-2663); the ack is eventually consistent.
            record = await runner.deliver_input(task_id, responses, principal)
        else:
            record = await runner.cancel(task_id, principal)
        if record is None:
            raise _not_found()
        info.tool, info.task_trace = record.tool, record.trace
        await runner.credentials.shown(record, headers)
        return {"resultType": "complete"}


def _not_found() -> JsonRpcError:
    # SEP-2663: an unknown or expired task id is -32602.
    return JsonRpcError(INVALID_PARAMS, "Task not found: the task id is unknown or has expired")
