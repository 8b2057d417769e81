"""TLS to the upstream (upstream.tls): a private CA, a client certificate for mTLS, verification on by default.
The upstream is the official SDK's server behind uvicorn's own TLS, with certificates made here by trustme."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from mcp_tasks_proxy.config import ConfigError, parse_config
from tests.conftest import Pki, serve_script, task_reaches


def https_upstream(pki: Pki, *, mtls: bool) -> Iterator[str]:
    tls = [str(pki.ca.parent / "server.pem"), str(pki.ca.parent / "server.key")] + ([str(pki.ca)] if mtls else [])
    yield from serve_script(sys.executable, "upstream_server.py", "--tls", *tls, scheme="https")


@pytest.fixture(scope="module")
def mtls_upstream(pki) -> Iterator[str]:
    yield from https_upstream(pki, mtls=True)


@pytest.fixture(scope="module")
def tls_upstream(pki) -> Iterator[str]:
    yield from https_upstream(pki, mtls=False)


async def works(proxy) -> None:
    """A pass-through call (the lean client), then a task (its background call): both over the upstream's TLS."""
    added = await proxy.client.call_tool("add", {"a": 2, "b": 3}, tasks=False)
    assert added.status == 200, added.message
    assert added.result["content"][0]["text"] == "5"
    created = await proxy.client.call_tool("slow_report", {"topic": "tls", "seconds": 0})
    done = await task_reaches(proxy.client, created.result["taskId"], "completed", "failed")
    assert done.result["status"] == "completed", done.result
    assert done.result["result"]["content"][0]["text"].startswith("Report on tls")


RULES = [{"match": "slow_report"}]


async def test_mtls_with_a_private_ca_and_a_client_certificate(make_proxy, mtls_upstream, pki):
    tls = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
    await works(await make_proxy(mtls_upstream, upstream={"tls": tls}, tools=RULES))
    both = {"ca_file": str(pki.ca), "cert_file": str(pki.client_both)}  # the key inside the certificate's file
    await works(await make_proxy(mtls_upstream, upstream={"tls": both}, tools=RULES))
    # Probed, not configured: the era probe and the legacy fallback (aiohttp's session) use the same TLS.
    await works(await make_proxy(mtls_upstream, protocol="auto", upstream={"tls": tls}, tools=RULES))


async def test_without_the_client_certificate_an_mtls_upstream_is_a_clear_upstream_failure(
    make_proxy, mtls_upstream, pki
):
    proxy = await make_proxy(mtls_upstream, protocol="modern", upstream={"tls": {"ca_file": str(pki.ca)}})
    reply = await proxy.client.call_tool("add", {"a": 2, "b": 3}, tasks=False)
    assert reply.status == 502
    assert reply.error["code"] == -32603 and reply.error["message"].startswith("Upstream failure")


async def test_verification_is_on_by_default_and_can_be_turned_off(make_proxy, tls_upstream):
    checked = await make_proxy(tls_upstream, protocol="modern", tools=RULES)  # the system's CAs lack the test CA
    reply = await checked.client.call_tool("add", {"a": 2, "b": 3}, tasks=False)
    assert reply.status == 502
    assert "certificate" in reply.error["message"].lower()
    created = await checked.client.call_tool("slow_report", {"topic": "t", "seconds": 0})
    failed = (
        await task_reaches(checked.client, created.result["taskId"], "failed") if "result" in created.message else None
    )
    assert failed is not None or created.status == 502
    unchecked = await make_proxy(tls_upstream, protocol="modern", upstream={"tls": {"verify": False}}, tools=RULES)
    await works(unchecked)


def test_tls_settings_are_checked_at_start_up(pki, tmp_path):
    https = "https://127.0.0.1:1/mcp"
    cases = [
        ({"url": https, "tls": {"ca_file": str(tmp_path / "missing.pem")}}, "upstream.tls: ca_file"),
        ({"url": https, "tls": {"key_file": str(pki.client_key)}}, "key_file needs cert_file"),
        ({"url": https, "tls": {"cert_file": str(pki.client_cert), "key_file": str(pki.ca)}}, "cert_file"),
        ({"url": "http://127.0.0.1:1/mcp", "tls": {"verify": False}}, "tls applies to an https:// upstream.url"),
    ]
    for upstream, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config({"upstream": upstream})
    parse_config({"upstream": {"url": https, "tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client_both)}}})
