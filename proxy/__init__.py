"""mcp-tasks-proxy: a sidecar that adds the MCP tasks extension (SEP-2663) in front of any MCP server."""

__version__ = "0.1.0"

PROTOCOL_VERSION = "2026-07-28"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
