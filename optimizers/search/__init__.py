"""The ``search`` stage: optuna search over demo sets, instructions and node settings.

``stage`` holds the stage (``RandomSearch``), ``space`` the search space, ``instructions`` the
instruction proposals, ``pruning`` the minibatch schedule and pruners, ``study`` the optuna study.

Example:
    >>> from flowopt.optimizers.search import RandomSearch
    >>> RandomSearch(n_candidates=8).n_candidates
    8
"""

from flowopt.optimizers.search.stage import RandomSearch

__all__ = ["RandomSearch"]
