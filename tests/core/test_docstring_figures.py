"""Measured figures (timings, rates, speed-ups, peak memory, confidence intervals) live in benchmarks/results/, with
the machine and command that produced them, not in the library's docstrings, where they go stale unseen
(issue 30). Perf scripts under benchmarks/ may say what a run costs; the library (flowopt, modules,
optimizers) may not."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_FOLDERS = ("flowopt", "modules", "optimizers")
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)? ?(?:ms|s|seconds|minutes) (?:per|a|an|each) \w+"  # 58 ms per step, 0.5 s a call
    r"|\b\d+(?:\.\d+)? ?(?:tokens?|tok|rows|steps|examples|calls|it)/s\b"  # 310 tokens/s
    r"|\b\d+(?:\.\d+)? ?x (?:faster|slower)\b"  # 2.1x faster
    r"|\[\+\d*\.\d+, [-+]\d*\.\d+\]|\[[-+]\d*\.\d+, \+\d*\.\d+\]"  # an interval such as [-0.012, +0.031]
    r"|\b\d+(?:\.\d+)? ?[GM]iB (?:peak|RSS)\b|\bpeak (?:RSS|memory) of \d+(?:\.\d+)? ?[GM]iB")  # 3.69 GiB peak


def figures(paths: list[Path], root: Path = ROOT) -> set[tuple[str, str, str]]:
    """(file, function or class or <module>, figure) for every measured figure in a docstring."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = " ".join((ast.get_docstring(node, clean=False) or "").split())
                name = getattr(node, "name", "<module>")
                found |= {(str(path.relative_to(root)), name, m.group()) for m in FIGURE.finditer(text)}
    return found


def test_no_library_docstring_quotes_a_measured_figure():
    paths = sorted(path for folder in LIBRARY_FOLDERS for path in (ROOT / folder).rglob("*.py"))
    found = figures(paths)
    assert found == set(), sorted(found)


def test_the_check_sees_figures_and_not_doctest_values(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Fast: 58 ms per step at batch 1,\n    about 2.5x faster; change [-0.012, +0.031]."""\n\n'
                      'def f():\n    """Peak: 3.69 GiB peak.\n\n    >>> g([-1.2, -0.4], [1.0, 1.0])\n'
                      '    0.5\n    """\n\n'
                      'class C:\n    """Gives up after ``timeout`` seconds per call (30 by default)."""\n')
    assert sorted(figures([module], root=tmp_path)) == [
        ("m.py", "<module>", "2.5x faster"), ("m.py", "<module>", "58 ms per step"),
        ("m.py", "<module>", "[-0.012, +0.031]"), ("m.py", "f", "3.69 GiB peak")]  # not a setting, not a doctest
