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
