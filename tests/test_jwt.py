"""Verified callers (security.principal: jwt): real tokens signed by a test issuer whose JWKS is served on loopback,
checked by the proxy on both readers; the refusals as the MCP authorization spec asks (401 or 403 with a
WWW-Authenticate challenge naming the Protected Resource Metadata); a task that stays its owner's across a
refreshed token."""

from __future__ import annotations

import json
import time
import uuid

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from mcp_tasks_proxy import tokens
from mcp_tasks_proxy.config import ConfigError, parse_config
from tests.conftest import task_reaches
from tests.factories import headers_for, meta, request
from tests.issuer import ISSUER, RESOURCE, bearer, security
from tests.test_lane import lane_counts

METADATA = "https://mcp.example.com/.well-known/oauth-protected-resource/mcp"


@pytest.fixture
def front(both_fronts: str) -> str:
    return both_fronts


@pytest.fixture
async def proxy(make_proxy, mcp_upstream, issuer):
    return await make_proxy(
        mcp_upstream,
        protocol="modern",
        tools=[{"match": "slow_report"}, {"match": "echo_authorization", "task": "never", "scopes": ["deploy"]}],
        security=security(issuer),
    )


def challenge(reply) -> str:
    return reply.headers.get("WWW-Authenticate", "")


async def test_a_request_without_a_token_gets_401_naming_the_resource_metadata(proxy):
    reply = await proxy.client.call_tool("echo_traceparent", {}, tasks=False)
    assert reply.status == 401
    assert challenge(reply) == f'Bearer resource_metadata="{METADATA}"'
    assert json.loads(reply.body)["error_description"] == "This endpoint needs a bearer token"
    for scheme in ("Basic dXNlcjpwYXNz", "Bearer ", "Bearer"):
        refused = await proxy.client.call_tool("echo_traceparent", {}, tasks=False, headers={"Authorization": scheme})
        assert refused.status == 401, scheme
    for method in ("GET", "DELETE"):  # the standalone stream and a session's end: the MCP endpoint too
        headers = {"Accept": "text/event-stream", "MCP-Protocol-Version": "2026-07-28"}
        async with proxy.client.session.request(method, proxy.url, headers=headers) as response:
            assert response.status == 401, method
            assert response.headers["WWW-Authenticate"] == f'Bearer resource_metadata="{METADATA}"'
    base = proxy.url.removesuffix("/mcp")
    async with proxy.client.session.get(base + "/healthz") as response:
        assert response.status == 200  # not the MCP endpoint: no token asked


async def test_a_valid_token_is_served_and_still_reaches_the_upstream(proxy, issuer):
    token = issuer.token()
    for _ in range(3):
        reply = await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(token))
        assert reply.status == 200 and "result" in reply.message
    # A tool whose rule needs a scope: the token's own Authorization goes upstream as the client sent it.
    scoped = issuer.token(scope="reports deploy")
    reply = await proxy.client.call_tool("echo_authorization", {}, tasks=False, headers=bearer(scoped))
    assert reply.result["content"][0]["text"] == f"Bearer {scoped}"


async def test_a_token_verified_once_is_served_by_the_lane_from_then_on(make_proxy, mcp_upstream, issuer, front):
    proxy = await make_proxy(mcp_upstream, protocol="modern", security=security(issuer))
    token = issuer.token()
    for _ in range(3):
        assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(token))).status == 200
    relayed = lane_counts(proxy).get("relayed", 0)
    # The first request of a token is the application's (it verifies it), the next ones the lane's.
    assert relayed == (2 if front == "lane" else 0)


@pytest.mark.parametrize(
    "case",
    ["expired", "wrong_audience", "wrong_issuer", "not_yet_valid", "no_exp", "bad_signature", "alg_none",
     "hs256_with_the_public_key", "unknown_key", "malformed", "huge", "sub_not_a_string"],
)  # fmt: skip
async def test_a_token_that_is_not_valid_gets_401_invalid_token(proxy, issuer, case, monkeypatch):
    if case == "expired":
        token = issuer.token(exp=int(time.time()) - 120)  # past the 30 s leeway
    elif case == "wrong_audience":
        token = issuer.token(aud="https://other.example/mcp")
    elif case == "wrong_issuer":
        token = issuer.token(iss="https://evil.example")
    elif case == "not_yet_valid":
        token = issuer.token(nbf=int(time.time()) + 600)
    elif case == "no_exp":
        token = issuer.token(exp=None)
    elif case == "bad_signature":
        head, body, signature = issuer.token().split(".")
        token = f"{head}.{body}.{signature[:-4]}AAAA"
    elif case == "alg_none":
        token = jwt.encode({"iss": ISSUER, "aud": RESOURCE, "sub": "alice", "exp": int(time.time()) + 60}, None,
                           algorithm="none", headers={"kid": "rsa-1"})  # fmt: skip
    elif case == "hs256_with_the_public_key":  # the classic confusion: the RSA public key as an HMAC secret
        public = (
            issuer.keys["rsa-1"]
            .public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        import hashlib
        import hmac

        def b64(data: bytes) -> str:
            import base64

            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        claims = {"iss": ISSUER, "aud": RESOURCE, "sub": "alice", "exp": int(time.time()) + 60}
        signing = b64(json.dumps({"alg": "HS256", "kid": "rsa-1"}).encode()) + "." + b64(json.dumps(claims).encode())
        token = signing + "." + b64(hmac.new(public, signing.encode(), hashlib.sha256).digest())
    elif case == "unknown_key":
        issuer.add("rsa-2", rsa.generate_private_key(public_exponent=65537, key_size=2048), publish=False)
        token = issuer.token(kid="rsa-2")
    elif case == "malformed":
        token = "not.a.token"
    elif case == "huge":  # past the proxy's bound, within the header aiohttp reads (8190 bytes)
        monkeypatch.setattr(tokens, "MAX_TOKEN_CHARS", 2000)
        token = issuer.token(padding="x" * 3000)
    else:
        token = issuer.token(sub={"id": 1})  # type: ignore[arg-type]
    reply = await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(token))
    assert reply.status == 401, (case, reply.body)
    assert challenge(reply).startswith('Bearer error="invalid_token", resource_metadata="'), case
    assert json.loads(reply.body)["error"] == "invalid_token"
    if case == "huge":
        huge = issuer.token(padding="x" * 9000)  # past what aiohttp reads of a header: its own 400
        assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(huge))).status == 400
    # The proxy goes on serving a valid token afterwards.
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(issuer.token()))).status == 200


async def test_a_tool_whose_rule_needs_a_scope_gets_403_naming_it(proxy, issuer):
    for scopes in (None, "reports", ["reports"]):
        claims = {"scope": scopes} if isinstance(scopes, str) else {"scp": scopes}
        token = issuer.token(**claims)
        reply = await proxy.client.call_tool("echo_authorization", {}, tasks=False, headers=bearer(token))
        assert reply.status == 403, scopes
        assert challenge(reply) == (
            f'Bearer error="insufficient_scope", resource_metadata="{METADATA}", scope="deploy", '
            'error_description="This tool needs the scopes deploy"'
        )
    for claims in ({"scope": "deploy reports"}, {"scp": ["deploy"]}):
        reply = await proxy.client.call_tool(
            "echo_authorization", {}, tasks=False, headers=bearer(issuer.token(**claims))
        )
        assert reply.status == 200, claims
    # A tool without scopes in its rule needs none.
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(issuer.token()))).status == 200


async def test_a_task_stays_its_owners_across_a_refreshed_token(proxy, issuer):
    first = issuer.token("alice")
    created = await proxy.client.call_tool("slow_report", {"topic": "t", "seconds": 0}, headers=bearer(first))
    task_id = created.result["taskId"]
    refreshed = issuer.token("alice", kid="ec-1")  # another token, another key, the same caller
    assert refreshed != first
    done = await task_reaches(proxy.client, task_id, "completed", headers=bearer(refreshed))
    assert done.result["status"] == "completed"
    other = await proxy.client.get_task(task_id, headers=bearer(issuer.token("mallory")))
    assert other.error is not None and "not found" in other.error["message"].lower()


async def test_a_rotated_key_is_fetched_and_an_issuer_that_fails_leaves_the_last_keys_in_use(
    proxy, issuer, monkeypatch
):
    monkeypatch.setattr(tokens, "REFETCH_EVERY_S", 0.0)
    kept = issuer.token("alice")
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(kept))).status == 200
    issuer.add("rsa-2", rsa.generate_private_key(public_exponent=65537, key_size=2048))  # published: a rotation
    fetches = issuer.fetches
    rotated = issuer.token("alice", kid="rsa-2")
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(rotated))).status == 200
    assert issuer.fetches == fetches + 1
    for answer in (503, b"{not json", b'{"keys": [{"kty": "nonsense"}]}', b"[]"):
        issuer.answer = answer
        unknown = issuer.token("alice", kid="rsa-3") if "rsa-3" in issuer.keys else None
        if unknown is None:
            issuer.add("rsa-3", rsa.generate_private_key(public_exponent=65537, key_size=2048), publish=False)
            unknown = issuer.token("alice", kid="rsa-3")
        reply = await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(unknown))
        assert reply.status == 401, answer
        # Keys held before still verify new tokens.
        fresh = issuer.token("alice", kid="ec-1")
        assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(fresh))).status == 200, answer


async def test_unknown_key_ids_do_not_make_the_proxy_ask_the_issuer_each_time(proxy, issuer):
    issuer.add("rsa-9", rsa.generate_private_key(public_exponent=65537, key_size=2048), publish=False)
    fetches = issuer.fetches
    for _ in range(5):
        token = issuer.token("alice", kid="rsa-9", jti=uuid.uuid4().hex)
        assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(token))).status == 401
    assert issuer.fetches - fetches <= 1  # at most one fetch in REFETCH_EVERY_S


async def test_the_protected_resource_metadata_is_served_at_both_well_known_paths(proxy):
    base = proxy.url.removesuffix("/mcp")
    for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
        async with proxy.client.session.get(base + path) as response:
            assert response.status == 200, path
            document = await response.json()
        assert document == {
            "resource": RESOURCE,
            "authorization_servers": [ISSUER],
            "scopes_supported": ["reports", "deploy"],
            "bearer_methods_supported": ["header"],
            "resource_signing_alg_values_supported": ["RS256", "ES256"],
        }


@pytest.mark.parametrize(
    "settings, error",
    [
        ({"principal": "jwt"}, "principal: jwt needs security.jwt"),
        ({"principal": "jwt", "jwt": {"issuer": ISSUER, "jwks_url": "http://keys.example/jwks"},
          "resource_url": RESOURCE}, "jwks_url must be https"),
        ({"principal": "jwt", "jwt": {"issuer": ISSUER, "jwks_url": "https://keys.example/jwks"}},
         "needs the tokens' audience"),
        ({"principal": "jwt", "jwt": {"issuer": ISSUER, "jwks_url": "https://k.example/jwks", "algorithms": ["none"]},
          "resource_url": RESOURCE}, "algorithms"),
        ({"principal": "jwt", "jwt": {"issuer": ISSUER, "jwks_url": "https://k.example/jwks", "algorithms": ["HS256"]},
          "resource_url": RESOURCE}, "algorithms"),
        ({"jwt": {"issuer": ISSUER, "jwks_url": "https://k.example/jwks"}}, "only with principal: jwt"),
        ({"principal": "jwt", "jwt": {"issuer": ISSUER, "jwks_url": "https://k.example/jwks", "secret": "x"},
          "resource_url": RESOURCE}, "security.jwt.secret: unknown key"),
    ],
)  # fmt: skip
def test_a_policy_that_cannot_verify_tokens_is_refused_with_what_is_wrong(settings, error):
    with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
        parse_config({"upstream": {"url": "http://127.0.0.1:1/mcp"}, "security": settings})


def test_scopes_without_verified_tokens_are_refused():
    with pytest.raises(ConfigError, match="scopes are checked only with security.principal: jwt"):
        parse_config({"upstream": {"url": "http://127.0.0.1:1/mcp"}, "tools": [{"match": "x", "scopes": ["a"]}]})


@pytest.mark.parametrize(
    "path", ["/./mcp", "/x/../mcp", "/%2e/mcp", "//mcp", "/mcp/", "/MCP", "/mcp;x", "/mcp%2F", "/elsewhere"]
)
async def test_no_path_reaches_the_upstream_without_a_token_nor_the_endpoint_under_another_name(proxy, issuer, path):
    """Every request the proxy forwards needs a token, whatever its path; and a path the upstream might take for
    its MCP endpoint (collapsed, in another case, with a slash more) is refused even with one: it would pass by the
    checks made there (scopes, limits)."""
    from tests.test_lane import port_of, raw_exchange

    message = request("tools/call", {"name": "echo_authorization", "arguments": {}, "_meta": meta(tasks=False)})
    body = json.dumps(message).encode()

    async def post(headers: dict[str, str]) -> tuple[int, bytes]:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in {**headers_for(message), **headers}.items())
        raw = await raw_exchange(port_of(proxy), head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return int(raw.split(b" ", 2)[1]), raw

    status, raw = await post({})
    assert status == 401, raw[:300]
    status, raw = await post(bearer(issuer.token(scope="deploy")))
    if path == "/elsewhere":  # another path of the upstream's: relayed, with the token
        assert status != 401, raw[:300]
    else:
        assert status == 404 and b"the MCP endpoint is /mcp" in raw, raw[:300]


async def test_a_jwks_with_entries_pyjwt_cannot_use_keeps_the_others(
    make_proxy, mcp_upstream, issuer, tmp_path, monkeypatch
):
    """An issuer's JWKS may hold keys of kinds PyJWT does not read: they are left out, the rest verify, whether the
    set comes from a file at start or from the issuer later; a document that is not a JWKS at all keeps the keys
    held."""
    good = issuer.jwks()["keys"]
    odd = [{"kty": "RSA", "alg": "none", "kid": "odd-alg", "n": "AQAB", "e": "AQAB"}, {"kty": "EC", "kid": ["x"]}, 7]
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": odd + good}))
    settings = security(issuer)
    settings["jwt"] = {"jwks_file": str(path), "issuer": ISSUER}
    proxy = await make_proxy(mcp_upstream, protocol="modern", security=settings)
    for kid in ("rsa-1", "ec-1"):
        reply = await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(issuer.token(kid=kid)))
        assert reply.status == 200, kid
    # From the issuer: garbage nested past any parser's depth, then an odd entry beside a new key.
    served = await make_proxy(mcp_upstream, protocol="modern", security=security(issuer))
    monkeypatch.setattr(tokens, "REFETCH_EVERY_S", 0.0)

    async def status(token: str) -> int:
        return (await served.client.call_tool("pid", {}, tasks=False, headers=bearer(token))).status

    issuer.answer = b"[" * 200_000
    issuer.add("rsa-2", rsa.generate_private_key(public_exponent=65537, key_size=2048), publish=False)
    assert await status(issuer.token(kid="rsa-2")) == 401
    assert await status(issuer.token()) == 200
    issuer.published.append("rsa-2")
    issuer.answer = json.dumps({"keys": odd + issuer.jwks()["keys"]}).encode()
    assert await status(issuer.token(kid="rsa-2")) == 200


async def test_a_token_without_a_key_id_is_tried_against_each_key(proxy, issuer):
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": RESOURCE, "sub": "alice", "exp": now + 60}
    token = jwt.encode(claims, issuer.keys["ec-1"], algorithm="ES256")  # the set lists an RSA key first
    assert "kid" not in jwt.get_unverified_header(token)
    assert (await proxy.client.call_tool("pid", {}, tasks=False, headers=bearer(token))).status == 200
