"""No dead code at module level: every function and class a source module defines is named somewhere else in
the project (source, tests, notebooks, README, the package's entry points). Issue 30 removed two that were not
(``plain_adapter``, ``structure_signature``); this keeps the next one from staying."""

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("flowopt", "modules", "optimizers", "benchmarks")
USE_FOLDERS = (*SOURCE_FOLDERS, "tests", "notebooks")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def word_counts(root: Path, folders: tuple[str, ...]) -> Counter[str]:
    files = [p for folder in folders for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
    files += [root / name for name in ("README.md", "pyproject.toml") if (root / name).is_file()]
    return Counter(word for path in files for word in WORD.findall(path.read_text(encoding="utf-8")))


def unused_definitions(root: Path, sources: tuple[str, ...], uses: tuple[str, ...]) -> list[str]:
    """Module-level functions and classes whose name occurs once in all of ``uses``: their definition."""
    counts = word_counts(root, uses)
    found = []
    for path in sorted(p for folder in sources for p in (root / folder).rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and counts[node.name] <= 1:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def test_every_module_level_function_and_class_is_used():
    assert unused_definitions(ROOT, SOURCE_FOLDERS, USE_FOLDERS) == []


def test_the_check_finds_a_definition_nothing_names(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def used():\n    return 1\n\ndef plain_adapter():\n    return used()\n\n"
                                           "class Entry:\n    pass\n")
    (tmp_path / "pyproject.toml").write_text('[project.entry-points."x"]\nentry = "pkg.a:Entry"\n')
    assert unused_definitions(tmp_path, ("pkg",), ("pkg",)) == ["pkg/a.py:4 plain_adapter"]
