"""Style is checked in CI like behaviour: ruff's lint rules and formatting (configured in pyproject.toml)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "proxy", "tests", "examples", "bench", "docs/_hooks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _imports(package: Path) -> dict[str, set[str]]:
    """Each module of `package` and the modules of the package it imports, read in a fresh interpreter: CPython
    3.11's parser may be left miscounting its recursion by a RecursionError earlier in the same process (another
    test's deep nesting), and ast.parse then raises SystemError."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_lint", str(package)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {name: set(imported) for name, imported in json.loads(done.stdout).items()}


def _read_imports(package: Path) -> dict[str, set[str]]:
    """Each module of `package` and the modules of the package it imports (TYPE_CHECKING imports included)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for candidate in [target, *(f"{target}.{alias.name}" for alias in node.names)]:
                    if candidate in modules and candidate != name:
                        graph[name].add(candidate)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in modules)
    return graph


def test_no_import_cycles():
    """A module that needs another's types names a Protocol, or the other takes what it needs as an argument:
    circles make the layers unreadable (and, at run time, fragile)."""
    graph = _imports(ROOT / "proxy")
    cycles = []
    for start in graph:
        # Depth-first from each module: a path that comes back to it is a cycle.
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for following in graph[node]:
                if following == start:
                    cycles.append(" -> ".join([*path, start]))
                elif following not in path and len(path) < 12:
                    stack.append((following, [*path, following]))
    assert not cycles, "\n".join(sorted(set(cycles))[:10])


if __name__ == "__main__":
    print(json.dumps({name: sorted(imported) for name, imported in _read_imports(Path(sys.argv[1])).items()}))
