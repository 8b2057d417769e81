"""The task console (/console) in a real browser: Playwright driving Debian's Chromium, in front of the quick start's
example server (examples/slow_server.py behind config/example.yaml), as a newcomer uses it. And where it is served:
on loopback by default, off elsewhere unless the policy says so, behind the same checks as every other path."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright

from mcp_tasks_proxy.config import ToolRule
from tests.conftest import ROOT, free_port, quick_start, quiet_proxy, require, wait_ready
from tests.issuer import ISSUER, RESOURCE, Issuer

# A browser test's setup starts two servers and Chromium: on two busy cores, more than the suite's 60 s.
pytestmark = pytest.mark.timeout(180)

SCREENSHOT = os.environ.get("MCP_TASKS_PROXY_CONSOLE_SCREENSHOT")
"""Where test_a_task_with_a_question_is_answered_in_the_page saves a screenshot (the docs' docs/console.png)."""


@pytest.fixture(scope="module")
def console_url() -> Iterator[str]:
    with quick_start() as url:
        yield url.removesuffix("/mcp") + "/console"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = require("chromium")
    with playwright.sync_playwright() as driver:
        # --no-sandbox: CI runs the tests as root, where Chromium's sandbox refuses to start.
        launched = driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any, console_url: str) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    opened = context.new_page()
    opened.set_default_timeout(20_000)
    problems: list[str] = []
    opened.on("pageerror", lambda error: problems.append(str(error)))
    opened.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    sent: list[str] = []
    opened.on("request", lambda request: sent.append(request.headers.get("mcp-method", "")) if request.method == "POST"
              else None)  # fmt: skip
    opened.sent_methods = sent
    opened.problems = problems
    opened.expected_problems = []  # what a test provokes on purpose ("503" for a refused listen), read at the end
    opened.goto(console_url)
    opened.wait_for_selector("#tools li[data-tool='slow_report']")
    yield opened
    context.close()
    # No script error, no refused request, no CSP violation: but those the test provoked, which may still come
    # after its last line (a poll in flight).
    unexpected = [problem for problem in problems if not any(part in problem for part in opened.expected_problems)]
    assert unexpected == [], unexpected


def call(page: Any, tool: str, arguments: dict[str, Any]) -> Any:
    """Choose the tool, type its arguments as JSON, press Call: the newest entry."""
    page.click(f"#tools li[data-tool='{tool}'] button")
    page.fill("#call-arguments", json.dumps(arguments))
    before = page.locator("#tasks li.entry").count()
    page.click("#call-button")
    page.wait_for_function(f"document.querySelectorAll('#tasks li.entry').length > {before}")
    newest = page.locator("#tasks li.entry").first.get_attribute("data-entry")
    return page.locator(f"#tasks li[data-entry='{newest}']")


def task_id_of(entry: Any) -> str:
    """The entry's task id, once the call's answer has made it a task (the entry shows before the answer)."""
    entry.page.wait_for_function("node => node.dataset.taskId !== ''", arg=entry.element_handle())
    return entry.get_attribute("data-task-id")


def reaches(entry: Any, status: str) -> None:
    entry.page.wait_for_function(
        "([node, status]) => node.dataset.status === status", arg=[entry.element_handle(), status]
    )


def test_the_tools_are_listed_with_the_rule_the_policy_gives_each(page):
    badges = {
        item.get_attribute("data-tool"): item.locator(".badge").inner_text() for item in page.locator("#tools li").all()
    }
    assert badges == {
        "slow_report": "a task",  # slow_*
        "personal_report": "a task",
        "failing_job": "a task",
        "add": "passes through",  # no rule names it
    }
    page.wait_for_function("() => document.getElementById('server').textContent.startsWith('Server: ')")
    assert re.search(r"Server: \S+ .*tasks offered", page.inner_text("#server"))
    page.click("#tools li[data-tool='slow_report'] button")
    assert 'Rule "slow_*": a task, created at once' in page.inner_text("#call-rule")
    # A flat input schema gets a form, which writes the arguments' JSON.
    page.fill("#call-fields input[data-key='topic']", "tides")
    assert json.loads(page.input_value("#call-arguments")) == {"topic": "tides", "seconds": 6.0}


def test_a_task_is_followed_live_to_completed_with_its_progress_and_result(page):
    # 10 s: time for the listen to open and carry a step or two (under load), before the task completes.
    entry = call(page, "slow_report", {"topic": "tides", "seconds": 10})
    task_id = task_id_of(entry)
    assert re.fullmatch(r"[A-Za-z0-9_-]{16,}", task_id), task_id
    page.wait_for_function(
        "node => /researching tides: step \\d of 5/.test(node.textContent)", arg=entry.element_handle()
    )  # the task's statusMessage, from the tool's progress
    reaches(entry, "completed")
    assert entry.locator(".result pre.text").inner_text() == "Report on tides: all 5 steps done in 10 s."
    assert re.search(r"ran from .* · [\d.]+ s", entry.locator(".timing").inner_text())
    assert entry.locator("button.cancel").count() == 0  # nothing to cancel once it ended
    # Followed through subscriptions/listen: no tasks/get was needed.
    assert "subscriptions/listen" in page.sent_methods and "tasks/get" not in page.sent_methods


def test_a_task_with_a_question_is_answered_in_the_page(page):
    done = call(page, "slow_report", {"topic": "the moon", "seconds": 1})
    reaches(done, "completed")
    entry = call(page, "personal_report", {"topic": "tides", "seconds": 1})
    reaches(entry, "input_required")
    question = entry.locator("form.input")
    assert question.locator(".question").inner_text() == "Who is this report for?"
    if SCREENSHOT:
        question.locator("input[data-key='name']").fill("Ada")
        page.screenshot(path=SCREENSHOT)
    question.locator("input[data-key='name']").fill("Ada")
    question.get_by_role("button", name="Send").click()
    reaches(entry, "completed")
    assert entry.locator(".result pre.text").inner_text() == "Dear Ada, here is your report on tides."
    assert "tasks/update" in page.sent_methods


def test_a_declined_question_ends_the_task_and_the_page_says_how(page):
    entry = call(page, "personal_report", {"topic": "tides", "seconds": 1})
    reaches(entry, "input_required")
    entry.locator("form.input").get_by_role("button", name="Decline").click()
    reaches(entry, "completed")  # the tool's own answer to a declined question: an error result
    assert entry.locator("form.input").count() == 0
    assert "elicitation was decline" in entry.locator(".result.is-error").inner_text()


def test_a_task_is_cancelled_from_the_page(page):
    entry = call(page, "slow_report", {"topic": "tides", "seconds": 60})
    task_id_of(entry)  # a task (a call not yet answered shows "working" too)
    entry.locator("button.cancel").click()
    reaches(entry, "cancelled")
    assert "tasks/cancel" in page.sent_methods


def test_a_tool_that_passes_through_answers_directly_and_a_failing_one_shows_its_error(page):
    entry = call(page, "add", {"a": 2, "b": 3})
    reaches(entry, "completed")
    assert entry.get_attribute("data-task-id") == ""
    assert "answered directly" in entry.inner_text()
    assert entry.locator(".result pre.text").first.inner_text() == "5"
    failing = call(page, "failing_job", {"reason": "disk full"})
    reaches(failing, "completed")  # a tool's own error is a completed task whose result says isError
    assert failing.locator(".result.is-error").count() == 1
    assert "Error executing tool failing_job" in failing.locator(".result").inner_text()


def refuse_listen(route: Any) -> None:
    if route.request.headers.get("mcp-method") == "subscriptions/listen":
        route.fulfill(status=503, content_type="text/plain", body="listen is down")
    else:
        route.continue_()


def test_without_subscriptions_listen_the_page_polls_tasks_get(page):
    page.route("**/mcp", refuse_listen)
    page.expected_problems.append("503")
    problems_before = page.sent_methods.copy()
    entry = call(page, "slow_report", {"topic": "tides", "seconds": 3})
    # Said while the task runs: once it ended, the page has nothing to follow and stops saying how.
    page.wait_for_function("() => /polling with tasks\\/get/i.test(document.getElementById('following').textContent)")
    reaches(entry, "completed")
    assert "tasks/get" in page.sent_methods[len(problems_before) :]
    page.unroute("**/mcp")
    assert [problem for problem in page.problems if "503" in problem]  # the browser saw the refused listen


def test_an_answer_being_typed_keeps_its_focus_while_the_task_is_polled(page):
    """Polling re-reads the task every second: the form being typed in stays in the page, focused, with its text."""
    page.route("**/mcp", refuse_listen)
    page.expected_problems.append("503")
    entry = call(page, "personal_report", {"topic": "tides", "seconds": 1})
    reaches(entry, "input_required")
    field = entry.locator("input[data-key='name']")
    field.click()
    is_poll = lambda response: response.request.headers.get("mcp-method") == "tasks/get"  # noqa: E731
    with page.expect_response(is_poll) as polled:  # a poll's answer re-renders the entry while the name is typed
        for letter in "Ada Lovelace":
            field.press_sequentially(letter)
            page.wait_for_timeout(150)
    assert polled.value.ok
    assert field.input_value() == "Ada Lovelace"
    assert page.evaluate("document.activeElement.dataset.key") == "name"
    entry.locator("form.input").get_by_role("button", name="Send").click()
    reaches(entry, "completed")
    page.unroute("**/mcp")


def test_a_server_that_asks_without_a_question_does_not_make_the_page_loop(page):
    """An input_required result with nothing to answer and no state: one call, one failure, no retry storm."""

    def asking(route: Any) -> None:
        if route.request.headers.get("mcp-method") == "tools/call":
            request_id = json.loads(route.request.post_data)["id"]
            body = {"jsonrpc": "2.0", "id": request_id, "result": {"resultType": "input_required"}}
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))
        else:
            route.continue_()

    page.route("**/mcp", asking)
    entry = call(page, "add", {"a": 1, "b": 2})
    reaches(entry, "failed")
    assert "sent no question" in entry.inner_text()
    page.wait_for_timeout(600)  # a retry would have gone out within 250 ms
    assert page.sent_methods.count("tools/call") == 1
    page.unroute("**/mcp")


def test_the_pages_event_stream_reader_follows_the_format(page):
    """console.js's sseEvents on streams cut and ended as servers and networks do."""
    cases = {
        "crlf split over chunks": (["data: 1\r", "\n\r\ndata: 2\n\n"], ["1", "2"]),
        "multi-line data, comments, other fields": ([": hi\nid: 7\ndata: a\ndata: b\nretry: 5\n\n"], ["a\nb"]),
        "a lone CR at the very end": (["data: a\rdata: b\r\r"], ["a\nb"]),
        "the last event without its blank line": (["data: x\n"], ["x"]),
        "an empty event is skipped": (["data:\n\ndata: y\n\n"], ["y"]),
        "not a data field": (["datax: no\ndata: yes\n\n"], ["yes"]),
    }
    for name, (chunks, expected) in cases.items():
        seen = page.evaluate(
            """async (chunks) => {
                const body = new ReadableStream({start(controller) {
                    for (const chunk of chunks) controller.enqueue(new TextEncoder().encode(chunk));
                    controller.close();
                }});
                const events = [];
                for await (const data of sseEvents(new Response(body))) events.push(data);
                return events;
            }""",
            chunks,
        )
        assert seen == expected, name


def test_a_reloaded_page_follows_the_tasks_it_started(page):
    entry = call(page, "slow_report", {"topic": "tides", "seconds": 2})
    task_id = task_id_of(entry)
    page.reload()
    again = page.locator(f"#tasks li[data-task-id='{task_id}']")
    again.wait_for()
    reaches(again, "completed")
    assert again.locator(".result pre.text").inner_text() == "Report on tides: all 5 steps done in 2 s."


def test_what_a_server_says_is_shown_as_text_never_run_as_markup(page):
    hostile = '<img src=x onerror="window.pwned=1">'
    tools = [{"name": hostile, "description": "<script>window.pwned=1</script>", "inputSchema": {"type": "object",
              "properties": {"q": {"type": "string", "title": hostile}}}}]  # fmt: skip

    def answer(route: Any, method: str, result: dict[str, Any]) -> None:
        if route.request.headers.get("mcp-method") != method:
            route.fallback()
            return
        body = {"jsonrpc": "2.0", "id": json.loads(route.request.post_data)["id"], "result": result}
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    listed = {"resultType": "complete", "tools": tools, "ttlMs": 0, "cacheScope": "private"}
    called = {"resultType": "complete", "content": [{"type": "text", "text": hostile}]}
    page.route("**/mcp", lambda route: answer(route, "tools/list", listed))
    page.route("**/mcp", lambda route: answer(route, "tools/call", called))
    page.reload()
    page.wait_for_selector("#tools li button")
    page.click("#tools li button")
    assert page.inner_text("#tools li .name") == hostile
    assert page.inner_text("#call-description") == "<script>window.pwned=1</script>"
    assert page.locator("#call-fields label").first.inner_text().startswith(hostile)
    page.click("#call-button")
    entry = page.locator("#tasks li.entry").first
    reaches(entry, "completed")
    assert entry.locator(".result pre.text").inner_text() == hostile  # a result's text, as text
    assert page.locator("img").count() == 0
    page.unroute("**/mcp")


def test_a_task_started_elsewhere_is_followed_by_its_id(page, console_url):
    """A task a script created (the same caller: no token, from this host) is followed by pasting its id; an id the
    proxy does not know ends as expired, not as a failure."""
    tasks = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
    meta = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": tasks,
    }
    arguments = {"topic": "tides", "seconds": 1}
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "slow_report", "arguments": arguments, "_meta": meta}}  # fmt: skip
    created = urllib.request.urlopen(urllib.request.Request(
        console_url.removesuffix("/console") + "/mcp", data=json.dumps(message).encode(), method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                 "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "slow_report"},
    ), timeout=30)  # fmt: skip
    task_id = json.loads(created.read())["result"]["taskId"]
    page.expected_problems.append("400")  # tasks/get's -32602 for the unknown id, maybe twice
    for wanted in (task_id, "no-such-task-0000"):
        page.fill("#follow-id", wanted)
        page.get_by_role("button", name="Follow").click()
    followed = page.locator(f"#tasks li[data-task-id='{task_id}']")
    reaches(followed, "completed")
    assert followed.locator(".result pre.text").inner_text() == "Report on tides: all 5 steps done in 1 s."
    unknown = page.locator("#tasks li[data-task-id='no-such-task-0000']")
    reaches(unknown, "expired")
    assert "no longer knows this task" in unknown.inner_text()


PATTERNS = ["slow_*", "personal_report", "a?c", "[ab]x", "[!ab]x", "x[", "*.*", "[]]x", "[!]]x", "a[b-d]e", "*"]
NAMES = [
    "slow_report",
    "slow_",
    "personal_report",
    "abc",
    "ac",
    "ax",
    "bx",
    "cx",
    "x[",
    "a.b",
    "ab",
    "]x",
    "ace",
    "a\nb",
]


def test_the_page_matches_tool_names_to_rules_as_the_proxy_does(page):
    """The page's glob matching (console.js) against the proxy's own (ToolRule.matches), on the same table."""
    expected = [[ToolRule(match=pattern).matches(name) for name in NAMES] for pattern in PATTERNS]
    seen = page.evaluate(
        "([patterns, names]) => patterns.map(p => names.map(n => globMatches(p, n)))", [PATTERNS, NAMES]
    )
    wrong = [(pattern, name) for pattern, row, seen_row in zip(PATTERNS, expected, seen, strict=True)
             for name, want, got in zip(NAMES, row, seen_row, strict=True) if want != got]  # fmt: skip
    assert wrong == []


def test_the_page_loads_offline_with_only_its_own_files(browser, console_url):
    """No CDN, no font, no request to another origin: every request the page makes is to the proxy."""
    context = browser.new_context()
    opened = context.new_page()
    origins: set[str] = set()
    opened.on("request", lambda request: origins.add(re.sub(r"^(https?://[^/]+).*", r"\1", request.url)))
    opened.goto(console_url)
    opened.wait_for_selector("#tools li[data-tool='add']")
    context.close()
    assert origins == {console_url.removesuffix("/console")}


@pytest.fixture(scope="session", autouse=True)
def _screenshot_dir() -> None:
    if SCREENSHOT:
        Path(SCREENSHOT).parent.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def everything_console(everything_upstream: str) -> Iterator[str]:
    """The proxy with config/everything.yaml in front of server-everything (a 2025-11-25 server, npm)."""
    port = free_port()
    with quiet_proxy(ROOT / "config" / "everything.yaml", everything_upstream, port):
        wait_ready(port)
        yield f"http://127.0.0.1:{port}/console"


def test_server_everythings_form_and_sampling_questions_are_answered_in_the_page(browser, everything_console):
    """Every field type of the reference server's elicitation (text, formats, numbers, a checkbox, single and
    multiple choices, titled or not) as a form whose answer goes back typed; and a sampling request answered as
    the model. The server's own result says what it received."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    opened = context.new_page()
    opened.set_default_timeout(30_000)
    problems: list[str] = []
    opened.on("pageerror", lambda error: problems.append(str(error)))
    updates: list[dict] = []
    opened.on("request", lambda request: updates.append(json.loads(request.post_data)) if request.method == "POST"
              and request.headers.get("mcp-method") == "tasks/update" else None)  # fmt: skip
    opened.goto(everything_console)
    opened.wait_for_selector("#tools li[data-tool='trigger-elicitation-request']")

    entry = call(opened, "trigger-elicitation-request", {})
    reaches(entry, "input_required")
    form = entry.locator("form.input")
    form.locator("input[data-key='name']").fill("Ada Lovelace")
    form.locator("input[data-key='birthdate']").fill("1815-12-10")
    form.locator("select[data-key='titledSingleSelectEnum']").select_option(label="Superman")
    form.get_by_role("button", name="Send").click()
    reaches(entry, "completed")
    content = updates[-1]["params"]["inputResponses"].popitem()[1]["content"]
    assert content["name"] == "Ada Lovelace" and content["birthdate"] == "1815-12-10"
    assert content["integer"] == 42 and content["number"] == 3.14 and content["check"] is False  # typed, not text
    assert isinstance(content["untitledMultipleSelectEnum"], list)
    assert "Name: Ada Lovelace" in entry.locator(".result").inner_text()  # what the server received

    sampled = call(opened, "trigger-sampling-request", {"prompt": "Say hi", "maxTokens": 50})
    reaches(sampled, "input_required")
    assert "Say hi" in sampled.locator("form.input blockquote").inner_text()
    sampled.locator("form.input textarea").fill("Hi there!")
    sampled.locator("form.input").get_by_role("button", name="Send").click()
    reaches(sampled, "completed")
    assert '"text": "Hi there!"' in sampled.locator(".result").inner_text()
    context.close()
    assert problems == []


@pytest.fixture(scope="module")
def plain_console(tmp_path_factory) -> Iterator[str]:
    """The example server behind a proxy whose policy names no tool: every call passes through, so personal_report's
    question comes back as the 2026 server's own MRTR round (input_required), which the page answers itself."""
    policy = tmp_path_factory.mktemp("plain") / "policy.yaml"
    policy.write_text("tools: []\n")
    with quick_start(policy) as url:
        yield url.removesuffix("/mcp") + "/console"


def test_a_question_before_a_direct_answer_is_an_mrtr_round_the_page_answers(browser, plain_console):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(20_000)
    sent: list[dict] = []
    opened.on("request", lambda request: sent.append(json.loads(request.post_data)) if request.method == "POST"
              and request.headers.get("mcp-method") == "tools/call" else None)  # fmt: skip
    opened.goto(plain_console)
    opened.wait_for_selector("#tools li[data-tool='personal_report']")
    assert opened.locator("#tools li[data-tool='personal_report'] .badge").inner_text() == "passes through"
    entry = call(opened, "personal_report", {"topic": "tides", "seconds": 1})
    reaches(entry, "input_required")
    assert "answered directly" in entry.inner_text()
    entry.locator("input[data-key='name']").fill("Ada")
    entry.locator("form.input").get_by_role("button", name="Send").click()
    reaches(entry, "completed")
    assert entry.locator(".result pre.text").inner_text() == "Dear Ada, here is your report on tides."
    first, retry = sent[0]["params"], sent[-1]["params"]
    assert "requestState" not in first and retry["requestState"]  # the server's state, echoed
    assert retry["arguments"] == first["arguments"] and sent[-1]["id"] != sent[0]["id"]  # the same call, a new id
    assert list(retry["inputResponses"].values()) == [{"action": "accept", "content": {"name": "Ada"}}]
    context.close()


@pytest.fixture(scope="module")
def jwt_console(tmp_path_factory) -> Iterator[tuple[str, Issuer]]:
    """The quick start with verified callers (security.principal: jwt, the issuer's keys from a JWKS file)."""
    issuer = Issuer()
    folder = tmp_path_factory.mktemp("jwt")
    (folder / "jwks.json").write_text(json.dumps(issuer.jwks()))
    policy = folder / "policy.yaml"  # (JSON is YAML too)
    policy.write_text(json.dumps({
        "security": {"principal": "jwt", "resource_url": RESOURCE,
                     "jwt": {"jwks_file": str(folder / "jwks.json"), "issuer": ISSUER}},
        "tools": [{"match": "slow_*"}],
    }))  # fmt: skip
    with quick_start(policy) as url:
        yield url.removesuffix("/mcp") + "/console", issuer


def test_with_verified_callers_the_page_asks_for_a_token_and_works_with_it(browser, jwt_console):
    console_url, issuer = jwt_console
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(20_000)
    opened.goto(console_url)  # the page itself needs no token
    opened.wait_for_selector("#auth.asked")
    assert opened.locator("#auth summary").inner_text() == "Credentials: the proxy asks for a token"
    opened.wait_for_function("() => document.getElementById('tools').textContent.includes('401')")
    assert "invalid_request: This endpoint needs a bearer token" in opened.inner_text("#tools")  # the refusal, said
    opened.fill("#token", "not-a-token")
    opened.get_by_role("button", name="Use").click()
    opened.wait_for_function("() => document.getElementById('tools').textContent.includes('invalid_token')")
    opened.fill("#token", issuer.token("alice"))
    opened.get_by_role("button", name="Use").click()
    opened.wait_for_selector("#tools li[data-tool='slow_report']")
    entry = call(opened, "slow_report", {"topic": "tides", "seconds": 1})
    reaches(entry, "completed")
    assert entry.locator(".result pre.text").inner_text() == "Report on tides: all 5 steps done in 1 s."
    context.close()
