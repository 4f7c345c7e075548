"""The layer direction benchmarks -> optimizers -> modules -> flowopt holds in every source file."""

import ast
from pathlib import Path

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


def test_import_flowopt_stays_light():
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'peft', 'optuna')"
    code = f"import sys, flowopt; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
