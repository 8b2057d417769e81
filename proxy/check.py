"""`mcp-tasks-proxy check [FILE] [TOOL ...] [--upstream URL] [--strict]`: validate a policy and show the rule each tool
gets; and the rules against the upstream's tools, for `check` and for the proxy at start-up (a rule that matches no
tool lets the slow tool it meant pass through untasked)."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import fnmatch
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp
import structlog

from .config import ENV_PREFIX, ConfigError, ProxyConfig, ToolRule, apply_overrides, load_config
from .log import configure_logging
from .security import Identity
from .upstream import build_gateway
from .upstream.events import CredentialsNeeded, NotMcp, UpstreamStartError, UpstreamUnavailable
from .upstream.gateway import Gateway
from .upstream.tools import list_tools as upstream_tools

log = structlog.get_logger(__name__)

"""tools/list pages followed at most (nextCursor): a server whose cursors never end cannot hold the check."""
RULES_RETRY_MIN_S = 1.0
RULES_RETRY_MAX_S = 60.0


def check_main(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> int:
    """0: the policy is valid (and the upstream answered, when asked; a rule that matches none of its tools is a
    warning); 1: the upstream could not be asked, or with --strict a rule matches none of its tools; 2: the policy
    or the command line is wrong."""
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy check",
        usage="mcp-tasks-proxy check [-h] [FILE] [TOOL ...] [--upstream URL] [--strict]",
        description="Validate a policy file and print the effective rule for each tool: those the upstream lists "
        "(when it is reachable), or the names given. Without FILE: MCP_TASKS_PROXY_CONFIG, else the embedded defaults.",
    )
    parser.add_argument("names", nargs="*", metavar="FILE TOOL", help="the YAML policy file (a .yaml/.yml path), "
                        "then tool names to check instead of asking the upstream")  # fmt: skip
    parser.add_argument("--upstream", metavar="URL", help="ask this upstream instead of the file's upstream.url")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a rule matches none of the tools the upstream lists"
    )
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
        unmatched = unmatched_rules(config.tools, names)
        for rule, suggestion in unmatched:
            hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
            print(f"mcp-tasks-proxy check: warning: the rule {rule.match!r} matches no tool of the upstream{hint}",
                  file=sys.stderr)  # fmt: skip
        return 1 if unmatched and args.strict else 0
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
    """Every tool name the upstream lists, whichever era it speaks."""
    async with build_gateway(config, Identity(config.security)) as gateway:
        return await tool_names(gateway, max_bytes=config.limits.max_result_bytes)


async def tool_names(gateway: Gateway, *, max_bytes: int) -> list[str]:
    """Every tool name the upstream lists (proxy/upstream/tools.py)."""
    return [tool["name"] for tool in await upstream_tools(gateway, max_bytes=max_bytes)]


def unmatched_rules(rules: Sequence[ToolRule], names: Sequence[str]) -> list[tuple[ToolRule, str | None]]:
    """The rules that match none of the tools `names`, each with a close pattern that would match one, if any."""
    return [(rule, _suggestion(rule.match, names)) for rule in rules if not any(rule.matches(n) for n in names)]


def _suggestion(pattern: str, names: Sequence[str]) -> str | None:
    literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    if literal == pattern:  # a tool's name: the closest name the upstream lists
        close = difflib.get_close_matches(pattern, names, n=1)
        return close[0] if close else None
    if not literal:
        return None
    # A glob: its literal start fitted to each tool's name ("slwo_*" becomes "slow_*" for slow_report), kept when
    # that tool matches it, and the candidate closest to the pattern as written.
    rest = pattern[len(literal) :]
    fitted = {name[: len(literal)] + rest: name for name in names}
    candidates = sorted(candidate for candidate, name in fitted.items() if fnmatch.fnmatchcase(name, candidate))
    close = difflib.get_close_matches(pattern, candidates, n=1)
    return close[0] if close else None


async def warn_unmatched_rules(gateway: Gateway, rules: Callable[[], Sequence[ToolRule]], *, max_bytes: int) -> None:
    """The proxy's start-up check: once the upstream's tools are known, one `rule_matches_no_tool` warning per rule
    that matches none of them. Asked again, backing off, while the upstream cannot be listed (still starting, not
    reachable, no MCP endpoint yet); never while it wants credentials, which only clients bring."""
    delay_s = RULES_RETRY_MIN_S
    while True:
        try:
            names = await tool_names(gateway, max_bytes=max_bytes)
            break
        except CredentialsNeeded as exc:
            log.info("rules_not_checked", reason=str(exc))
            return
        except UpstreamUnavailable as exc:
            log.debug("rules_check_deferred", reason=str(exc), retry_s=delay_s)
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, RULES_RETRY_MAX_S)
    for rule, suggestion in unmatched_rules(rules(), names):
        log.warning(
            "rule_matches_no_tool",
            pattern=rule.match,
            tools=len(names),
            **({"suggestion": suggestion} if suggestion else {}),
        )
