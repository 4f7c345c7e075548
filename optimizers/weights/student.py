"""Find the student model of a program, and bind a trained adapter to a program.

After a weights stage every predictor of the program runs on the student ``LocalLM`` with the trained
adapter, through an :class:`~flowopt.lm.pinned.AdapterLM` bound to that adapter. For a
:class:`flowopt.Workflow` that is written in the IR: ``lms["student"]`` (the LocalLM's spec, which
names the adapter folder), every node's ``lm`` set to ``"student"``, and
``weights["student"] = {"base", "adapter", "sha256"}`` with the adapter path relative to the compile
run folder. Other ``dspy.Module`` programs get the LM on each predictor, as DSPy's own optimizers do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dspy

STUDENT = "student"


def program_lms(program: dspy.Module) -> list[Any]:
    """Every LM the program's predictors would use (own LM, then the Workflow node's LM)."""
    from flowopt.workflow import Workflow

    lms = [p.lm for _, p in program.named_predictors() if getattr(p, "lm", None) is not None]
    if isinstance(program, Workflow):
        for node_id in program.nodes:
            lm = program.lm_for(node_id)
            if lm is not None:
                lms.append(lm)
    return lms


def find_local(program: dspy.Module) -> tuple[Any, str | None]:
    """The ``LocalLM`` behind the program's predictors and the adapter they run with; failing that, the
    configured LM (``dspy.configure(lm=...)`` / ``dspy.context``) when it is local, since predictors
    that name no LM run on it: the stage then trains the very model (and its settings: token limit,
    batch size) the program runs on, instead of loading a second copy with default settings.
    ``(None, None)`` when neither is local."""
    from flowopt.lm import local_of

    configured = [dspy.settings.lm] if dspy.settings.lm is not None else []
    for lm in [*program_lms(program), *configured]:
        local = local_of(lm)
        if local is not None:
            adapter = getattr(getattr(lm, "engine", None), "adapter", None)  # an AdapterLM names its own
            # ``...`` (or no engine attribute): the LocalLM's model-wide adapter state.
            return local, adapter if isinstance(adapter, str) else local.active_adapter
    return None, None


def attach(program: dspy.Module, local: Any, adapter: str, *, adapter_dir: Path, sha256: str,
           run_root: Path | None) -> dspy.Module:
    """Make every predictor of ``program`` (changed in place and returned) use ``local`` with ``adapter``."""
    from flowopt.lm.pinned import AdapterLM
    from flowopt.workflow import Workflow

    lm = AdapterLM(local, adapter, path=adapter_dir, sha256=sha256)
    if isinstance(program, Workflow):
        program.lms[STUDENT] = lm
        for node_id in program.nodes:
            program.node_lms[node_id] = STUDENT
        for _, predictor in program.named_predictors():
            predictor.lm = None  # the node's LM applies; a predictor's own LM would override it
        program.weights[STUDENT] = {"base": local.name, "adapter": _relative(adapter_dir, run_root),
                                    "sha256": sha256}
    else:
        for _, predictor in program.named_predictors():
            predictor.lm = lm
    return program


def _relative(path: Path, root: Path | None) -> str:
    if root is None:
        return str(path.resolve())
    try:
        return Path(os.path.relpath(path.resolve(), root.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        return str(path.resolve())
