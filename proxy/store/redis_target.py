"""What `store.url` names: one Redis node, or a service whose master Redis Sentinel names.

    redis://[user:password@]host:port/db      rediss:// for TLS; unix:///run/redis.sock?db=0
    redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]      rediss+sentinel:// for TLS
    redis+cluster://[user:password@]host:port[,host:port...]                     rediss+cluster:// for TLS

With Sentinel, the credentials and the database are the master's; the sentinels are asked for the master's
address without credentials (redis-py's default), over TLS when the master is. The address is asked again at every
reconnection, so a failover is followed (redis_link.py also drops a connection that answers READONLY: an old master
demoted to a replica). With Redis Cluster the hosts are where the cluster's layout is first read; every key of the
proxy is in one hash slot (a hash tag in store.key_prefix), so one node holds them all, and the store follows that
slot (MOVED, ASK) as the cluster moves it. The parsed password never appears in a message.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import unquote, urlsplit

from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)
_SENTINEL_PORT = 26379
_REDIS_PORT = 6379


@dataclasses.dataclass(frozen=True)
class RedisTarget:
    hosts: tuple[tuple[str, int], ...]
    """The node (one), or the sentinels."""
    service: str | None = None
    """With Sentinel: the name of the master it watches."""
    path: str | None = None
    """A unix socket instead of hosts."""
    username: str | None = dataclasses.field(default=None, repr=False)
    password: str | None = dataclasses.field(default=None, repr=False)
    db: int = 0
    tls: bool = False
    cluster: bool = False

    @property
    def sentinel(self) -> bool:
        return self.service is not None


def parse_store_url(url: str) -> RedisTarget:
    """The target `url` names; ValueError (without the URL, which may hold a password) when it names none."""
    scheme = url.partition("://")[0]
    if scheme in SENTINEL_SCHEMES:
        return _sentinel(url, tls=scheme == "rediss+sentinel")
    if scheme in CLUSTER_SCHEMES:
        return _cluster(url, tls=scheme == "rediss+cluster")
    if scheme not in SCHEMES:
        raise ValueError(
            "store.url must start with redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
            "redis+cluster:// or rediss+cluster://"
        )
    options = parse_url(url)
    path = options.get("path")
    if options.get("connection_class") is UnixDomainSocketConnection and not path:
        raise ValueError("a unix:// Redis URL needs the socket's path (unix:///run/redis.sock)")
    return RedisTarget(
        hosts=((options.get("host", "localhost"), int(options.get("port", 6379))),),
        path=path,
        username=options.get("username"),
        password=options.get("password"),
        db=int(options.get("db") or 0),
        tls=options.get("connection_class") is SSLConnection,
    )


def _hosts(hostlist: str, default_port: int, what: str) -> tuple[tuple[str, int], ...]:
    hosts = []
    for entry in hostlist.split(","):
        try:
            address = urlsplit(f"//{entry.strip()}")
            host, port = address.hostname, address.port
        except ValueError:
            host = port = None
        if not host:
            raise ValueError(f"a {what} URL names its hosts as host:port[,host:port]")
        hosts.append((host, port or default_port))
    return tuple(hosts)


def _credentials(netloc: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hostlist = netloc.rpartition("@")
    credentials = urlsplit(f"//{userinfo}@_") if at else None
    username = unquote(credentials.username) if credentials and credentials.username else None
    password = unquote(credentials.password) if credentials and credentials.password is not None else None
    return username, password, hostlist


def _cluster(url: str, *, tls: bool) -> RedisTarget:
    parts = urlsplit(url)
    username, password, hostlist = _credentials(parts.netloc)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("Redis Cluster has one database: a cluster URL names none (or /0)")
    return RedisTarget(
        hosts=_hosts(hostlist, _REDIS_PORT, "cluster"), username=username, password=password, tls=tls, cluster=True
    )


def _sentinel(url: str, *, tls: bool) -> RedisTarget:
    parts = urlsplit(url)
    username, password, hostlist = _credentials(parts.netloc)
    names = [unquote(name) for name in parts.path.split("/") if name]
    if not names or len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError("a Sentinel URL ends with the master's service name, then optionally a database: /mymaster/0")
    return RedisTarget(
        hosts=_hosts(hostlist, _SENTINEL_PORT, "Sentinel"),
        service=names[0],
        username=username,
        password=password,
        db=int(names[1]) if len(names) == 2 else 0,
        tls=tls,
    )


def hash_tag(prefix: str) -> str | None:
    """The hash tag of keys that start with `prefix` (Redis Cluster's rule: the first {...} that is not empty)."""
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start >= 0 else -1
    return prefix[start + 1 : end] if start >= 0 and end > start + 1 else None
