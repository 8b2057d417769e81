"""Verified callers in one run: mcp-tasks-proxy in front of a server without auth of its own accepts only the tokens
your issuer signs, a task stays its caller's across a token refresh, and a limit holds per caller.

Run from the repository root after `pip install '.[examples]'`:
    python examples/verified_callers.py                                  # one proxy, the memory store
    python examples/verified_callers.py --redis redis://127.0.0.1:6379/0  # two replicas sharing one Redis

The script plays the authorization server: it makes a signing key, writes the JWKS the proxy reads
(security.jwt.jwks_file; in production, jwks_url names your issuer's), and signs tokens as an issuer would. With
--redis, every request after the first goes to the other replica, as a round-robin balancer would send it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import jwt
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import demo  # noqa: E402  (a sibling script: its port checks and waits)
from task_client import PROTOCOL_VERSION, ClientError, envelope  # noqa: E402

ISSUER = "https://issuer.example"


class Issuer:
    """The authorization server's part: one signing key, its JWKS, and tokens for a resource."""

    def __init__(self, audience: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.audience = audience

    def jwks(self) -> dict[str, Any]:
        public = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": "example-1", "use": "sig", "alg": "ES256"}]}

    def token(self, sub: str, lifetime_s: int = 300) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "aud": self.audience, "sub": sub, "iat": now, "exp": now + lifetime_s,
                  "jti": uuid.uuid4().hex}  # fmt: skip
        return jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": "example-1"})


def post(url: str, method: str, params: dict[str, Any], token: str | None) -> tuple[int, dict[str, str], Any]:
    """One JSON-RPC request with the 2026-07-28 headers and the bearer token: status, headers and parsed body."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": PROTOCOL_VERSION, "Mcp-Method": method}  # fmt: skip
    if method == "tools/call":
        headers["Mcp-Name"] = params["name"]
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    body = json.dumps({"jsonrpc": "2.0", "id": uuid.uuid4().hex[:8], "method": method, "params": params}).encode()
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30)
    except urllib.error.HTTPError as exc:  # 401, 403, 429: still an answer
        response = exc
    with response:
        raw = response.read()
        return response.status, dict(response.headers), json.loads(raw) if raw else None


def step(text: str) -> None:
    print(f"\n== {text}")


def walkthrough(urls: list[str], issuer: Issuer) -> int:
    """Each step prints what was sent and what came back; any surprise ends the run with exit status 1."""
    turn = iter(urls * 100)  # round-robin over the replicas (one URL without --redis)

    def at() -> str:
        url = next(turn)
        print(f"--> {url}")
        return url

    def expect(condition: bool, what: str) -> None:
        if not condition:
            raise ClientError(f"walk-through: {what}")

    step("No token: 401, and a challenge that names where to learn about this resource")
    status, headers, _ = post(at(), "tools/list", {"_meta": envelope()}, None)
    print(f"HTTP {status}, WWW-Authenticate: {headers.get('WWW-Authenticate')}")
    expect(status == 401 and "resource_metadata=" in headers.get("WWW-Authenticate", ""), "no 401 challenge")

    step("A token signed by another key: 401 invalid_token")
    status, headers, _ = post(at(), "tools/list", {"_meta": envelope()}, Issuer(issuer.audience).token("alice"))
    print(f"HTTP {status}, WWW-Authenticate: {headers.get('WWW-Authenticate')}")
    expect(status == 401 and 'error="invalid_token"' in headers.get("WWW-Authenticate", ""), "a forged token passed")

    step("Alice's token: slow_report becomes a task")
    first_token = issuer.token("alice")
    call = {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 4}, "_meta": envelope()}
    status, _, answer = post(at(), "tools/call", call, first_token)
    print(f"HTTP {status}: {json.dumps(answer)}")
    expect(status == 200 and answer.get("result", {}).get("resultType") == "task", "no task was made")
    task_id = answer["result"]["taskId"]

    step("While it runs, a second call of hers: past the limit of one slow call at once per caller")
    status, headers, answer = post(at(), "tools/call", call, first_token)
    print(f"HTTP {status}, Retry-After: {headers.get('Retry-After')}: {json.dumps(answer)}")
    expect(status == 429 and answer["error"]["data"]["limit"] == "one-slow-call", "the limit did not hold")

    step("Her client refreshes its token (a new one, the same subject): the task is still hers")
    refreshed = issuer.token("alice")
    status, _, answer = post(at(), "tasks/get", {"taskId": task_id, "_meta": envelope()}, refreshed)
    print(f"HTTP {status}: {json.dumps(answer)}")
    expect(status == 200 and answer["result"]["status"] == "working", "the refreshed token lost the task")

    step("Bob, with a valid token of his own, cannot see it")
    status, _, answer = post(at(), "tasks/get", {"taskId": task_id, "_meta": envelope()}, issuer.token("bob"))
    print(f"HTTP {status}: {json.dumps(answer)}")
    expect("error" in answer, "another caller read the task")

    step("Alice follows her task to its result with the refreshed token")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(1)
        _, _, answer = post(next(turn), "tasks/get", {"taskId": task_id, "_meta": envelope()}, refreshed)
        task = answer["result"]
        print(f"    status={task['status']!r} statusMessage={task.get('statusMessage')!r}")
        if task["status"] in ("completed", "failed", "cancelled"):
            expect(task["status"] == "completed", f"the task ended {task['status']}")
            print(f"<-- {json.dumps(task['result']['content'][0]['text'])}")
            break
    else:
        raise ClientError("walk-through: the task did not end within 60 s")
    print("\nDone: only the issuer's tokens were accepted, the task outlived a token refresh, the limit held.")
    return 0


def policy(server_url: str, resource_url: str, jwks: Path, redis_url: str | None) -> dict[str, Any]:
    """The policy this walk-through runs: what a newcomer adds to their own (docs/getting-started.md)."""
    written: dict[str, Any] = {
        "upstream": {"url": server_url},
        "tools": [{"match": "slow_*"}],
        "security": {
            "principal": "jwt",
            "resource_url": resource_url,  # the tokens' audience: the public URL of the MCP endpoint
            "jwt": {"jwks_file": str(jwks), "issuer": ISSUER},
            "resource_metadata": {"authorization_servers": [ISSUER]},
        },
        "limits": {
            "rates": [
                {"per": "caller", "requests_per_s": 20, "burst": 40},
                {"per": "caller", "match": "slow_*", "concurrency": 1, "name": "one-slow-call"},
            ]
        },
    }
    if redis_url is not None:
        prefix = f"verified-callers-{uuid.uuid4().hex[:6]}:"  # a run of its own, whatever the Redis holds
        written["store"] = {"backend": "redis", "url": redis_url, "key_prefix": prefix}
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-port", type=int, default=9000, help="port of the example MCP server")
    parser.add_argument("--proxy-port", type=int, default=8080, help="port of mcp-tasks-proxy")
    parser.add_argument("--second-port", type=int, help="with --redis, port of the second replica (default: one more)")
    parser.add_argument("--redis", metavar="URL", help="run two replicas that share this Redis")
    args = parser.parse_args()
    ports = [args.proxy_port]
    if args.redis:
        ports.append(args.second_port or args.proxy_port + 1)
    demo.require_free(args.server_port, "--server-port")
    for port in ports:
        demo.require_free(port, "--proxy-port" if port == args.proxy_port else "--second-port")
    server_url = f"http://127.0.0.1:{args.server_port}/mcp"
    urls = [f"http://127.0.0.1:{port}/mcp" for port in ports]
    issuer = Issuer(audience=urls[0])
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as work:
        jwks = Path(work) / "jwks.json"
        jwks.write_text(json.dumps(issuer.jwks()))
        written = Path(work) / "policy.yaml"
        written.write_text(yaml.safe_dump(policy(server_url, urls[0], jwks, args.redis)))
        try:
            processes.append(subprocess.Popen([sys.executable, str(HERE / "slow_server.py"), str(args.server_port)]))
            demo.wait_for_port(args.server_port, processes[0], "the example server")
            for port in ports:
                proxy = subprocess.Popen([sys.executable, "-m", "mcp_tasks_proxy", "--config", str(written),
                                          "--port", str(port), "--log-level", "warning"])  # fmt: skip
                processes.append(proxy)
                demo.wait_for_port(port, proxy, "mcp-tasks-proxy")
                demo.wait_ready(port, proxy)
            return walkthrough(urls, issuer)
        except ClientError as exc:
            print(exc, file=sys.stderr)
            return 1
        finally:
            demo.stop(*reversed(processes))


if __name__ == "__main__":
    sys.exit(main())
