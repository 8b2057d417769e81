"""Chaos: three replicas on one real redis-server, in front of an upstream that counts every run of its tools, lose
members to SIGKILL in a loop while a few hundred tasks are created and run. Clients do what a careful client does:
they send every call with an Idempotency-Key and, when a replica dies under their request, send it again to
another one.

At the end every task has one recorded outcome: a tool the policy marks idempotent completed (run again after each
lost replica, within its attempts); one it does not completed or failed with outcome "unknown", and ran at most
once. None is left working.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import signal

import aiohttp
import pytest

from tests.conftest import Replica, eventually
from tests.factories import McpClient
from tests.test_replicas import killed

ROUNDS = 6
CALLS_PER_ROUND = 50
"""Half of each round's calls are of the idempotent tool, half of the other."""
SPREAD_S = 1.5
"""Each round's calls are sent over this long, and a replica is killed in the middle of it."""
ATTEMPTS = 10
TOOLS = [
    {"match": "counted", "idempotent": True, "retry": {"attempts": ATTEMPTS, "backoff_ms": 50}},
    {"match": "counted_once"},
]


# Six replicas started, 300 tasks and a minute's wait for the last to end: past the suite's 60 s on busy cores.
@pytest.mark.timeout(240)
async def test_replicas_killed_in_a_loop_lose_no_task_and_run_nothing_unsafe_twice(
    replicas,
    session,
    mcp_upstream,
    upstream_client,
):
    live: list[Replica] = [replicas(mcp_upstream, tools=TOOLS) for _ in range(3)]
    prefix = f"chaos-{secrets.token_hex(4)}-"
    rng = random.Random(prefix)
    created: dict[str, tuple[str, str]] = {}  # tag -> (tool, task id)
    resent = 0

    async def submit(tool: str, tag: str, seconds: float, after_s: float) -> None:
        nonlocal resent
        await asyncio.sleep(after_s)
        for _ in range(50):
            client = McpClient(session, rng.choice(live).url)
            try:
                reply = await client.call_tool(tool, {"tag": tag, "seconds": seconds}, headers={"Idempotency-Key": tag})
            except aiohttp.ClientError:
                reply = None  # the replica died under the request: did it make the task? The key says.
            if reply is not None and reply.status == 200 and reply.message.get("result"):
                created[tag] = (tool, reply.result["taskId"])
                return
            resent += 1
            await asyncio.sleep(0.05)
        raise AssertionError(f"{tag} could not be created")

    for round_number in range(ROUNDS):
        calls = []
        for n in range(CALLS_PER_ROUND):
            tool = "counted" if n % 2 else "counted_once"
            tag = f"{prefix}{round_number}-{n}"
            calls.append(submit(tool, tag, rng.uniform(0.2, 2.0), rng.uniform(0, SPREAD_S)))
        submitting = asyncio.gather(*calls)
        await asyncio.sleep(rng.uniform(0.3, SPREAD_S - 0.3))  # some created, some on their way, some running
        victim = rng.choice(live)
        killed(victim)  # requests on their way to it die with it, or are refused until it leaves the rotation
        await asyncio.sleep(0.1)
        live.remove(victim)
        await submitting
        live.append(replicas(mcp_upstream, tools=TOOLS))  # the deployment replaces it
        await asyncio.sleep(0.5)

    assert len(created) == ROUNDS * CALLS_PER_ROUND
    outcomes: dict[str, dict] = {}

    async def all_ended() -> bool:
        client = McpClient(session, live[0].url)
        for tag, (_, task_id) in created.items():
            if tag in outcomes:
                continue
            task = (await client.get_task(task_id)).result
            if task["status"] in ("completed", "failed", "cancelled"):
                outcomes[tag] = task
        return len(outcomes) == len(created)

    # The last replica was killed with calls of up to 2 s running: a lease (1 s), a sweep and a run later, all end.
    await eventually(all_ended, timeout_s=60, what="every task ending")
    counts_reply = await upstream_client.call_tool("arrival_counts", {"prefix": prefix}, tasks=False)
    runs: dict[str, int] = counts_reply.result["structuredContent"]

    summary = {"completed": 0, "unknown": 0, "run_again": 0, "resent": resent}
    for tag, (tool, _) in created.items():
        task = outcomes[tag]
        ran = runs.get(tag, 0)
        if tool == "counted":
            assert task["status"] == "completed", (tag, task)
            assert task["result"]["content"][0]["text"] == f"counted {tag}"
            assert 1 <= ran <= ATTEMPTS, (tag, ran)
            summary["run_again"] += ran > 1
        else:
            assert ran <= 1, (tag, ran)  # never twice
            if task["status"] == "failed":
                assert task["error"]["data"] == {"outcome": "unknown"}, (tag, task)
                summary["unknown"] += 1
                continue
            assert task["status"] == "completed" and ran == 1, (tag, task, ran)
        summary["completed"] += 1
    print(f"chaos: {len(created)} tasks, {ROUNDS} replicas killed, {summary}")
    assert summary["run_again"] > 0 and summary["unknown"] > 0, summary  # the kills did hit running calls

    # One key, fifty concurrent submissions spread over the replicas: one task, one upstream run.
    tag = f"{prefix}one-key"
    replies = await asyncio.gather(
        *(
            McpClient(session, live[n % len(live)].url).call_tool(
                "counted_once", {"tag": tag, "seconds": 0.2}, headers={"Idempotency-Key": tag}
            )
            for n in range(50)
        )
    )
    assert {reply.result["taskId"] for reply in replies} == {replies[0].result["taskId"]}
    client = McpClient(session, live[0].url)

    async def one_run_done() -> bool:
        return (await client.get_task(replies[0].result["taskId"])).result["status"] == "completed"

    await eventually(one_run_done, what="the keyed call")
    counts_reply = await upstream_client.call_tool("arrival_counts", {"prefix": tag}, tasks=False)
    assert counts_reply.result["structuredContent"] == {tag: 1}
    for replica in live:
        replica.process.send_signal(signal.SIGTERM)
