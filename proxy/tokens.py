"""Verified callers (security.principal: jwt): each bearer token checked locally with PyJWT against the issuer's
signing keys (a JWKS), its issuer, audience, expiry and algorithm; the caller named by its claims, so that a
refreshed token is the same caller. A token once verified is kept until it expires, so that a request costs a
dict lookup, not a signature check. What a refusal looks like is RFC 6750's and the MCP authorization spec's:
401 (or 403 for a missing scope) with a WWW-Authenticate challenge naming the Protected Resource Metadata."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import structlog
from cachetools import TLRUCache
from multidict import MultiMapping

from .config import ConfigError, JwtConfig, SecurityConfig
from .jsonrpc import dumps

log = structlog.get_logger(__name__)

MAX_TOKEN_CHARS = 8192
"""Longer is refused unread (aiohttp reads header values of up to 8190 bytes anyway)."""
MAX_JWKS_BYTES = 512 * 1024
JWKS_TIMEOUT_S = 5.0
REFETCH_EVERY_S = 10.0
"""A key id the proxy does not hold makes it ask the issuer again, at most this often: made-up key ids cost the
issuer nothing."""
KEPT_TOKENS = 10_000
_MAX_KEYS = 100
"""The entries of a JWKS read at most."""
WELL_KNOWN = "/.well-known/oauth-protected-resource"


class TokenRefused(Exception):
    """A request the proxy refuses for its credential: 401 (none, or not valid) or 403 (a scope it lacks)."""

    def __init__(self, status: int, error: str | None, description: str, *, scope: str | None = None) -> None:
        super().__init__(description)
        self.status, self.error, self.description, self.scope = status, error, description, scope


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    principal: str
    """The principal claims' values, as one JSON array: the same for every token the caller is given."""
    scopes: frozenset[str]
    expires: float
    """Until when (epoch seconds, leeway included) the token is taken without checking it again."""


class Keys:
    """The issuer's signing keys: from a file, or fetched from jwks_url (again for a key id not held, at most every
    REFETCH_EVERY_S; the last good set kept when the issuer fails)."""

    def __init__(self, config: JwtConfig) -> None:
        self._url = str(config.jwks_url) if config.jwks_url is not None else None
        self._by_id: dict[str | None, jwt.PyJWK] = {}
        self._all: list[jwt.PyJWK] = []
        self._fetched_at = -REFETCH_EVERY_S
        self._fetching: asyncio.Future[None] | None = None
        if config.jwks_file is not None:
            try:
                self._take(_parse_jwks(Path(config.jwks_file).read_bytes()))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"security.jwt.jwks_file: {exc}") from None

    def known(self, kid: str | None) -> list[jwt.PyJWK]:
        """The keys a token with this key id may be signed with, from those held now."""
        if kid is None:
            return self._all
        key = self._by_id.get(kid)
        return [key] if key is not None else []

    async def lookup(self, kid: str | None) -> list[jwt.PyJWK]:
        """As `known`, asking the issuer first when it names a key id not held (or none is held yet)."""
        keys = self.known(kid)
        if keys or self._url is None:
            return keys
        if time.monotonic() - self._fetched_at >= REFETCH_EVERY_S:
            await self.refresh()
        return self.known(kid)

    async def refresh(self) -> None:
        """Fetch the JWKS (one fetch at a time; concurrent callers wait for it). A failure keeps the keys held."""
        if self._url is None:
            return
        if self._fetching is not None:
            await asyncio.shield(self._fetching)
            return
        self._fetching = asyncio.get_running_loop().create_future()
        self._fetched_at = time.monotonic()
        try:
            self._take(await _fetch_jwks(self._url))
            log.info("jwks_fetched", keys=len(self._all))
        except Exception as exc:  # whatever the issuer answers (or fails to), the keys held stay in use
            log.warning("jwks_unavailable", reason=str(exc) or type(exc).__name__, keys_kept=len(self._all))
        finally:
            self._fetching.set_result(None)
            self._fetching = None

    def _take(self, keys: list[jwt.PyJWK]) -> None:
        self._all = keys
        self._by_id = {key.key_id: key for key in keys}


async def _fetch_jwks(url: str) -> list[jwt.PyJWK]:
    timeout = aiohttp.ClientTimeout(total=JWKS_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        if response.status != 200:
            raise ValueError(f"the issuer answered HTTP {response.status}")
        body = await response.content.read(MAX_JWKS_BYTES + 1)
        if len(body) > MAX_JWKS_BYTES:
            raise ValueError(f"the JWKS exceeds {MAX_JWKS_BYTES} bytes")
        return _parse_jwks(body)


def _parse_jwks(body: bytes) -> list[jwt.PyJWK]:
    """The usable keys of a JWKS document. An entry PyJWT cannot use (a type, curve or algorithm it does not know,
    a key id that is not text) is left out, logged; ValueError when none is left."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError('not a JWKS: no "keys" list')
    keys = []
    for entry in entries[:_MAX_KEYS]:
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("kid", ""), str):
                raise ValueError("an entry that is not a key with a text key id")
            keys.append(jwt.PyJWK(entry))
        except Exception as exc:  # PyJWT raises more than its own errors for entries it cannot use
            log.warning("jwks_key_skipped", reason=str(exc)[:200] or type(exc).__name__)
    if not keys:
        raise ValueError("a JWKS without a usable key")
    return keys


class TokenVerifier:
    def __init__(self, security: SecurityConfig) -> None:
        config = security.jwt
        assert config is not None
        self._config = config
        self._audience = config.audience or str(security.resource_url)
        self._algorithms = list(config.algorithms)
        self._leeway = config.leeway_s
        self._claims = list(config.principal_claims)
        self.keys = Keys(config)
        self._kept: TLRUCache[str, Caller] = TLRUCache(KEPT_TOKENS, ttu=lambda _key, caller, _now: caller.expires,
                                                       timer=time.time)  # fmt: skip
        self.metadata_url = metadata_url(security)

    def cached(self, headers: MultiMapping[str]) -> Caller | None:
        """The caller of a token verified before and not expired yet: no signature checked, no key fetched."""
        token = _bearer(headers.get("Authorization"))
        return self._kept.get(token) if token is not None else None

    async def verify(self, headers: MultiMapping[str]) -> Caller:
        """The request's caller; TokenRefused (401) when it has no valid bearer token."""
        token = _bearer(headers.get("Authorization"))
        if token is None:
            raise TokenRefused(401, None, "This endpoint needs a bearer token")
        caller = self._kept.get(token)
        if caller is not None:
            return caller
        kid = _key_id(token)
        return self._check(token, await self.keys.lookup(kid), verify_exp=True)

    def principal_of(self, headers: MultiMapping[str]) -> str:
        """The principal of a request that passed `verify` (on this replica or another, perhaps long ago: a task's
        kept headers): the token is not checked for expiry again, only for being the issuer's."""
        token = _bearer(headers.get("Authorization"))
        if token is None:
            raise TokenRefused(401, None, "This endpoint needs a bearer token")
        caller = self._kept.get(token)
        if caller is not None:
            return caller.principal
        return self._check(token, self.keys.known(_key_id(token)), verify_exp=False).principal

    def _check(self, token: str, keys: list[jwt.PyJWK], *, verify_exp: bool) -> Caller:
        if not keys:
            raise TokenRefused(401, "invalid_token", "The token is signed with a key the issuer does not publish")
        options = {"require": ["exp", "iss", "aud", *self._claims], "verify_exp": verify_exp}
        failure: jwt.PyJWTError | None = None
        for key in keys[:8]:  # a token without a key id: the first keys of the set, not all of an endless one
            try:
                claims = jwt.decode(token, key, algorithms=self._algorithms, audience=self._audience,
                                    issuer=self._config.issuer, leeway=self._leeway, options=options)  # fmt: skip
                break
            except (jwt.InvalidSignatureError, jwt.InvalidAlgorithmError) as exc:  # perhaps the next key's
                failure = exc
            except jwt.PyJWTError as exc:
                raise TokenRefused(401, "invalid_token", _described(exc)) from None
        else:
            raise TokenRefused(401, "invalid_token", _described(failure or jwt.InvalidSignatureError()))
        values = [claims[name] for name in self._claims]
        if not all(isinstance(value, (str, int)) and not isinstance(value, bool) for value in values):
            raise TokenRefused(401, "invalid_token", "The token's principal claims are not strings")
        expires = claims["exp"]  # (a number whenever PyJWT checked it: not when asked of a token verified before)
        if not isinstance(expires, int | float) or isinstance(expires, bool):
            raise TokenRefused(401, "invalid_token", "The token's exp is not a number")
        caller = Caller(dumps(values).decode(), _scopes(claims), float(expires) + self._leeway)
        if verify_exp:
            self._kept[token] = caller
        return caller

    def challenge(self, refused: TokenRefused) -> str:
        """The WWW-Authenticate value for a refusal (RFC 6750 section 3, RFC 9728 section 5.1)."""
        parts = [f'resource_metadata="{self.metadata_url}"']
        if refused.error is not None:
            parts.insert(0, f'error="{refused.error}"')
        if refused.scope is not None:
            parts.append(f'scope="{refused.scope}"')
        if refused.error is not None:
            parts.append('error_description="{}"'.format(refused.description.replace('"', "'")))
        return "Bearer " + ", ".join(parts)


def missing_scopes(caller: Caller, needed: Iterable[str]) -> TokenRefused | None:
    """A 403 naming every scope the rule needs, when the caller's token lacks any of them."""
    needed = list(needed)
    if all(scope in caller.scopes for scope in needed):
        return None
    return TokenRefused(
        403, "insufficient_scope", f"This tool needs the scopes {' '.join(needed)}", scope=" ".join(needed)
    )


def metadata_url(security: SecurityConfig) -> str:
    """Where the Protected Resource Metadata is (RFC 9728 section 3.1: the well-known path, then the resource's)."""
    resource = str(security.resource_url) if security.resource_url is not None else ""
    if not resource:
        return WELL_KNOWN
    scheme, _, rest = resource.partition("://")
    host, _, path = rest.partition("/")
    return f"{scheme}://{host}{WELL_KNOWN}" + (f"/{path}" if path else "")


def _bearer(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused(401, "invalid_token", f"The token is longer than {MAX_TOKEN_CHARS} characters")
    return token


def _key_id(token: str) -> str | None:
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise TokenRefused(401, "invalid_token", _described(exc)) from None
    kid = header.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise TokenRefused(401, "invalid_token", "The token's key id is not a string")
    return kid


def _scopes(claims: dict[str, Any]) -> frozenset[str]:
    """The token's scopes: `scope` (RFC 8693, space-separated) or `scp` (a list, or a string as some issuers send)."""
    value = claims.get("scope", claims.get("scp"))
    if isinstance(value, str):
        return frozenset(value.split())
    if isinstance(value, list):
        return frozenset(item for item in value if isinstance(item, str))
    return frozenset()


def _described(exc: jwt.PyJWTError) -> str:
    """PyJWT's words for a refusal, as the client may see them (they name a claim or a check, never a value)."""
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "The token has expired"
    if isinstance(exc, jwt.InvalidAudienceError):
        return "The token was not issued for this server (audience)"
    if isinstance(exc, jwt.InvalidIssuerError):
        return "The token was not issued by the expected issuer"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return "The token is signed with an algorithm this server does not accept"
    if isinstance(exc, jwt.InvalidSignatureError):
        return "The token's signature does not verify"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"The token lacks the {exc.claim!r} claim"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "The token is not valid yet"
    return "The token is malformed"
