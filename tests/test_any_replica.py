"""Any replica answers any request of a 2025 session (listen.advertise_url): three proxy replicas, each in front of
its own stateful SDK 1.x server (the sidecar topology), sharing a real redis-server, behind a round-robin balancer
with no affinity. Real processes throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import sys

import aiohttp
import pytest

from tests.balancer import RoundRobin
from tests.conftest import ROOT, LegacyClient, eventually, free_port, legacy_python, serve_script
from tests.factories import McpClient, meta
from tests.test_durable import Client2025
from tests.test_real_clients import run_client, sdk1_call, ts_call
from tests.test_stdio import legacy_command

SESSION_CLIENT = ROOT / "tests" / "clients" / "sdk1_session.py"
RULES = [{"match": "ask_name"}]  # a durable call, whose server asks the user: the rest passes through


@pytest.fixture
def own_servers():
    """Three SDK 1.x servers, one per replica; each knows only the sessions made on it."""
    with contextlib.ExitStack() as stack:
        start = contextlib.contextmanager(serve_script)
        yield [stack.enter_context(start(legacy_python(), "legacy_server.py")) for _ in range(3)]


@pytest.fixture
async def balanced():
    balancers: list[RoundRobin] = []

    async def build(proxies) -> tuple[str, RoundRobin]:
        balancer = RoundRobin([proxy.url.removesuffix("/mcp") for proxy in proxies])
        balancers.append(balancer)
        return await balancer.start(free_port()), balancer

    yield build
    for balancer in balancers:
        await balancer.close()


@pytest.mark.parametrize(("advertise", "transport"), [(True, "http"), (False, "http"), (True, "stdio")])
async def test_a_whole_sdk_session_through_round_robin_without_affinity(
    replicas, own_servers, balanced, advertise, transport
):
    # stdio: each replica starts its own SDK 1.x child, and the proxy itself holds the 2025 session in front of it.
    servers = own_servers if transport == "http" else [legacy_command()] * 3
    proxies = [replicas(server, advertise=advertise, tools=RULES) for server in servers]
    url, balancer = await balanced(proxies)
    outcome = await run_client(str(legacy_python()), str(SESSION_CLIENT), url, timeout_s=60)
    hit = {index for index, _, _ in balancer.hits}
    failures = [h for h in balancer.hits if h[2] >= 400]
    print(f"\nround-robin, {transport}, advertise={advertise}: {len(balancer.hits)} requests, "
          f"replicas hit {sorted(hit)}, failures {failures}")  # fmt: skip
    if not advertise:  # the problem this solves: the second request already lands where the session is unknown
        assert "failed" in outcome, outcome
        return
    assert "failed" not in outcome, outcome
    assert outcome["added"] == "5" and outcome["tools"] > 5 and outcome["prompts"] >= 1
    assert len(set(outcome["pids"])) == 1  # every call of the session reached the one server that holds it
    assert "Ada" in outcome["asked"]  # the server's question, answered through another replica, reached it
    assert hit == {0, 1, 2} and len(balancer.hits) >= 10
    assert not [h for h in balancer.hits if h[2] >= 400]
    assert any(method == "DELETE" for _, method, _ in balancer.hits)  # the session's end, through some replica


async def test_the_sessions_replica_lost_means_404_then_a_new_session_works(replicas, own_servers):
    owner, other = (replicas(server, advertise=True, tools=RULES, lease_s=30) for server in own_servers[:2])
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
        client.url = other.url  # the same session, through a replica that does not hold it
        assert await list_tools(client) == 200
        owner.process.send_signal(signal.SIGKILL)
        owner.process.wait()
        # At once, while the lost replica's lease still lasts: its address refuses connections, so the session is
        # gone (503 until the lease lapsed would have the client retry a session that no longer exists).
        assert await list_tools(client) == 404
        fresh = Client2025(http, other.url)
        await fresh.initialize()  # what a client does after a 404: a new session, which works
        assert await list_tools(fresh) == 200


async def test_a_clients_own_hop_header_gets_it_nothing(replicas, own_servers):
    owner, other = (replicas(server, advertise=True, tools=RULES) for server in own_servers[:2])
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        await client.initialize()
        client.url = other.url
        # Forged: had it been taken as a replica's, `other` would have served the session itself (its server: 404).
        client.headers["Mcp-Tasks-Proxy-Hop"] = "someone.1.AAAA"
        assert await list_tools(client) == 200  # forwarded to the owner as any request
    assert "hop_header_refused" in other.log.read_text()


async def list_tools(client: Client2025) -> int:
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {}}
    async with client.http.post(client.url, json=message, headers=client.headers) as response:
        body = await response.read()
        if response.status == 200 and response.content_type == "application/json":
            assert json.loads(body)["result"]["tools"]
        return response.status


@pytest.mark.parametrize("rules", [RULES, []], ids=["kept-alive call (sync window)", "relayed call (bridge)"])
async def test_a_2026_clients_mrtr_retry_reaches_the_replica_holding_its_parked_call(replicas, legacy_upstream, rules):
    # In front of a 2025 server, a synchronous call that asks is held open upstream on the replica that got it.
    parked_on, retried_on = (replicas(legacy_upstream, advertise=True, tools=rules) for _ in range(2))
    async with aiohttp.ClientSession() as http:
        params = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, elicitation={})}
        first = await McpClient(http, parked_on.url).call("tools/call", params)
        (key,) = first.result["inputRequests"]
        retry = {**params, "inputResponses": {key: {"action": "accept", "content": {"name": "Ada"}}},
                 "requestState": first.result["requestState"]}  # fmt: skip
        done = await McpClient(http, retried_on.url).call("tools/call", retry)
        assert done.result["content"][0]["text"] == "hello Ada", done.message
        # Single use, wherever it is sent again.
        again = await McpClient(http, retried_on.url).call("tools/call", retry)
        assert again.error["code"] == -32602


async def test_a_retry_for_a_parked_call_whose_replica_is_gone_is_refused_at_once(replicas, legacy_upstream):
    # Its replica's lease still lasts, but its address refuses connections: the call went with it.
    parked_on, retried_on = (replicas(legacy_upstream, advertise=True, tools=[], lease_s=30) for _ in range(2))
    async with aiohttp.ClientSession() as http:
        params = {"name": "ask_name", "arguments": {}, "_meta": meta(tasks=False, elicitation={})}
        first = await McpClient(http, parked_on.url).call("tools/call", params)
        (key,) = first.result["inputRequests"]
        parked_on.process.send_signal(signal.SIGKILL)
        parked_on.process.wait()
        retry = {**params, "inputResponses": {key: {"action": "accept", "content": {"name": "Ada"}}},
                 "requestState": first.result["requestState"]}  # fmt: skip
        refused = await McpClient(http, retried_on.url).call("tools/call", retry)
        assert refused.status == 400 and refused.error["data"] == {"reason": "invalid_request_state"}, refused.message


async def test_a_forwarded_request_keeps_the_host_the_client_used(replicas, own_servers):
    # The replicas accept only the name clients use (security.allowed_hosts), not each other's pod addresses.
    security = {"principal_key": "replicas-share-this-key", "allowed_hosts": ["mcp.example"]}
    owner, other = (replicas(s, advertise=True, tools=RULES, security=security) for s in own_servers[:2])
    async with aiohttp.ClientSession() as http:
        client = Client2025(http, owner.url)
        client.headers["Host"] = "mcp.example"
        await client.initialize()
        client.url = other.url
        assert await list_tools(client) == 200  # checked on the owner as on the replica that took it


async def test_before_the_shared_key_loads_a_session_is_answered_here_and_its_answer_goes_out(tmp_path):
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from mcp_tasks_proxy.config import SecurityConfig
    from mcp_tasks_proxy.front.session_routing import SessionRouting
    from mcp_tasks_proxy.security import Identity
    from mcp_tasks_proxy.store.base import MemoryTaskStore

    identity = Identity(SecurityConfig(), shared_store=True)  # the key is kept in Redis, which has not answered
    routing = SessionRouting(MemoryTaskStore(max_tasks=10), identity, lambda: "me")
    request = make_mocked_request("POST", "/mcp", headers={"Mcp-Session-Id": "s-1"})
    assert await routing._forward_if_elsewhere(request) is None  # tried here: the upstream knows its sessions
    await routing.on_response_prepare(request, web.Response(headers={"Mcp-Session-Id": "s-1"}))  # no exception


async def test_a_2026_stdio_childs_mrtr_retry_reaches_the_child_that_sealed_its_state(replicas):
    """Each replica runs its own copy of a 2026 stdio server, whose SDK seals requestState with a key of its process:
    a retry on another replica was refused there (-32602). The proxy's handle names the replica and the copy."""
    fixture = [sys.executable, str(ROOT / "tests" / "conformance" / "fixture_server.py"), "--stdio"]
    asked_on, retried_on = (replicas(fixture, advertise=True, tools=[]) for _ in range(2))
    async with aiohttp.ClientSession() as http:
        params = {"name": "confirm_delete", "arguments": {"filename": "a.txt"}, "_meta": meta(tasks=False)}
        first = await McpClient(http, asked_on.url).call("tools/call", params)
        assert first.result["resultType"] == "input_required", first.message
        assert first.result["requestState"].startswith("mtp1c.")  # the child's own state, wrapped
        retry = {**params, "inputResponses": {"confirm": {"action": "accept", "content": {"confirm": "yes"}}},
                 "requestState": first.result["requestState"]}  # fmt: skip
        done = await McpClient(http, retried_on.url).call("tools/call", retry)
        assert done.result["content"][0]["text"] == "a.txt deleted", done.message
        # Bound to the caller: another one's retry is refused, wherever it lands.
        stolen = await McpClient(http, asked_on.url).call("tools/call", retry, headers={"Authorization": "Bearer x"})
        assert stolen.error["data"] == {"reason": "invalid_request_state"}, stolen.message


@pytest.mark.parametrize(
    "client",
    ["python-sdk-1", "python-sdk-1-sep-1686", "typescript-sdk-1"],
)
async def test_a_2025_client_gets_its_calls_outcome_after_its_sessions_replica_is_killed(
    replicas, plain_legacy_upstream, balanced, client
):
    """Real 2025 clients, three replicas behind round-robin with sessions routed (advertise_url), in front of one
    shared server: the replica holding the client's session is killed mid-call. The client resumes its stream (or
    polls its task) through the others, which answer from the call's record, and gets the answer of the call run
    again by the replica that took it over; the session lives on in the shared server, so the SDK's own requests
    after the call (its tools/list) are served too, every time."""
    rules = [{"match": "gated", "idempotent": True, "keepalive_s": 0.5, "max_stream_s": 1.5}]
    proxies = [replicas(plain_legacy_upstream, advertise=True, tools=rules) for _ in range(3)]
    url, balancer = await balanced(proxies)
    tag = secrets.token_hex(6)
    if client == "typescript-sdk-1":
        call = asyncio.ensure_future(ts_call(url, "gated", {"tag": tag}, timeout_s=60))
    else:
        flags = ["--as-task", "--connection-per-request"] if client.endswith("sep-1686") else []
        call = asyncio.ensure_future(sdk1_call(url, "gated", {"tag": tag}, *flags, timeout_s=60))
    async with aiohttp.ClientSession() as http:
        server = LegacyClient(http, plain_legacy_upstream)

        async def runs(count: int) -> bool:
            return await server.call_tool("gate_arrivals", {"tag": tag}) == str(count)

        await eventually(lambda: runs(1), what="the call running upstream")
        owner = proxies[balancer.hits[0][0]]  # the replica that answered initialize holds the session
        owner.process.send_signal(signal.SIGKILL)
        owner.process.wait()
        await eventually(lambda: runs(2), what="the call run again by another replica")
        await server.call_tool("release", {"tag": tag})
    outcome = await call
    assert outcome["text"] == f"gate {tag} opened" and outcome["isError"] is False, outcome


@pytest.mark.parametrize("client", ["python-sdk-1", "python-sdk-1-sep-1686", "typescript-sdk-1"])
async def test_in_sidecars_a_2025_client_gets_its_calls_outcome_after_its_sessions_replica_is_killed(
    replicas, own_servers, balanced, client
):
    """The sidecar topology: each replica its own server, so the session goes with the replica that is killed, and
    its other requests get that answer (404). The call's outcome does not: the Python SDK 1.x client, having listed
    the tools first as hosts do, and the TypeScript SDK 1.x client resume their stream through another replica (the
    SEP-1686 client polls its task there) and get the result of the call run again in front of that replica's
    server, over a session of the proxy's (that server never knew the client's). Without the listing, the Python SDK
    lists the tools after the call, to check its result: on the lost session that is a 404, which the SDK reports
    as the call's failure."""
    rules = [{"match": "gated", "idempotent": True, "keepalive_s": 0.5, "max_stream_s": 1.5}]
    proxies = [replicas(server, advertise=True, tools=rules) for server in own_servers]
    url, balancer = await balanced(proxies)
    tag = secrets.token_hex(6)
    if client == "typescript-sdk-1":
        call = asyncio.ensure_future(ts_call(url, "gated", {"tag": tag}, timeout_s=60))
    else:
        flags = ["--as-task", "--connection-per-request"] if client.endswith("sep-1686") else ["--list-first"]
        call = asyncio.ensure_future(sdk1_call(url, "gated", {"tag": tag}, *flags, timeout_s=60))
    async with aiohttp.ClientSession() as http:
        servers = [LegacyClient(http, server) for server in own_servers]

        async def runs(count: int) -> bool:
            counts = [int(await server.call_tool("gate_arrivals", {"tag": tag})) for server in servers]
            return sum(counts) == count

        await eventually(lambda: runs(1), what="the call running upstream")
        owner = proxies[balancer.hits[0][0]]  # the replica that answered initialize holds the session
        owner.process.send_signal(signal.SIGKILL)
        owner.process.wait()
        await eventually(lambda: runs(2), what="the call run again by another replica")
        for server in servers:
            await server.call_tool("release", {"tag": tag})
    outcome = await call
    assert outcome["text"] == f"gate {tag} opened" and outcome["isError"] is False, outcome
