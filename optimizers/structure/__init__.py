"""Structure search: Monte Carlo tree search over typed edits of a workflow graph (the ``structure`` stage).

Example:
    >>> from flowopt.optimizers.structure import StructureSearch
    >>> StructureSearch.name
    'structure'
"""

from flowopt.optimizers.structure.checkpoint import Checkpointer, JsonCheckpoint
from flowopt.optimizers.structure.edits import (
    AddProgrammer,
    AddRefine,
    AddRetrieve,
    Edit,
    InvalidEdit,
    RemoveNode,
    SetConfig,
    SwapOperator,
    WrapEnsemble,
    edit_from_dict,
    edit_kinds,
)
from flowopt.optimizers.structure.pareto import pareto_point, pick_point
from flowopt.optimizers.structure.proposers import (
    LMProposer,
    NoProposal,
    Proposal,
    ProposalContext,
    Proposer,
    RuleProposer,
    Vocabulary,
)
from flowopt.optimizers.structure.result import Evaluation, SearchResult, as_evaluation, replay, replay_log
from flowopt.optimizers.structure.search import MCTS
from flowopt.optimizers.structure.search_settings import SearchSettings
from flowopt.optimizers.structure.selection import mixed_probabilities
from flowopt.optimizers.structure.stage import StructureSearch, pick
from flowopt.optimizers.structure.tree import SearchTree, TreeNode

__all__ = [
    "MCTS",
    "AddProgrammer",
    "AddRefine",
    "AddRetrieve",
    "Checkpointer",
    "Edit",
    "Evaluation",
    "InvalidEdit",
    "JsonCheckpoint",
    "LMProposer",
    "NoProposal",
    "Proposal",
    "ProposalContext",
    "Proposer",
    "RemoveNode",
    "RuleProposer",
    "SearchResult",
    "SearchSettings",
    "SearchTree",
    "SetConfig",
    "StructureSearch",
    "SwapOperator",
    "TreeNode",
    "Vocabulary",
    "WrapEnsemble",
    "as_evaluation",
    "edit_from_dict",
    "edit_kinds",
    "mixed_probabilities",
    "pareto_point",
    "pick",
    "pick_point",
    "replay",
    "replay_log",
]
