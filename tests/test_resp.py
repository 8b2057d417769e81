"""The pipelining Redis connection of the store's hot path: against a real redis-server, and scripted faults."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import redis.asyncio as redis

from mcp_tasks_proxy.store.redis_store import RedisTaskStore
from mcp_tasks_proxy.store.resp import RespClient, RespError
from mcp_tasks_proxy.tasks.model import TaskStatus, transition
from tests.test_store_contract import T0, record


async def test_concurrent_commands_each_get_their_own_reply(redis_url: str) -> None:
    client = RespClient(redis_url, timeout_s=5)
    try:
        await asyncio.gather(*(client.execute("SET", f"resp:{n}", f"value-{n}") for n in range(300)))
        order = list(range(300))
        random.shuffle(order)
        replies = await asyncio.gather(*(client.execute("GET", f"resp:{n}") for n in order))
        assert replies == [f"value-{n}".encode() for n in order]
        assert await client.execute("GET", "resp:missing") is None
        assert await client.execute("DEL", "resp:0", "resp:1") == 2
    finally:
        await client.aclose()


async def test_an_error_reply_raises_and_its_neighbours_still_answer(redis_url: str) -> None:
    client = RespClient(redis_url, timeout_s=5)
    try:
        await client.execute("SET", "resp:text", "abc")
        with pytest.raises(RespError, match="WRONGTYPE|not an integer"):
            await client.pipeline([("SET", "resp:a", "1"), ("INCR", "resp:text"), ("SET", "resp:b", "2")])
        assert await client.pipeline([("GET", "resp:a"), ("GET", "resp:b")]) == [b"1", b"2"]
        replies = await client.pipeline([("MULTI",), ("INCR", "resp:n"), ("INCR", "resp:n"), ("EXEC",)])
        assert replies == [b"OK", b"QUEUED", b"QUEUED", [1, 2]]
    finally:
        await client.aclose()


async def test_a_cancelled_caller_does_not_shift_the_replies_of_others(redis_url: str) -> None:
    client = RespClient(redis_url, timeout_s=5)
    try:
        await client.pipeline([("SET", "resp:x", "x"), ("SET", "resp:y", "y")])
        for _ in range(50):
            doomed = asyncio.ensure_future(client.execute("GET", "resp:x"))
            await asyncio.sleep(0)  # written, not yet answered
            doomed.cancel()
            assert await client.execute("GET", "resp:y") == b"y"
            with pytest.raises(asyncio.CancelledError):
                await doomed
    finally:
        await client.aclose()


COMMANDS: list[tuple] = [
    ("SET", "diff:k", b"\x00\xff\r\n binary"),
    ("GET", "diff:k"),
    ("GET", "diff:missing"),
    ("EXISTS", "diff:k", "diff:missing"),
    ("INCRBY", "diff:n", 7),
    ("INCRBY", "diff:n", -12),
    ("RPUSH", "diff:l", "a", "", "c"),
    ("LRANGE", "diff:l", 0, -1),
    ("LRANGE", "diff:missing", 0, -1),
    ("HSET", "diff:h", "f", "ünïcode"),
    ("HGETALL", "diff:h"),
    ("ECHO", "ünïcode \r\n"),
    ("SET", "diff:big", b"x" * 1_000_000),
    ("STRLEN", "diff:big"),
    ("GET", "diff:big"),
    ("EVAL", "return {1, 'two', {3, {}}, false, -5}", 0),
    ("EVAL", "return redis.status_reply('FINE')", 0),
    ("EVAL", "return 3.99", 0),
    ("EVAL", "return {KEYS[1], ARGV[1], ARGV[2]}", 1, "diff:k", "", b"\x00"),
]
ERRORS: list[tuple] = [
    ("INCR", "diff:k"),
    ("LPUSH", "diff:k", "x"),
    ("EVAL", "return redis.error_reply('MYERR custom words')", 0),
    ("EVAL", "return {err = 'ERR from a table'}", 0),
    ("NOSUCHCOMMAND", "x"),
    ("GET",),
]


async def test_resp_reads_every_reply_as_redis_py_does(redis_url: str) -> None:
    """resp.py stands in for redis-py on the store's hot path (docs/benchmarks.md says why): the same commands, sent
    by both to one real redis-server, get the same replies, and the same errors."""
    ours = RespClient(redis_url, timeout_s=5, max_reply_bytes=2_000_000)
    theirs = redis.Redis.from_url(redis_url, protocol=2)  # resp.py speaks RESP2, as Redis does until HELLO 3
    theirs.response_callbacks.clear()  # redis-py's replies as read, not made into its Python types per command
    try:
        expected = []
        for command in COMMANDS:
            expected.append(await theirs.execute_command(*command))
        await theirs.flushdb()
        assert await ours.pipeline(COMMANDS) == expected  # pipelined in one write
        await theirs.flushdb()
        assert [await ours.execute(*command) for command in COMMANDS] == expected  # one at a time
        for command in ERRORS:
            with pytest.raises(redis.ResponseError) as their_error:
                await theirs.execute_command(*command)
            with pytest.raises(RespError) as our_error:
                await ours.execute(*command)
            # redis-py takes a known code (ERR, WRONGTYPE...) off the front of the message; resp.py keeps it.
            assert str(our_error.value).endswith(str(their_error.value)), command
        assert await ours.execute("GET", "diff:k") == expected[1]  # the connection is in step after the errors
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_the_store_reloads_its_script_when_redis_forgot_it(redis_url: str) -> None:
    store = RedisTaskStore(redis_url, key_prefix="noscript:", lease_s=2, timeout_s=2)
    admin = redis.Redis.from_url(redis_url)
    try:
        rec = record()
        await store.create(rec)
        await admin.script_flush()
        done = await store.update(rec.task_id, lambda r: transition(r, TaskStatus.COMPLETED, now=T0, result={}))
        assert done is not None and done.status is TaskStatus.COMPLETED
        assert (await store.get(rec.task_id)) == done
        assert not await admin.sismember("noscript:running", rec.task_id)  # the script also left the running set
    finally:
        await admin.aclose()
        await store.aclose()


class LyingRedis:
    """A fake Redis for faults a real one never makes: `answer` maps each read's bytes to what goes back; what
    each connection sent is recorded."""

    def __init__(self, answer, delay_s: float = 0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.sent: list[list[bytes]] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen: list[bytes] = []
        self.sent.append(seen)
        self.writers.append(writer)
        try:
            while data := await reader.read(65536):
                seen.append(data)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(self.answer(data))
        except ConnectionError:
            pass
        finally:
            writer.close()

    @property
    def connections(self) -> int:
        return len(self.sent)

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.01)  # let the handlers see their end


async def test_credentials_and_database_from_the_url_and_a_reconnect_after_a_timeout() -> None:
    def only_hello(data: bytes) -> bytes:  # +OK to AUTH and SELECT, nothing to anything else
        return b"".join(b"+OK\r\n" for word in (b"AUTH", b"SELECT") if word in data)

    scripted = LyingRedis(only_hello)
    async with scripted:
        assert scripted.server is not None
        port = scripted.server.sockets[0].getsockname()[1]
        client = RespClient(f"redis://user:secret@127.0.0.1:{port}/3", timeout_s=0.3)
        try:
            with pytest.raises(TimeoutError):
                await client.execute("GET", "k")
            with pytest.raises(TimeoutError):
                await client.execute("GET", "k")
            assert scripted.connections == 2  # the connection that stopped answering was replaced
            sent = b"".join(scripted.sent[0])
            assert sent.startswith(
                b"*3\r\n$4\r\nAUTH\r\n$4\r\nuser\r\n$6\r\nsecret\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n"
            )
            assert sent.endswith(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
        finally:
            await client.aclose()


def port_of(fake: LyingRedis) -> int:
    assert fake.server is not None
    return fake.server.sockets[0].getsockname()[1]


async def test_two_nodes_bouncing_a_moved_are_followed_with_pauses_within_the_timeout() -> None:
    """While a migration ends, each of two nodes may say the other holds the slot: the client follows, pausing once
    the redirections come back to a node already tried, and gives up when its timeout is spent."""
    ports: dict[str, int] = {}
    first = LyingRedis(lambda data: b"-MOVED 1 127.0.0.1:%d\r\n" % ports["second"])
    second = LyingRedis(lambda data: b"-MOVED 1 127.0.0.1:%d\r\n" % ports["first"])
    async with first as url, second:
        ports.update(first=port_of(first), second=port_of(second))
        client = RespClient(url, timeout_s=0.5)
        try:
            started = asyncio.get_running_loop().time()
            # The last MOVED, or (on a slow machine the deadline falls on a connection to the other node) the timeout.
            with pytest.raises((RespError, TimeoutError)) as failed:
                await client.execute("GET", "k")
            elapsed = asyncio.get_running_loop().time() - started
        finally:
            await client.aclose()
    assert isinstance(failed.value, TimeoutError) or str(failed.value).startswith("MOVED"), failed.value
    # It kept following until the timeout (a MOVED is given up only within a pause of it), and no longer (the
    # bound is loose: a busy machine is slow, not wrong).
    assert 0.5 - 0.05 <= elapsed < 2.5
    # Each redirection is a connection: both nodes followed, but paused (without pauses: thousands).
    assert 2 <= first.connections + second.connections <= 20


async def test_a_moved_to_a_node_that_never_answers_stays_within_the_timeout_and_is_not_followed_again() -> None:
    """The seed answers MOVED late, to a node that accepts connections and never answers (a paused or partitioned
    Redis): the call fails within its timeout, not the timeout again after the redirection, and the next call asks
    the seed again instead of the node that did not answer."""
    silent = LyingRedis(lambda data: b"")
    seed = LyingRedis(lambda data: b"-MOVED 1 127.0.0.1:%d\r\n" % port_of(silent), delay_s=0.6)
    async with seed as url, silent:
        client = RespClient(url, timeout_s=1.0)
        try:
            for attempt in (1, 2):
                started = asyncio.get_running_loop().time()
                with pytest.raises(TimeoutError):
                    await client.execute("GET", "k")
                assert asyncio.get_running_loop().time() - started < 1.4  # one timeout: 0.6 s + 1 s before
                assert seed.connections == attempt  # the second call went to the seed again
        finally:
            await client.aclose()


_HUGE_HOST = b"h" * 70_000
_UNRESOLVABLE = "^cannot connect to Redis \\(an address that cannot be resolved"


@pytest.mark.parametrize(
    "reply, error",
    [(b"-MOVED 1 127.0.0.1:notaport\r\n", "^MOVED 1 127.0.0.1:notaport$"), (b"-MOVED\r\n", "^MOVED$"),
     (b"-ASK 1 2 3 4\r\n", "^ASK 1 2 3 4$"), (b"-MOVED 1 " + _HUGE_HOST + b":1\r\n", _UNRESOLVABLE),
     (b"-ASK 1 " + _HUGE_HOST + b":1\r\n", _UNRESOLVABLE), (b"-MOVED 1 \xff\xfe:1\r\n", "^cannot connect to Redis")],
    ids=["port", "bare", "words", "huge-host", "huge-ask-host", "not-utf8"],
)  # fmt: skip
async def test_a_redirection_that_cannot_be_followed_is_the_callers_error_and_crosses_to_no_one(reply, error) -> None:
    """A node whose MOVED or ASK names nothing usable (hostile, or broken): the command fails with a RespError (the
    store's "unavailable", never another exception), and a neighbour's command on the same connection still gets
    its own reply."""

    def answer(data: bytes) -> bytes:
        return b"".join(reply if b"bad" in command else b"$4\r\nmine\r\n" for command in data.split(b"*2\r\n")[1:])

    fake = LyingRedis(answer)
    async with fake as url:
        client = RespClient(url, timeout_s=1)
        try:
            bad, good = await asyncio.gather(client.execute("GET", "bad"), client.execute("GET", "good"),
                                             return_exceptions=True)  # fmt: skip
        finally:
            await client.aclose()
    assert isinstance(bad, RespError), bad
    assert re.search(error, str(bad)), str(bad)[:200]
    assert good == b"mine"
    assert fake.connections == 1


async def test_a_moved_to_where_nothing_listens_fails_and_the_next_command_asks_the_seed() -> None:
    from tests.conftest import free_port

    nowhere = free_port()
    fake = LyingRedis(lambda data: b"-MOVED 1 127.0.0.1:%d\r\n" % nowhere)
    async with fake as url:
        client = RespClient(url, timeout_s=1)
        try:
            for attempt in (1, 2):
                with pytest.raises(RespError, match="cannot connect"):
                    await client.execute("GET", "k")
                assert fake.connections == attempt  # the seed again, not the node that is gone
        finally:
            await client.aclose()


async def test_an_unreachable_redis_is_a_resp_error() -> None:
    from tests.conftest import free_port

    client = RespClient(f"redis://127.0.0.1:{free_port()}/0", timeout_s=2)
    with pytest.raises(RespError, match="cannot connect"):
        await client.execute("PING")


@pytest.mark.usefixtures("redis_binary")
async def test_a_unix_socket_url_with_a_database_reaches_that_database(tmp_path) -> None:
    import shutil
    import subprocess

    from tests.conftest import stop

    socket_path = tmp_path / "redis.sock"
    binary = shutil.which("redis-server")
    assert binary is not None
    process = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(socket_path), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    database_2 = redis.Redis(unix_socket_path=str(socket_path), db=2)
    database_0 = redis.Redis(unix_socket_path=str(socket_path), db=0)
    client = RespClient(f"unix://{socket_path}?db=2", timeout_s=5)
    try:
        for _ in range(200):
            if socket_path.exists():
                break
            await asyncio.sleep(0.05)
        await client.execute("SET", "resp:db", "two")
        assert await database_2.get("resp:db") == b"two"
        assert await database_0.get("resp:db") is None
    finally:
        await client.aclose()
        await database_2.aclose()
        await database_0.aclose()
        stop(process)


def echo_key(data: bytes) -> bytes:
    """`GET k` -> the bulk string k, so that a shifted reply is visible as a wrong key."""
    key = data.split(b"\r\n")[-2]
    return b"$%d\r\n%s\r\n" % (len(key), key)


async def test_an_argument_that_cannot_be_encoded_takes_no_reply_slot(redis_url: str) -> None:
    """Defect 1: a lone surrogate used to queue a reply slot and then fail, shifting every later reply by one."""
    client = RespClient(redis_url, timeout_s=5)
    try:
        await client.pipeline([("SET", f"resp:k{n}", f"v{n}") for n in range(20)])
        for _ in range(5):
            with pytest.raises(ValueError, match="not valid Unicode"):
                await client.execute("GET", "\ud800")
        replies = await asyncio.gather(*(client.execute("GET", f"resp:k{n}") for n in range(20)))
        assert replies == [f"v{n}".encode() for n in range(20)]
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "fault, message",
    [
        (lambda data: echo_key(data) + b"+EXTRA\r\n", "no command asked for"),
        (lambda data: b"?what\r\n", "malformed"),
        (lambda data: b"$999999999\r\n" + b"x" * 200_000, "exceeds 100000 bytes"),
    ],
    ids=["extra-reply", "malformed-reply", "huge-bulk"],
)
async def test_a_reply_stream_that_cannot_be_right_fails_its_connection_and_no_reply_crosses(fault, message) -> None:
    calls = 0

    def answer(data: bytes) -> bytes:
        nonlocal calls
        calls += 1
        return fault(data) if calls == 2 else echo_key(data)

    lying = LyingRedis(answer)
    async with lying as url:
        client = RespClient(url, timeout_s=3, max_reply_bytes=100_000)
        try:
            assert await client.execute("GET", "first") == b"first"
            if message == "no command asked for":
                assert await client.execute("GET", "second") == b"second"  # its own reply; the extra one ends it
                await asyncio.sleep(0.05)
                assert client._protocol is not None and client._protocol.broken is not None
                assert message in client._protocol.broken
            else:
                with pytest.raises(RespError, match=message):
                    await client.execute("GET", "second")
            # A new connection, and each answer is its own again.
            for key in ("a", "b", "c"):
                assert await client.execute("GET", key) == key.encode()
            assert lying.connections == 2
        finally:
            await client.aclose()


async def test_the_store_refuses_another_tasks_record_and_drops_the_connection(redis_url: str) -> None:
    store = RedisTaskStore(redis_url, key_prefix="crossed:", lease_s=2, timeout_s=2)
    admin = redis.Redis.from_url(redis_url)
    try:
        mine, theirs = record(), record()
        await store.create(mine)
        await store.create(theirs)
        # Simulate a shifted reply: the key of `mine` holds the record of `theirs`.
        await admin.set(f"crossed:task:{mine.task_id}", await admin.get(f"crossed:task:{theirs.task_id}"))
        from mcp_tasks_proxy.store.base import StoreUnavailable

        with pytest.raises(StoreUnavailable):
            await store.get(mine.task_id)
        assert (await store.get(theirs.task_id)) == theirs  # a fresh connection answers correctly
    finally:
        await admin.aclose()
        await store.aclose()
