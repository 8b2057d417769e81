"""examples/sdk_tasks_client.py, the official Python SDK 2.x client with the tasks extension declared, run as a user
runs it against the quick start's proxy; and the same SDK without the extension, for the difference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, free_port, quick_start, quiet_proxy, wait_ready

EXAMPLE = ROOT / "examples" / "sdk_tasks_client.py"
REPORT = "Report on tides: all 5 steps done in 2 s."


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    with quick_start() as url:
        yield url


def run(*args: str, timeout: float = 50, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, input=stdin, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_the_sdk_client_gets_a_task_and_follows_it_to_the_tools_result(proxy_url):
    done = run(str(EXAMPLE), proxy_url, "slow_report", '{"topic": "tides", "seconds": 2}')
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    lines = done.stdout.splitlines()
    created = re.fullmatch(r"task (\S+): working", lines[0])
    assert created, done.stdout  # the CreateTaskResult came first, its task id printed
    task_id = created.group(1)
    polled = lines[1:-1]
    assert any(re.fullmatch(rf"task {task_id}: working \(researching tides: step \d of 5\)", line) for line in polled)
    assert polled[-1] == f"task {task_id}: completed"  # tasks/get reached the end, and nothing was polled after it
    assert all(line.startswith(f"task {task_id}: ") for line in polled)
    assert lines[-1] == REPORT  # the completed task's result, the tool's own text


def test_a_tool_no_rule_names_is_answered_without_a_task(proxy_url):
    done = run(str(EXAMPLE), proxy_url, "add", '{"a": 2, "b": 3}')
    assert (done.returncode, done.stdout, done.stderr) == (0, "5\n", "")


# The SDK as installed: a plain Client (no extension), or one with the example's extension whose tools/call result is
# read as it comes (allow_claimed=True: the CreateTaskResult itself, not followed).
PROBE = """
import asyncio, json, sys, time
sys.path.insert(0, "examples")
from mcp import Client
from sdk_tasks_client import Tasks

async def main(url, declared):
    async with Client(url, extensions=[Tasks()] if declared else None) as client:
        started = time.monotonic()
        arguments = {"topic": "tides", "seconds": 2}
        if declared:
            result = await client.session.call_tool("slow_report", arguments, allow_claimed=True)
        else:
            result = await client.call_tool("slow_report", arguments)
        print(json.dumps({"elapsed_s": time.monotonic() - started, "result": result.model_dump(mode="json",
                                                                                               by_alias=True)}))

asyncio.run(main(sys.argv[1], sys.argv[2] == "declared"))
"""


def probe(proxy_url: str, declared: bool) -> dict:
    done = run("-c", PROBE, proxy_url, "declared" if declared else "plain")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return json.loads(done.stdout)


def test_without_the_extension_the_same_call_is_answered_in_its_request_not_as_a_task(proxy_url):
    """`pip install mcp` alone: the tools/call's one request waits the tool's 2 s out and carries its result (the
    proxy keeps it alive, but a client or gateway timeout shorter than the tool would end it); declared, the same
    call is answered at once with a CreateTaskResult."""
    plain = probe(proxy_url, declared=False)
    assert plain["result"]["resultType"] == "complete"
    assert "taskId" not in plain["result"]
    assert plain["result"]["content"][0]["text"] == REPORT
    assert plain["elapsed_s"] >= 2

    declared = probe(proxy_url, declared=True)
    assert declared["result"]["resultType"] == "task"
    assert declared["result"]["status"] == "working" and declared["result"]["taskId"]
    assert declared["result"]["pollIntervalMs"] == 1000  # config/example.yaml's poll_interval_ms
    assert declared["elapsed_s"] < 2  # sync_window_ms: 0, so before the tool could finish


def test_a_question_the_task_asks_is_answered_from_the_terminal(proxy_url):
    """personal_report asks who the report is for (an MRTR elicitation of the 2026 server): the task turns
    input_required, the client prompts for each field, and tasks/update sends the answer."""
    done = run(str(EXAMPLE), proxy_url, "personal_report", '{"topic": "tides", "seconds": 1}', stdin="Ada\n")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    lines = done.stdout.splitlines()
    asked = lines.index("? Who is this report for?")
    assert re.fullmatch(r"task \S+: input_required \(.*\)", lines[asked - 1]), done.stdout
    assert lines[asked + 1] == "  Name: Ada"  # the prompt, and the piped answer echoed on its line
    assert re.fullmatch(r"task \S+: completed", lines[-2])
    assert lines[-1] == "Dear Ada, here is your report on tides."


def test_answer_gives_the_answer_and_decline_declines(proxy_url):
    done = run(
        str(EXAMPLE), "--answer", '{"name": "Ada"}', proxy_url, "personal_report", '{"topic": "tides", "seconds": 1}'
    )
    assert (done.returncode, done.stdout.splitlines()[-1]) == (0, "Dear Ada, here is your report on tides.")
    declined = run(str(EXAMPLE), "--answer", "decline", proxy_url, "personal_report", '{"topic": "tides"}')
    assert declined.returncode == 1  # the tool's own answer to a declined question: an error result
    assert "elicitation was decline" in declined.stdout
    assert one_line_error(declined) == "error: personal_report returned an error"


def test_a_2025_servers_question_is_answered_the_same_way(legacy_upstream, tmp_path):
    """In front of a 2025-11-25 server (SDK 1.x) whose tool asks on its event stream: the proxy makes the question
    the task's inputRequests, and the client answers it as it answers a 2026 server's."""
    policy = tmp_path / "policy.yaml"
    policy.write_text('tools:\n  - match: "ask_*"\n')
    port = free_port()
    with quiet_proxy(policy, legacy_upstream, port):
        wait_ready(port)
        done = run(str(EXAMPLE), "--answer", '{"name": "Ada"}', f"http://127.0.0.1:{port}/mcp", "ask_name")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    lines = done.stdout.splitlines()
    assert "? Your name?" in lines
    assert any(re.fullmatch(r"task \S+: input_required.*", line) for line in lines)
    assert lines[-1] == "hello Ada"


def test_a_tool_error_prints_the_tools_text_and_exits_1(proxy_url):
    done = run(str(EXAMPLE), proxy_url, "failing_job")
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == "Error executing tool failing_job"
    assert one_line_error(done) == "error: failing_job returned an error"


def test_no_proxy_there_is_one_error_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    done = run(str(EXAMPLE), url, "slow_report")
    assert (done.returncode, done.stdout) == (1, "")
    assert one_line_error(done).startswith(f"error: {url}: ConnectError")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "usage: sdk_tasks_client.py [--answer JSON|decline] URL TOOL [JSON_ARGUMENTS]"),
        (["127.0.0.1:8080/mcp", "add"], "usage: sdk_tasks_client.py [--answer JSON|decline] URL TOOL [JSON_ARGUMENTS]"),
        (["http://127.0.0.1:8080/mcp", "add", '{"a": '], "error: JSON_ARGUMENTS must be a JSON object"),
        (["http://127.0.0.1:8080/mcp", "add", "[1, 2]"], "error: JSON_ARGUMENTS must be a JSON object"),
        (["--answer", "Ada", "http://127.0.0.1:8080/mcp", "add"], "error: --answer takes a JSON object or decline"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, line):
    done = run(str(EXAMPLE), *args)
    assert (done.returncode, done.stdout) == (2, "")
    assert one_line_error(done) == line


def test_help_exits_0():
    done = run(str(EXAMPLE), "--help")
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        "usage: sdk_tasks_client.py [--answer JSON|decline] URL TOOL [JSON_ARGUMENTS]\n",
        "",
    )
