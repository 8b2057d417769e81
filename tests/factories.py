"""Canonical 2026-07-28 messages and a small HTTP client that speaks them, for end-to-end tests."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import aiohttp

PROTOCOL_VERSION = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
_ids = itertools.count(1)


def meta(*, tasks: bool = True, version: str = PROTOCOL_VERSION, **capabilities: Any) -> dict[str, Any]:
    caps: dict[str, Any] = dict(capabilities)
    if tasks:
        caps["extensions"] = {TASKS: {}}
    return {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientCapabilities": caps,
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "0"},
    }


def request(method: str, params: dict[str, Any] | None = None, *, id: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": next(_ids) if id is None else id, "method": method, "params": params or {}}


def headers_for(message: dict[str, Any]) -> dict[str, str]:
    """The SEP-2243 routing headers a 2026 client sends for this message."""
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": PROTOCOL_VERSION,
        "Mcp-Method": message["method"],
    }
    params = message.get("params") or {}
    if message["method"] in ("tools/call", "prompts/get") and isinstance(params.get("name"), str):
        headers["Mcp-Name"] = params["name"]
    elif message["method"] == "resources/read" and isinstance(params.get("uri"), str):
        headers["Mcp-Name"] = params["uri"]
    elif message["method"].startswith("tasks/") and isinstance(params.get("taskId"), str):
        headers["Mcp-Name"] = params["taskId"]
    return headers


@dataclasses.dataclass
class Reply:
    status: int
    headers: Any
    body: bytes
    message: Any
    """The JSON-RPC message: the body itself, or the last data event of an event stream."""
    events: list[Any]
    """Every data event of an event stream (empty for a JSON body)."""

    @property
    def result(self) -> Any:
        assert "result" in self.message, f"expected a result, got {self.message}"
        return self.message["result"]

    @property
    def error(self) -> Any:
        assert "error" in self.message, f"expected an error, got {self.message}"
        return self.message["error"]


def parse_body(content_type: str, body: bytes) -> tuple[Any, list[Any]]:
    if content_type.startswith("text/event-stream"):
        events = []
        for block in body.decode().replace("\r\n", "\n").split("\n\n"):
            data = "\n".join(line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:"))
            if data:
                events.append(json.loads(data))
        return (events[-1] if events else None), events
    if not body:
        return None, []
    try:
        return json.loads(body), []
    except ValueError:
        return None, []


class McpClient:
    """Posts 2026-07-28 requests to one MCP endpoint over real HTTP."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, front: str = "lane") -> None:
        self.session = session
        self.url = url
        self.expect100 = front == "aiohttp"
        """Posts that expect 100-continue, which the lane hands to aiohttp with their connection: every request of
        this client is then read by aiohttp's server (tests/conftest.py `front`)."""

    async def post_raw(self, body: bytes | str, headers: dict[str, str] | None = None) -> Reply:
        async with self.session.post(self.url, data=body, headers=headers or {}, expect100=self.expect100) as response:
            raw = await response.read()
            message, events = parse_body(response.headers.get("Content-Type", ""), raw)
            return Reply(response.status, response.headers, raw, message, events)

    async def send(self, message: dict[str, Any], *, headers: dict[str, str] | None = None) -> Reply:
        merged = {**headers_for(message), **(headers or {})}
        return await self.post_raw(json.dumps(message), merged)

    async def call(self, method: str, params: dict[str, Any] | None = None, *, tasks: bool = True, **kw: Any) -> Reply:
        params = dict(params or {})
        params.setdefault("_meta", meta(tasks=tasks))
        return await self.send(request(method, params), **kw)

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, tasks: bool = True, **kw: Any
    ) -> Reply:
        return await self.call("tools/call", {"name": name, "arguments": arguments or {}}, tasks=tasks, **kw)

    async def get_task(self, task_id: str, **kw: Any) -> Reply:
        return await self.call("tasks/get", {"taskId": task_id}, **kw)

    async def cancel_task(self, task_id: str, **kw: Any) -> Reply:
        return await self.call("tasks/cancel", {"taskId": task_id}, **kw)
