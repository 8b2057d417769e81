"""A test authorization server for the verified-callers tests: signing keys, a JWKS served on loopback (the
`issuer` fixture, tests/conftest.py), and tokens signed as an issuer signs them."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ISSUER = "https://issuer.example"
RESOURCE = "https://mcp.example.com/mcp"


class Issuer:
    """A test authorization server: its signing keys, its JWKS (served, and changed at will), and its tokens."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.published: list[str] = []
        self.answer: Any = None
        """None: the JWKS of the published keys; else what the JWKS endpoint answers instead (a status, bytes)."""
        self.fetches = 0
        self.url = ""
        self.add("rsa-1", rsa.generate_private_key(public_exponent=65537, key_size=2048))
        self.add("ec-1", ec.generate_private_key(ec.SECP256R1()))

    def add(self, kid: str, key: Any, *, publish: bool = True) -> None:
        self.keys[kid] = key
        if publish:
            self.published.append(kid)

    def jwks(self) -> dict[str, Any]:
        out = []
        for kid in self.published:
            public = self.keys[kid].public_key()
            algorithm = (
                jwt.algorithms.RSAAlgorithm if isinstance(public, rsa.RSAPublicKey) else jwt.algorithms.ECAlgorithm
            )
            jwk = json.loads(algorithm.to_jwk(public))
            out.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": out}

    def token(
        self, sub: str = "alice", *, kid: str = "rsa-1", headers: dict[str, Any] | None = None, **claims: Any
    ) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": RESOURCE, "sub": sub, "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex}
        body.update(claims)
        body = {key: value for key, value in body.items() if value is not None}
        algorithm = "RS256" if kid.startswith("rsa") else "ES256"
        return jwt.encode(body, self.keys[kid], algorithm=algorithm, headers={"kid": kid, **(headers or {})})

    async def serve(self, request: web.Request) -> web.StreamResponse:
        self.fetches += 1
        if isinstance(self.answer, int):
            return web.Response(status=self.answer)
        if isinstance(self.answer, bytes):
            return web.Response(body=self.answer, content_type="application/json")
        return web.json_response(self.jwks())


def security(issuer: Issuer, **jwt_settings: Any) -> dict[str, Any]:
    return {
        "principal": "jwt",
        "resource_url": RESOURCE,
        "jwt": {"jwks_url": issuer.url, "issuer": ISSUER, **jwt_settings},
        "resource_metadata": {"authorization_servers": [ISSUER], "scopes_supported": ["reports", "deploy"]},
    }


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
