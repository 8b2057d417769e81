"""bench/poisson.py, the open-loop generator behind the µs-timed creation p99 (bench/ab.py --path create): it
sends at the rate asked, times each answer from the request's scheduled time, and a wrong answer voids the run."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import poisson  # noqa: E402  (bench/ is a folder of scripts)

BODY = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t"}}).encode()


async def serve(aiohttp_server, answer):
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return await answer(len(seen))

    app = web.Application()
    app.router.add_post("/mcp", handler)
    server = await aiohttp_server(app)
    return str(server.make_url("/mcp")), seen


async def test_it_sends_poisson_arrivals_at_the_rate_and_counts_the_wait_against_the_server(aiohttp_server):
    async def slow_every_tenth(n: int) -> web.Response:
        if n % 10 == 0:
            await asyncio.sleep(0.02)
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})

    url, seen = await serve(aiohttp_server, slow_every_tenth)
    result = await asyncio.to_thread(poisson.run, url, BODY, {"Content-Type": "application/json"}, rate=400,
                                     seconds=1.0, connections=4, seed=7)  # fmt: skip
    assert 300 <= result.requests <= 500  # the seeded draw of a Poisson count around 400
    assert len(seen) == result.requests and set(seen) == {BODY}
    assert result.p50_ms < 20 <= max(result.latencies_ms)  # a tenth waited 20 ms: the figure says so
    assert result.p99_ms >= 20
    assert len(result.send_lag_ms) == result.requests and min(result.send_lag_ms) >= 0


@pytest.mark.parametrize("status, payload", [(500, {"jsonrpc": "2.0", "id": 1, "result": {}}),
                                             (200, {"jsonrpc": "2.0", "id": 1, "error": {"code": -1}})])  # fmt: skip
async def test_a_wrong_answer_voids_the_run(aiohttp_server, status, payload):
    async def wrong_on_the_third(n: int) -> web.Response:
        if n == 3:
            return web.json_response(payload, status=status)
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})

    url, seen = await serve(aiohttp_server, wrong_on_the_third)
    with pytest.raises(SystemExit, match=f"answered {status}"):
        await asyncio.to_thread(poisson.run, url, BODY, {}, rate=200, seconds=0.5, connections=2, seed=1)
    assert len(seen) < 90  # it stopped at the third answer, not at the end of the run
