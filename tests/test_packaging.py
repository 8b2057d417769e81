"""The package installs under a name of its own, `mcp_tasks_proxy`, from the source in proxy/; nothing is installed
as a top-level `proxy` (a name other projects install too), and the Docker build context is what the image needs."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_of_the_source_is_installed():
    mapped = {
        "mcp_tasks_proxy" + "".join(f".{part}" for part in init.parent.relative_to(ROOT / "proxy").parts)
        for init in (ROOT / "proxy").rglob("__init__.py")
    }
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"mcp_tasks_proxy": "proxy"}
    assert set(setuptools["packages"]) == mapped
    assert PYPROJECT["project"]["scripts"]["mcp-tasks-proxy"] == "mcp_tasks_proxy.__main__:main"


def test_imports_inside_the_package_are_relative():
    """An absolute `proxy.` (or `mcp_tasks_proxy.`) import would load a second copy of a module, or none at all."""
    absolute = []
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            absolute += [f"{path.relative_to(ROOT)}: {name}" for name in names
                         if name.split(".")[0] in ("proxy", "mcp_tasks_proxy")]  # fmt: skip
    assert not absolute


def test_the_installed_name_is_mcp_tasks_proxy_and_not_proxy(tmp_path):
    """Outside the checkout (-P, another directory), as any other program on the machine sees the install."""
    found = subprocess.run(
        [sys.executable, "-P", "-c", "import mcp_tasks_proxy, importlib.util; print(mcp_tasks_proxy.__file__); "
         "print(importlib.util.find_spec('proxy'))"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    where, proxy_spec = found.stdout.split()
    assert Path(where).resolve() == (ROOT / "proxy" / "__init__.py").resolve()
    assert proxy_spec == "None"
    started = subprocess.run([sys.executable, "-P", "-m", "mcp_tasks_proxy", "--version"], cwd=tmp_path,
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert started.stdout.startswith("mcp-tasks-proxy ")


def test_the_wheel_holds_mcp_tasks_proxy_only(tmp_path):
    # Built from a copy of what the Dockerfile copies: no build/ of an earlier build, nothing left in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "proxy", source / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"mcp_tasks_proxy"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "mcp_tasks_proxy/front/lane/connection.py" in names and "mcp_tasks_proxy/upstream/stdio/__init__.py" in names
    # The task console's page and files, which are not Python: package data.
    shipped = ("console.html", "mcp.js", "forms.js", "console.js", "console.css")
    assert {f"mcp_tasks_proxy/console/{name}" for name in shipped} <= set(names)


def test_python_m_build_makes_what_a_release_publishes_and_the_wheel_runs_from_anywhere(tmp_path):
    """The sdist and wheel `python -m build` makes, as PyPI would take them (`twine check`); the wheel installed on
    its own (no checkout, no editable install) answers --version and serves the console's files."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "proxy", source / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "-q", "--outdir", str(dist), str(source)], check=True,
                   capture_output=True, timeout=240)  # fmt: skip
    built = sorted(path.name for path in dist.iterdir())
    assert [name.split("-")[0] for name in built] == ["mcp_tasks_proxy", "mcp_tasks_proxy"], built
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                             capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr
    # Unpacked into a directory of its own, ahead of the checkout's editable install on the path.
    (wheel,) = dist.glob("*.whl")
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    code = ("import mcp_tasks_proxy, importlib.resources as r; print(mcp_tasks_proxy.__file__); "
            "print(len(r.files('mcp_tasks_proxy.console').joinpath('console.js').read_text()))")  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(target)}
    found = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=environment, capture_output=True,
                           text=True, check=True)  # fmt: skip
    where, size = found.stdout.split()
    assert Path(where).is_relative_to(target) and int(size) > 1000
    version = subprocess.run([sys.executable, "-P", "-m", "mcp_tasks_proxy", "--version"], cwd=tmp_path,
                             env=environment, capture_output=True, text=True, check=True)  # fmt: skip
    assert version.stdout.strip() == f"mcp-tasks-proxy {built[0].split('-')[1].removesuffix('.tar.gz')}"


def test_the_docker_build_context_is_what_the_dockerfiles_copy():
    """No .dockerignore sent the whole checkout (its virtual environments and node_modules: 748 MB) to the builder."""
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*"  # everything out, then what is copied back in
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    dockerfiles = [ROOT / "Dockerfile", ROOT / "examples" / "compose" / "example-server.Dockerfile"]  # context: ROOT
    for line in "\n".join(path.read_text() for path in dockerfiles).splitlines():
        match = re.match(r"COPY (?!--from)(.+) \S+$", line)
        if match:
            copied.update(source.rstrip("/") for source in match.group(1).split())
    assert copied == kept
