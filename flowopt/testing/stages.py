"""The stage contract, as checks a plugin author runs on their own stage (as optuna ships its sampler tests).

Every check takes a :class:`StageRecipe` (a program factory, data, a metric and the stage's settings,
small enough to run in seconds) and raises :class:`AssertionError` saying what broke. A stage keeps the
contract when it

* refuses a setting of the wrong type (every typed field), ``NaN`` and ``2.5`` for an int with a
  :class:`~flowopt.errors.ConfigError` (:func:`check_settings_are_validated`), documents every
  setting in its docstring (:func:`check_settings_are_documented`) and gives JSON ``settings()``
  (:func:`check_settings_are_json`);
* leaves the caller's program unchanged, in its JSON and in what it answers (:func:`check_input_unchanged`);
* gives the same program for the same seed (:func:`check_same_seed`);
* when the budget runs out, still returns a program, with a typed stop reason (:func:`check_budget_stop`);
* resumes a finished run without paying again (:func:`check_resume`);
* writes files only under its run folder (:func:`check_files_under_run_dir`);
* is refused when compile is launched on several processes, unless it shares its work among them
  (:func:`check_process_launch`).

:func:`check_stage_contract` runs them all. No pytest is needed.

Example:
    >>> import dataclasses
    >>> import typing
    >>> from flowopt.compiler import Stage
    >>> from flowopt.settings import at_least, check_stage
    >>> from flowopt.testing import check_settings_are_json, check_settings_are_validated
    >>> @dataclasses.dataclass(frozen=True)
    ... class Noop(Stage):
    ...     name: typing.ClassVar[str] = "noop-contract"
    ...     rounds: int = 1
    ...     def __post_init__(self):
    ...         check_stage(self, {"rounds": at_least(1)})
    ...     def run(self, program, ctx):
    ...         return program
    >>> check_settings_are_validated(Noop); check_settings_are_json(Noop())
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dspy

from flowopt.compiler import Budget, Stage, compile
from flowopt.compiler.budget import LIMITS
from flowopt.errors import ConfigError
from flowopt.testing.scripted import scripted_lm


@dataclass
class StageRecipe:
    """A program factory, data and metric on which one stage runs in a few seconds.

    ``settings`` are the stage's (``compile(stages=[(name, settings)])``); ``inputs`` what the caller
    asks its program before and after compile.
    """

    program: Callable[[], dspy.Module]
    trainset: list[dspy.Example]
    valset: list[dspy.Example]
    metric: Callable[..., float]
    settings: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)


def scripted_recipe(settings: dict[str, Any] | None = None) -> StageRecipe:
    """A one-node Workflow over a scripted LM that answers right only when shown a demo of the same
    category: a task any prompt-level stage can improve, with no real LM."""
    from flowopt.registry import get_operator
    from flowopt.workflow import Workflow

    predict = get_operator("Predict")  # through the registry: the core does not import flowopt.modules

    def answer(req: Any) -> Any:
        if req.output_fields != ["answer"]:  # an optimizer's own call (MIPRO's proposer, GEPA's reflection)
            fields = {name: "Answer the question." for name in req.output_fields}
            return json.dumps(fields) if "JSON" in req.system else fields
        q = req.inputs.get("question", "")
        cats = {str(d.get("question", ""))[:1] for d in req.demos if str(d.get("answer", "")).startswith("#")}
        return {"answer": "#" + q[::-1] if q[:1] in cats else q}

    lm = scripted_lm(answer, model="scripted/conformance", cache=False)  # cache hits would not spend the budget

    def program() -> dspy.Module:
        wf = Workflow("question -> answer", name="conformance")
        wf.add("solve", predict("question -> answer"), lm="default")
        wf.lms["default"] = lm
        return wf

    data = [dspy.Example(question=f"{'abc'[i % 3]}{i}", answer="#" + f"{'abc'[i % 3]}{i}"[::-1])
            .with_inputs("question") for i in range(18)]
    return StageRecipe(program, data[:12], data[12:],
                       lambda ex, pred, trace=None: float(ex.answer == pred.answer),
                       dict(settings or {}), [{"question": "a100"}, {"question": "b200"}])


def _compile(recipe: StageRecipe, name: str, program: dspy.Module, **kwargs: Any) -> dspy.Module:
    return compile(program, recipe.trainset, recipe.metric, valset=recipe.valset,
                   stages=[(name, recipe.settings)], quiet=True, num_threads=2, **kwargs)


def _answers(program: dspy.Module, inputs: list[dict[str, Any]]) -> list[str]:
    return [str(program(**kwargs).toDict()) for kwargs in inputs]


def _fail(what: str) -> None:
    raise AssertionError(what)


class _Wrong:
    """A value of no declared setting type."""

    def __repr__(self) -> str:
        return "<wrong>"


def _typed_fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints.get(f.name, Any)) for f in dataclasses.fields(cls) if hints.get(f.name, Any) is not Any]


def _refused(cls: type, setting: str, value: Any) -> None:
    try:
        cls(**{setting: value})
    except ConfigError as err:
        if setting not in str(err) or "Fix:" not in str(err):
            _fail(f"{cls.__name__}({setting}={value!r}): the error does not name the setting and a fix: {err}")
        return
    _fail(f"{cls.__name__}({setting}={value!r}) was accepted")


def check_settings_are_validated(cls: type[Stage]) -> None:
    """Every typed setting refuses a value of no declared type; numbers refuse NaN; ints refuse 2.5."""
    if not dataclasses.is_dataclass(cls):
        _fail(f"{cls.__name__}: settings must be dataclass fields")
    fields = _typed_fields(cls)
    if not fields:
        _fail(f"{cls.__name__}: no typed settings")
    for name, hint in fields:
        _refused(cls, name, _Wrong())
        args = typing.get_args(hint)
        if float in (hint, *args):
            _refused(cls, name, math.nan)
        if int in (hint, *args) and float not in args:
            _refused(cls, name, 2.5)


def check_settings_are_documented(cls: type) -> None:
    """Every setting (dataclass field) is named in the class docstring (``name:`` or ````name````)."""
    doc = cls.__doc__ or ""
    missing = [f.name for f in dataclasses.fields(cls)
               if not re.search(rf"(^|[\s,`(]){re.escape(f.name)}([`:,\s=)]|$)", doc)]
    if missing:
        _fail(f"{cls.__name__}'s docstring does not document {missing}")


def check_settings_are_json(stage: Stage) -> None:
    """``settings()`` is JSON data (no NaN) naming every field (a dataclass-valued one, or all of its
    fields), and the same on every call (it is recorded in the report and compared on resume)."""
    settings = stage.settings()
    try:
        json.dumps(settings, allow_nan=False)
    except (TypeError, ValueError) as err:
        _fail(f"{type(stage).__name__}.settings() is not JSON: {err}")
    missing: list[str] = []
    fields: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(stage) if dataclasses.is_dataclass(stage) else ()
    for f in fields:
        value = getattr(stage, f.name)
        # A group of settings held as a dataclass of its own may be given flat (StructureSearch's search).
        names = [g.name for g in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else [f.name]
        if f.name not in settings and not all(name in settings for name in names):
            missing.append(f.name)
    if missing:
        _fail(f"{type(stage).__name__}.settings() leaves out {sorted(missing)}")
    if stage.settings() != settings:
        _fail(f"{type(stage).__name__}.settings() differs between two calls")


def check_input_unchanged(recipe: StageRecipe, name: str) -> None:
    """The caller's program keeps its JSON and its answers."""
    program = recipe.program()
    json_before, answers_before = program.canonical_json(), _answers(program, recipe.inputs)
    _compile(recipe, name, program)
    if program.canonical_json() != json_before:
        _fail(f"stage {name!r} changed the caller's program")
    if _answers(program, recipe.inputs) != answers_before:
        _fail(f"stage {name!r} changed what the caller's program answers")


def check_same_seed(first: StageRecipe, second: StageRecipe, name: str, root: Path) -> None:
    """Two runs with the same seed (each on its own recipe: its own LM) give the same program."""
    one = _compile(first, name, first.program(), seed=3, run_dir=root / "first")
    two = _compile(second, name, second.program(), seed=3, run_dir=root / "second")
    # The two runs live in two folders by construction; saved files (adapters) may name their folder.
    if (one.canonical_json().replace(str(root / "first"), "<run>")
            != two.canonical_json().replace(str(root / "second"), "<run>")):
        _fail(f"stage {name!r} gave two programs for one seed")


def check_budget_stop(recipe: StageRecipe, name: str) -> None:
    """With a budget of the baseline's calls and one more, the stage still returns a runnable program and
    the report says ``budget: <limit>``. Run it with DSPy's cache off (cache hits spend no budget)."""
    out = _compile(recipe, name, recipe.program(), budget=Budget(max_lm_calls=len(recipe.valset) + 1))
    row = out.report.stage(name)
    kind, _, limit = row.stop_reason.partition(": ")
    if kind != "budget" or limit.split()[0] not in LIMITS:
        _fail(f"stage {name!r} stopped by the budget reports {row.stop_reason!r}")
    if not out.report.stop_reason.startswith("budget: max_lm_calls"):
        _fail(f"the report's stop reason is {out.report.stop_reason!r}")
    _answers(out, recipe.inputs[:1])  # the program returned still runs


def check_resume(recipe: StageRecipe, name: str, root: Path) -> None:
    """A finished run resumed from its folder returns the same program, marks the stage resumed and
    makes no LM call."""
    run_dir = root / "resumed"
    first = _compile(recipe, name, recipe.program(), run_dir=run_dir)
    again = _compile(recipe, name, recipe.program(), run_dir=run_dir, resume=True)
    if again.canonical_json() != first.canonical_json():
        _fail(f"stage {name!r} resumed from a finished run returned another program")
    row = again.report.stage(name)
    if not row.resumed or again.report.total["this_run"]["lm_calls"] != 0:
        _fail(f"stage {name!r} was run again on resume (resumed={row.resumed}, "
              f"{again.report.total['this_run']['lm_calls']} LM calls)")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@contextmanager
def _inside(cwd: Path, temp: Path) -> Iterator[None]:
    """Run with ``cwd`` as the working folder and ``temp`` as tempfile's folder."""
    before, saved = Path.cwd(), tempfile.tempdir
    os.chdir(cwd)
    tempfile.tempdir = str(temp)
    try:
        yield
    finally:
        os.chdir(before)
        tempfile.tempdir = saved


def check_files_under_run_dir(recipe: StageRecipe, name: str, root: Path) -> None:
    """With a run folder, the stage writes nothing outside it: not in the working folder, not in
    tempfile's folder (both watched under ``root``)."""
    cwd, temp, run_dir = root / "cwd", root / "tmp", root / "run"
    cwd.mkdir(parents=True, exist_ok=True)
    temp.mkdir(parents=True, exist_ok=True)
    with _inside(cwd, temp):
        _compile(recipe, name, recipe.program(), run_dir=run_dir)
    stray = sorted(_tree(cwd) | _tree(temp))
    if stray:
        _fail(f"stage {name!r} wrote outside its run folder: {stray[:5]}")
    if not (run_dir / "report.json").is_file():
        _fail(f"compile with stage {name!r} wrote no report in its run folder")


def check_process_launch(cls: type[Stage], recipe: StageRecipe, name: str) -> None:
    """A stage that runs in one process (``multi_process = False``) is refused, before any LM call, when
    compile was launched on several processes (every process would repeat it)."""
    if cls.multi_process:
        return  # it shares its work: checked by running it launched (the weights stages' own tests)
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="2")
    try:
        _compile(recipe, name, recipe.program())
    except ConfigError as err:
        if "processes" not in str(err):
            _fail(f"stage {name!r} launched on 2 processes: {err}")
        return
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _fail(f"stage {name!r} (multi_process=False) ran when compile was launched on 2 processes")


def check_stage_contract(cls: type[Stage], make_recipe: Callable[[], StageRecipe], root: Path) -> None:
    """Every check of this module on stage ``cls``; ``make_recipe`` gives a fresh recipe each call (its own
    LM), ``root`` an empty folder the checks write in."""
    name = cls.name
    check_settings_are_validated(cls)
    check_settings_are_documented(cls)
    check_settings_are_json(cls(**make_recipe().settings))
    check_input_unchanged(make_recipe(), name)
    check_same_seed(make_recipe(), make_recipe(), name, root / "seed")
    check_resume(make_recipe(), name, root / "resume")
    check_files_under_run_dir(make_recipe(), name, root / "files")
    check_process_launch(cls, make_recipe(), name)
    check_budget_stop(make_recipe(), name)
