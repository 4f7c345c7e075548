"""A Workflow saved and loaded with DSPy's calls as well as flowopt's: which file is which format.

``wf.save(path)`` writes flowopt's document (``flowopt.workflow/v1``); ``wf.save(dir, save_program=True)``
writes a program folder that both ``flowopt.load(dir)`` and ``dspy.load(dir, allow_pickle=True)`` read:

- ``program.json``: flowopt's document (structure, instructions, demos, settings), read without pickle;
- ``program.pkl``: for ``dspy.load``, a pickle holding no code, only a call to
  :func:`flowopt.workflow.workflow_from_program_json` with that same document;
- ``metadata.json``: DSPy's dependency versions, which ``dspy.load`` checks.

``wf.load(path)`` reads flowopt's document or DSPy's state format (``dspy.Module.save(wf, "x.json")``)
and returns which one it read.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from flowopt.errors import SchemaError, WorkflowError
from flowopt.ir import workflow_from_dict
from flowopt.lm_spec import refuse_loaded_endpoints
from flowopt.workflow_graph import WorkflowGraph

if TYPE_CHECKING:
    from flowopt.workflow import Workflow

WorkflowT = TypeVar("WorkflowT", bound=WorkflowGraph)

logger = logging.getLogger(__name__)

FLOWOPT_DOCUMENT = "flowopt.workflow/v1"
DSPY_STATE = "dspy.state"
PROGRAM_JSON, PROGRAM_PICKLE, METADATA_JSON = "program.json", "program.pkl", "metadata.json"


def save_workflow(wf: Workflow, path: str | Path, *, save_program: bool = False,
                  modules_to_serialize: Iterable[Any] | None = None) -> Path:
    """Save as ``dspy.Module.save`` does: a file, or with ``save_program=True`` a program folder.

    ``.pkl`` paths get DSPy's pickled state (what ``dspy.Module.save`` writes there); every other
    file gets flowopt's JSON document. ``modules_to_serialize`` is accepted for DSPy's signature and
    has nothing to do: the program pickle holds no code, operators are found by their registered name.
    """
    from dspy.utils.saving import get_dependency_versions

    from flowopt.io import atomic_write_bytes, atomic_write_json, atomic_write_text

    target = Path(path)
    if not save_program:
        if target.suffix == ".pkl":
            import dspy

            dspy.Module.save(wf, str(target))
            return target
        return atomic_write_text(target, wf.to_json() + "\n")
    if target.suffix:
        raise WorkflowError(f"save_program=True writes a folder, but {target} has a file suffix",
                            fix=f"pass a folder path such as {target.with_suffix('')}")
    if target.exists() and not target.is_dir():
        raise WorkflowError(f"{target} exists and is a file, not a folder",
                            fix="pass a new folder path, or remove that file")
    if modules_to_serialize:
        logger.info("save_program: modules_to_serialize is not needed, the program pickle holds no code")
    document = wf.to_json()
    atomic_write_text(target / PROGRAM_JSON, document + "\n")
    atomic_write_bytes(target / PROGRAM_PICKLE, pickle.dumps(wf))  # Workflow.__reduce__: the document only
    atomic_write_json(target / METADATA_JSON, {"dependency_versions": get_dependency_versions(),
                                               "flowopt_document": PROGRAM_JSON})
    return target


def load_into(wf: Workflow, path: str | Path, *, allow_pickle: bool = False,
              allow_unsafe_lm_state: bool = False) -> str:
    """Load ``path`` into ``wf`` in place; returns the format read (``"flowopt.workflow/v1"`` or ``"dspy.state"``).

    A flowopt document (a file, or a program folder's ``program.json``) replaces the whole program:
    nodes, wiring, instructions and demos; LMs already bound on ``wf`` stay bound by name. DSPy's state
    format loads the predictors' state into the nodes ``wf`` already has, as ``dspy.Module.load`` does.
    """
    import dspy

    from flowopt.validate import read_document

    source = Path(path)
    if source.is_dir():
        source = source / PROGRAM_JSON
    if not source.is_file():
        raise SchemaError(f"no saved program at {path}",
                          fix="check the path, or save one with wf.save(path) or wf.save(folder, save_program=True)")
    if source.suffix == ".pkl":
        dspy.Module.load(wf, str(source), allow_pickle=allow_pickle, allow_unsafe_lm_state=allow_unsafe_lm_state)
        return _loaded(source, DSPY_STATE)
    document = read_document(source)
    if isinstance(document, dict) and isinstance(document.get("metadata"), dict) and "schema" not in document:
        _check_state_names(wf, document, source)
        dspy.Module.load(wf, str(source), allow_pickle=allow_pickle, allow_unsafe_lm_state=allow_unsafe_lm_state)
        return _loaded(source, DSPY_STATE)
    loaded = document_workflow(document, type(wf), source=str(source))
    bound = {name: lm for name, lm in wf.lms.items() if not isinstance(lm, dict) and name in loaded.lms}
    loaded.lms.update(bound)
    wf.__dict__.clear()
    wf.__dict__.update(loaded.__dict__)
    return _loaded(source, FLOWOPT_DOCUMENT)


def document_workflow(document: Any, cls: type[WorkflowT], *, source: str) -> WorkflowT:
    """A workflow of class ``cls`` from a loaded flowopt document, refusing LM endpoints the file chose
    (as :func:`flowopt.load` does); ``source`` names the file in that error."""
    wf = workflow_from_dict(document, cls)
    refuse_loaded_endpoints(wf.lms, source=source)
    return wf


def _check_state_names(wf: Workflow, state: dict[str, Any], source: Path) -> None:
    """DSPy's state is keyed by predictor name; say which node is missing rather than raise KeyError."""
    names = {name for name, _ in wf.named_parameters()}
    missing = sorted(names - set(state))
    extra = sorted(set(state) - names - {"metadata"})
    if missing or extra:
        what = f"no entry for {missing[0]!r}" if missing else f"an entry for {extra[0]!r}, which this workflow lacks"
        raise WorkflowError(f"{source} is DSPy state saved from another program: it has {what}",
                            fix="load it into a workflow with the same nodes, or save with wf.save(path), "
                                "which keeps the structure too")


def _loaded(source: Path, fmt: str) -> str:
    logger.info("loaded %s as %s", source, fmt)
    return fmt
