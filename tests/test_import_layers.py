"""The package's dependencies point one way (docs/architecture.md): every import of every installed module, at module
level or inside a function, is parsed from the source and checked against the layers below; no import cycle anywhere.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest
from conftest import ROOT

from pulseinfer_jax._moved import MOVED

PKG = "pulseinfer_jax"
# installed subpackage -> its folder in the repository (pyproject.toml maps the three top-level folders)
FOLDERS = {f"{PKG}.models": ROOT / "models", f"{PKG}.pallas_kernels": ROOT / "pallas_kernels",
           f"{PKG}.host_offload": ROOT / "host_offload"}

# Layers, bottom first: a module may import its own group and the groups of lower layers, never a higher one.
LAYERS = [
    ["_moved", "kv", "parallel"],
    ["pallas_kernels"],
    ["models", "host_offload"],
    ["options", "request", "selection"],
    ["config", "backends", "startup_checks", "runner"],
    ["sched"],
    ["engine"],
    ["api", "calibration", "serving", "console", "demo", "cli"],
]
RANK = {group: i for i, groups in enumerate(LAYERS) for group in groups}
# the leaves (models, kernels, host I/O) and the bottom import only from lower layers; named so the rule reads plainly
LEAVES = {"models", "pallas_kernels", "host_offload", "kv", "parallel"}
CORE = {"engine", "sched", "runner", "selection", "api", "serving", "cli", "config", "backends", "startup_checks",
        "request", "calibration", "console", "demo", "options"}


def modules() -> dict[str, pathlib.Path]:
    """Every installed module's dotted name -> its source file."""
    out = {}
    roots = {PKG: ROOT / PKG, **FOLDERS}
    for name, folder in roots.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def imports_of(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The package modules `path` imports (absolute or relative; `from pkg import module` counts as the module)."""
    tree = ast.parse(path.read_text())
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known}


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, m, known) - {m} for m, p in mods.items()}


def test_every_module_has_a_layer(graph):
    missing = sorted({group(m) for m in graph if m != PKG} - set(RANK))
    assert not missing, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {missing}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in graph.items() if m != PKG
                  for d in deps if d != PKG and RANK[group(d)] > RANK[group(m)])


def leaf_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in graph.items() if group(m) in LEAVES
                  for d in deps if group(d) in CORE)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down(graph):
    bad = upward_imports(graph)
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_leaves_never_import_the_core(graph):
    bad = leaf_violations(graph)
    assert not bad, "\n".join(bad)


def test_no_import_cycle(graph):
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_checks_can_fail():
    """A made-up graph: a cycle between the CLI and the demo, a kernel importing the runner."""
    cli, demo, kernel = f"{PKG}.cli", f"{PKG}.demo", f"{PKG}.pallas_kernels.k"
    fake = {cli: {demo}, demo: {cli}, kernel: {f"{PKG}.runner.dense"}, f"{PKG}.runner.dense": set()}
    assert cycles(fake) == [[cli, demo]]
    assert upward_imports(fake) == [f"{kernel} imports {PKG}.runner.dense"]
    assert leaf_violations(fake) == [f"{kernel} imports {PKG}.runner.dense"]


def test_dev_tools_are_not_installed():
    """The compile-only gate and the cost model live in bench/aot, outside the installed package."""
    assert not (ROOT / PKG / "aot").exists()
    assert (ROOT / "bench" / "aot" / "check.py").is_file()


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_say_where_they_moved(old):
    """Importing a module path of an earlier release fails with its new place, and that place imports."""
    with pytest.raises(ModuleNotFoundError, match="moved: it is now"):
        importlib.import_module(f"{PKG}.{old}")
    for new in re.findall(r"\b(?:pulseinfer_jax|bench)(?:\.\w+)+", MOVED[old]):
        importlib.import_module(new)
