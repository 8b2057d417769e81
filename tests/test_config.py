"""The policy file: validation that names the key, rule matching, and operator overrides."""

from __future__ import annotations

import argparse
import subprocess

import pytest
import yaml

from mcp_tasks_proxy.__main__ import build_parser, resolve_config, split_command
from mcp_tasks_proxy.config import ConfigError, TaskMode, TlsConfig, load_config, parse_config
from mcp_tasks_proxy.store.redis_link import SystemTls
from tests.conftest import PROXY, ROOT


def write(tmp_path, text: str):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("upstream:\n  urll: http://x/mcp\n", "upstream.urll: unknown key"),
        ("tools:\n  - match: a\n    taks: required\n", "tools.0.taks: unknown key"),
        (
            "tools:\n  - match: a\n    task: sometimes\n",
            "tools.0.task: Input should be 'never', 'optional' or 'required'",
        ),
        ("tasks:\n  ttl_ms: soon\n", "tasks.ttl_ms: Input should be a valid integer"),
        ("listen:\n  port: 70000\n", "listen.port: Input should be less than or equal to 65535"),
        ("tools:\n  - match: a\n  - match: a\n", "tools: the pattern 'a' appears twice"),
        ("- just\n- a list\n", "the top level must be a mapping"),
        ("tools: [\n", "not valid YAML at line"),
        ("tools:\n  - task: required\n", "tools.0.match: Field required"),
    ],
)
def test_invalid_files_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_every_shipped_config_is_valid():
    for path in sorted((ROOT / "config").glob("*.yaml")):
        config = load_config(path)
        if path.name == "container.yaml":  # the image's defaults, under a policy file: no upstream of its own
            assert config.listen.host == "0.0.0.0" and config.upstream.url is None
            continue
        assert config.upstream.url is not None or config.upstream.command is not None, path


def test_every_config_error_is_listed_on_one_line_unknown_keys_first(tmp_path):
    text = "listen:\n  port: abc\ntools:\n  - match: 1\n    bogus: 2\nfoo: 1\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message and "more)" not in message
    assert ": 4 errors: tools.0.bogus: unknown key; foo: unknown key; listen.port: " in message
    assert "tools.0.match: Input should be a valid string" in message


def test_a_policy_file_overrides_the_defaults_file_section_by_section(tmp_path):
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("listen:\n  host: 0.0.0.0\n  port: 8080\nlogging:\n  format: json\n")
    policy = write(tmp_path, "listen:\n  port: 9090\ntools:\n  - match: a\n")
    config = load_config(policy, defaults=defaults)
    assert (config.listen.host, config.listen.port, config.logging.format) == ("0.0.0.0", 9090, "json")
    assert [rule.match for rule in config.tools] == ["a"]
    assert load_config(None, defaults=defaults).listen.port == 8080
    defaults.write_text("listen:\n  prot: 1\n")
    with pytest.raises(ConfigError, match=r"defaults.yaml: listen.prot: unknown key"):
        load_config(policy, defaults=defaults)  # the defaults file's own mistakes name it


def test_a_stdio_command_is_exclusive_with_a_url_and_owns_env_and_cwd():
    config = parse_config({"upstream": {"command": ["python", "server.py"], "env": {"K": "v"}, "cwd": "/srv"}})
    assert config.upstream_name == "stdio:python"  # never the arguments, which may hold secrets
    with pytest.raises(ConfigError, match="upstream: url and command are exclusive"):
        parse_config({"upstream": {"url": "http://127.0.0.1:9/mcp", "command": ["server"]}})
    with pytest.raises(ConfigError, match="env and cwd apply to upstream.command only"):
        parse_config({"upstream": {"url": "http://127.0.0.1:9/mcp", "env": {"K": "v"}}})
    with pytest.raises(ConfigError, match="upstream.command: List should have at least 1 item"):
        parse_config({"upstream": {"command": []}})
    with pytest.raises(ConfigError, match="upstream.stdio.dispatch"):
        parse_config({"upstream": {"command": ["s"], "stdio": {"dispatch": "round-robin"}}})


def test_a_command_after_the_flags_replaces_the_files_url_and_a_url_flag_the_files_command(tmp_path):
    with_url = tmp_path / "url.yaml"
    with_url.write_text("upstream: {url: 'http://127.0.0.1:9/mcp'}\n")
    argv, command = split_command(["--config", str(with_url), "--", "npx", "-y", "server", "--port", "1"])
    assert command == ["npx", "-y", "server", "--port", "1"]  # the server's own flags stay the server's
    config = resolve_config(build_parser().parse_args(argv), {}, command)
    assert config.upstream.command == ["npx", "-y", "server", "--port", "1"] and config.upstream.url is None

    with_command = tmp_path / "command.yaml"
    with_command.write_text("upstream: {command: [server], env: {K: v}}\n")
    argv, command = split_command(["--config", str(with_command), "--upstream", "http://127.0.0.1:9/mcp"])
    config = resolve_config(build_parser().parse_args(argv), {}, command)
    assert str(config.upstream.url) == "http://127.0.0.1:9/mcp"
    assert config.upstream.command is None and config.upstream.env == {}


def test_first_matching_rule_wins_and_unmatched_tools_pass_through():
    config = parse_config(
        {
            "tools": [
                {"match": "render_final", "task": "never"},
                {"match": "render_*", "task": "required", "sync_window_ms": 100},
                {"match": "search"},
            ]
        }
    )
    assert config.rule_for("render_final").task is TaskMode.NEVER
    assert config.rule_for("render_video").task is TaskMode.REQUIRED
    assert config.rule_for("search").task is TaskMode.OPTIONAL
    assert config.rule_for("Search") is None  # matching is case-sensitive, as tool names are
    assert config.rule_for("list_files") is None


def test_rule_defaults():
    rule = parse_config({"tools": [{"match": "x"}]}).tools[0]
    assert (rule.task, rule.sync_window_ms, rule.timeout_s, rule.ttl_ms) == (TaskMode.OPTIONAL, 0, 3600.0, None)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_flags_override_environment_which_overrides_the_file(tmp_path):
    path = write(tmp_path, "listen:\n  port: 1111\nupstream:\n  url: http://file:1/mcp\ntools:\n  - match: a\n")
    env = {"MCP_TASKS_PROXY_CONFIG": str(path), "MCP_TASKS_PROXY_PORT": "2222", "MCP_TASKS_PROXY_HOST": "0.0.0.0"}
    config = resolve_config(_args(), env)
    assert (config.listen.host, config.listen.port, str(config.upstream.url)) == ("0.0.0.0", 2222, "http://file:1/mcp")
    assert config.tools[0].match == "a"
    config = resolve_config(_args("--port", "3333", "--upstream", "http://flag:2/mcp"), env)
    assert (config.listen.port, str(config.upstream.url)) == (3333, "http://flag:2/mcp")


def test_bad_environment_values_are_config_errors():
    with pytest.raises(ConfigError, match="MCP_TASKS_PROXY_PORT: expected an integer"):
        resolve_config(_args("--upstream", "http://u/mcp"), {"MCP_TASKS_PROXY_PORT": "eighty"})
    with pytest.raises(ConfigError, match="^MCP_TASKS_PROXY_UPSTREAM .not a url.: Input should be a valid URL"):
        resolve_config(_args(), {"MCP_TASKS_PROXY_UPSTREAM": "not a url"})


def test_no_upstream_anywhere_says_how_to_set_one():
    with pytest.raises(ConfigError, match="--upstream"):
        resolve_config(_args(), {})


def test_cli_exits_2_with_one_line_naming_the_key(tmp_path):
    path = write(tmp_path, "upstream:\n  url: http://127.0.0.1:1/mcp\ntools:\n  - match: a\n    sync_window: 5\n")
    done = subprocess.run([*PROXY, "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mcp-tasks-proxy: config error: {path}: tools.0.sync_window: unknown key (did you mean 'sync_window_ms'?)"
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("listen:\n  prot: 9\n", "listen.prot: unknown key (did you mean 'port'?)"),
        ("upstreem: {}\n", "upstreem: unknown key (did you mean 'upstream'?)"),
        ("upstream:\n  tls:\n    ca_fil: x\n", "upstream.tls.ca_fil: unknown key (did you mean 'ca_file'?)"),
        (
            "tools:\n  - match: a\n    retry:\n      attempt: 2\n",
            "tools.0.retry.attempt: unknown key (did you mean 'attempts'?)",
        ),
        ("tools:\n  - match: a\n    zzzz: 1\n", "tools.0.zzzz: unknown key"),
    ],
)
def test_an_unknown_key_names_the_key_it_likely_meant(text, message):
    with pytest.raises(ConfigError) as raised:
        parse_config(yaml.safe_load(text))
    assert str(raised.value).endswith(message)
    assert "Value error" not in str(raised.value)


def test_store_override_is_memory_or_a_redis_url(tmp_path):
    path = write(tmp_path, "upstream:\n  url: http://u:1/mcp\nstore:\n  backend: redis\n  url: redis://file:6379/0\n")
    config = resolve_config(_args("--config", str(path)), {"MCP_TASKS_PROXY_STORE": "memory"})
    assert (config.store.backend, config.store.url) == ("memory", None)
    config = resolve_config(_args("--config", str(path), "--store", "redis://flag:6380/1"), {})
    assert (config.store.backend, config.store.url) == ("redis", "redis://flag:6380/1")
    with pytest.raises(ConfigError, match="store: the redis backend needs store.url"):
        parse_config({"store": {"backend": "redis"}})
    with pytest.raises(ConfigError, match="must start with redis://"):
        resolve_config(_args("--upstream", "http://u/mcp", "--store", "http://not-redis"), {})


def test_store_tls_default_is_tls_config_default():
    """A store made without TLS settings reads the same as TlsConfig() (the store does not import config)."""
    fields = ("verify", "ca_file", "cert_file", "key_file")
    assert set(TlsConfig.model_fields) == set(fields), "a new TlsConfig field: SystemTls and TlsSettings say it too"
    assert {name: getattr(SystemTls(), name) for name in fields} == TlsConfig().model_dump(include=set(fields))
    ours, theirs = SystemTls().ssl_context(), TlsConfig().ssl_context()
    assert (ours.verify_mode, ours.check_hostname) == (theirs.verify_mode, theirs.check_hostname)
