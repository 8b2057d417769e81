"""How a rate-limited load arrives: the timing behind docs/benchmarks.md's creation p99.

    python bench/arrivals.py [--generator wrk|h2load] [--rate 1000] [--connections N] [--seconds 4]

bench/run.py's rate runs draw exponential pauses in wrk's `delay()`, meant as Poisson arrivals, but wrk's timers
fire on one thread's millisecond ticks; `bench/ab.py --path create` offers its arrivals from h2load, one process
per connection (bench/run.py `poisson`). A bare server here records the moment each request arrives; the figures
compare them with a Poisson process at the rate measured: the share of gaps under 100 µs, and the share of
requests that arrive with three or more others in the 250 µs before them (about one creation's time), which is
what a p99 waits behind.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import META_TASKS, RATE_LOADS, free_port  # noqa: E402  (bench/ is a folder of scripts)

_BODY = b'{"jsonrpc":"2.0","id":1,"result":{}}'
_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)


class _Recorder(asyncio.Protocol):
    arrivals: list[float] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.arrivals.append(time.perf_counter())  # each of wrk's requests comes in one read
        self.transport.write(_ANSWER)  # type: ignore[attr-defined]


def _serve(port: int, ready: threading.Event, stop: threading.Event) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Recorder, "127.0.0.1", port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generator", choices=("wrk", "h2load"), default="wrk")
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--connections", type=int, help="16 for wrk, 64 for h2load (as bench/ab.py uses them)")
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_serve, args=(port, ready, stop))
    thread.start()
    try:
        ready.wait(10)
        load, connections = RATE_LOADS[args.generator]
        load(f"http://127.0.0.1:{port}/mcp", "tools/call", {"name": "echo", "arguments": {}}, meta=META_TASKS,
            connections=args.connections or connections, seconds=args.seconds, name="echo", rate=args.rate)  # fmt: skip
    finally:
        stop.set()
        thread.join()
    moments = sorted(_Recorder.arrivals)
    gaps = [later - earlier for earlier, later in zip(moments, moments[1:], strict=False)]
    rate = (len(moments) - 1) / (moments[-1] - moments[0])
    behind = sum(1 for i, t in enumerate(moments) if i - bisect.bisect_left(moments, t - 250e-6) >= 3)
    mean = rate * 250e-6  # arrivals a Poisson process has in 250 µs
    poisson_behind = 1 - math.exp(-mean) * (1 + mean + mean**2 / 2)
    print(f"{len(moments)} requests, {rate:.0f}/s")
    print(f"gaps under 100 µs: {args.generator} {sum(g < 100e-6 for g in gaps) / len(gaps):.1%}, "
          f"Poisson {1 - math.exp(-rate * 100e-6):.1%}")  # fmt: skip
    print(f"requests with 3 or more others in the 250 µs before: {args.generator} {behind / len(moments):.1%}, "
          f"Poisson {poisson_behind:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
