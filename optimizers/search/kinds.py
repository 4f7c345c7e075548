"""Which kind of extra candidate to try next: a Thompson-sampling bandit over candidate kinds.

The search's extra candidates (those beyond the planned ones) come in kinds, each a change to the
*leader* (the best fully scored candidate when the candidate is asked):

* ``"bootstrap"``: a fresh shuffled bootstrap of DSPy's full demo size (as BFRS's candidates, with
  the next BFRS seeds), the leader's instructions and settings;
* ``"subset"``: a subset of 1..``max_demos`` demos from the pool (drawn by the optuna sampler), the
  leader's instructions and settings;
* ``"instruction"``: the leader's demos and settings, another instruction for one predictor;
* ``"settings"``: the leader's demos and instructions, another temperature or ``ScEnsemble`` size for
  one node (only when ``temperatures`` or ``ensemble_n`` are given).

What pays differs from task to task: where demos are the only lever an instruction candidate is the
leader again with different noise, and where one demo in eight helps a small subset finds it where a
full bootstrap dilutes it. So the kind is learned during the search: a finished extra *won* when it
was ahead of its leader on the examples it was scored on by at least one standard error of the paired
difference (``z = (wins - losses) / sqrt(wins + losses) >= 1`` on the discordant examples; a bare lead
wins too often by chance, as a candidate the same as the leader but for noise would). Each kind's
win rate has a Beta(1, 1) prior; each extra draws from every available kind's posterior and takes the
highest draw (Thompson sampling), so kinds that win get more of the calls. Before that, every
available kind is tried once (:data:`EXPLORE_ORDER`: the kinds the planned set of bootstraps does not
already cover first): a draw seeded by the candidate number alone would otherwise give a whole wave
of extras, all asked before any finishes, to the kind the seed happens to favour, and under a small
budget that wave is most of the extras. An instruction extra takes an instruction not yet tried on
the same leader while there is one. The draw is seeded by (seed, candidate number) and reads only
finished trials (and the kinds of the extras already asked): a resumed search repeats an
uninterrupted one.

Example:
    >>> import random
    >>> record = {"bootstrap": (0, 6), "subset": (5, 1)}
    >>> [choose_kind(random.Random(i), ("bootstrap", "subset"), record) for i in range(5)]
    ['subset', 'subset', 'subset', 'subset', 'subset']
    >>> win([1.0] * 10 + [0.0] * 2, [0.0] * 10 + [1.0] * 2)  # 10 wins, 2 losses: z = 2.3
    True
    >>> win([1.0, 0.0] * 5, [0.0, 1.0] * 5)  # as many wins as losses
    False
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

KINDS = ("bootstrap", "subset", "instruction", "settings")
# The order untried kinds are tried in: the planned candidates are full bootstraps already, so the kinds
# that change something else come first (under a budget that pays for a few extras, each gets its look).
EXPLORE_ORDER = ("instruction", "settings", "subset", "bootstrap")
LEADER = "leader"  # user attr of an extra: the candidate number of the leader it changes
WIN_Z = 1.0  # a win: ahead of the leader by at least one standard error of the paired difference


def win(challenger: Sequence[float], leader: Sequence[float]) -> bool:
    """Was ``challenger`` ahead of ``leader`` on their common examples by at least ``WIN_Z`` standard
    errors of the paired difference? (Graded scores: the normal z of the mean difference.)"""
    n = min(len(challenger), len(leader))
    diffs = [float(a) - float(b) for a, b in zip(challenger[:n], leader[:n])]
    moved = [d for d in diffs if d]
    if not moved:
        return False
    total = sum(diffs)
    spread = math.sqrt(sum(d * d for d in moved))  # 0/1 scores: sqrt(wins + losses)
    return total / spread >= WIN_Z


def kind_record(extras: Iterable[tuple[str, Sequence[float], Sequence[float]]]) -> dict[str, tuple[int, int]]:
    """``{kind: (wins, losses)}`` from finished extras, each given as (kind, its scores, its leader's scores)."""
    out: dict[str, tuple[int, int]] = {}
    for kind, scores, leader in extras:
        wins, losses = out.get(kind, (0, 0))
        out[kind] = (wins + 1, losses) if win(scores, leader) else (wins, losses + 1)
    return out


def choose_kind(rng: random.Random, available: Sequence[str], record: Mapping[str, tuple[int, int]]) -> str:
    """Thompson sampling: the available kind with the highest draw from its Beta(1 + wins, 1 + losses)."""
    draws = {k: rng.betavariate(1 + record.get(k, (0, 0))[0], 1 + record.get(k, (0, 0))[1]) for k in available}
    return max(available, key=lambda k: draws[k])


def next_kind(rng: random.Random, available: Sequence[str], record: Mapping[str, tuple[int, int]],
              asked: Collection[str]) -> str:
    """The kind of the next extra: the first available kind (in :data:`EXPLORE_ORDER`) no extra has been
    asked of yet, else Thompson sampling over ``record`` (:func:`choose_kind`); ``"subset"`` if none is
    available."""
    if not available:
        return "subset"
    untried = [k for k in EXPLORE_ORDER if k in available and k not in asked]
    return untried[0] if untried else choose_kind(rng, available, record)


def leader_params(params: Mapping[str, Any], keep: str) -> dict[str, Any]:
    """The leader's parameters of one sort: ``"demos"`` (``p{i}.k``, ``p{i}.d{j}``), ``"instruction"``
    (``p{i}.instr``) or ``"settings"`` (``.temp``, ``.n``)."""
    def sort(name: str) -> str:
        if name.endswith(".instr"):
            return "instruction"
        if name.endswith((".temp", ".n")):
            return "settings"
        return "demos"

    return {k: v for k, v in params.items() if sort(k) == keep}


def plan_extra(study: Any, space: Any, ctx: Any, number: int, sampler: str, n_candidates: int,
               bootstrap: Any) -> None:
    """Set extra candidate ``number`` up as a change to the leader, of the kind the bandit draws: its
    parameters and demos are enqueued (a ``"subset"`` leaves its demos to the sampler, which is set).
    ``bootstrap(number)`` bootstraps a fresh demo set (per predictor) for a ``"bootstrap"``."""
    from optuna.trial import TrialState

    from flowopt.optimizers.search.study import SCORES, candidate_sampler

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and SCORES in t.user_attrs]
    by_number = {int(t.user_attrs.get("candidate", t.number)): t for t in done}
    record = kind_record((t.user_attrs["kind"], t.user_attrs[SCORES],
                          by_number[t.user_attrs[LEADER]].user_attrs[SCORES])
                         for t in done if t.user_attrs.get(LEADER) in by_number)
    # The extras asked before this one (finished or not; by candidate number, so a rerun counts once).
    earlier = {int(t.user_attrs["candidate"]): t for t in trials
               if LEADER in t.user_attrs and int(t.user_attrs.get("candidate", number)) < number}
    complete = [t for t in done if t.state == TrialState.COMPLETE]
    rng = random.Random(f"flowopt-kind:{ctx.seed}:{number}")
    available = space.extra_kinds() if complete else [k for k in space.extra_kinds() if k in ("bootstrap", "subset")]
    kind = next_kind(rng, available, record, {t.user_attrs["kind"] for t in earlier.values()})
    attrs: dict[str, Any] = {"candidate": number, "kind": kind}
    params: dict[str, Any] = {}
    if complete:
        leader = max(complete, key=lambda t: (t.value, -int(t.user_attrs.get("candidate", t.number))))
        attrs[LEADER] = int(leader.user_attrs.get("candidate", leader.number))
        params = dict(leader.params)
        if kind in ("instruction", "settings"):  # the leader's demos, one other instruction or setting
            attrs.update({k: leader.user_attrs[k] for k in ("demos", "demo_sets") if k in leader.user_attrs})
            tried = [dict(t.params) for t in earlier.values()
                     if t.user_attrs[LEADER] == attrs[LEADER] and t.user_attrs["kind"] == kind]
            params.update(space.change_one(kind, params, rng, tried))
        else:  # new demos: the leader's instructions and settings
            params = {**leader_params(params, "instruction"), **leader_params(params, "settings")}
    if kind == "bootstrap":
        attrs["demo_sets"] = bootstrap(number)
    elif kind == "subset":
        study.sampler = candidate_sampler(sampler, ctx.seed, number, n_candidates)
    study.enqueue_trial(params, user_attrs=attrs)
