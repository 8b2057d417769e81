"""The 2026-07-28 era's rules, whatever the transport: the era probe, and a call's answer read as events."""

from __future__ import annotations

from typing import Any

from .. import PROTOCOL_VERSION, __version__
from .events import Event, Failed, Finished, InputNeeded, interpret_progress, proxy_failure

PROBE_ID = "mtp-discover"


def discover_probe() -> dict[str, Any]:
    """server/discover with the proxy's own envelope: a 2026 server answers a DiscoverResult, a 2025 one an error."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "mcp-tasks-proxy", "version": __version__},
    }
    return {"jsonrpc": "2.0", "id": PROBE_ID, "method": "server/discover", "params": {"_meta": meta}}


def is_discover_result(answer: dict[str, Any] | None) -> bool:
    result = answer.get("result") if isinstance(answer, dict) else None
    return isinstance(result, dict) and "supportedVersions" in result


def interpret(message: Any, request_id: Any, how: str, size: int, upstream: str) -> Event | None:
    """One message of a call's answer as an event; None for what is not part of the call (other notifications).
    `how` names the answer for errors ("HTTP 200", "stdio")."""
    if not isinstance(message, dict):
        return proxy_failure("the upstream sent something that is not a JSON-RPC message", upstream)
    method = message.get("method")
    if method == "notifications/progress":
        return interpret_progress(message)
    if isinstance(method, str):
        if "id" in message:
            # A server-to-client request (a legacy server's elicitation, sampling, roots) cannot be answered here.
            return proxy_failure(f"the upstream sent a {method} request, which this proxy cannot relay", upstream)
        return None  # other notifications (logging) are not part of a task
    if message.get("id") != request_id:
        return proxy_failure("the upstream answered a different request id", upstream)
    if isinstance(message.get("error"), dict):
        error = message["error"]
        return Failed(error, f"the upstream answered with JSON-RPC error {error.get('code')}")
    result = message.get("result")
    if not isinstance(result, dict):
        return proxy_failure(f"the upstream's {how} response has no result object", upstream)
    if result.get("resultType") == "input_required":
        if not isinstance(result.get("inputRequests", {}), dict) or not (
            result.get("inputRequests") or isinstance(result.get("requestState"), str)
        ):
            return proxy_failure(
                "the upstream's input_required result has neither inputRequests nor requestState", upstream
            )
        return InputNeeded(result)
    return Finished(result, size)
