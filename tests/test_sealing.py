"""A call kept in the store for another replica: sealed so that whoever reads Redis learns nothing from it and can
change nothing in it."""

from __future__ import annotations

from multidict import CIMultiDict

from mcp_tasks_proxy.tasks.job import ToolCall
from mcp_tasks_proxy.tasks.sealing import CallSeal


def call() -> ToolCall:
    headers = CIMultiDict([("Authorization", "Bearer s3cret-token"), ("X-Tenant", "a"), ("X-Tenant", "b")])
    message = {"jsonrpc": "2.0", "id": "mtp-1", "method": "tools/call", "params": {"name": "t", "arguments": {"n": 1}}}
    return ToolCall(
        tool="t",
        message=message,
        headers=headers,
        capabilities={"elicitation": {}},
        principal="p",
        credential="c",
        caller="p",
    )


def test_a_sealed_call_opens_as_it_was_and_shows_nothing_of_it():
    seal = CallSeal(b"the operator's key")
    sealed = seal.seal("task-1", call())
    assert b"s3cret-token" not in sealed and b"arguments" not in sealed
    assert seal.seal("task-1", call()) != sealed  # a fresh nonce each time
    opened = seal.unseal("task-1", sealed, "p", "t")
    assert opened is not None
    assert opened.message == call().message
    assert list(opened.headers.items()) == list(call().headers.items())  # repeated headers kept, in order
    assert (opened.tool, opened.capabilities, opened.credential, opened.caller, opened.principal) == (
        "t",
        {"elicitation": {}},
        "c",
        "p",
        "p",
    )


def test_a_call_that_was_altered_moved_or_sealed_with_another_key_does_not_open():
    seal = CallSeal(b"the operator's key")
    sealed = seal.seal("task-1", call())
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    assert seal.unseal("task-1", bytes(flipped), "p", "t") is None
    assert seal.unseal("task-2", sealed, "p", "t") is None  # another task's record cannot borrow it
    assert seal.unseal("task-1", sealed, "someone else", "t") is None  # nor a record edited to name another owner
    assert seal.unseal("task-1", sealed, "p", "another tool") is None
    assert CallSeal(b"another key").unseal("task-1", sealed, "p", "t") is None
    assert seal.unseal("task-1", b"", "p", "t") is None
    assert seal.unseal("task-1", b"\x02" + sealed[1:], "p", "t") is None  # a version this one does not read


def test_a_durable_calls_own_upstream_session_is_kept_by_id():
    from mcp_tasks_proxy.upstream.routing import LegacySession

    seal = CallSeal(b"the operator's key")
    durable = call()
    durable.client_session = LegacySession(session_id="s-1", protocol_version="2025-06-18", principal="p")
    opened = seal.unseal("task-1", seal.seal("task-1", durable), "p", "t")
    assert opened is not None and opened.client_session is not None
    assert (opened.client_session.session_id, opened.client_session.protocol_version) == ("s-1", "2025-06-18")
    assert opened.client_session.principal == "p"
    assert seal.unseal("task-1", seal.seal("task-1", call()), "p", "t").client_session is None


def test_the_servers_own_task_and_its_session_are_kept_sealed_as_text():
    from mcp_tasks_proxy.upstream.events import UpstreamTask

    seal = CallSeal(b"the operator's key")
    made = UpstreamTask("upstream-task-1", "session-secret", "2025-11-25")
    sealed = seal.seal_upstream_task("task-1", made, "p")
    assert isinstance(sealed, str) and "session-secret" not in sealed
    assert seal.unseal_upstream_task("task-1", sealed, "p") == made
    assert seal.unseal_upstream_task("task-2", sealed, "p") is None
    assert seal.unseal_upstream_task("task-1", sealed, "q") is None
    assert CallSeal(b"another key").unseal_upstream_task("task-1", sealed, "p") is None
    assert seal.unseal_upstream_task("task-1", "not base64 at all!", "p") is None
    assert seal.unseal_upstream_task("task-1", "", "p") is None
