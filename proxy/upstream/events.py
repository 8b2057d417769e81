"""A call to the upstream as the rest of the proxy reads it, whatever the transport and era: Progress, then Finished
or Failed; InputNeeded when the server asks for input mid-call."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from ..jsonrpc import INTERNAL_ERROR, error_object


class AnswerTooLarge(Exception):
    """An answer (a body, an event, a line) over the limit the reader was given: not read on."""


class UpstreamStartError(Exception):
    """A stdio server could not be started at all (a missing program, a bad working directory)."""


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or refused the proxy's own handshake."""


class NotMcp(UpstreamUnavailable):
    """The upstream answers, but as no MCP server of either era would: a wrong path (404), a web page, another API.
    The message says what each probe got."""


class CredentialsNeeded(UpstreamUnavailable):
    """The upstream wants credentials even to say which era it speaks (HTTP 401/403): an MCP server all the same,
    whose era a client's request, with its credentials, tells."""


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    message: str | None
    progress: float | None = None
    total: float | None = None
    raw: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    """The notification as the upstream sent it, for relaying to a synchronous caller."""

    def describe(self) -> str | None:
        if self.message:
            return self.message
        if self.progress is None:
            return None
        if self.total:
            return f"{self.progress:g} of {self.total:g}"
        return f"{self.progress:g}"


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    result: dict[str, Any]
    size: int = 0
    """Bytes of the message that carried it, as received (what limits.max_result_bytes bounds)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    error: dict[str, Any]
    """A JSON-RPC error object: the upstream's own, or -32603 made by the proxy."""
    status_message: str
    unread: bool = False
    """The proxy could not read the upstream's answer (unreachable, stream cut): the work may go on upstream."""


@dataclasses.dataclass(frozen=True, slots=True)
class InputNeeded:
    """A 2026-07-28 upstream answered `input_required` (MRTR): answer `input_requests`, echo `request_state`."""

    result: dict[str, Any]
    """The upstream's InputRequiredResult as it came (a legacy server's request is put in the same shape)."""
    reply: Callable[[dict[str, Any]], Awaitable[None]] | None = dataclasses.field(default=None, compare=False)
    """Legacy upstreams only: posts the answer back on the open call, which then goes on; modern ones get a retry."""

    @property
    def input_requests(self) -> dict[str, Any]:
        requests = self.result.get("inputRequests")
        return requests if isinstance(requests, dict) else {}

    @property
    def request_state(self) -> str | None:
        state = self.result.get("requestState")
        return state if isinstance(state, str) else None


Event = Progress | Finished | Failed | InputNeeded


def proxy_failure(reason: str, upstream: str) -> Failed:
    return Failed(error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": upstream}), reason, True)


def too_large(limit: int) -> Failed:
    """The upstream's answer (a body, or one event of its stream) is over limits.max_result_bytes: the read stopped
    there, and the call with it."""
    reason = f"the upstream's answer exceeds limits.max_result_bytes ({limit})"
    return Failed(error_object(INTERNAL_ERROR, f"Proxy failure: {reason}"), reason)


def interpret_progress(message: dict[str, Any]) -> Progress:
    params = message.get("params") if isinstance(message.get("params"), dict) else {}
    text = params.get("message")
    return Progress(
        message=text if isinstance(text, str) else None,
        progress=_number(params.get("progress")),
        total=_number(params.get("total")),
        raw=message,
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
