"""Walk the whole task flow through mcp-tasks-proxy in plain HTTP, printing every message on the wire.

Run: python examples/task_client.py [http://127.0.0.1:8080/mcp]
Standard library only, so that nothing hides what goes over the wire.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

PROTOCOL_VERSION = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
_ids = itertools.count(1)


def envelope(*, declare_tasks: bool = True, elicitation: bool = False) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"extensions": {TASKS: {}}} if declare_tasks else {}
    if elicitation:
        capabilities["elicitation"] = {}  # form mode: this client can put a question to its user
    return {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": capabilities,
        "io.modelcontextprotocol/clientInfo": {"name": "task-client-example", "version": "1.0"},
    }


def rpc(
    url: str, method: str, params: dict[str, Any], *, name: str | None = None, quiet: bool = False
) -> dict[str, Any]:
    """POST one request with the 2026-07-28 headers; return the JSON-RPC response (last event of a stream)."""
    message = {"jsonrpc": "2.0", "id": next(_ids), "method": method, "params": params}
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": PROTOCOL_VERSION,
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = name
    if not quiet:
        print(f"\n--> {json.dumps(message)}")
    request = urllib.request.Request(url, data=json.dumps(message).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read().decode()
            content_type = response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:  # 4xx answers still carry a JSON-RPC error
        body = exc.read().decode()
        content_type = exc.headers.get("Content-Type", "")
    if content_type.startswith("text/event-stream"):
        datas = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
        body = next(d for d in reversed(datas) if d)
    answer = json.loads(body)
    if not quiet:
        print(f"<-- {json.dumps(answer)}")
    return answer


def follow(
    url: str, task: dict[str, Any], *, until: tuple[str, ...] = ("completed", "failed", "cancelled")
) -> dict[str, Any]:
    """Poll tasks/get at the interval the proxy suggests, until the task reaches one of `until`."""
    task_id = task["taskId"]
    last_status = None
    while True:
        time.sleep(task.get("pollIntervalMs", 1000) / 1000)
        answer = rpc(url, "tasks/get", {"taskId": task_id, "_meta": envelope()}, name=task_id, quiet=True)
        task = answer["result"]
        line = (task["status"], task.get("statusMessage"))
        if line != last_status:
            print(f"    tasks/get: status={task['status']!r} statusMessage={task.get('statusMessage')!r}")
            last_status = line
        if task["status"] in until:
            print(f"<-- {json.dumps(answer)}")
            return task


def follow_by_notifications(url: str, task_id: str) -> dict[str, Any]:
    """subscriptions/listen with notifications.taskIds: the proxy pushes the task's state; no polling."""
    message = {
        "jsonrpc": "2.0",
        "id": next(_ids),
        "method": "subscriptions/listen",
        "params": {"notifications": {"taskIds": [task_id]}, "_meta": envelope()},
    }
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": PROTOCOL_VERSION,
        "Mcp-Method": "subscriptions/listen",
    }
    print(f"\n--> {json.dumps(message)}")
    request = urllib.request.Request(url, data=json.dumps(message).encode(), headers=headers, method="POST")
    task: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:  # the event stream, line by line, as it arrives
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("method") == "notifications/tasks":
                task = event["params"]
                print(f"<-- notifications/tasks: status={task['status']!r} statusMessage={task.get('statusMessage')!r}")
            else:
                print(f"<-- {json.dumps(event)}")
    return task


def main(url: str) -> int:
    print(f"Talking to {url}")
    rpc(url, "server/discover", {"_meta": envelope()})

    print("\n# A slow tool, made a task by the policy: the answer is a CreateTaskResult at once.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 4}, "_meta": envelope()},
        name="slow_report",
    )
    final = follow(url, created["result"])
    assert final["status"] == "completed", final

    print("\n# A tool that asks who the report is for: the question arrives as the task's inputRequests.")
    created = rpc(
        url,
        "tools/call",
        {"name": "personal_report", "arguments": {"topic": "tides", "seconds": 2}, "_meta": envelope(elicitation=True)},
        name="personal_report",
    )
    task = follow(url, created["result"], until=("input_required", "completed", "failed", "cancelled"))
    assert task["status"] == "input_required", task
    # Answer every outstanding request, under the keys the task gave (a real client would ask its user here).
    answers = {key: {"action": "accept", "content": {"name": "Ada"}} for key in task["inputRequests"]}
    task_id = task["taskId"]
    rpc(url, "tasks/update", {"taskId": task_id, "inputResponses": answers, "_meta": envelope()}, name=task_id)
    final = follow(url, task)
    assert final["status"] == "completed", final

    print("\n# The same slow tool without declaring the extension: an ordinary call, kept alive while it runs.")
    rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "tides", "seconds": 1}, "_meta": envelope(declare_tasks=False)},
        name="slow_report",
    )

    print("\n# Cancel: tasks/cancel is acknowledged, and the upstream call is stopped.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "volcanoes", "seconds": 30}, "_meta": envelope()},
        name="slow_report",
    )
    task_id = created["result"]["taskId"]
    rpc(url, "tasks/cancel", {"taskId": task_id, "_meta": envelope()}, name=task_id)
    rpc(url, "tasks/get", {"taskId": task_id, "_meta": envelope()}, name=task_id)

    print("\n# Follow a task by notifications (subscriptions/listen) instead of polling.")
    created = rpc(
        url,
        "tools/call",
        {"name": "slow_report", "arguments": {"topic": "comets", "seconds": 2}, "_meta": envelope()},
        name="slow_report",
    )
    final = follow_by_notifications(url, created["result"]["taskId"])
    assert final["status"] == "completed", final

    print("\n# A fast tool the policy leaves alone passes straight through.")
    rpc(url, "tools/call", {"name": "add", "arguments": {"a": 2, "b": 3}, "_meta": envelope()}, name="add")
    print(
        "\nDone: three tasks completed (one after asking for input, one followed by notifications), one cancelled, "
        "one call without tasks kept alive, one call passed through."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/mcp"))
