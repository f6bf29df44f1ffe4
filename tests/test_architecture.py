"""The layout holds: no import cycles (lazy imports included), no private names imported across
modules, the worker side takes only the shared modules of the controller side, and the model
registry and the config agree on the families."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

PACKAGES = ("cona_cli", "launch")
# What torchrun's workers (package `launch`) may import from the controller side.
SHARED_WITH_WORKERS = {
    "cona_core.config",
    "cona_core.strategy",
    "cona_core.gns",
    "cona_core.rundir",
    "cona_core.clock",
    "cona_core.pretrained",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every runtime import of a project module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            names = [a.name for a in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            found.append((node.module, [n for n in names if f"{node.module}.{n}" not in modules], node.lineno))
            found += [(m, [], node.lineno) for m in submodules]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _, _ in _imports(name, path, modules):
            graph[name].add(target)
            parts = target.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ first
            parents = {".".join(parts[:i]) for i in range(1, len(parts))}
            graph[name].update(p for p in parents if p in modules and p != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_lazy_imports_included() -> None:
    graph = _graph()
    assert len(graph) > 40  # the walk found the packages
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_names_imported_across_modules() -> None:
    modules = _modules()
    private = [
        f"{path.relative_to(REPO)}:{line}: {target}.{n}"
        for name, path in modules.items()
        for target, names, line in _imports(name, path, modules)
        for n in names
        if n.startswith("_")
    ]
    assert private == []


def test_workers_import_only_the_shared_modules_of_the_controller_side() -> None:
    modules = _modules()
    taken = {
        target
        for name, path in modules.items()
        if name.startswith("launch")
        for target, _, _ in _imports(name, path, modules)
        if target.startswith("cona_cli")
    }
    assert taken <= SHARED_WITH_WORKERS, taken - SHARED_WITH_WORKERS


def test_the_registry_serves_every_family_the_config_accepts() -> None:
    from cona_core.config import MODEL_FAMILIES, ModelConfig
    from cona_core.shape import SHAPES, model_shape
    from launch.models import FAMILY_MODULES, get_spec

    assert set(FAMILY_MODULES) == set(SHAPES) == set(MODEL_FAMILIES)
    for family in MODEL_FAMILIES:
        spec = get_spec(family)
        m = ModelConfig(n_layers=2, d_model=32, n_heads=4, ffn=64, seq_len=16, family=family)
        # The engine's shape is the planner's, both with the vocabulary padded to a multiple of 128.
        assert spec.family == family and spec.shape(m, 300) == model_shape(m, 300) == SHAPES[family](m, 384)


def test_a_built_wheel_carries_the_hardware_profiles(tmp_path: Path) -> None:
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("cona-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if n.startswith("cona_cli/planner/profiles/")}
    assert {p.name for p in (REPO / "cona_cli" / "planner" / "profiles").glob("*.yaml")} <= shipped
