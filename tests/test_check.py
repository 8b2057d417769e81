"""The rules against the upstream's tools (proxy/check.py): what counts as matching no tool, the suggestion made,
and tools/list followed across pages. The command itself, as a process: tests/test_cli.py."""

from __future__ import annotations

import pytest
import structlog
from aiohttp import web

from mcp_tasks_proxy.check import list_tools, unmatched_rules, warn_unmatched_rules
from mcp_tasks_proxy.config import ToolRule, parse_config
from mcp_tasks_proxy.security import Identity
from mcp_tasks_proxy.upstream import build_gateway
from mcp_tasks_proxy.upstream.tools import MAX_TOOL_PAGES

TOOLS = ["slow_report", "slow_render", "personal_report", "add"]


@pytest.mark.parametrize(
    ("pattern", "suggestion"),
    [
        ("slow_reprot", "slow_report"),  # a name misspelt: the closest tool
        ("slwo_*", "slow_*"),  # a glob misspelt: the glob fitted to the tools' names
        ("Slow_*", "slow_*"),  # matching is case-sensitive
        ("personal_*_v2", None),  # nothing close enough to say
        ("*_export", None),  # no literal start to compare
        ("zzz", None),
    ],
    ids=["name", "glob", "case", "glob-nothing-close", "leading-star", "nothing-close"],
)
def test_a_rule_that_matches_no_tool_is_named_with_a_close_pattern(pattern, suggestion):
    rules = [ToolRule(match="slow_*"), ToolRule(match=pattern), ToolRule(match="add")]
    unmatched = unmatched_rules(rules, TOOLS)
    assert [(rule.match, hint) for rule, hint in unmatched] == [(pattern, suggestion)]


def test_rules_that_match_some_tool_are_not_named():
    rules = [ToolRule(match=p) for p in ("slow_*", "personal_report", "*", "a?d")]
    assert unmatched_rules(rules, TOOLS) == []


def paged_upstream(pages: int | None):
    """A 2026-07-28 upstream whose tools/list has `pages` pages (None: a next cursor every time, without end)."""
    asked: list[object] = []

    async def handle(request: web.Request) -> web.Response:
        message = await request.json()
        if message["method"] == "server/discover":
            result = {"supportedVersions": ["2026-07-28"], "capabilities": {"tools": {}}}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
        cursor = message["params"].get("cursor")
        asked.append(cursor)
        page = 0 if cursor is None else int(cursor.removeprefix("p"))
        result = {"tools": [{"name": f"tool_{page}", "inputSchema": {"type": "object"}}]}
        if pages is None or page + 1 < pages:
            result["nextCursor"] = f"p{page + 1}"
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    return handle, asked


async def test_tools_are_listed_across_pages_and_the_pages_are_bounded(fake_upstream):
    handle, asked = paged_upstream(3)
    fake = await fake_upstream(handle)
    config = parse_config({"upstream": {"url": fake.url}})
    assert await list_tools(config) == ["tool_0", "tool_1", "tool_2"]
    assert asked == [None, "p1", "p2"]

    handle, asked = paged_upstream(None)
    fake = await fake_upstream(handle)
    with structlog.testing.capture_logs() as logs:
        names = await list_tools(parse_config({"upstream": {"url": fake.url}}))
    assert len(names) == len(asked) == MAX_TOOL_PAGES
    assert [line["event"] for line in logs if line["log_level"] == "warning"] == ["tools_list_truncated"]


async def test_the_start_up_check_warns_once_per_rule_that_matches_no_tool(fake_upstream):
    handle, _ = paged_upstream(2)
    fake = await fake_upstream(handle)
    config = parse_config({"upstream": {"url": fake.url}, "tools": [{"match": "tool_*"}, {"match": "tol_1"}]})
    async with build_gateway(config, Identity(config.security)) as gateway:
        with structlog.testing.capture_logs() as logs:
            await warn_unmatched_rules(gateway, lambda: config.tools, max_bytes=1 << 20)
    warnings = [line for line in logs if line["event"] == "rule_matches_no_tool"]
    assert warnings == [
        {
            "event": "rule_matches_no_tool",
            "log_level": "warning",
            "pattern": "tol_1",
            "tools": 2,
            "suggestion": "tool_1",
        }
    ]
