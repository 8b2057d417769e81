"""`mcp-tasks-proxy check [FILE] [TOOL ...] [--upstream URL]`: validate a policy and show the rule each tool gets."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
from multidict import CIMultiDict

from . import PROTOCOL_VERSION
from .config import ENV_PREFIX, ConfigError, ProxyConfig, apply_overrides, load_config
from .log import configure_logging
from .security import Identity
from .upstream import build_gateway
from .upstream.events import CredentialsNeeded, Failed, Finished, NotMcp, UpstreamStartError, UpstreamUnavailable


def check_main(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> int:
    """0: the policy is valid (and the upstream answered, when asked); 1: the upstream could not be asked;
    2: the policy or the command line is wrong."""
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy check",
        usage="mcp-tasks-proxy check [-h] [FILE] [TOOL ...] [--upstream URL]",
        description="Validate a policy file and print the effective rule for each tool: those the upstream lists "
        "(when it is reachable), or the names given. Without FILE: MCP_TASKS_PROXY_CONFIG, else the embedded defaults.",
    )
    parser.add_argument("names", nargs="*", metavar="FILE TOOL", help="the YAML policy file (a .yaml/.yml path), "
                        "then tool names to check instead of asking the upstream")  # fmt: skip
    parser.add_argument("--upstream", metavar="URL", help="ask this upstream instead of the file's upstream.url")
    args = parser.parse_args(list(argv))
    names = list(args.names)
    path = names.pop(0) if names and _is_policy_path(names[0]) else environ.get(f"{ENV_PREFIX}CONFIG") or None
    configure_logging(level="warning", format="console")  # the report is the output; keep log lines out of it
    try:
        config = apply_overrides(load_config(path), {"upstream.url": args.upstream})
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: config error: {exc}", file=sys.stderr)
        return 2
    print(f"{path or 'the embedded defaults'}: valid, {len(config.tools)} rule(s)")
    if not names:
        if config.upstream.url is None and config.upstream.command is None:
            print("no upstream to ask for its tools: give --upstream URL, or name the tools to check")
            return 0
        try:
            names = asyncio.run(list_tools(config))
        except NotMcp as exc:
            print(f"mcp-tasks-proxy check: {config.upstream_name}: {exc}; or name the tools to check", file=sys.stderr)
            return 1
        except (UpstreamUnavailable, UpstreamStartError, ConnectionError, aiohttp.ClientError, OSError) as exc:
            fix = "name" if isinstance(exc, CredentialsNeeded) else "start it, or name"
            print(
                f"mcp-tasks-proxy check: the upstream {config.upstream_name} could not be asked for its tools ({exc}); "
                f"{fix} the tools to check",
                file=sys.stderr,
            )
            return 1
        print(f"the upstream {config.upstream_name} lists {len(names)} tool(s)")
    print_rules(config, names)
    return 0


def _is_policy_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or os.sep in name or Path(name).is_file()


def print_rules(config: ProxyConfig, names: Sequence[str]) -> None:
    rows = [("tool", "rule", "task", "sync_window_ms", "timeout_s")]
    for name in names:
        rule = config.rule_for(name)
        if rule is None:
            rows.append((name, "(none)", "passthrough", "", ""))
        else:
            rows.append((name, rule.match, rule.task.value, str(rule.sync_window_ms), f"{rule.timeout_s:g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


async def list_tools(config: ProxyConfig) -> list[str]:
    """Every tool name the upstream lists (following pagination), whichever era it speaks."""
    async with build_gateway(config, Identity(config.security)) as gateway:
        await gateway.era()  # what it found, as it is (NotMcp: the URL answers, but not as MCP), not as a failed call
        names: list[str] = []
        cursor = None
        for page in itertools.count():
            params: dict = {
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
                    "io.modelcontextprotocol/clientCapabilities": {},
                }
            }
            if cursor is not None:
                params["cursor"] = cursor
            message = {"jsonrpc": "2.0", "id": f"check-{page}", "method": "tools/list", "params": params}
            headers = CIMultiDict({"MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": "tools/list"})
            result = None
            async for event in gateway.call_tool(message, headers, {}, max_bytes=config.limits.max_result_bytes):
                if isinstance(event, Finished):
                    result = event.result
                elif isinstance(event, Failed):
                    raise UpstreamUnavailable(event.status_message)
            if result is None:
                raise UpstreamUnavailable("no tools/list result")
            names.extend(tool["name"] for tool in result.get("tools", []) if isinstance(tool, dict))
            cursor = result.get("nextCursor")
            if not cursor or page > 100:
                return names
        return names
