"""Operators usable as workflow nodes. Each is one file and registers itself by name.

Example:
    >>> from flowopt.modules import ChainOfThought, Predict
    >>> Predict("question -> answer").spec.input_names
    ['question']
"""

from flowopt.modules.chain_of_thought import ChainOfThought
from flowopt.modules.custom import Custom
from flowopt.modules.predict import Predict
from flowopt.modules.programmer import Programmer
from flowopt.modules.react import ReAct
from flowopt.modules.refine import Refine
from flowopt.modules.retrieve import Retrieve
from flowopt.modules.sc_ensemble import ScEnsemble

__all__ = ["ChainOfThought", "Custom", "Predict", "Programmer", "ReAct", "Refine", "Retrieve", "ScEnsemble"]
