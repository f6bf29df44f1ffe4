"""The layout holds. Three packages, each with one owner:

- `cona_core`: what both sides share (config schema, strategies, run folder and exit codes, clock, model
  shapes, the noise-scale estimator, Φ and the LR gain). It imports neither `cona_cli` nor `launch`, nor
  torch or numpy (numpy only for type hints; scipy inside the one function that needs Student's t), so
  `import cona_core` loads no torch.
- `launch`: what torchrun runs. It takes from the project only `cona_core`, never `cona_cli`.
- `cona_cli`: the controller. It imports `launch` only inside functions: where it needs torch or the data
  pipeline's tokenizers (export, corpus preparation, checkpoint and weight checks), never at import.

Besides: no import cycles (lazy imports included), no private names imported across modules, the model
registry and the config agree on the families, and a wheel ships every package and the hardware profiles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

PACKAGES = ("cona_core", "cona_cli", "launch")
CORE_NEVER = ("cona_cli", "launch", "torch", "numpy")  # not even lazily (numpy: under TYPE_CHECKING only)
CORE_NOT_AT_IMPORT = ("scipy",)  # heavy: only inside the function that needs it


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


def _runtime_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, inside a function) for every import in a file that runs (TYPE_CHECKING blocks left out);
    for `from a import b`, the module a."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if getattr(child, "lineno", None) in skip:
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _taken(package: str, roots: tuple[str, ...], *, at_import_only: bool = False) -> list[str]:
    """`file:line: module` for each import in `package` of a module under `roots`."""
    return [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for name, path in _modules().items()
        if name.split(".")[0] == package
        for module, line, in_function in _runtime_imports(path)
        if module.split(".")[0] in roots and not (at_import_only and in_function)
    ]


def test_the_import_rule_finder_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport a.b\nif TYPE_CHECKING:\n    import c\n"
        "def f():\n    from d import e\nclass K:\n    import g\n"
    )
    assert _runtime_imports(source) == [("typing", 1, False), ("a.b", 2, False), ("d", 6, True), ("g", 8, False)]


def test_cona_core_imports_neither_side_nor_torch() -> None:
    assert _taken("cona_core", CORE_NEVER) == []
    assert _taken("cona_core", CORE_NOT_AT_IMPORT, at_import_only=True) == []


def test_launch_imports_nothing_from_cona_cli() -> None:
    assert _taken("launch", ("cona_cli",)) == []


def test_cona_cli_imports_launch_only_inside_functions() -> None:
    assert _taken("cona_cli", ("launch",), at_import_only=True) == []
    assert _taken("cona_cli", ("launch",))  # the lazy ones the walk must see (export, corpus preparation, ...)


def test_importing_cona_core_loads_no_torch() -> None:
    code = (
        "import importlib, pkgutil, sys, cona_core\n"
        "for m in pkgutil.walk_packages(cona_core.__path__, 'cona_core.'): importlib.import_module(m.name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({CORE_NEVER + CORE_NOT_AT_IMPORT!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


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
    assert {n.split("/")[0] for n in names if n.endswith("/__init__.py")} == set(PACKAGES)
    shipped = {Path(n).name for n in names if n.startswith("cona_cli/planner/profiles/")}
    assert {p.name for p in (REPO / "cona_cli" / "planner" / "profiles").glob("*.yaml")} <= shipped
