"""The peer for the task-path comparison: a FastMCP server with fastmcp-tasks (SEP-2663 in-process), the same
instant `echo` tool. Runs in its own environment (bench/run.py builds it). Run: python bench/peer_server.py PORT"""

from __future__ import annotations

import sys

from fastmcp import FastMCP
from fastmcp_tasks import TasksExtension

server = FastMCP("peer")
server.add_extension(TasksExtension())


@server.tool(task=True)
async def echo() -> str:
    return "ok"


if __name__ == "__main__":
    server.run(transport="http", host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
