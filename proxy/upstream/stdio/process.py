"""A stdio MCP server as a child process: started, read line by line, restarted with backoff, stopped in order.

The stdio transport frames one JSON-RPC message per `\\n`-terminated line, read with the proxy's strict JSON parser.
A line that cannot be read as a message (too long, not UTF-8, not JSON, a number that is not finite, not a JSON-RPC
message) is reported as Unreadable with what tells which call it answered: the ids a lenient reading finds, else its
head and tail. A line longer than `max_line_bytes` is discarded without being held (`readuntil`, then `readexactly`
of what overran), so a flooding child costs at most about twice the limit. stderr is always drained (a full pipe
would stop the child), logged line by line, and its last lines kept for the failure of the calls that were running
when the child died. The proxy owns the pipes and closes them when a run ends, whoever else holds their other ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from ...jsonrpc import loads
from ..events import RequestUnsent

log = structlog.get_logger(__name__)

_STDERR_LINE_BYTES = 8 * 1024
"""A stderr line is logged up to this length; the rest of it is dropped."""
_STDERR_TAIL = 20
"""stderr lines kept for the failure of the calls a dying child leaves."""
_LOGGED_LINES = 200
"""stderr lines logged one by one per child; past that one in a thousand (a flood must not flood)."""
_EDGE_BYTES = 256
"""Of an unreadable line, the head and tail kept: where its id is when nothing else can tell."""
_LAST_OUTPUT_S = 2.0
"""After the child exits, how long its pipes are still read for what it wrote last (a process it left behind may
hold them open: no end of file ever comes)."""
_HEALTHY_S = 60.0
"""A child that ran this long resets the restart backoff."""
_MAX_UNREAD_BYTES = 16 * 1024 * 1024
"""Bytes written to the child's stdin and not yet read by it, past which a new message fails at once."""
_WRITE_TIMEOUT_S = 30.0
"""How long a write may wait for a child that does not read its stdin."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChildSpec:
    argv: Sequence[str]
    env: dict[str, str]
    """The child's whole environment (the inherited names and upstream.env)."""
    cwd: str | None = None
    max_line_bytes: int = 16 * 1024 * 1024
    restart_min_s: float = 0.5
    restart_max_s: float = 30.0
    stop_grace_s: float = 2.0
    term_grace_s: float = 2.0

    @property
    def name(self) -> str:
        """How logs and errors name the child: its program only, since arguments may hold secrets."""
        return f"stdio:{Path(self.argv[0]).name}"


def child_env(inherit: Sequence[str], extra: dict[str, str]) -> dict[str, str]:
    """The inherited variables (as the SDKs' stdio clients do, so the proxy's own secrets stay its own) and `extra`."""
    env = {name: os.environ[name] for name in inherit if name in os.environ}
    env.update(extra)
    return env


UNREADABLE_REASONS = ("too_long", "invalid_utf8", "not_json", "non_finite_number", "not_jsonrpc")
"""Why a line of the child's could not be read (the `reason` label of the unreadable-lines metric)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unreadable:
    """A stdout line that is no message the proxy can take: why (`reason`, one of UNREADABLE_REASONS, and `detail`
    in words), its first and last bytes, its size, and the ids of the responses in it when a lenient reading could
    tell them (None when it could not: then only the edges can)."""

    reason: str
    detail: str
    head: bytes
    tail: bytes
    size: int
    ids: tuple[Any, ...] | None = None


def unreadable(text: bytes, exc: BaseException) -> Unreadable:
    """What is wrong with a line the strict parser refused (`exc`), and whose answer it was, read leniently: invalid
    UTF-8 replaced, NaN and overflowing numbers taken, so the id of an answer with one bad byte is still known."""
    head, tail = text[:_EDGE_BYTES], text[-_EDGE_BYTES:]
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as bad:
        decoded = text.decode("utf-8", "replace")
        reason, detail = "invalid_utf8", f"it is not valid UTF-8 (byte 0x{text[bad.start]:02x} at offset {bad.start})"
    else:
        reason, detail = "not_json", f"it is not JSON ({exc})"
    if not text.startswith((b"{", b"[")):
        return Unreadable(reason, detail, head, tail, len(text))  # a banner, a stray print: no answer of anyone's
    numbers: list[str] = []  # what the strict parser refuses and this reading takes: NaN, 1e999, 400 digits

    def constant(name: str) -> float:
        numbers.append(f"a number that is not finite ({name})")
        return float(name)

    def floating(literal: str) -> float:
        value = float(literal)
        if math.isinf(value):
            numbers.append(f"a number that is not finite ({literal[:32]})")
        return value

    def integer(literal: str) -> int:
        value = int(literal)
        if abs(value) > sys.float_info.max:
            numbers.append(f"a number that overflows a double ({literal[:32]}...)")
        return value

    try:
        message = json.loads(decoded, parse_constant=constant, parse_float=floating, parse_int=integer)
    except (ValueError, RecursionError):
        return Unreadable(reason, detail, head, tail, len(text))
    if numbers and reason == "not_json":
        reason, detail = "non_finite_number", f"it has {numbers[0]}"
    return Unreadable(reason, detail, head, tail, len(text), response_ids(message))


def response_ids(message: Any) -> tuple[Any, ...]:
    """The ids of the responses a message holds: its own, or those of a batch's members (never a request's: the
    child's own ids say nothing about the proxy's calls)."""
    members = message if isinstance(message, list) else [message]
    return tuple(
        member["id"]
        for member in members
        if isinstance(member, dict) and "id" in member and not isinstance(member.get("method"), str)
    )


class ChildProcess:
    """One run of the child: its pipes read until it exits. `on_message` gets each JSON-RPC message (with its size),
    `on_unreadable` each line that is none; both are called in the reader and must not block."""

    def __init__(
        self,
        spec: ChildSpec,
        generation: int,
        on_message: Callable[[dict[str, Any], int], None],
        on_unreadable: Callable[[Unreadable], None],
        on_kill: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        self.generation = generation
        self._on_kill = on_kill
        self._on_message = on_message
        self._on_unreadable = on_unreadable
        self._process: asyncio.subprocess.Process | None = None
        self._stdin: asyncio.StreamWriter | None = None
        self._outgoing: list[bytes] = []
        """Lines written in this turn of the loop, sent together at its end: one pipe write for a burst of calls."""
        self._pipes: list[asyncio.BaseTransport] = []
        self._readers: list[asyncio.Task[None]] = []
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self._stderr_lines = 0
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Spawn the child; OSError (a missing program, a bad cwd) is the caller's to report."""
        # The proxy makes the three pipes itself rather than ask for PIPE: asyncio's Process gives no public way to
        # close its ends, and a process the child leaves behind in a session of its own (setsid, beyond killpg)
        # holds the other ends open, so no end of file ever comes. Then asyncio's own loop never finishes wait()
        # (it waits for the pipes too) and uvloop's keeps their descriptors, three more at every restart. Pipe
        # transports from connect_read_pipe / connect_write_pipe are the proxy's to close, on either loop; the
        # subprocess transport has no pipe left to wait for.
        stdout = asyncio.StreamReader(limit=self.spec.max_line_bytes)
        stderr = asyncio.StreamReader(limit=self.spec.max_line_bytes)
        theirs: list[int] = []
        try:
            stdin_fd = await self._pipe(theirs, None)
            stdout_fd = await self._pipe(theirs, stdout)
            stderr_fd = await self._pipe(theirs, stderr)
            self._process = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=stdin_fd,
                stdout=stdout_fd,
                stderr=stderr_fd,
                env=self.spec.env,
                cwd=self.spec.cwd,
                # Its own process group: a wrapper (sh, npx) and what it starts are stopped together (killpg).
                start_new_session=True,
            )
        except BaseException:
            self._close_pipes()
            raise
        finally:
            for fd in theirs:  # the child has its copies: with ours closed, its exit (or its group's) ends the pipes
                os.close(fd)
        self.started_at = time.monotonic()
        log.info("upstream_started", upstream=self.spec.name, pid=self._process.pid, generation=self.generation)
        self._readers = [
            asyncio.ensure_future(self._read_stdout(stdout)),
            asyncio.ensure_future(self._read_stderr(stderr)),
        ]

    async def _pipe(self, theirs: list[int], reader: asyncio.StreamReader | None) -> int:
        """One pipe: the proxy's end connected (read into `reader`, or written to as stdin when None), the child's
        end returned (and added to `theirs`, to be closed here once the child has it)."""
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        ours, child_end = (write_fd, read_fd) if reader is None else (read_fd, write_fd)
        theirs.append(child_end)
        pipe = os.fdopen(ours, "wb" if reader is None else "rb", buffering=0)  # the transport closes it
        try:
            if reader is None:
                # StreamReaderProtocol for its flow control: StreamWriter.drain() needs a protocol that has it.
                transport, protocol = await loop.connect_write_pipe(
                    lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), pipe
                )
                self._stdin = asyncio.StreamWriter(transport, protocol, None, loop)
            else:
                transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:
            pipe.close()
            raise
        self._pipes.append(transport)
        return child_end

    def _close_pipes(self) -> None:
        """Stop reading and close the proxy's ends of the pipes: whatever still holds the other ends (a process the
        child left behind) writes into a closed pipe, and reaches no call of a later run."""
        for reader in self._readers:
            reader.cancel()
        for transport in self._pipes:
            if not isinstance(transport, asyncio.WriteTransport):
                transport.close()
            elif not transport.is_closing() or transport.get_write_buffer_size():
                transport.abort()  # what the child did not read goes (stdin closed by stop() may still hold some)
        self._pipes = []

    async def wait(self) -> int:
        """The exit status, once the child has exited and its pipes are read to their end (or for _LAST_OUTPUT_S,
        when something it left behind holds them open); the pipes are closed then."""
        assert self._process is not None
        status = await self._process.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._readers, return_exceptions=True), _LAST_OUTPUT_S)
        self._close_pipes()
        return status

    async def write(self, line: bytes) -> None:
        """One message (a line with its newline) to the child's stdin. Raises ConnectionError when the child is
        gone or has not read its stdin for _WRITE_TIMEOUT_S."""
        process, stdin = self._process, self._stdin
        if process is None or stdin is None or process.returncode is not None or stdin.transport.is_closing():
            raise RequestUnsent("the stdio server is not running")
        if stdin.transport.get_write_buffer_size() > _MAX_UNREAD_BYTES:
            # A child that does not read: each message would wait in memory until it does.
            raise RequestUnsent(f"the stdio server has not read {_MAX_UNREAD_BYTES} bytes written to its stdin")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush, stdin)
        self._outgoing.append(line)  # whole lines, joined: the framing stays whole
        try:
            await asyncio.sleep(0)  # the turn's flush, before drain() looks at what the pipe holds
            async with asyncio.timeout(_WRITE_TIMEOUT_S):  # drain() has room for many waiters: no lock to queue on
                await stdin.drain()
        except TimeoutError:
            # Not reading for that long is a fault of the child's, like dying: it is stopped, and started again.
            log.warning("upstream_stdin_stuck", upstream=self.spec.name, pid=process.pid, wait_s=_WRITE_TIMEOUT_S)
            self.kill()
            raise ConnectionError(f"the stdio server has not read its stdin for {_WRITE_TIMEOUT_S:g} s") from None
        except (BrokenPipeError, ConnectionResetError, RuntimeError) as exc:
            raise ConnectionError(f"the stdio server's stdin is closed ({type(exc).__name__})") from None

    def _flush(self, stdin: asyncio.StreamWriter) -> None:
        lines, self._outgoing = self._outgoing, []
        if stdin is self._stdin and not stdin.transport.is_closing():
            with contextlib.suppress(RuntimeError):  # (closed meanwhile: each writer's drain() says so)
                stdin.write(b"".join(lines))

    def kill(self) -> None:
        """SIGKILL the child's process group at once; from now on it takes no request (the supervisor sees it exit
        and starts it again)."""
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._on_kill()

    async def stop(self) -> int | None:
        """As the stdio transport asks: close stdin, wait; SIGTERM the group, wait; SIGKILL. The exit status."""
        process = self._process
        if process is None:
            return None
        if process.returncode is None and self._stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self._stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), self.spec.stop_grace_s)
        for sig, grace in ((signal.SIGTERM, self.spec.term_grace_s), (signal.SIGKILL, 5.0)):
            if process.returncode is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), grace)
        # What the group still holds (a wrapper's children that outlived it) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        self._close_pipes()
        return process.returncode

    async def _read_stdout(self, stdout: asyncio.StreamReader) -> None:
        limit = self.spec.max_line_bytes
        while True:
            try:
                line = await stdout.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    self._line(exc.partial)  # a last message without its newline
                return
            except asyncio.LimitOverrunError as exc:
                await self._discard(stdout, exc.consumed, limit)
                continue
            self._line(line)

    async def _discard(self, stdout: asyncio.StreamReader, consumed: int, limit: int) -> None:
        """Read past one over-long line without keeping it, then report its edges."""
        head = bytes(await stdout.readexactly(consumed)) if consumed else b""
        size, tail = len(head), head[-_EDGE_BYTES:]
        head = head[:_EDGE_BYTES]
        while True:
            try:
                rest = await stdout.readuntil(b"\n")
            except asyncio.LimitOverrunError as exc:
                chunk = await stdout.readexactly(exc.consumed) if exc.consumed else b""
                size += len(chunk)
                tail = (tail + chunk)[-_EDGE_BYTES:]
                if not exc.consumed:  # pragma: no cover - readuntil always consumes when over the limit
                    await asyncio.sleep(0)
                continue
            except asyncio.IncompleteReadError as exc:
                rest = exc.partial
            size += len(rest)
            tail = (tail + rest)[-_EDGE_BYTES:]
            break
        detail = f"it is {size} bytes long, over upstream.stdio.max_line_bytes ({limit})"
        self._report(self._on_unreadable, Unreadable("too_long", detail, head, tail, size))

    def _line(self, line: bytes) -> None:
        text = line.strip()
        if not text:
            return
        try:
            message = loads(text)
        except ValueError as exc:
            # Not a message: a banner or a stray print (the transport forbids them, servers do it anyway), or an
            # answer broken on the way (one bad byte). Either way whoever waits for it is told.
            self._report(self._on_unreadable, unreadable(text, exc))
            return
        if not isinstance(message, dict):
            why = "it is a batch (stdio carries one message per line)" if isinstance(message, list) else None
            detail = why or f"it is a JSON {type(message).__name__}, not a JSON-RPC message"
            line = Unreadable(
                "not_jsonrpc", detail, text[:_EDGE_BYTES], text[-_EDGE_BYTES:], len(text), response_ids(message)
            )
            self._report(self._on_unreadable, line)
            return
        self._report(self._on_message, message, len(text))

    def _report(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # a fault of the proxy's own on one line must not stop the reading of the rest
            log.exception("upstream_message_error", upstream=self.spec.name)

    async def _read_stderr(self, stderr: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stderr.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                line = exc.partial
                if not line:
                    return
            except asyncio.LimitOverrunError as exc:
                line = await stderr.readexactly(exc.consumed) if exc.consumed else b""
            text = line[:_STDERR_LINE_BYTES].decode("utf-8", "replace").rstrip()
            if not text:
                continue
            self.stderr_tail.append(text[:500])
            self._stderr_lines += 1
            if self._stderr_lines <= _LOGGED_LINES or self._stderr_lines % 1000 == 0:
                log.info("upstream_stderr", upstream=self.spec.name, pid=self.pid, line=text, count=self._stderr_lines)


class Supervisor:
    """Keeps one child running: starts it, and when it exits tells `on_exit` and starts it again, the delay doubling
    from restart_min_s to restart_max_s (and back to the minimum after a healthy run)."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        on_start: Callable[[ChildProcess], None],
        on_exit: Callable[[ChildProcess, int], None],
        on_message: Callable[[ChildProcess, dict[str, Any], int], None],
        on_unreadable: Callable[[ChildProcess, Unreadable], None],
        on_kill: Callable[[ChildProcess], None] = lambda child: None,
    ) -> None:
        self.spec = spec
        self._on_start = on_start
        self._on_kill = on_kill
        self._on_exit = on_exit
        self._on_message = on_message
        self._on_unreadable = on_unreadable
        self.child: ChildProcess | None = None
        self.state = "starting"
        """For /readyz: "running", "starting", or why the child is not running."""
        self._generation = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._recycled: ChildProcess | None = None

    async def start(self) -> None:
        """Start the first child (OSError when it cannot be spawned at all), then keep it running."""
        child = await self._spawn()
        self._loop_task = asyncio.ensure_future(self._watch(child))

    async def _spawn(self) -> ChildProcess:
        self._generation += 1
        child = ChildProcess(
            self.spec,
            self._generation,
            lambda message, size: self._on_message(child, message, size),
            lambda line: self._on_unreadable(child, line),
            lambda: self._killed(child),
        )
        await child.start()
        self.child = child
        self.state = "running"
        self._on_start(child)
        return child

    def _killed(self, child: ChildProcess) -> None:
        if self.child is child:
            self.child = None  # no request goes to it while it dies
            self.state = "killed (it stopped reading its stdin), restarting"
            self._on_kill(child)

    def recycle(self) -> Awaitable[None] | None:
        """Stop the running child as at shutdown and start a fresh one at once: nothing it kept of its callers
        survives. From this call on no request goes to it (the channel's wait for the next run); what is returned
        stops it, for the caller to run in the background. None when none runs (it is being restarted anyway)."""
        child = self.child
        if child is None or self._stopping:
            return None
        self._recycled = child
        self._killed(child)
        self.state = "restarting for another caller"
        return child.stop()  # the watch loop starts the next one as soon as this one is gone

    @property
    def recycling(self) -> bool:
        """Stopped on purpose, to start again at once: not a failure for /readyz."""
        return self._recycled is not None

    async def _watch(self, child: ChildProcess) -> None:
        delay = self.spec.restart_min_s
        while True:
            status = await child.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # what a wrapper left behind in its group goes with it
            ran_s = time.monotonic() - child.started_at
            self.child = None
            if self._stopping:
                return
            if self._recycled is child:  # stopped on purpose: started again at once, with no backoff
                self._recycled = None
                self._on_exit(child, status)
                log.info("upstream_recycled", upstream=self.spec.name, pid=child.pid, ran_s=round(ran_s, 3))
                child = await self._respawn(self.spec.restart_min_s)
                continue
            self._on_exit(child, status)
            if ran_s >= _HEALTHY_S:
                delay = self.spec.restart_min_s
            self.state = f"exited with status {status}, restarting in {delay:g} s"
            log.warning(
                "upstream_exited",
                upstream=self.spec.name,
                pid=child.pid,
                status=status,
                ran_s=round(ran_s, 3),
                restart_in_s=delay,
                stderr_tail=list(child.stderr_tail)[-5:],
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.spec.restart_max_s)
            child = await self._respawn(delay)

    async def _respawn(self, delay: float) -> ChildProcess:
        """A new child, trying again while it cannot start, the delay doubling from `delay`."""
        while True:
            try:
                return await self._spawn()
            except OSError as exc:
                self.state = f"cannot start ({exc}), retrying in {delay:g} s"
                log.warning("upstream_start_failed", upstream=self.spec.name, reason=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.spec.restart_max_s)

    async def stop(self) -> None:
        self._stopping = True
        child = self.child
        if child is not None:
            status = await child.stop()
            log.info("upstream_stopped", upstream=self.spec.name, pid=child.pid, status=status)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
