"""One tool call with the official Python SDK 2.x client (a 2026-07-28 client without the tasks extension), as a
user's program makes it; prints the outcome as JSON. Its streams are not resumable: a cut connection ends the call.

Usage: python sdk2_client.py URL TOOL ARGUMENTS_JSON TIMEOUT_S
"""

from __future__ import annotations

import asyncio
import json
import sys

from mcp import Client


async def main(url: str, tool: str, arguments: dict, timeout_s: float) -> dict:
    async with Client(url, read_timeout_seconds=timeout_s) as client:
        result = await client.call_tool(tool, arguments)
        return {"text": result.content[0].text, "isError": result.is_error}


if __name__ == "__main__":
    url, tool, arguments, timeout_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    try:
        outcome = asyncio.run(asyncio.wait_for(main(url, tool, arguments, timeout_s), timeout_s + 5))
    except BaseException as exc:  # the point of some tests: the call dies, and how
        outcome = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps(outcome), flush=True)
