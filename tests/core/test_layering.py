"""The layer direction benchmarks -> optimizers -> modules -> flowopt holds in every source file, and no module
imports itself through others (an import circle)."""

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"flowopt": 0, "modules": 1, "optimizers": 2, "benchmarks": 3}
IMPORT_LAYER = {"flowopt.modules": 1, "flowopt.optimizers": 2, "flowopt.benchmarks": 3}


def imported_layers(path: Path) -> list[tuple[int, str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            for prefix, layer in IMPORT_LAYER.items():
                if name == prefix or name.startswith(prefix + "."):
                    found.append((node.lineno, name, layer))
    return found


def violations() -> list[str]:
    problems = []
    for folder, layer in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for lineno, name, imported in imported_layers(path):
                if imported > layer:
                    problems.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    return problems


def test_no_layer_imports_a_higher_one():
    assert violations() == []


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import flowopt.optimizers.search\nfrom flowopt.benchmarks import cli\nimport dspy\n")
    assert [layer for _, _, layer in imported_layers(bad)] == [2, 3, 3]


@pytest.mark.parametrize("module", ["flowopt", "flowopt.lm"])
def test_import_flowopt_stays_light(module):
    """``import flowopt`` and ``import flowopt.lm`` (which imports the local runtime's modules, so that a saved
    engine finds the LocalLM builder) load no torch: it loads when a LocalLM is built."""
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'peft', 'optuna')"
    code = f"import sys, {module}; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- import circles ---------------------------------------------------------------------------------------------
PACKAGES = {"flowopt": "flowopt", "modules": "flowopt.modules", "optimizers": "flowopt.optimizers",
            "benchmarks": "flowopt.benchmarks"}


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (folders mapped to their import names)."""
    found = {}
    for folder, package in packages.items():
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    named = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    return isinstance(node, ast.If) and named


def imported_modules(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """The package's modules that ``path`` imports when run: module level and inside functions alike
    (a function-local import still closes a circle when called), not under ``if TYPE_CHECKING``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, int]] = []
    stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # "from package import module" imports the module
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
        stack.extend(ast.iter_child_nodes(node))
    return [(target, line) for target, line in found if target in known and target != name]


def import_graph(root: Path, packages: dict[str, str]) -> nx.DiGraph:
    files = module_files(root, packages)
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        for target, line in imported_modules(path, name, set(files)):
            graph.add_edge(name, target, line=line)
    return graph


def circles(graph: nx.DiGraph) -> list[str]:
    return [" -> ".join(f"{a}:{graph.edges[a, b]['line']}" for a, b in zip(cycle, [*cycle[1:], cycle[0]]))
            for cycle in nx.simple_cycles(graph)]


def test_no_module_imports_itself_through_others():
    assert circles(import_graph(ROOT, PACKAGES)) == []


def test_the_circle_check_sees_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "def later():\n    from .c import thing\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert sorted(graph.edges) == [("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a")]
    (circle,) = circles(graph)
    assert sorted(circle.split(" -> ")) == ["pkg.a:1", "pkg.b:5", "pkg.c:1"]  # module:line of each import
    graph.remove_edge("pkg.c", "pkg.a")
    assert circles(graph) == []
