"""The task console: a page at /console from which a person calls tools and watches, answers and cancels their tasks.

The page (console.html, its scripts mcp.js, forms.js and console.js, console.css, shipped in this package) is a
client of the proxy's own /mcp, as any MCP client is: no API of its own. The one thing it learns here rather than
over MCP is the policy's tool rules, written into the page when it is served, so that it can say which tools become
tasks.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from aiohttp import web

from ..policy import LivePolicy

CONSOLE_PATH = "/console"
ASSETS = {
    "mcp.js": "text/javascript",  # the wire
    "forms.js": "text/javascript",  # inputs from JSON Schema, the rules' matching
    "console.js": "text/javascript",  # the page: tools, calls and tasks
    "console.css": "text/css",
}
PATHS = frozenset({CONSOLE_PATH, *(f"{CONSOLE_PATH}/{name}" for name in ASSETS)})
_RULES_MARK = "{{rules}}"

# The page runs only its own script and style, talks only to this origin (its empty icon is a data: URL, or the
# browser would ask the upstream for /favicon.ico), and is never framed: an upstream's
# tool descriptions and results are shown as text, and a policy's patterns are data, never markup.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def add_routes(app: web.Application, policy: LivePolicy, served: Any) -> None:
    """GET /console and its assets, each through `served` (the request context, Host/Origin guard and error
    boundary every route has)."""
    template = _read("console.html")
    assets = {name: _read(name).encode() for name in ASSETS}

    async def page(request: web.Request) -> web.Response:
        # Rendered per request: a reloaded policy's rules show on the next load.
        body = template.replace(_RULES_MARK, _rules_json(policy))
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers=_HEADERS)

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.Response(body=assets[name], content_type=ASSETS[name], charset="utf-8", headers=_HEADERS)

    async def read_only(request: web.Request) -> web.Response:
        # Never forwarded: these paths skip the token check that guards what reaches the upstream.
        return web.Response(status=405, headers={"Allow": "GET, HEAD"}, text="405: the console's pages are read only")

    app.router.add_get(CONSOLE_PATH, served(page))
    app.router.add_route("*", CONSOLE_PATH, served(read_only))
    for name in ASSETS:
        path = f"{CONSOLE_PATH}/{{name:{name.replace('.', '[.]')}}}"
        app.router.add_get(path, served(asset))
        app.router.add_route("*", path, served(read_only))


def _rules_json(policy: LivePolicy) -> str:
    """The policy's tool rules, in order, as the page shows them; `<` escaped, so no value ends the script block."""
    rules: list[dict[str, Any]] = [
        {
            "match": rule.match,
            "task": rule.task.value,
            "durable": rule.durable,
            "syncWindowMs": rule.sync_window_ms,
            "timeoutS": rule.timeout_s,
        }
        for rule in policy.config.tools
    ]
    return json.dumps(rules).replace("<", "\\u003c")
