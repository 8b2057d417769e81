"""Where the task console is served: on loopback by default, off elsewhere unless the policy says so, behind the
same checks as every other path, and never forwarded. (Its browser tests: tests/test_console.py.)"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from tests.issuer import security


async def get(url: str, **headers: str) -> tuple[int, str, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.text(), dict(response.headers)


async def not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, text="the upstream's")


async def test_the_console_is_on_on_loopback_and_its_page_is_the_proxys(make_proxy, fake_upstream):
    upstream = await fake_upstream(not_found)
    proxy = await make_proxy(upstream.url, tools=[{"match": "<script>*"}])
    base = proxy.url.removesuffix("/mcp")
    status, body, headers = await get(f"{base}/console")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in headers["Content-Security-Policy"] and "frame-ancestors 'none'" in headers[
        "Content-Security-Policy"]  # fmt: skip
    assert '"match": "\\u003cscript>*"' in body  # a pattern is data in the page, never markup
    assets = [("mcp.js", "text/javascript"), ("forms.js", "text/javascript"), ("console.js", "text/javascript"),
              ("console.css", "text/css")]  # fmt: skip
    for asset, kind in assets:
        status, _, headers = await get(f"{base}/console/{asset}")
        assert (status, headers["Content-Type"]) == (200, f"{kind}; charset=utf-8")
    async with aiohttp.ClientSession() as session, session.post(f"{base}/console", data=b"{}") as response:
        assert response.status == 405  # read only, and never forwarded
    status, _, _ = await get(f"{base}/console", Host="evil.example")
    assert status == 421  # the Host guard, as on every path
    status, body, _ = await get(f"{base}/console/other.js")
    assert (status, body) == (404, "the upstream's")  # what is not the console's passes through
    assert upstream.received[-1]["path"] == "/console/other.js"
    assert all(request["path"] != "/console" for request in upstream.received)


@pytest.mark.parametrize(("listen", "served"), [
    ({"host": "0.0.0.0"}, False),
    ({"host": "0.0.0.0", "console": True}, True),
    ({"console": False}, False),
])  # fmt: skip
async def test_off_the_loopback_the_console_is_off_unless_the_policy_turns_it_on(
    make_proxy, fake_upstream, listen, served
):
    upstream = await fake_upstream(not_found)
    proxy = await make_proxy(upstream.url, listen=listen)
    status, body, _ = await get(proxy.url.removesuffix("/mcp") + "/console")
    assert (status == 200 and "task console" in body) is served
    assert (body == "the upstream's") is not served  # off: the path is the upstream's, as any other


async def test_with_verified_callers_the_page_loads_without_a_token_and_nothing_else_does(
    make_proxy, fake_upstream, issuer
):
    """principal: jwt. The console's paths are static and the proxy's: no token. A path that only decodes to
    one of them (/console%2Fconsole.js) is routed upstream, so it is checked like any other."""
    upstream = await fake_upstream(not_found)
    proxy = await make_proxy(upstream.url, security=security(issuer))
    base = proxy.url.removesuffix("/mcp")
    assert (await get(f"{base}/console"))[0] == 200
    assert (await get(f"{base}/console/console.js"))[0] == 200
    assert (await get(f"{base}/console%2Fconsole.js"))[0] == 401
    assert (await get(f"{base}/elsewhere"))[0] == 401
    assert [request for request in upstream.received if request["method"] == "GET"] == []  # (the era probe: POST)
