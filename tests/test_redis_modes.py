"""The Redis that operators run: Sentinel (a master killed under load, the failover followed), TLS with a private
CA and a client certificate, and an ACL user whose keys and channels are limited to the proxy's prefix. Real
redis-server processes (and `redis-server --sentinel`), started by each test."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis.asyncio as redis_client
from redis.exceptions import MovedError

from mcp_tasks_proxy.config import ConfigError, parse_config
from mcp_tasks_proxy.store.base import StoreUnavailable
from mcp_tasks_proxy.store.redis_store import RedisTaskStore
from mcp_tasks_proxy.tasks.model import TaskRecord, TaskStatus, new_task_id
from tests.conftest import free_port, stop, task_reaches, wait_for_port


def record() -> TaskRecord:
    now = datetime.now(UTC)
    return TaskRecord(new_task_id(), "t", TaskStatus.COMPLETED, now, now, 600_000, 1000, result={"content": []})


@pytest.fixture
def sentinel(tmp_path, redis_server, redis_binary):
    """A master, its replica and one sentinel (quorum 1) that fails over a second after the master is lost."""
    master = redis_server()
    replica = redis_server("--replicaof", "127.0.0.1", str(master.port))
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor mtp 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds mtp 1000\nsentinel failover-timeout mtp 5000\n"
    )
    process = subprocess.Popen([redis_binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port, process)
        yield master, replica, f"redis+sentinel://127.0.0.1:{port}/mtp"
    finally:
        stop(process)


async def replicated(master_url: str) -> None:
    """Wait until the replica has every write so far (WAIT), so that the failover loses none of them."""
    client = redis_client.from_url(master_url)
    try:
        for _ in range(100):
            if await client.wait(1, 1000) >= 1:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the replica never caught up")
    finally:
        await client.aclose()


async def test_the_store_follows_a_sentinel_failover(sentinel):
    master, replica, url = sentinel
    store = RedisTaskStore(url, key_prefix=f"s-{secrets.token_hex(3)}:", lease_s=5, timeout_s=1)
    try:
        before = record()
        await store.create(before)
        await replicated(master.url)
        master.kill()
        after = record()
        for _ in range(300):  # about 1 s to notice, then the promotion: well within 30 s
            try:
                await store.create(after)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("no task could be created after the failover")
        assert (await store.get(after.task_id)).task_id == after.task_id
        assert (await store.get(before.task_id)).result == {"content": []}  # written before, read after
        promoted = redis_client.from_url(replica.url)
        try:
            assert (await promoted.info("replication"))["role"] == "master"  # the write went to the new master
        finally:
            await promoted.aclose()
    finally:
        await store.aclose()


async def test_tasks_keep_being_created_and_read_through_a_failover_under_load(make_proxy, mcp_upstream, sentinel):
    master, _, url = sentinel
    store = {"backend": "redis", "url": url, "key_prefix": f"load-{secrets.token_hex(3)}:", "timeout_s": 1}
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "add"}], store=store)
    outcomes: list[str] = []
    created: list[str] = []
    stop_at = asyncio.get_running_loop().time() + 60

    async def load() -> None:
        while asyncio.get_running_loop().time() < stop_at:
            reply = await proxy.client.call_tool("add", {"a": 1, "b": 2})
            if reply.status == 200 and "result" in reply.message:
                created.append(reply.result["taskId"])
                outcomes.append("created")
            else:
                outcomes.append("refused")  # a clear error while no master answers, never a hang
            await asyncio.sleep(0.02)

    loader = asyncio.ensure_future(load())
    while len(created) < 20:
        await asyncio.sleep(0.05)
    await replicated(master.url)
    first = created[0]
    master.kill()
    killed_at = len(outcomes)
    while outcomes[killed_at:].count("created") < 20:  # creations resume after the failover
        assert not loader.done(), loader
        assert asyncio.get_running_loop().time() < stop_at, "creations did not resume after the failover"
        await asyncio.sleep(0.1)
    loader.cancel()
    await asyncio.gather(loader, return_exceptions=True)
    await task_reaches(proxy.client, first, "completed")  # made before the failover, read after it
    await task_reaches(proxy.client, created[-1], "completed")


@pytest.fixture
def tls_redis(tmp_path, pki, redis_binary):
    """TLS only (client certificates required), the default user off, and a user `proxy` whose keys and pub/sub
    channels are limited to the prefix `mtp:`, and who may not use CONFIG, KEYS or the administration commands."""
    port = free_port()
    acl = tmp_path / "users.acl"
    # As managed services do: no CONFIG, no KEYS, nothing of the server's administration.
    allowed = "+@all -config -keys -debug -flushall -flushdb -shutdown -monitor -save -bgsave"
    acl.write_text(f"user default off\nuser proxy on >s3cret-pass ~mtp:* &mtp:* {allowed}\n")
    where = pki.ca.parent
    argv = [redis_binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--tls-cert-file", str(where / "server.pem"), "--tls-key-file", str(where / "server.key"),
            "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "yes", "--aclfile", str(acl)]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port, process)
        yield port
    finally:
        stop(process)


def tls_store(port: int, pki, password: str = "s3cret-pass") -> dict:
    tls = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
    return {"backend": "redis", "url": f"rediss://proxy:{password}@127.0.0.1:{port}/0", "key_prefix": "mtp:",
            "tls": tls}  # fmt: skip


async def test_tls_with_a_client_certificate_and_an_acl_user_limited_to_the_prefix(
    make_proxy, mcp_upstream, tls_redis, pki
):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "add"}], store=tls_store(tls_redis, pki))
    ready = await proxy.client.session.get(proxy.url.replace("/mcp", "/readyz"))
    assert ready.status == 200, await ready.text()
    created = await proxy.client.call_tool("add", {"a": 2, "b": 3})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["structuredContent"] == {"result": 5}


async def test_a_refused_redis_password_is_said_without_the_password(make_proxy, mcp_upstream, tls_redis, pki):
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "add"}], store=tls_store(tls_redis, pki, "wrong-one"))
    ready = await proxy.client.session.get(proxy.url.replace("/mcp", "/readyz"))
    text = await ready.text()
    assert ready.status == 503 and "credentials of store.url" in text and "wrong-one" not in text, text


@pytest.mark.parametrize(
    ("store", "says"),
    [
        ({"backend": "redis", "url": "redis+sentinel://h1:26379,h2:x/mymaster"}, "names its hosts"),
        ({"backend": "redis", "url": "redis+sentinel://h1:26379/"}, "service name"),
        ({"backend": "redis", "url": "redis://h1/0", "tls": {"verify": False}}, "store.tls applies to a rediss://"),
        ({"backend": "redis", "url": "redis+cluster://h1:7000"}, "needs a hash tag"),
        ({"backend": "redis", "url": "redis+cluster://h1/3", "key_prefix": "{m}:"}, "one database"),
        ({"backend": "redis", "url": "memcached://h1"}, "must start with"),
    ],
)
def test_store_urls_and_tls_are_checked_at_start_up(store, says):
    with pytest.raises(ConfigError) as refused:
        parse_config({"upstream": {"url": "http://127.0.0.1:1/mcp"}, "store": store})
    assert says in str(refused.value)


# --- Redis Cluster ----------------------------------------------------------------------------------------------

PREFIX = "{mtp}:"  # every key of the proxy in the slot of "mtp"


@pytest.fixture
def cluster(tmp_path, redis_binary):
    """Three masters, no replicas, slots spread by redis-cli; yields their ports. Ports are picked free and bound a
    moment later: another test's server may take one meanwhile, so a cluster that cannot be made is made again on
    other ports (at most three times), with the reason if it never can."""
    for attempt in range(3):
        processes: list[subprocess.Popen[bytes]] = []
        try:
            try:
                ports = _make_cluster(tmp_path / str(attempt), redis_binary, processes)
            except Exception:
                if attempt == 2:
                    raise
                continue
            yield ports
            return
        finally:
            for process in processes:
                stop(process)


def _make_cluster(home: Path, redis_binary: str, processes: list[subprocess.Popen[bytes]]) -> list[int]:
    ports = [free_port() for _ in range(3)]
    for port in ports:
        (home / str(port)).mkdir(parents=True)
        argv = [redis_binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(home / str(port)),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(free_port())]  # (the default, port + 10000, may be past 65535)  # fmt: skip
        processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        wait_for_port(port, processes[-1])
    create = [redis_binary.replace("redis-server", "redis-cli"), "--cluster", "create",
              *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0", "--cluster-yes"]  # fmt: skip
    made = subprocess.run(create, capture_output=True, timeout=60)
    if made.returncode:
        raise AssertionError(f"redis-cli --cluster create failed: {made.stdout[-2000:]!r} {made.stderr!r}")
    return ports


async def cluster_ready(ports) -> None:
    for port in ports:
        client = redis_client.Redis(port=port)
        try:
            for _ in range(200):
                if b"cluster_state:ok" in await client.execute_command("CLUSTER", "INFO"):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"node {port} never saw the cluster ok")
        finally:
            await client.aclose()


async def slot_owner(ports, slot: int) -> tuple[int, list[int]]:
    """The port of the node holding `slot`, and the others'."""
    client = redis_client.Redis(port=ports[0])
    try:
        for start, end, master, *_ in await client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                owner = int(master[1])
                return owner, [port for port in ports if port != owner]
    finally:
        await client.aclose()
    raise AssertionError(f"no node holds slot {slot}")


async def start_migration(slot: int, source: int, target: int) -> str:
    """Mark `slot` migrating from node `source` to node `target` (redis-cli reshard's first step); the target's id."""
    src, dst = redis_client.Redis(port=source), redis_client.Redis(port=target)
    try:
        src_id = (await src.execute_command("CLUSTER", "MYID")).decode()
        dst_id = (await dst.execute_command("CLUSTER", "MYID")).decode()
        await dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        await src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        return dst_id
    finally:
        await src.aclose()
        await dst.aclose()


async def move_keys(slot: int, source: int, target: int, *, batch: int = 5, pause_s: float = 0.0) -> None:
    src = redis_client.Redis(port=source)
    try:
        while keys := await src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            await src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            await asyncio.sleep(pause_s)
    finally:
        await src.aclose()


async def assign(slot: int, node_id: str, ports) -> None:
    """`CLUSTER SETSLOT slot NODE node_id` on each node of `ports`, in that order (the migration's last step)."""
    for port in ports:
        node = redis_client.Redis(port=port)
        try:
            await node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)
        finally:
            await node.aclose()


async def migrate(slot: int, source: int, target: int, ports, moving: asyncio.Event) -> None:
    """Move one slot from node `source` to node `target` the way redis-cli reshard does, a few keys at a time."""
    dst_id = await start_migration(slot, source, target)
    moving.set()
    # The store works on meanwhile: some keys here, some there (ASK).
    await move_keys(slot, source, target, pause_s=0.02)
    await assign(slot, dst_id, ports)


async def test_the_store_on_a_cluster_follows_its_slot_through_a_migration(cluster):
    await cluster_ready(cluster)
    seed = redis_client.Redis(port=cluster[0])
    slot = await seed.execute_command("CLUSTER", "KEYSLOT", PREFIX)
    await seed.aclose()
    owner, others = await slot_owner(cluster, slot)
    # Seeded with a node that does not hold the slot: the first commands are MOVED there.
    url = f"redis+cluster://127.0.0.1:{others[0]}"
    store = RedisTaskStore(url, key_prefix=PREFIX, lease_s=5, timeout_s=2)
    try:
        written = [record() for _ in range(40)]
        for each in written:
            await store.create(each)
        moving = asyncio.Event()
        migration = asyncio.ensure_future(migrate(slot, owner, others[1], cluster, moving))
        await moving.wait()
        during = []
        while not migration.done():  # creates and reads while the keys move: ASK, then MOVED
            each = record()
            await store.create(each)
            during.append(each)
            assert (await store.get(written[len(during) % len(written)].task_id)) is not None
        await migration
        assert (await slot_owner(cluster, slot))[0] == others[1]
        for each in [*written, *during, record()]:
            if await store.get(each.task_id) is None:
                await store.create(each)  # the last one: made after the slot moved
            assert (await store.get(each.task_id)).task_id == each.task_id
        assert during, "the migration ended before the store was used during it"
        assert set(await store.running_task_ids()) == set()  # the running set (a terminal record is in none)
    finally:
        await store.aclose()


async def test_the_store_on_a_cluster_waits_out_nodes_that_disagree_about_its_slot(cluster):
    """A migration ends with `SETSLOT NODE` on each node in turn. Once the source has handed the slot over and
    before the target has taken it, each answers MOVED to the other: the store follows the bounce, pausing, until
    they agree, instead of failing the command after one redirection."""
    await cluster_ready(cluster)
    seed = redis_client.Redis(port=cluster[0])
    slot = await seed.execute_command("CLUSTER", "KEYSLOT", PREFIX)
    await seed.aclose()
    owner, others = await slot_owner(cluster, slot)
    store = RedisTaskStore(f"redis+cluster://127.0.0.1:{owner}", key_prefix=PREFIX, lease_s=5, timeout_s=3)
    target = redis_client.Redis(port=others[1])
    reading = None
    try:
        kept = record()
        await store.create(kept)
        dst_id = await start_migration(slot, owner, others[1])
        await move_keys(slot, owner, others[1], batch=100)
        await assign(slot, dst_id, [owner])  # the source first: they disagree
        with pytest.raises(MovedError, match=f":{owner}$"):
            await target.get(f"{PREFIX}anything")  # the target, still importing, sends a plain command back
        reading = asyncio.ensure_future(store.get(kept.task_id))
        await asyncio.sleep(0.3)  # several bounces' worth
        assert not reading.done(), reading
        await assign(slot, dst_id, [others[1], others[0]])
        assert (await reading).task_id == kept.task_id
    finally:
        if reading is not None:
            reading.cancel()
        await target.aclose()
        await store.aclose()


async def test_the_proxy_on_a_cluster(make_proxy, mcp_upstream, cluster):
    await cluster_ready(cluster)
    store = {"backend": "redis", "url": f"redis+cluster://127.0.0.1:{cluster[0]},127.0.0.1:{cluster[1]}",
             "key_prefix": PREFIX}  # fmt: skip
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "add"}], store=store)
    ready = await proxy.client.session.get(proxy.url.replace("/mcp", "/readyz"))
    assert ready.status == 200, await ready.text()
    created = await proxy.client.call_tool("add", {"a": 2, "b": 3})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed")
    assert done.result["result"]["structuredContent"] == {"result": 5}
