"""flowopt: a compiler for LLM programs.

Declare a workflow (typed operators wired as a graph), run it as a DSPy module, save it as one JSON
document, and compile it with ``flowopt.compile(program, trainset, metric)``.
"""

from flowopt.compiler import Budget, CompileReport, Stage, StageContext, compile, register_stage
from flowopt.errors import (
    BudgetExhausted,
    ConfigError,
    DataError,
    FlowoptError,
    LMError,
    MetricError,
    SandboxError,
    SchemaError,
    UnknownOperatorError,
    WorkflowError,
)
from flowopt.operator import Operator
from flowopt.registry import get_operator, operator_names, register_operator
from flowopt.signature import FieldSpec, SignatureSpec
from flowopt.version import __version__ as __version__
from flowopt.workflow import INPUT, OUTPUT, Workflow, chain, load

__all__ = [
    "INPUT",
    "OUTPUT",
    "Budget",
    "BudgetExhausted",
    "CompileReport",
    "ConfigError",
    "DataError",
    "FieldSpec",
    "FlowoptError",
    "LMError",
    "MetricError",
    "Operator",
    "SandboxError",
    "SchemaError",
    "SignatureSpec",
    "Stage",
    "StageContext",
    "UnknownOperatorError",
    "Workflow",
    "WorkflowError",
    "chain",
    "compile",
    "get_operator",
    "load",
    "operator_names",
    "register_operator",
    "register_stage",
]
