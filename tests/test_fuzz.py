"""Fuzzing: malformed and adversarial JSON-RPC thrown at a running proxy (a real process, in front of a real
`mcp` 2.x upstream), once with the memory store and once with a real redis-server. Strings include lone surrogates
(sent as JSON escapes), control characters and, in raw bodies, invalid UTF-8. Every time: a JSON-RPC answer or a
relayed upstream answer, never a 5xx; no task is corrupted; and the next request is served."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import free_port, quiet_proxy
from tests.factories import headers_for, meta
from tests.schemas import validate, validate_response

METHODS = ["tools/call", "tools/list", "tasks/get", "tasks/update", "tasks/cancel", "tasks/list", "tasks/result",
           "server/discover", "prompts/get", "initialize", "notifications/cancelled"]  # fmt: skip


def hostile_text(max_size: int) -> st.SearchStrategy[str]:
    """Any code point, lone surrogates (category Cs, which text() leaves out by default) and controls included."""
    return st.text(st.characters(exclude_categories=()), max_size=max_size) | st.text(
        st.sampled_from(["\ud800", "\udfff", "\x00", "\x1f", "\x7f", "\u2028", "\ufeff", "a"]), max_size=max_size
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
    | hostile_text(30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(hostile_text(12), children, max_size=4),
    max_leaves=20,
)  # fmt: skip
ids = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), hostile_text(40), json_values)


@st.composite
def rpc_like(draw) -> dict:
    """Mostly-valid JSON-RPC with one or more fields wrong in type or value."""
    params = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "name": st.one_of(st.sampled_from(["slow_report", "add", "one_question"]), json_values),
                "arguments": json_values,
                "taskId": st.one_of(hostile_text(40), json_values),
                "inputResponses": json_values,
                "requestState": json_values,
                "task": json_values,
                "_meta": st.one_of(st.just(meta()), st.just(meta(tasks=False)), json_values),
            },
        )
    )
    message = {
        "jsonrpc": draw(st.one_of(st.just("2.0"), json_values)),
        "id": draw(ids),
        "method": draw(st.one_of(st.sampled_from(METHODS), hostile_text(20), json_values)),
        "params": draw(st.one_of(st.just(params), json_values)),
    }
    for key in draw(st.lists(st.sampled_from(list(message)), max_size=2)):
        message.pop(key, None)
    return message


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.one_of(st.just("application/json"), header_text),
        "Mcp-Name": header_text,
        "Mcp-Method": header_text,
        "MCP-Protocol-Version": st.one_of(st.just("2026-07-28"), header_text),
        "Accept": header_text,
    },
)


@pytest.fixture(scope="module", params=["memory", "redis"])
def proxy_port(request, mcp_upstream, tmp_path_factory) -> Iterator[int]:
    port = free_port()
    policy = tmp_path_factory.mktemp("fuzz") / "policy.yaml"
    # Every tool a task for declaring clients: the most surface.
    text = "tools:\n  - match: '*'\n"
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
        text += f"store: {{backend: redis, url: '{redis_url}', key_prefix: 'fuzz-{port}:'}}\n"
        text += "security: {principal_key: fuzz-key}\n"
    policy.write_text(text)
    with quiet_proxy(policy, mcp_upstream, port):
        yield port


def post(port: int, body: bytes, extra: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        connection.request("POST", "/mcp", body=body, headers={**base, **(extra or {})})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        connection.close()


def assert_sane(status: int, content_type: str, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if content_type.startswith("application/json") and body:
        message = json.loads(body)
        assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", body[:300]
        assert ("result" in message) != ("error" in message)
        if "error" in message:
            assert isinstance(message["error"]["code"], int) and isinstance(message["error"]["message"], str)


@pytest.fixture(scope="module")
def a_task(proxy_port) -> str:
    """A task created before the fuzzing; it must come out of it intact."""
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})}}  # fmt: skip
    status, _, body = post(proxy_port, json.dumps(message).encode(), headers_for(message))
    assert status == 200, body
    return json.loads(body)["result"]["taskId"]


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=st.binary(max_size=300))
def test_arbitrary_bytes(proxy_port, body):
    assert_sane(*post(proxy_port, body))


@FUZZ
@given(value=json_values)
def test_arbitrary_json(proxy_port, value):
    assert_sane(*post(proxy_port, json.dumps(value).encode()))


@FUZZ
@given(message=rpc_like(), extra=headers)
def test_json_rpc_with_wrong_fields_and_headers(proxy_port, a_task, message, extra):
    assert_sane(*post(proxy_port, json.dumps(message).encode(), extra))


@FUZZ
@given(
    task_id=st.one_of(hostile_text(60), st.just("x" * 10_000)),
    responses=st.dictionaries(hostile_text(10), json_values, max_size=4),
)
def test_random_task_ids_and_foreign_keys(proxy_port, a_task, task_id, responses):
    for method, params in (("tasks/get", {}), ("tasks/update", {"inputResponses": responses}), ("tasks/cancel", {})):
        for target in (task_id, a_task if method == "tasks/update" else task_id):
            message = {
                "jsonrpc": "2.0",
                "id": 5,
                "method": method,
                "params": {"taskId": target, **params, "_meta": meta()},
            }
            # No Mcp-Name: it is optional on tasks/*, and a hostile id may be no header value at all.
            headers = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}
            status, content_type, body = post(proxy_port, json.dumps(message).encode(), headers)
            assert_sane(status, content_type, body)
            if target != a_task:
                # Unknown, expired and malformed ids all read as "not found"; a store error here would be a fault.
                assert json.loads(body)["error"]["code"] == -32602, body[:300]


STRING_FIELDS = [
    ("id",),
    ("method",),
    ("params", "name"),
    ("params", "taskId"),
    ("params", "arguments", "a"),
    ("params", "inputResponses", "k"),
    ("params", "_meta", "io.modelcontextprotocol/protocolVersion"),
]


@FUZZ
@given(
    method=st.sampled_from(["tools/call", "tasks/get", "tasks/update", "tasks/cancel"]),
    field=st.sampled_from(STRING_FIELDS),
    raw_bytes=st.binary(min_size=1, max_size=12).filter(lambda b: not _utf8(b))
    | st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]),
)
def test_invalid_utf8_in_every_string_field(proxy_port, a_task, method, field, raw_bytes):
    params = {"name": "one_question", "taskId": a_task, "arguments": {"a": "x"}, "inputResponses": {"k": "x"},
              "_meta": meta()}  # fmt: skip
    message = {"jsonrpc": "2.0", "id": 3, "method": method, "params": params}
    target = message
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = "MARKER"
    body = json.dumps(message).encode().replace(b"MARKER", raw_bytes, 1)
    headers = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}
    status, content_type, answer = post(proxy_port, body, headers)
    assert_sane(status, content_type, answer)
    if content_type.startswith("application/json") and answer:
        message = json.loads(answer)
        assert "error" in message and message["error"]["code"] == -32700, message  # not JSON: a parse error


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b'{"jsonrpc":"2.0","id":1,"id":2,"method":"tasks/get","method":"tools/list","params":{}}',
        json.dumps([{"jsonrpc": "2.0", "id": n, "method": "tools/list", "params": {}} for n in range(3)]).encode(),
        '{"jsonrpc":"2.0","id":"\u2603\U0001f600","method":"tools/list","params":{}}'.encode(),
        b'{"jsonrpc":"2.0","id":1e400,"method":"tools/list"}',
        b'{"jsonrpc":"2.0","id":"\\ud800","method":"tasks/get","params":{"taskId":"\\udfff"}}',
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"\\ud800","arguments":{"\\udc00":"\\ud800"}}}',
    ],
    ids=[
        "deep-array",
        "deep-object",
        "duplicate-keys",
        "batch",
        "unicode-id",
        "huge-float-id",
        "surrogate-id",
        "surrogate-tool-name",
    ],
)
def test_pathological_documents(proxy_port, body):
    assert_sane(*post(proxy_port, body))


def test_the_task_made_before_fuzzing_is_intact_and_the_proxy_serves(proxy_port, a_task):
    message = {"jsonrpc": "2.0", "id": 9, "method": "tasks/get", "params": {"taskId": a_task, "_meta": meta()}}
    status, _, body = post(proxy_port, json.dumps(message).encode(), headers_for(message))
    assert status == 200
    task = json.loads(body)["result"]
    # Fuzzed tasks/update and tasks/cancel calls carried the right id (and, like its creator, no credential), so
    # they may have answered it (perhaps with nonsense the upstream refused) or cancelled it. Whatever happened,
    # the task is a well-formed DetailedTask.
    validate_response(json.loads(body), "GetTaskResult")
    validate(task, "DetailedTask")
    if task["status"] == "failed":
        assert task["error"]["message"] and task["statusMessage"]


def _reference_loads(text: str) -> object:
    """What `loads` says of `text`, read the slow way: the standard library with a bound on every number."""
    from mcp_tasks_proxy.jsonrpc import _bounded_int, _finite_float, _not_json

    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float, parse_int=_bounded_int)


_NUMBER = st.builds(
    lambda sign, digits, fraction, exponent: f"{sign}{digits}{fraction}{exponent}",
    st.sampled_from(["", "-"]),
    st.integers(min_value=0, max_value=10**420).map(str),
    st.sampled_from(["", ".5", ".000001"]),
    st.sampled_from(["", "e5", "e-5", "E99", "e+99", "e100", "e308", "e309", "e-400", "e999"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_NUMBER, min_size=1, max_size=4), st.booleans())
def test_loads_bounds_every_number_as_the_slow_reading_does(numbers: list[str], escaped: bool) -> None:
    """`loads` calls back for each number only where one may overflow a double; what it accepts and refuses is what
    a callback on every number would say (a value past a double is refused, a long integer comes back whole)."""
    from mcp_tasks_proxy.jsonrpc import loads

    text = "[" + ",".join(numbers) + (',"\\ud800"' if escaped else "") + "]"  # a lone surrogate: the stdlib's path
    try:
        expected: object = _reference_loads(text)
    except ValueError:
        expected = ValueError
    try:
        got: object = loads(text)
    except ValueError:
        got = ValueError
    assert got == expected or (expected is not ValueError and repr(got) == repr(expected)), text[:200]
