"""Structure search: Monte Carlo tree search over typed edits of a workflow graph (the ``structure`` stage).

Example:
    >>> from flowopt.optimizers.structure import StructureSearch
    >>> StructureSearch.name
    'structure'
"""

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
from flowopt.optimizers.structure.proposers import (
    LMProposer,
    NoProposal,
    Proposal,
    ProposalContext,
    Proposer,
    RuleProposer,
    Vocabulary,
)
from flowopt.optimizers.structure.search import (
    MCTS,
    Evaluation,
    JsonCheckpoint,
    SearchResult,
    SearchSettings,
    pick_point,
    replay,
    replay_log,
)
from flowopt.optimizers.structure.selection import mixed_probabilities
from flowopt.optimizers.structure.stage import StructureSearch, pick
from flowopt.optimizers.structure.tree import SearchTree, TreeNode

__all__ = [
    "MCTS",
    "AddProgrammer",
    "AddRefine",
    "AddRetrieve",
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
    "edit_from_dict",
    "edit_kinds",
    "mixed_probabilities",
    "pick",
    "pick_point",
    "replay",
    "replay_log",
]
