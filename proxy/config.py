"""The proxy's one configuration object: the YAML policy file, validated by pydantic, plus operator overrides."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import ipaddress
import math
import os
import re
import ssl
import typing
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .store.redis_target import hash_tag, parse_store_url


class ConfigError(Exception):
    """The configuration cannot be used; the message is one line that names the offending key."""


class _Strict(BaseModel):
    # extra="forbid": a typo in the YAML stops start-up with the key's path instead of being ignored.
    # use_attribute_docstrings: the docstring under a field is its description (the policy reference, docs/).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TaskMode(StrEnum):
    NEVER = "never"
    OPTIONAL = "optional"
    REQUIRED = "required"


PositiveInt = Annotated[int, Field(gt=0)]


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    """The address to listen on: loopback by default (a sidecar's clients share its pod); 0.0.0.0 for every one."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    """The port to listen on (0: one the system picks)."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 15.0
    """How long a client connection may go without a complete request head: from its start to its first request,
    and between requests on a kept-alive connection. Past it the connection is closed (slow senders, idle ones)."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """How long a client may take to send a request's body; past it the request gets HTTP 408."""
    max_connections: PositiveInt = 4096
    """Open client connections at most; past it a new connection is answered HTTP 503 and closed."""
    advertise_url: AnyHttpUrl | None = None
    """Where the other replicas reach this one (http://10.0.0.5:8080; in Kubernetes from the pod IP). With the Redis
    store, a request for a 2025 session another replica holds is forwarded to it (session_routing.py); unset, sessions
    need affinity as before."""
    console: bool | None = None
    """The task console at /console: a page to call tools and watch, answer and cancel their tasks in a browser. It
    is a client of /mcp like any other (the same Host/Origin checks, the same principal). Unset: on when listening on
    loopback, off otherwise. While on, /console and /console/* are the proxy's, not forwarded upstream."""

    @property
    def console_on(self) -> bool:
        return self.is_loopback if self.console is None else self.console

    @property
    def is_loopback(self) -> bool:
        """Whether only this host (this container, this pod) can connect: 127.0.0.0/8, ::1 or localhost."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name other than localhost, or every address ("", "0.0.0.0", "::")


class StdioConfig(_Strict):
    """A server the proxy starts itself (upstream.command), spoken to over its stdin and stdout."""

    inherit_env: list[str] = ["HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER"]
    """The proxy's environment variables the child gets (as the SDKs' stdio clients pass), before upstream.env."""
    max_line_bytes: PositiveInt | None = None
    """The longest line (one message) read from the child; a longer one is dropped and fails its call. Default:
    limits.max_result_bytes."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """How long the child may take to answer its first request (initialize or server/discover); also how long a
    request waits for a child that is restarting."""
    restart_min_s: Annotated[float, Field(gt=0)] = 0.5
    """The first delay before restarting a child that exited; it doubles on each exit in a row."""
    restart_max_s: Annotated[float, Field(gt=0)] = 30.0
    """The longest delay between restarts of a child that keeps exiting."""
    stop_grace_s: Annotated[float, Field(ge=0)] = 2.0
    """On shutdown: how long the child has to exit once its stdin is closed, before SIGTERM."""
    term_grace_s: Annotated[float, Field(ge=0)] = 2.0
    """After SIGTERM: how long before SIGKILL."""
    children: PositiveInt = 1
    """How many copies of the server the proxy starts (each restarted and stopped alike)."""
    max_children: PositiveInt | None = None
    """How many copies may run at most (default: 4, or children if more). Another is started when a caller has no
    copy of its own free for a call (see share_children), or, shared, when a call that may be asked something finds
    every copy waiting on an open question of another caller's; copies started so stay. 1 with children 1: always
    one copy."""
    share_children: bool = False
    """false: each copy serves one caller (a principal, or an anonymous client's address) until it is restarted for
    another, so that nothing a server keeps of a caller (the roots it was given, its subscriptions, its log level,
    an abandoned question) reaches the next. A caller with no copy of its own free takes a copy nobody has, a new
    one up to max_children, or the idle copy of another caller, restarted (its state gone); past that its call
    waits up to start_timeout_s for one, then fails. true: any copy serves any caller, for servers that keep
    nothing of their clients."""
    dispatch: Literal["shared", "exclusive"] = "shared"
    """stdio ties a 2025 server's question to no call, so with two calls that may be asked something in flight on
    one copy the proxy must refuse it. shared: each request goes to the copy with the fewest in flight, but never a
    call that may be asked something to a copy waiting on an open question (another copy is started if need be, up
    to max_children). exclusive: such a call goes to a copy with no other such call, waiting for one to be free."""
    max_in_flight: PositiveInt = 10_000
    """Requests the child may have in flight at once; past it a call fails at once instead of queueing."""
    max_sessions: PositiveInt = 10_000
    """2025-era client sessions the proxy keeps for the child, or for a server that speaks 2026-07-28 only (over
    HTTP too, then): it answers their initialize itself. Past it the least recently used idle one (no call in
    flight, no GET stream open) is ended: its client gets 404 and initializes again. A busy session is never ended
    to make room; when all are busy, a new one is refused (503)."""
    max_sessions_per_principal: PositiveInt = 64
    """Of those, one caller's: a principal's, or an anonymous caller's network address (anonymous clients are not
    one caller). Past it that caller's own least recently used idle session is ended, never another caller's; when
    all of its sessions are busy, its new one is refused (503)."""

    @model_validator(mode="after")
    def _children_within_max(self) -> StdioConfig:
        if self.max_children is not None and self.max_children < self.children:
            raise ValueError(f"max_children ({self.max_children}) is below children ({self.children})")
        return self


class TlsConfig(_Strict):
    """TLS to a server the proxy connects to (an https:// upstream, a rediss:// store): whose certificates to trust,
    and the proxy's own for mTLS."""

    verify: bool = True
    """Check the server's certificate and host name; false only for a test bench, never in production."""
    ca_file: str | None = None
    """A PEM bundle of the CAs to trust instead of the system's (a private CA)."""
    cert_file: str | None = None
    """The proxy's client certificate (PEM, may hold the key too), for an upstream that requires mTLS."""
    key_file: str | None = None
    """The client certificate's private key (PEM), when not in cert_file."""

    @model_validator(mode="after")
    def _loadable(self) -> TlsConfig:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the client certificate it is the key of)")
        self.ssl_context()  # a missing file or a key that does not match fails here, at start-up, naming it
        return self

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        where = ""
        try:
            if self.ca_file is not None:
                where = f"ca_file {self.ca_file}"
                context.load_verify_locations(cafile=self.ca_file)
            if self.cert_file is not None:
                where = f"cert_file {self.cert_file}" + (f" / key_file {self.key_file}" if self.key_file else "")
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{where}: {exc.strerror or exc.reason or exc}") from None
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


class UpstreamConfig(_Strict):
    url: AnyHttpUrl | None = None
    """The MCP endpoint of an HTTP server (Streamable HTTP, either era), e.g. http://127.0.0.1:9000/mcp."""
    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    """Instead of url: the argv of a stdio server the proxy starts and speaks to over stdin/stdout."""
    env: dict[str, str] = {}
    """upstream.command: environment variables for the child, added to stdio.inherit_env."""
    cwd: str | None = None
    """upstream.command: the child's working directory (default: the proxy's)."""
    stdio: StdioConfig = StdioConfig()
    tls: TlsConfig = TlsConfig()
    """For an https:// url: CA bundle, client certificate (mTLS), verification."""
    protocol: Literal["auto", "modern", "legacy"] = "auto"
    """The upstream's era: auto probes server/discover and falls back to initialize, as the official SDKs do."""
    connect_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """How long to wait for a TCP connection to the upstream before the call fails."""
    max_sessions: PositiveInt = 64
    """Legacy upstreams: sessions the proxy keeps open (one per credential). Past it the least recently used idle
    one is ended; one with a call in flight never is, and when all have one, a call that needs a new session fails
    saying so."""
    max_sessions_per_caller: PositiveInt = 16
    """Legacy upstreams over HTTP: of max_sessions, one caller's at most. A call that may be asked something has a
    session to itself while there is room; past this its caller's calls share its sessions, so that one caller's
    many calls never leave others without one."""
    round_wait_s: Annotated[float, Field(gt=0)] = 20.0
    """Legacy upstreams: how long a synchronous call that asked for input (an MRTR round: its answer is
    input_required) stays open upstream for the client's retry. MRTR lets a client read a round and never come back;
    past this the call is cancelled there, and the session or stdio child it held serves other calls. Raise it when
    people answer forms in synchronous calls; a task's questions wait input_wait_s instead."""
    input_wait_s: Annotated[float, Field(gt=0)] = 300.0
    """Legacy upstreams: how long a task's call that asked for input stays open upstream for the client's answers
    (tasks/update); past this the task fails, the call is cancelled there, and its session or child is free."""

    @model_validator(mode="after")
    def _one_upstream(self) -> UpstreamConfig:
        if self.url is not None and self.command is not None:
            raise ValueError("url and command are exclusive: an upstream is reached over HTTP or started over stdio")
        if self.command is None and (self.env or self.cwd is not None):
            raise ValueError("env and cwd apply to upstream.command only")
        if self.tls != TlsConfig() and not (self.url is not None and self.url.scheme == "https"):
            raise ValueError("tls applies to an https:// upstream.url only")
        return self


class TaskDefaults(_Strict):
    ttl_ms: PositiveInt = 3_600_000
    """How long a task is kept after creation; fixed at creation, not extended by updates."""
    poll_interval_ms: PositiveInt = 2_000
    """The polling interval suggested to clients in every task."""
    max_tasks: PositiveInt = 10_000
    """Cap on stored tasks; the oldest finished tasks are evicted first, working tasks never."""
    max_input_rounds: PositiveInt = 10
    """How many times one task's upstream may answer input_required before the task fails."""
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    """On shutdown, how long running tasks may still finish before they are failed."""


class RetryPolicy(_Strict):
    attempts: Annotated[int, Field(ge=1, le=100)] = 3
    """How many times a call may be sent, the first included. A request that never left (a refused connection) is
    sent again for every rule; one that may have reached the server (a reset before any answer, HTTP 429, 502, 503
    or 504, a stdio child that exited mid-call) only when the rule is idempotent."""
    backoff_ms: Annotated[int, Field(ge=0)] = 200
    """The wait before the first retry; it doubles with each later one, with random jitter, up to max_backoff_ms. A
    longer Retry-After from the server is honoured. Every attempt and wait fits in the rule's timeout_s."""
    max_backoff_ms: Annotated[int, Field(ge=0)] = 5000
    """The longest wait between two attempts."""


class ToolRule(_Strict):
    match: Annotated[str, Field(min_length=1)]
    """A tool name or a shell-style glob (`render_*`); the first rule that matches wins."""
    task: TaskMode = TaskMode.OPTIONAL
    """optional: a task when the client declares the extension; required: only as a task; never: passes through."""
    sync_window_ms: Annotated[int, Field(ge=0)] = 0
    """Wait this long for the upstream; a result in time is returned directly, otherwise a task."""
    timeout_s: Annotated[float, Field(gt=0)] = 3600.0
    """The limit of each input round of a background call (its retries and their waits included); past it the task
    fails."""
    max_input_rounds: PositiveInt | None = None
    """Overrides tasks.max_input_rounds for this rule's tasks."""
    max_concurrency: PositiveInt | None = None
    """At most this many background calls of each matching tool at once on this replica (None: no limit)."""
    on_limit: Literal["queue", "refuse"] = "queue"
    """Past max_concurrency: queue the task until a call ends, or refuse the tools/call with an error."""
    ttl_ms: PositiveInt | None = None
    """Overrides tasks.ttl_ms for this rule's tasks."""
    poll_interval_ms: PositiveInt | None = None
    """Overrides tasks.poll_interval_ms for this rule's tasks."""
    durable: bool = True
    """Clients without tasks (2025-era clients, 2026 clients without the extension) get a durable call: the call
    runs as a task would, and their response stream is kept alive (and resumable for 2025-11-25 clients) until the
    result. False: such clients' calls pass through untouched."""
    keepalive_s: Annotated[float, Field(gt=0, le=300)] = 15.0
    """A durable call's stream sends something at least this often: notifications/progress when the client sent a
    progressToken, else an SSE comment. Below the idle timeouts of clients, gateways and load balancers."""
    max_stream_s: Annotated[float, Field(gt=0)] = 300.0
    """2025-11-25 clients: a durable call's stream is closed after this long (its events carry ids and a retry
    delay), and the client resumes it with GET and Last-Event-ID, on any replica. Below any limit on how long a
    connection may stay open."""
    idempotent: bool | Literal["hint"] = False
    """True: the tool may run again with the same arguments without harm (a read, a lookup, an upsert), so a call
    that may have reached the server without an answer coming back is sent again (retry). False: only a call that
    never left is sent again. "hint": as true for the tools whose annotations in the upstream's tools/list say
    readOnlyHint or idempotentHint (the operator trusts this server's hints), else as false."""
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    scopes: list[Annotated[str, Field(min_length=1, pattern=r"^[\x21\x23-\x5b\x5d-\x7e]+$")]] = []
    """With principal: jwt, the scopes a token must hold (its `scope` or `scp` claim) to call a matching tool;
    without them, HTTP 403 with a WWW-Authenticate challenge naming them all."""

    def matches(self, tool_name: str) -> bool:
        return _matcher(self.match)(tool_name)


@functools.cache
def _matcher(pattern: str) -> Callable[[str], bool]:
    """A rule's glob compiled once (every tools/call asks every rule before the one that matches); a plain name is
    compared as it is. Cached by pattern: patterns come from the policy file, a bounded set."""
    if not any(char in pattern for char in "*?["):
        return pattern.__eq__
    match = re.compile(fnmatch.translate(pattern)).match
    return lambda name: match(name) is not None


class StoreConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    """memory: one process, nothing to install; redis: shared by several replicas."""
    url: str | None = None
    """redis://[user:password@]host:port/db (rediss:// for TLS), unix:///path.sock, or a Sentinel's service:
    redis+sentinel://[user:password@]host:port[,host:port]/service[/db] (rediss+sentinel:// for TLS), or a Redis
    Cluster's nodes: redis+cluster://[user:password@]host:port[,host:port] (rediss+cluster://; key_prefix then
    needs a hash tag); required for the redis backend."""
    tls: TlsConfig = TlsConfig()
    """For a rediss:// url: CA bundle, client certificate (mTLS), verification."""
    key_prefix: str = "mcp-tasks-proxy:"
    """Every key the proxy writes starts with this, so several deployments can share one Redis."""
    lease_s: Annotated[float, Field(gt=0)] = 10.0
    """A replica renews its lease every lease_s/3; when it lapses, its running tasks are failed."""
    reap_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """How often each replica looks for running tasks of lost replicas (lost ones end within lease_s + this)."""
    timeout_s: Annotated[float, Field(gt=0)] = 2.0
    """Limit of each Redis call; past it the request that needed it gets -32603 instead of hanging."""
    reconcile_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """How often each replica re-reads the tasks it runs for cancellations and answers whose event it missed
    (pub/sub drops what is published while a connection is down; reconnects trigger the same re-read at once)."""

    @model_validator(mode="after")
    def _url_for_redis(self) -> StoreConfig:
        if self.backend == "redis" and not self.url:
            raise ValueError("the redis backend needs store.url (redis://host:port/db)")
        if self.url:
            target = parse_store_url(self.url)  # ValueError naming what is wrong, never the URL (a password)
            if self.tls != TlsConfig() and not target.tls:
                raise ValueError("store.tls applies to a rediss://, rediss+sentinel:// or rediss+cluster:// store.url")
            if target.cluster and hash_tag(self.key_prefix) is None:
                # Every key of a task is updated together, which Redis Cluster allows only within one hash slot.
                raise ValueError(
                    "with Redis Cluster, store.key_prefix needs a hash tag, so that every key is in one slot: "
                    f"{{{self.key_prefix.rstrip(':') or 'mcp-tasks-proxy'}}}:"
                )
        elif self.tls != TlsConfig():
            raise ValueError("store.tls applies to a rediss://, rediss+sentinel:// or rediss+cluster:// store.url")
        return self


class RateLimit(_Strict):
    """One limit on the requests to the MCP endpoint: a sustained rate with a burst above it, or how many may run at
    once (concurrency), or both."""

    per: Literal["caller", "tool", "caller+tool", "upstream"]
    """What is counted apart: each caller (a principal, or an anonymous caller's network address), each tool, each
    caller's use of each tool, or the upstream as a whole. `tool` and `caller+tool` count only tools/call."""
    match: Annotated[str, Field(min_length=1)] | None = None
    """A tool name or glob: the entry counts only the tools/call of those tools. Without it, a rate counts every
    JSON-RPC message POSTed to the MCP endpoint (tools/call and tasks/get polling alike; each message of a batch),
    and a concurrency every tools/call."""
    requests_per_s: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    """The sustained rate."""
    burst: PositiveInt | None = None
    """How many may come at once above the rate (default: the rate, rounded up)."""
    concurrency: PositiveInt | None = None
    """How many tools/call may run at once: a call answered directly until it is answered, a call that goes on in
    the background (a task, a durable or kept-alive call) until it ends. Held in Redis as leases with the Redis
    store: every replica counts against the same limit, and a lost replica's leases lapse within 30 s."""
    on_limit: Literal["refuse", "queue"] = "refuse"
    """Past `concurrency`: refuse (HTTP 429), or queue until one ends. A queued call that goes on in the background
    starts at once (a task is answered with its task) and waits, working, with a status message that says so; a
    call answered directly waits up to queue_timeout_s, then is refused."""
    queue_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """With on_limit: queue, how long a call answered directly waits for its turn (a background call waits as long
    as its task lives)."""
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+*?-]+$")] | None = None
    """What a refusal's data.limit and the mcp_tasks_proxy_rate_limited_total label call it (default: `per`,
    then `match`)."""

    @model_validator(mode="after")
    def _limits_something(self) -> RateLimit:
        if self.requests_per_s is None and self.concurrency is None:
            raise ValueError("a limit needs requests_per_s, concurrency or both")
        if self.burst is not None and self.requests_per_s is None:
            raise ValueError("burst needs requests_per_s")
        # (By value, not by what was written: the policy's layers are merged with every default in place.)
        if self.on_limit != "refuse" and self.concurrency is None:
            raise ValueError("on_limit: queue needs concurrency")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.per if self.match is None else f"{self.per}:{self.match}")

    def matches(self, tool_name: str) -> bool:
        return self.match is None or _matcher(self.match)(tool_name)

    @property
    def allowed_burst(self) -> int:
        assert self.requests_per_s is not None
        return self.burst if self.burst is not None else max(1, math.ceil(self.requests_per_s))


class LimitsConfig(_Strict):
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    """Largest request body accepted from a client (tool arguments included); larger ones get HTTP 413."""
    max_running_tasks: PositiveInt = 1000
    """Background calls running on this replica at once; a task past it is refused with an error."""
    max_tasks_per_principal: PositiveInt | None = None
    """Background calls one caller may have running on this replica at once (None: no limit). A caller is a
    principal, or for anonymous requests their network address."""
    max_result_bytes: PositiveInt = 16 * 1024 * 1024
    """Largest result a task stores; a larger one fails the task with a message that says so."""
    min_poll_interval_ms: Annotated[int, Field(ge=0)] = 0
    """If > 0, tasks/get on one task faster than this is refused (HTTP 429) with the task's pollIntervalMs."""
    rates: list[RateLimit] = []
    """Limits on the requests to the MCP endpoint (a rate, calls at once, or both), each by caller, tool, both, or
    the upstream: kept in Redis with the Redis store, so that every replica counts against the same limit (per
    replica with the memory store, or while Redis does not answer). Past one: HTTP 429, Retry-After, and -32603
    with data.limit and data.retryAfterMs (or queued, for a concurrency with on_limit: queue)."""

    @functools.cached_property
    def rated(self) -> bool:
        """Some entry limits a rate (kept: the front door asks on every request)."""
        return any(rate.requests_per_s is not None for rate in self.rates)

    @functools.cached_property
    def concurrent(self) -> bool:
        """Some entry limits calls at once."""
        return any(rate.concurrency is not None for rate in self.rates)

    @field_validator("rates")
    @classmethod
    def _distinct_names(cls, rates: list[RateLimit]) -> list[RateLimit]:
        labels = [rate.label for rate in rates]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"two rate limits are called {label!r}: name one of them (name: ...)")
        return rates


_JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")


class JwtConfig(_Strict):
    jwks_url: AnyHttpUrl | None = None
    """Where the issuer publishes its signing keys (a JWKS): https, or plain http to a loopback address. Fetched at
    start, kept, and fetched again for a key id it does not hold (at most every 10 s); when the issuer does not
    answer, the last keys it gave stay in use."""
    jwks_file: Path | None = None
    """The signing keys from a file instead (a JWKS, read at start: a key removed from it is dropped at the next
    start)."""
    issuer: Annotated[str, Field(min_length=1)]
    """The `iss` every token must carry."""
    audience: str | None = None
    """The `aud` every token must carry (RFC 8707: issued for this server); default: security.resource_url."""
    algorithms: list[Literal[_JWT_ALGORITHMS]] = ["RS256", "ES256"]  # type: ignore[valid-type]
    """The signature algorithms accepted (asymmetric only: never "none", nor a shared secret)."""
    principal_claims: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = ["iss", "sub"]
    """The claims that name the caller, who owns its tasks whatever token it shows next (a refreshed one)."""
    leeway_s: Annotated[float, Field(ge=0, le=300)] = 30.0
    """Clock skew allowed on exp and nbf."""

    @model_validator(mode="after")
    def _one_key_source(self) -> JwtConfig:
        if (self.jwks_url is None) == (self.jwks_file is None):
            raise ValueError("set one of jwks_url and jwks_file")
        if self.jwks_url is not None and self.jwks_url.scheme == "http" and self.jwks_url.host not in _LOOPBACK:
            raise ValueError("jwks_url must be https (plain http only to a loopback address)")
        return self


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _url_as_written(value: str) -> str:
    """An http(s) URL checked, and kept as written: an issuer or resource identifier is compared as a string, where
    pydantic's URL type would add a trailing slash to a bare host."""
    parsed = AnyHttpUrl(value)
    if parsed.host is None:
        raise ValueError("an http or https URL with a host")
    return value


UrlText = Annotated[str, AfterValidator(_url_as_written)]


class ResourceMetadataConfig(_Strict):
    """The Protected Resource Metadata document (RFC 9728) the proxy serves at /.well-known/oauth-protected-resource
    (and at that path followed by the MCP endpoint's): how clients find the authorization server."""

    authorization_servers: Annotated[list[UrlText], Field(min_length=1)]
    """The issuers whose tokens the resource takes, as their metadata names them (clients discover them here)."""
    scopes_supported: list[str] | None = None
    """The scopes a client may ask for (without offline_access: refresh tokens are no resource's need)."""
    resource_name: str | None = None
    """A name for people, shown by clients that ask for consent."""
    resource_documentation: UrlText | None = None
    """A page for developers about this server."""


class SecurityConfig(_Strict):
    principal: Literal["authorization", "jwt", "header", "none"] = "authorization"
    """Who owns a task: a keyed hash of the Authorization header (a refreshed token is a new caller); the named
    claims of a bearer token the proxy verifies (security.jwt: a refreshed token is the same caller); a header a
    trusted front proxy sets; or nobody (one tenant). Only its owner can see, answer or cancel a task."""
    jwt: JwtConfig | None = None
    """With principal: jwt, how tokens are verified. Every request to the MCP endpoint must carry a valid one
    (401 with a WWW-Authenticate challenge otherwise); the token still goes to the upstream."""
    resource_url: UrlText | None = None
    """The MCP endpoint's public URL (https://mcp.example.com/mcp): the tokens' audience unless jwt.audience says
    otherwise, and the `resource` of the Protected Resource Metadata."""
    resource_metadata: ResourceMetadataConfig | None = None
    """Served by the proxy when set; else a request for it goes to the upstream like any other path."""
    principal_header: str = "X-Forwarded-User"
    """With principal: header, the header that names the caller (only trust it behind a proxy that sets it)."""
    principal_key: str | None = None
    """Key of the principal hashes; replicas sharing a Redis store must share it (or MCP_TASKS_PROXY_PRINCIPAL_KEY)."""
    allowed_hosts: list[str] | None = None
    """Host header values accepted ("host", "host:port", "*"); default: loopback names when listening on loopback,
    any otherwise. Guards against DNS rebinding."""
    allowed_origins: list[str] | None = None
    """Origin header values accepted ("scheme://host[:port]", "*"); requests without Origin are not browsers and pass.
    Default: loopback origins when listening on loopback, none otherwise."""

    @model_validator(mode="after")
    def _jwt_complete(self) -> SecurityConfig:
        if self.principal == "jwt":
            if self.jwt is None:
                raise ValueError("principal: jwt needs security.jwt (jwks_url or jwks_file, issuer)")
            if self.jwt.audience is None and self.resource_url is None:
                raise ValueError("principal: jwt needs the tokens' audience: security.jwt.audience or resource_url")
        elif self.jwt is not None:
            raise ValueError(f"security.jwt is used only with principal: jwt (principal is {self.principal})")
        if self.resource_metadata is not None and self.resource_url is None:
            raise ValueError("resource_metadata needs resource_url, the document's `resource`")
        return self


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """info: a line per request and per task transition; warning: only what needs attention."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto: console lines on a terminal, JSON lines otherwise."""


class ProxyConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    tasks: TaskDefaults = TaskDefaults()
    tools: list[ToolRule] = []
    store: StoreConfig = StoreConfig()
    limits: LimitsConfig = LimitsConfig()
    security: SecurityConfig = SecurityConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _scopes_need_tokens(self) -> ProxyConfig:
        scoped = [rule.match for rule in self.tools if rule.scopes]
        if scoped and self.security.principal != "jwt":
            raise ValueError(
                f"tools {scoped[0]!r}: scopes are checked only with security.principal: jwt (it is "
                f"{self.security.principal}), which reads them from the verified token"
            )
        return self

    @field_validator("tools")
    @classmethod
    def _no_duplicate_matches(cls, rules: list[ToolRule]) -> list[ToolRule]:
        seen: set[str] = set()
        for rule in rules:
            if rule.match in seen:
                raise ValueError(f"the pattern {rule.match!r} appears twice; only the first could ever match")
            seen.add(rule.match)
        return rules

    @property
    def upstream_url(self) -> str:
        if self.upstream.url is None:
            raise ConfigError(
                "no upstream: set upstream.url in the config file, --upstream, or MCP_TASKS_PROXY_UPSTREAM "
                "(or upstream.command, or the server's command after --)"
            )
        return str(self.upstream.url)

    @property
    def upstream_name(self) -> str:
        """How logs name the upstream: its URL, or `stdio:<program>` (a command's arguments may hold secrets)."""
        if self.upstream.command is not None:
            return f"stdio:{Path(self.upstream.command[0]).name}"
        return self.upstream_url

    def rule_for(self, tool_name: str) -> ToolRule | None:
        """The first rule whose pattern matches; None means the call passes through."""
        for rule in self.tools:
            if rule.matches(tool_name):
                return rule
        return None


def _format_validation_error(exc: ValidationError, source: str) -> str:
    """Every error, on one line: unknown keys first (a typo is the likeliest mistake, and other errors often follow
    from it), each as `path: message`, an unknown key with the key it most likely meant."""
    errors = sorted(exc.errors(), key=lambda error: error["type"] != "extra_forbidden")
    described = []
    for error in errors:
        path = ".".join(str(part) for part in error["loc"]) or "(top level)"
        if error["type"] == "extra_forbidden":
            meant = _meant(error["loc"])
            message = f"unknown key (did you mean {meant!r}?)" if meant else "unknown key"
        else:
            # pydantic prefixes the text of a validator's ValueError with its kind: the text alone says it.
            message = error["msg"].removeprefix("Value error, ")
        described.append(f"{path}: {message}")
    if len(described) == 1:
        return f"{source}: {described[0]}"
    return f"{source}: {len(described)} errors: " + "; ".join(described)


def _meant(loc: tuple[int | str, ...]) -> str | None:
    """The key of the section at loc[:-1] closest to the unknown loc[-1], when one is close (difflib)."""
    model: type[BaseModel] | None = ProxyConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list section (tools): its model is the list's
        field = model.model_fields.get(str(part)) if model is not None else None
        model = section_model(field.annotation) if field is not None else None
        if model is None:
            return None
    if model is None:
        return None
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return close[0] if close else None


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (a section of the policy): itself, or inside Optional, list, Annotated; None for a
    value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = section_model(argument)
        if found is not None:
            return found
    return None


def parse_config(data: Any, *, source: str = "config") -> ProxyConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, not {type(data).__name__}")
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from exc


def _read_yaml(path: str | os.PathLike[str]) -> Any:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML{where}") from exc


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section (a list, like `tools`, replaces the base's whole)."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        merged[key] = _merged(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return merged


def load_config(path: str | os.PathLike[str] | None, *, defaults: str | os.PathLike[str] | None = None) -> ProxyConfig:
    """Read and validate the YAML policy file, on top of a defaults file (a container image's) when given; the only
    place that touches the file system for configuration."""
    base: Any = {}
    if defaults is not None:
        base = _read_yaml(defaults)
        parse_config(base, source=str(defaults))  # its own errors name it
    if path is None:
        return parse_config(base, source=str(defaults))
    data = _read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return parse_config(_merged(base or {}, data), source=str(path))


ENV_PREFIX = "MCP_TASKS_PROXY_"


def apply_overrides(config: ProxyConfig, overrides: Mapping[str, Any]) -> ProxyConfig:
    """Apply per-deployment settings (flags or environment) on top of the file; None values are ignored."""
    data = config.model_dump(mode="json")
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "store":
            # One setting for the operator: "memory", or the Redis URL (which implies the redis backend).
            data["store"]["backend"] = "memory" if value == "memory" else "redis"
            data["store"]["url"] = None if value == "memory" else value
            continue
        section, key = dotted.split(".")
        data[section][key] = value
        if dotted in ("upstream.url", "upstream.command"):
            # One upstream: a later source's url replaces an earlier one's command, and the other way round.
            other = "command" if key == "url" else "url"
            data["upstream"][other] = None
            if other == "command":
                data["upstream"]["env"], data["upstream"]["cwd"] = {}, None
    return parse_config(data, source="overrides")
