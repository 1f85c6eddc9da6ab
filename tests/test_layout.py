"""The package's layering, checked on the source: torch only in the bridge, kernels below the model, no
import circles (deferred imports included) and no private names taken across files."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ttj_jax", "bridge")


def _modules(packages=PACKAGES) -> dict[str, pathlib.Path]:
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import in the file, at any depth (deferred ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def _internal_target(module: str, names: list[str]) -> list[str]:
    """The package modules an import statement reaches (`from pkg import submodule` counts as the submodule)."""
    targets = []
    if module in MODULES:
        targets.append(module)
    targets += [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return targets


def _graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path):
            for target in _internal_target(module, names):
                if target != name and not name.startswith(target + "."):   # a package's own __init__
                    graph[name].add(target)
    return graph


def test_no_torch_in_the_jax_package():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in MODULES.items() if name.startswith("ttj_jax")
                 for module, _, line in _imports(path) if module.split(".")[0] == "torch"]
    assert not offenders, f"torch imported inside ttj_jax (only bridge/ may): {offenders}"


@pytest.mark.slow
def test_importing_the_jax_package_loads_no_torch():
    code = "import sys, ttj_jax, ttj_jax.stacks; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_kernels_do_not_import_the_model():
    above = ("ttj_jax.model", "ttj_jax.stacks", "ttj_jax.layers", "ttj_jax.planner", "bridge")
    graph = _graph()
    offenders = [(name, target) for name in graph if name.startswith("ttj_jax.kernels")
                 for target in graph[name] if target.startswith(above)]
    assert not offenders, f"kernel modules import the layers above them: {offenders}"


def test_no_import_circles():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles (deferred imports count): " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_files():
    offenders = []
    for path in _modules(PACKAGES + ("bench",)).values():
        for module, names, line in _imports(path):
            if _internal_target(module, []) or module.split(".")[0] in PACKAGES + ("bench",):
                offenders += [f"{path.relative_to(ROOT)}:{line} {module}.{n}" for n in names
                              if n.startswith("_") and not n.startswith("__")]
    assert not offenders, f"private names imported from another file: {offenders}"


def test_the_checks_above_can_fail(tmp_path):
    """The graph walk sees deferred imports and names a circle (guards the checks against passing vacuously)."""
    source = "def f():\n    from ttj_jax.model import forward\n    from bridge import _private\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    imports = _imports(path)
    assert ("ttj_jax.model", ["forward"], 2) in imports
    assert ("bridge", ["_private"], 3) in imports
    assert "ttj_jax.model" in _internal_target("ttj_jax.model", ["forward"])
    assert _graph()["ttj_jax.model"], "the model imports package modules: the graph must see them"
