"""Credentials that follow the caller (security.principal: jwt): a task's later upstream requests carry the newest
token its owner has shown, on the replica that runs it or through Redis from another one; an upstream 401 is tried
once more with a newer token, and without one the task fails saying so. The upstream is a fake that asks one
question (MRTR) and then accepts only the token the test says is current: a fault no SDK server injects."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis as sync_redis
from aiohttp import web

from tests.conftest import eventually, start_redis, stop, task_reaches
from tests.factories import meta
from tests.issuer import bearer, security

ELICIT = {"elicitation": {}}


class PickyUpstream:
    """A 2026-07-28 server whose tool `ask` asks one question, then answers only a request carrying `accepted`."""

    def __init__(self) -> None:
        self.accepted: str | None = None
        self.seen: list[str | None] = []
        """The Authorization of each tools/call, in order."""
        self.hold: asyncio.Event | None = None
        """Set: the answering round waits for it before it judges the token."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": body.get("id"), "result": {}})
        authorization = request.headers.get("Authorization")
        self.seen.append(authorization)
        if "inputResponses" not in body["params"]:
            question = {"method": "elicitation/create", "params": {"message": "go on?", "requestedSchema": {
                "type": "object", "properties": {}}}}  # fmt: skip
            result = {"resultType": "input_required", "inputRequests": {"q": question}, "requestState": "round-1"}
            return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": result})
        if self.hold is not None:
            await self.hold.wait()
        if authorization != f"Bearer {self.accepted}":
            error = {"code": -32001, "message": "the token is not the current one"}
            return web.json_response({"jsonrpc": "2.0", "id": body["id"], "error": error}, status=401)
        result = {"content": [{"type": "text", "text": "done"}]}
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": result})


@pytest.fixture
async def picky(fake_upstream):
    upstream = PickyUpstream()
    upstream.url = (await fake_upstream(upstream.handle)).url  # type: ignore[attr-defined]
    return upstream


async def make(make_proxy, picky, issuer, **sections: Any):
    return await make_proxy(picky.url, protocol="modern", tools=[{"match": "ask"}], security=security(issuer),
                            **sections)  # fmt: skip


async def ask(proxy, token: str) -> str:
    params = {"name": "ask", "arguments": {}, "_meta": meta(**ELICIT)}
    created = await proxy.client.call("tools/call", params, headers=bearer(token))
    assert created.result["resultType"] == "task", created.message
    task_id = created.result["taskId"]
    await task_reaches(proxy.client, task_id, "input_required", headers=bearer(token))
    return task_id


async def answer(proxy, task_id: str, token: str) -> None:
    responses = {"q": {"action": "accept", "content": {}}}
    reply = await proxy.client.call("tasks/update", {"taskId": task_id, "inputResponses": responses},
                                    headers=bearer(token))  # fmt: skip
    assert reply.result == {"resultType": "complete"}, reply.message


async def test_the_next_round_carries_the_token_the_owner_showed_last(make_proxy, picky, issuer):
    proxy = await make(make_proxy, picky, issuer)
    first, refreshed = issuer.token("alice"), issuer.token("alice", kid="ec-1")
    task_id = await ask(proxy, first)
    picky.accepted = refreshed  # the issuer revoked the first token; the client refreshed
    await answer(proxy, task_id, refreshed)
    done = await task_reaches(proxy.client, task_id, "completed", "failed", headers=bearer(refreshed))
    assert done.result["status"] == "completed", done.result
    assert picky.seen == [f"Bearer {first}", f"Bearer {refreshed}"]


async def test_a_401_is_tried_once_more_with_a_token_shown_meanwhile(make_proxy, picky, issuer):
    proxy = await make(make_proxy, picky, issuer)
    first, second, third = (issuer.token("alice", jti=str(n)) for n in range(3))
    task_id = await ask(proxy, first)
    picky.accepted, picky.hold = third, asyncio.Event()
    await answer(proxy, task_id, second)  # the round goes with the second token, and waits upstream

    async def round_sent() -> bool:
        return len(picky.seen) == 2

    await eventually(round_sent, what="the answering round reaching the upstream")
    await proxy.client.get_task(task_id, headers=bearer(third))  # a newer token while the round is out
    picky.hold.set()  # the upstream refuses the second one
    done = await task_reaches(proxy.client, task_id, "completed", "failed", headers=bearer(third))
    assert done.result["status"] == "completed", done.result
    assert picky.seen[1:] == [f"Bearer {second}", f"Bearer {third}"]


async def test_a_401_without_a_newer_token_fails_the_task_saying_so(make_proxy, picky, issuer):
    proxy = await make(make_proxy, picky, issuer)
    token = issuer.token("alice")
    task_id = await ask(proxy, token)
    picky.accepted = "another"
    await answer(proxy, task_id, token)
    done = await task_reaches(proxy.client, task_id, "completed", "failed", headers=bearer(token))
    assert done.result["status"] == "failed"
    assert done.result["statusMessage"] == (
        "the upstream refused the task's credential (HTTP 401), and its owner has shown no newer one since it was sent"
    )
    assert "refused the call's credential (HTTP 401)" in done.result["error"]["message"]
    assert len(picky.seen) == 2  # tried once: no newer token to try


async def test_with_principal_authorization_a_refreshed_token_is_another_caller(make_proxy, picky, issuer):
    proxy = await make_proxy(picky.url, protocol="modern", tools=[{"match": "ask"}])
    first, refreshed = issuer.token("alice"), issuer.token("alice", kid="ec-1")
    task_id = await ask(proxy, first)
    other = await proxy.client.get_task(task_id, headers=bearer(refreshed))
    assert other.error is not None and "not found" in other.error["message"].lower()


async def test_a_token_shown_to_another_replica_reaches_the_call_through_redis(make_proxy, picky, issuer):
    process, url = start_redis()
    try:
        store = {"backend": "redis", "url": url, "key_prefix": "credentials:"}
        shared = {**security(issuer), "principal_key": "operator-key"}  # sealing needs the operator's key
        runs = await make_proxy(picky.url, protocol="modern", tools=[{"match": "ask"}], store=store, security=shared)
        other = await make_proxy(picky.url, protocol="modern", tools=[{"match": "ask"}], store=store, security=shared)
        first, refreshed = issuer.token("alice"), issuer.token("alice", kid="ec-1")
        task_id = await ask(runs, first)
        picky.accepted = refreshed
        # Seen by the replica that does not run the call: kept in Redis, sealed, for the one that does.
        await task_reaches(other.client, task_id, "input_required", headers=bearer(refreshed))
        await answer(other, task_id, refreshed)
        done = await task_reaches(other.client, task_id, "completed", "failed", headers=bearer(refreshed))
        assert done.result["status"] == "completed", done.result
        assert picky.seen == [f"Bearer {first}", f"Bearer {refreshed}"]
        # The credential kept for the call goes with the task's end, as the sealed call does.
        redis = sync_redis.Redis.from_url(url)
        assert redis.exists(f"credentials:credential:{task_id}", f"credentials:call:{task_id}") == 0
        redis.close()
    finally:
        stop(process)
