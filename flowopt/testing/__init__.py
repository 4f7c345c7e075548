"""Test helpers shipped with flowopt: scripted LMs (:mod:`.scripted`) and the stage contract (:mod:`.stages`).

A plugin author checks a stage of their own against the contract every built-in stage keeps::

    from flowopt.testing import check_stage_contract, scripted_recipe
    check_stage_contract(MyStage, lambda: scripted_recipe({"rounds": 1}), tmp_path)

Example:
    >>> import dspy
    >>> from flowopt.testing import scripted_lm
    >>> with dspy.context(lm=scripted_lm(lambda req: {"answer": "hi"})):
    ...     dspy.Predict("question -> answer")(question="?").answer
    'hi'
"""

from flowopt.testing.scripted import AnswerFn, AsyncScriptedEngine, ScriptedEngine, ScriptedRequest, scripted_lm
from flowopt.testing.stages import (
    StageRecipe,
    check_budget_stop,
    check_files_under_run_dir,
    check_input_unchanged,
    check_process_launch,
    check_resume,
    check_same_seed,
    check_settings_are_documented,
    check_settings_are_json,
    check_settings_are_validated,
    check_stage_contract,
    scripted_recipe,
)

__all__ = [
    "AnswerFn",
    "AsyncScriptedEngine",
    "ScriptedEngine",
    "ScriptedRequest",
    "StageRecipe",
    "check_budget_stop",
    "check_files_under_run_dir",
    "check_input_unchanged",
    "check_process_launch",
    "check_resume",
    "check_same_seed",
    "check_settings_are_documented",
    "check_settings_are_json",
    "check_settings_are_validated",
    "check_stage_contract",
    "scripted_lm",
    "scripted_recipe",
]
