"""The team guide's mechanical style rules hold in every file: no source or test file over 450 lines, no
function over 80 lines, and no private name (``_x``) of one project module used by another outside tests."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("flowopt", "modules", "optimizers", "benchmarks")
PROJECT_PACKAGES = ("flowopt",)  # what the four folders import as (flowopt, flowopt.modules, ...)
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def python_files(folders: tuple[str, ...]) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def long_files(paths: list[Path], limit: int = MAX_FILE_LINES, root: Path = ROOT) -> list[str]:
    sizes = ((path, len(path.read_text(encoding="utf-8").splitlines())) for path in paths)
    return [f"{path.relative_to(root)}: {lines} lines" for path, lines in sizes if lines > limit]


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES, root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, module and class variables, attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if is_private(name)}


def _own_object(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: a class using its own private names."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reach_ins(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Uses in one module of a private name another project module defines, and imports of private names or
    private modules from the project (third-party private names, such as ``torch._dynamo``, are not counted)."""
    trees = {path: parsed(path) for path in paths}
    defined = {path: defined_private_names(tree) for path, tree in trees.items()}
    defined_in: dict[str, set[Path]] = {}
    for path, names in defined.items():
        for name in names:
            defined_in.setdefault(name, set()).add(path)
    found = []
    for path, tree in trees.items():
        elsewhere = {name for name, owners in defined_in.items() if path not in owners}
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
                parts = [*node.module.split("."), *(alias.name for alias in node.names)]
                found += [f"{where}:{node.lineno} imports {name}" for name in parts if is_private(name)]
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] in PROJECT_PACKAGES
                          and any(is_private(part) for part in alias.name.split("."))]
            elif (isinstance(node, ast.Attribute) and node.attr in elsewhere and not _own_object(node.value)):
                found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_source_or_test_file_is_over_450_lines():
    assert long_files(python_files((*SOURCE_FOLDERS, "tests"))) == []


def test_no_function_is_over_80_lines():
    assert long_functions(python_files((*SOURCE_FOLDERS, "tests"))) == []


def test_no_module_uses_another_modules_private_names():
    assert private_reach_ins(python_files(SOURCE_FOLDERS)) == []


def test_the_checks_catch_what_they_guard(tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text("class Engine:\n    def __init__(self):\n        self._queue = []\n"
                     "    def _check(self):\n        return self._queue\n\ndef _helper():\n    return 1\n")
    user = tmp_path / "user.py"
    user.write_text("import torch\nfrom flowopt.owner import _helper\nfrom flowopt.modules._fields import x\n"
                    "import flowopt._secret\n\ndef run(engine):\n    engine._check()\n    torch._dynamo.reset()\n"
                    "    return engine._queue, _helper()\n")
    found = private_reach_ins([owner, user], root=tmp_path)
    assert sorted(found) == sorted(["user.py:2 imports _helper", "user.py:3 imports _fields",
                                    "user.py:4 imports flowopt._secret", "user.py:7 uses engine._check",
                                    "user.py:9 uses engine._queue"])  # not the owner's own uses, nor torch's
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 80 + "\n" * 380)
    assert long_functions([long], root=tmp_path) == ["long.py:1 f: 81 lines"]
    assert long_functions([long], limit=81, root=tmp_path) == []
    assert long_files([long], root=tmp_path) == ["long.py: 461 lines"]
    assert long_files([long], limit=461, root=tmp_path) == []
