"""A fake legacy (2025-11-25) MCP server on the stdio transport that injects one fault, for the proxy's stdio tests.

Standard library only. Run: python tests/stdio_hostile.py MODE

It reads newline-delimited JSON-RPC on stdin and answers on stdout, each request in a task of its own: `initialize`
(protocolVersion 2025-11-25, capabilities {"tools": {}}), `ping`, `tools/list` and `tools/call`; notifications and
responses are ignored, any other method (`server/discover` included: it is legacy) gets -32601, an unknown tool -32602
and a line that is not JSON -32700. Its tools:

- echo {"text": str}: answers that text;
- sleep {"seconds": float}: answers "slept N s" after that long;
- pid {}: answers os.getpid().

At stdin EOF it finishes the calls under way, then exits 0. MODE is one of:

- ok: no fault.
- banner: writes two lines that are not JSON on stdout at start ("Server starting..." ...), then behaves.
- long_line: echo "flood" is answered by one JSON response of ~100 MB on a single line (the proxy must drop it and
  fail that call); every other call, later ones too, is answered normally.
- junk_lines: echo "flood" writes 1,000,000 short lines that are not JSON on stdout, then answers normally.
- stderr_flood: writes 50 MB to stderr (in lines) before reading anything, then behaves; it blocks until stderr is
  drained.
- die_mid_call: sleep writes "dying now" on stderr and exits with status 3 after 0.2 s, without answering.
- never_answers: reads stdin but never writes anything on stdout (initialize is never answered); exits at EOF.
- ignores_eof_and_term: ignores SIGTERM and keeps running after stdin EOF (sleeps forever): only SIGKILL stops it.
- exit_at_start: writes "fatal: bad config" on stderr and exits with status 2 at once.
- stops_reading: echo "stop" is answered, and from then on stdin is never read again (the process lives on).
- unreadable: echo's answer is broken as its text says (any other text is answered normally): "invalid_utf8" (one
  byte 0xff in it), "truncated" (cut short: not JSON), "nan" (NaN in its result), "no_result" (neither result nor
  error), "bad_method" (a method that is not a string), "batch" (the answer inside a JSON array); "stray" writes a
  line with a byte 0xff that names no call ("id": "m999.1") and a banner, then answers normally.
- leaves_a_grandchild: starts a process in a session of its own that inherits stdin, stdout and stderr, writes its
  pid (a line) to the file named by the second argument and sleeps 10 minutes; then exits with status 1 at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

MODES = (
    "ok",
    "banner",
    "long_line",
    "junk_lines",
    "stderr_flood",
    "die_mid_call",
    "never_answers",
    "ignores_eof_and_term",
    "exit_at_start",
    "stops_reading",
    "unreadable",
    "leaves_a_grandchild",
)
PROTOCOL_VERSION = "2025-11-25"
LONG_LINE_BYTES = 100 * 1024 * 1024
JUNK_LINES = 1_000_000
STDERR_FLOOD_BYTES = 50 * 1024 * 1024

TOOLS: list[dict[str, Any]] = [
    {
        "name": "echo",
        "description": "Answer the text it is given.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
    {
        "name": "sleep",
        "description": "Answer after `seconds`.",
        "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    },
    {"name": "pid", "description": "This process's id.", "inputSchema": {"type": "object", "properties": {}}},
]


class ToolError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Server:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.out = sys.stdout.buffer
        self.lock = asyncio.Lock()  # one message at a time on stdout: lines never interleave
        self.tasks: set[asyncio.Task[None]] = set()
        self.stop_reading = threading.Event()

    async def write(self, data: bytes) -> None:
        """Write whole lines on stdout, off the event loop (a big write waits for the reader without stalling us)."""
        if self.mode == "never_answers":
            return
        async with self.lock:
            await asyncio.to_thread(self._write_blocking, data)

    def _write_blocking(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    async def send(self, message: dict[str, Any]) -> None:
        await self.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def handle_line(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            await self.send({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}})
            return
        if not isinstance(message, dict) or "method" not in message or "id" not in message:
            return  # a notification, or the client's answer to a request we never send
        request_id = message["id"]
        try:
            result = await self.dispatch(message["method"], message.get("params") or {}, request_id)
        except ToolError as exc:
            await self.send({"jsonrpc": "2.0", "id": request_id, "error": {"code": exc.code, "message": exc.message}})
            return
        if result is not None:
            await self.send({"jsonrpc": "2.0", "id": request_id, "result": result})

    async def dispatch(self, method: str, params: dict[str, Any], request_id: Any) -> dict[str, Any] | None:
        """The result of a request, or None when the answer was written already (or never will be)."""
        if method == "initialize":
            return {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "stdio-hostile", "version": "1"},
            }
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": TOOLS}
        if method == "tools/call":
            return await self.call_tool(str(params.get("name")), params.get("arguments") or {}, request_id)
        raise ToolError(-32601, f"Method not found: {method}")

    async def call_tool(self, name: str, arguments: dict[str, Any], request_id: Any) -> dict[str, Any] | None:
        if name == "echo":
            text = str(arguments.get("text", ""))
            if text == "flood" and self.mode == "long_line":
                head = b'{"jsonrpc":"2.0","id":' + json.dumps(request_id).encode() + b',"result":{"content":'
                await self.write(head + b'[{"type":"text","text":"' + b"x" * LONG_LINE_BYTES + b'"}]}}\n')
                return None
            if self.mode == "unreadable" and text in BROKEN:
                await self.write(broken(text, request_id))
                if text != "stray":
                    return None
            if text == "stop" and self.mode == "stops_reading":
                self.stop_reading.set()
            if text == "flood" and self.mode == "junk_lines":
                await self.write(b"".join(b"junk line %d\n" % n for n in range(JUNK_LINES)))
            return text_result(text)
        if name == "sleep":
            if self.mode == "die_mid_call":
                sys.stderr.write("dying now\n")
                sys.stderr.flush()
                await asyncio.sleep(0.2)
                os._exit(3)
            seconds = float(arguments.get("seconds", 0))
            await asyncio.sleep(seconds)
            return text_result(f"slept {seconds:g} s")
        if name == "pid":
            return text_result(str(os.getpid()))
        raise ToolError(-32602, f"Unknown tool: {name}")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[bytes | None] = asyncio.Queue()

        def read() -> None:  # a thread: works whatever stdin is (pipe, file, terminal)
            for line in sys.stdin.buffer:
                loop.call_soon_threadsafe(lines.put_nowait, line)
                if self.stop_reading.is_set():
                    threading.Event().wait()  # never again: what the proxy writes now stays in the pipe
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read, name="stdin", daemon=True).start()
        if self.mode == "banner":
            await self.write(f"Server starting...\nListening on stdio (pid {os.getpid()})\n".encode())
        while (line := await lines.get()) is not None:
            if not line.strip():
                continue
            task = asyncio.create_task(self.handle_line(line))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if self.mode == "ignores_eof_and_term":
            await asyncio.Event().wait()  # forever
        await asyncio.gather(*self.tasks)  # what was asked before EOF is still answered


def text_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": False}


def answer(request_id: Any, **members: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, **members}, separators=(",", ":")).encode()


BROKEN = frozenset({"invalid_utf8", "truncated", "nan", "no_result", "bad_method", "batch", "stray"})


def broken(how: str, request_id: Any) -> bytes:
    """Mode `unreadable`'s answer to echo `how` (one of BROKEN), as written on stdout."""
    match how:
        case "invalid_utf8":
            line = answer(request_id, result=text_result("one bad byte: *")).replace(b"*", b"\xff")
        case "truncated":
            line = answer(request_id, result=text_result("cut short"))[:-20]
        case "nan":
            line = answer(request_id, result={"content": [], "value": float("nan")})
        case "no_result":
            line = answer(request_id)
        case "bad_method":
            line = answer(request_id, method=5)
        case "batch":
            line = b"[" + answer(request_id, result=text_result("batched")) + b"]"
        case _:  # stray
            line = answer("m999.1", result=text_result("*")).replace(b"*", b"\xff") + b"\nnot a message"
    return line + b"\n"


def leave_a_grandchild(pid_file: str) -> None:
    """A process out of the proxy's reach (a session of its own: killpg does not get it) that holds our pipes."""
    script = f"echo $$ >> '{pid_file}'; exec sleep 600"
    subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True)  # inherits stdin, stdout and stderr


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode not in MODES:
        sys.exit(f"usage: stdio_hostile.py {{{','.join(MODES)}}}")
    if mode == "leaves_a_grandchild":
        leave_a_grandchild(sys.argv[2])
        os._exit(1)
    if mode == "exit_at_start":
        sys.stderr.write("fatal: bad config\n")
        sys.stderr.flush()
        os._exit(2)
    if mode == "ignores_eof_and_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "stderr_flood":
        line = b"stderr flood " + b"." * 86 + b"\n"  # 100 bytes
        sys.stderr.buffer.write(line * (STDERR_FLOOD_BYTES // len(line)))
        sys.stderr.flush()
    asyncio.run(Server(mode).run())


if __name__ == "__main__":
    main()
