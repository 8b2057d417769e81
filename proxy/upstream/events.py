"""A call to the upstream as the rest of the proxy reads it, whatever the transport and era: Progress, then Finished
or Failed; InputNeeded when the server asks for input mid-call."""

from __future__ import annotations

import dataclasses
import email.utils
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Literal

from ..jsonrpc import INTERNAL_ERROR, error_object


class AnswerTooLarge(Exception):
    """An answer (a body, an event, a line) over the limit the reader was given: not read on."""


class UpstreamStartError(Exception):
    """A stdio server could not be started at all (a missing program, a bad working directory)."""


class RequestUnsent(ConnectionError):
    """The request never reached the upstream (no connection could be made): sending it again runs nothing twice."""


class CallCut(ConnectionError):
    """The upstream went away with the call in it (a stdio child that exited): it may have run, or not. `error` is
    the JSON-RPC error that says so."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "")))
        self.error = error


class UpstreamUnavailable(Exception):
    """The upstream could not be reached or refused the proxy's own handshake."""


class NotMcp(UpstreamUnavailable):
    """The upstream answers, but as no MCP server of either era would: a wrong path (404), a web page, another API.
    The message says what each probe got."""


class CredentialsNeeded(UpstreamUnavailable):
    """The upstream wants credentials even to say which era it speaks (HTTP 401/403): an MCP server all the same,
    whose era a client's request, with its credentials, tells."""


@dataclasses.dataclass(frozen=True, slots=True)
class UpstreamTask:
    """A 2025 server's own task for a call, and the session it belongs to (servers bind tasks to one)."""

    task_id: str
    session_id: str | None
    protocol_version: str


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    message: str | None
    progress: float | None = None
    total: float | None = None
    raw: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    """The notification as the upstream sent it, for relaying to a synchronous caller."""
    upstream_task: UpstreamTask | None = None
    """The server made the call a SEP-1686 task of its own: a replica taking the call over follows it instead of
    running the call again (proxy/tasks/takeover.py)."""

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
    transient: Transient | None = None
    """Why a new attempt may succeed where this one failed: "unsent" when the request never left (a refused
    connection: any call may be sent again), "unanswered" when it may have reached the server but no answer came
    (a reset before the first byte, 429/502/503/504, a stdio child that exited: only a rule marked idempotent
    runs again)."""
    retry_after_s: float | None = None
    """The server's Retry-After, when it gave one."""
    refused_credentials: bool = False
    """The upstream answered HTTP 401: the call's credential, not its work, failed (the call did not run)."""
    challenge: str | None = None
    """With refused_credentials, the upstream's WWW-Authenticate, for a client that can answer it."""


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


Transient = Literal["unsent", "unanswered"]
RETRIED_STATUSES = frozenset({429, 502, 503, 504})
"""HTTP statuses that say "not now" rather than "no" (a gateway, a load balancer, a server shedding load)."""


def failure_reason(error: dict[str, Any]) -> str:
    """What went wrong, from an error the proxy made ("Upstream failure: <reason>"): the reason alone, which the
    error that carries it on adds its own prefix to."""
    return str(error.get("message", "")).removeprefix("Upstream failure: ")


def cut_failure(error: dict[str, Any]) -> Failed:
    """The upstream went away with the call in it (the stdio channel's answer when its child exited): the error as
    the channel made it, and the call may be sent again for an idempotent rule."""
    return Failed(error, failure_reason(error), unread=True, transient="unanswered")


def proxy_failure(
    reason: str, upstream: str, *, transient: Transient | None = None, retry_after_s: float | None = None
) -> Failed:
    error = error_object(INTERNAL_ERROR, f"Upstream failure: {reason}", {"upstream": upstream})
    return Failed(error, reason, True, transient, retry_after_s)


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After field (RFC 9110 §10.2.3): delay-seconds, or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit() alone takes "²", which float() refuses
        return float(value)  # huge is fine: a wait past the round's timeout ends the retries
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    if moment.tzinfo is None:
        return None
    return max((moment - datetime.now(UTC)).total_seconds(), 0.0)


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
