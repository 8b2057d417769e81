"""Quick start: run the example MCP server, put mcp-tasks-proxy in front of it, and walk a task flow.

Run from the repository root after `pip install '.[examples]'`:
    python examples/demo.py            # keeps both running afterwards; Ctrl-C stops them
    python examples/demo.py --exit     # stops both once the walk-through is done
    python examples/demo.py --stdio    # the proxy starts the server itself and speaks to it over stdio
    python examples/demo.py --verbose  # the server's and the proxy's logs on the terminal, not in a file

Then open http://127.0.0.1:8080/console to call the tools and watch their tasks in a browser.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import task_client  # noqa: E402  (a sibling script, not a package)


def require_free(port: int, option: str) -> None:
    """Refuse to start on a port another program holds: the walk-through would talk to that program instead."""
    with socket.socket() as probe:
        # As the servers bind (SO_REUSEADDR): a port left in TIME-WAIT by the last run is free, a listening one not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(f"demo: port {port} is taken by another program: pass {option} with a free port") from None


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with code {process.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on port {port} within {timeout_s:g} s")


def wait_ready(port: int, proxy: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Until /readyz says the upstream answers (a stdio child has started and been initialized)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proxy.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return
        except OSError:  # HTTPError (503: not ready yet) included
            time.sleep(0.1)
    raise SystemExit(f"mcp-tasks-proxy was not ready within {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-port", type=int, default=9000, help="port of the example MCP server")
    parser.add_argument("--proxy-port", type=int, default=8080, help="port of mcp-tasks-proxy")
    parser.add_argument("--exit", action="store_true", help="stop both processes after the walk-through")
    parser.add_argument("--stdio", action="store_true", help="let the proxy start the server as its stdio child")
    parser.add_argument("--verbose", action="store_true", help="the logs on the terminal instead of in a file")
    args = parser.parse_args()
    # Stopped as a service manager or `kill` stops it: the server and the proxy go with it (see `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    if not args.stdio:
        require_free(args.server_port, "--server-port")
    require_free(args.proxy_port, "--proxy-port")
    # The walk-through alone on the terminal; the server's and the proxy's log lines in a file it names.
    # (Named by port: two demos on one machine keep their own.)
    log_path = Path(tempfile.gettempdir()) / f"mcp-tasks-proxy-demo-{args.proxy_port}.log"
    log = None if args.verbose else open(log_path, "wb")  # noqa: SIM115
    if log is not None:
        print(f"(The server's and the proxy's logs: {log.name}; --verbose shows them here.)\n", flush=True)
    server = None
    if args.stdio:
        upstream = "its stdio child, examples/slow_server.py --stdio"
        where = ["--", sys.executable, str(HERE / "slow_server.py"), "--stdio"]
    else:
        upstream = f"http://127.0.0.1:{args.server_port}/mcp"
        where = ["--upstream", upstream]
        server = subprocess.Popen(
            [sys.executable, str(HERE / "slow_server.py"), str(args.server_port)], stdout=log, stderr=log
        )
    proxy = None
    try:
        if server is not None:
            wait_for_port(args.server_port, server, "the example server")
        config = str(HERE.parent / "config" / "example.yaml")
        proxy = subprocess.Popen(
            [sys.executable, "-m", "mcp_tasks_proxy", "--config", config, "--port", str(args.proxy_port), *where],
            stdout=log,
            stderr=log,
        )
        wait_for_port(args.proxy_port, proxy, "mcp-tasks-proxy")
        wait_ready(args.proxy_port, proxy)
        url = f"http://127.0.0.1:{args.proxy_port}/mcp"
        status = task_client.main(url)
        if args.exit:
            return status
        print(f"\nmcp-tasks-proxy serves {url} in front of {upstream}.")
        print(f"Open http://127.0.0.1:{args.proxy_port}/console to call the tools and watch their tasks in a browser.")
        print("Ctrl-C stops both.", flush=True)
        proxy.wait()
        return proxy.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        if proxy is not None and proxy.poll() is None:
            # The proxy gives a task still running its grace (tasks.shutdown_grace_s, 10 s) before it stops.
            print("\nStopping the proxy and the server (a task still running gets up to 10 s)...", flush=True)
        stop(proxy, server)
        if log is not None:
            log.close()


def stop(*processes: subprocess.Popen[bytes] | None) -> None:
    """Stop each process still running, in order: asked to end, killed after 10 s."""
    for process in processes:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())
