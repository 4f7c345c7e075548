"""The compiler: ``compile()``, the :class:`Stage` interface, budget, evaluation, report and resume.

Stages are found by name through the ``flowopt.stages`` entry-point group (see :mod:`.stages`), so
this package never imports ``flowopt.optimizers``.
"""

from flowopt.compiler.budget import Budget, BudgetStop, BudgetTracker, Usage
from flowopt.compiler.checkpoint import clone_program, program_from_data, program_to_data, saved_output
from flowopt.compiler.compile import compile
from flowopt.compiler.context import StageContext, StageOutcome
from flowopt.compiler.evaluate import EvalResult, Evaluator, confidence_interval
from flowopt.compiler.report import CompileReport, StageReport
from flowopt.compiler.stage import Stage
from flowopt.compiler.stages import get_stage, register_stage, resolve_stages, stage_names

__all__ = [
    "Budget",
    "BudgetStop",
    "BudgetTracker",
    "CompileReport",
    "EvalResult",
    "Evaluator",
    "Stage",
    "StageContext",
    "StageOutcome",
    "StageReport",
    "Usage",
    "clone_program",
    "compile",
    "confidence_interval",
    "get_stage",
    "program_from_data",
    "program_to_data",
    "register_stage",
    "resolve_stages",
    "saved_output",
    "stage_names",
]
