"""0/1 score lists with a controlled overlap, for testing the search's pruning rules directly."""

from __future__ import annotations


def scores(mean: float, n: int, offset: int = 0) -> list[float]:
    """0/1 scores with ``round(mean * n)`` ones, placed from ``offset`` on (so overlaps are controlled)."""
    ones = round(mean * n)
    return [1.0 if (i - offset) % n < ones else 0.0 for i in range(n)]


def pairs(losses: int, wins: int, ties: int) -> tuple[list[float], list[float]]:
    """Challenger and leader scores with that many losses, wins and (both right) ties for the challenger."""
    challenger = [0.0] * losses + [1.0] * wins + [1.0] * ties
    leader = [1.0] * losses + [0.0] * wins + [1.0] * ties
    return challenger, leader
