"""The upstream's tools as its tools/list says, read page by page through the gateway (whatever the era)."""

from __future__ import annotations

from typing import Any

import structlog
from multidict import CIMultiDict, MultiMapping

from .. import PROTOCOL_VERSION
from .events import Failed, Finished, UpstreamUnavailable
from .gateway import Gateway

log = structlog.get_logger(__name__)

MAX_TOOL_PAGES = 100


async def list_tools(
    gateway: Gateway, *, max_bytes: int, credentials: MultiMapping[str] | None = None
) -> list[dict[str, Any]]:
    """Every tool the upstream lists, following nextCursor for MAX_TOOL_PAGES pages at most; `credentials` are the
    caller's headers whose Authorization goes with the request. Raises UpstreamUnavailable (NotMcp,
    CredentialsNeeded: what the era probe found, as it is, not as a failed call)."""
    headers: CIMultiDict[str] = CIMultiDict({"MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": "tools/list"})
    if credentials is not None and "Authorization" in credentials:
        headers["Authorization"] = credentials["Authorization"]
    await gateway.era(headers)
    tools: list[dict[str, Any]] = []
    cursor = None
    for page in range(MAX_TOOL_PAGES):
        params: dict[str, Any] = {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
                "io.modelcontextprotocol/clientCapabilities": {},
            }
        }
        if cursor is not None:
            params["cursor"] = cursor
        message = {"jsonrpc": "2.0", "id": f"tools-{page}", "method": "tools/list", "params": params}
        result = None
        async for event in gateway.call_tool(message, headers, {}, max_bytes=max_bytes):
            if isinstance(event, Finished):
                result = event.result
            elif isinstance(event, Failed):
                raise UpstreamUnavailable(event.status_message)
        if result is None:
            raise UpstreamUnavailable("no tools/list result")
        tools.extend(tool for tool in result.get("tools", []) if isinstance(tool, dict) and "name" in tool)
        cursor = result.get("nextCursor")
        if not cursor:
            return tools
    log.warning("tools_list_truncated", pages=MAX_TOOL_PAGES, tools=len(tools))
    return tools
