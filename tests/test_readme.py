"""The README's Python examples run as written, with dspy.LM swapped for a scripted LM."""

import re
from pathlib import Path

import dspy
import pytest

from flowopt.testing import ScriptedEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def scripted_answer(request):
    # Plausible values for every field the README's programs ask for.
    return {f: "print(51)" if f == "code" else "51" for f in request.output_fields}


def test_readme_has_examples():
    assert len(python_blocks()) >= 2


def test_readme_examples_run(tmp_path, monkeypatch):
    models = []
    real_lm = dspy.LM

    def fake_lm(model, *args, **kwargs):
        models.append(model)
        return real_lm(f"scripted/{model}", engine=ScriptedEngine(scripted_answer))

    # Modules that subclass dspy.LM must be imported before it is patched, or a block that first
    # reaches them (a local model's adapter pick) would build them on this function.
    import flowopt.lm.engine  # noqa: F401

    monkeypatch.setattr(dspy, "LM", fake_lm)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in python_blocks():
        try:
            exec(compile(block, str(README), "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message shows which block failed
            pytest.fail(f"README block failed: {err!r}\n---\n{block}")
    assert models and (tmp_path / "qa.json").exists()


# -- the README is a map: what a newcomer needs on the first screen, figures in benchmarks/results ----------------
FIRST_SCREEN_LINES = 40


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # no headings in code
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative links (``[text](file#anchor)``, ``[text](#anchor)``) whose file or heading does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file) if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_the_first_screen_shows_install_the_main_command_compiling_and_the_architecture():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN_LINES])
    assert "<!-- ci:install -->" in first and "python -m pytest" in first
    assert "main command" in first and "(#benchmarks)" in first
    assert "(#compile)" in first and "(#architecture)" in first
    assert "## Architecture" in README.read_text(encoding="utf-8")


def test_measured_intervals_live_in_the_results_readme_not_here():
    interval = r"\[[-+]?\d+\.\d+, [-+]?\d+\.\d+\]"  # a 95% interval such as [+0.003, +0.037]
    assert re.findall(interval, README.read_text(encoding="utf-8")) == []
    assert "benchmarks/results/README.md" in README.read_text(encoding="utf-8")


def test_every_relative_link_leads_to_a_file_and_heading_that_exist(tmp_path):
    assert broken_links(README) == []
    assert broken_links(README.parent / "benchmarks" / "results" / "README.md") == []
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n## `flowopt serve` under load\n")
    page.write_text("[a](other.md#flowopt-serve-under-load) [b](other.md#gone) [c](missing.md) [d](#top)\n# Top\n")
    assert broken_links(page) == ["other.md#gone", "missing.md"]
