"""Programs as data, and the layout of a compile run folder.

A stage's output is saved as data only: a ``Workflow`` as its workflow JSON, any other
``dspy.Module`` as DSPy's JSON state (demos, signatures), predictor settings and a description of each
predictor's LM (model and plain settings, never keys). Loading reuses the compiled program's LM client
where the description matches and builds the described LM where a stage changed it (e.g. a weights
stage's student LM with its adapter).

Run folder layout::

    run_dir/
      compile.json           what is being compiled (fingerprint, stage list) and the baseline row
      stages/00-demos/       the stage's own folder (its checkpoints; search.db for the search)
        output.json          written when the stage finished: its program (kept or not) and report row
      report.json            the report so far
      program.json           the best program (workflow JSON with meta["report"], or module state)
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from flowopt.compiler.integrity import read_sealed, seal
from flowopt.errors import ConfigError, FlowoptError
from flowopt.io import atomic_write_json
from flowopt.lm_spec import LoadedLMSpec, lm_from_spec, lm_to_spec, refuse_loaded_endpoints
from flowopt.workflow import Workflow

logger = logging.getLogger(__name__)

RUN_SCHEMA = "flowopt.compile-run/v1"


def _is_workflow(program: Any) -> bool:
    return hasattr(program, "canonical_json") and hasattr(program, "to_dict") and hasattr(program, "lms")


def _lm_objects(program: Any) -> list[Any]:
    lms = [p.lm for _, p in program.named_predictors() if getattr(p, "lm", None) is not None]
    if _is_workflow(program):
        lms.extend(v for v in program.lms.values() if not isinstance(v, dict))
    return lms


def clone_program(program: Any) -> Any:
    """A deep copy whose LM clients are shared with the original (they hold connections and caches)."""
    memo: dict[int, Any] = {id(lm): lm for lm in _lm_objects(program)}
    # DSPy appends every LM call to each calling module's ``history``: copying it would be slow and
    # would make copies look busier than they are. Each copy starts with empty histories.
    modules = [program, *(m for _, m in program.named_sub_modules())]
    for module in modules:
        history = module.__dict__.get("history")
        if isinstance(history, list):
            memo[id(history)] = []
    return copy.deepcopy(program, memo)


def program_to_data(program: Any) -> dict[str, Any]:
    if _is_workflow(program):
        return {"kind": "workflow", "workflow": program.to_dict()}
    state = program.dump_state(json_mode=True)
    for entry in state.values():
        if isinstance(entry, dict):
            entry.pop("lm", None)
    configs, lms = {}, {}
    for name, predictor in program.named_predictors():
        config = {k: v for k, v in dict(getattr(predictor, "config", {}) or {}).items() if _is_json(v)}
        configs[name] = config
        lm = getattr(predictor, "lm", None)
        if lm is not None:
            try:
                lms[name] = lm_to_spec(lm)
            except FlowoptError as err:  # e.g. a LocalLM over an in-memory model: nothing on disk to name
                logger.warning("predictor %r: its LM cannot be described (%s); a resumed run will use the "
                               "compiled program's LM for it", name, err)
    return {"kind": "module", "class": f"{type(program).__module__}.{type(program).__qualname__}",
            "state": state, "configs": configs, "lms": lms}


def program_from_data(data: dict[str, Any], base: Any) -> Any:
    """Rebuild a program saved by :func:`program_to_data`, taking LM clients from ``base``."""
    if data.get("kind") == "workflow":
        wf = Workflow.from_dict(data["workflow"])
        if _is_workflow(base):
            for name, lm in base.lms.items():
                if name in wf.lms:
                    wf.lms[name] = _bind_base_lm(wf.lms[name], lm, wf.weights.get(name))
        # Entries the caller did not bind come from the run folder, which may be shared or edited.
        refuse_loaded_endpoints(wf.lms, source="a checkpoint in the run folder")
        return wf
    program = clone_program(base)
    lms = {name: p.lm for name, p in program.named_predictors()}
    state = {k: (dict(v, lm=None) if isinstance(v, dict) else v) for k, v in data["state"].items()}
    program.load_state(state)
    saved_lms = data.get("lms", {})
    for name, predictor in program.named_predictors():
        predictor.lm = _restore_lm(saved_lms.get(name), lms.get(name), name=name)
        predictor.config = dict(data.get("configs", {}).get(name, predictor.config))
    return program


def _bind_base_lm(saved: Any, base_lm: Any, weights: Any) -> Any:
    """The LM a saved workflow's ``lms`` entry runs on when the caller's program binds ``base_lm`` to it
    (an entry a weights stage wrote runs on the caller's local model with its adapter: see
    :func:`flowopt.lm.pinned.bind_saved_adapter`)."""
    if not isinstance(saved, dict) or not saved.get("adapter"):
        return base_lm  # no adapter: the caller's LM wins, and no local runtime is needed to say so
    from flowopt.lm.pinned import bind_saved_adapter  # imports torch: only for a saved adapter

    return bind_saved_adapter(saved, base_lm, weights)


def _restore_lm(spec: dict[str, Any] | None, base_lm: Any, *, name: str) -> Any:
    """The LM a saved predictor ran with: ``base_lm`` when it is the one described (it keeps its client,
    keys and cache), else a new LM built from the description."""
    if spec is None:
        return base_lm
    if base_lm is not None:
        try:
            if lm_to_spec(base_lm) == spec:
                return base_lm
        except FlowoptError:
            pass  # the base LM cannot be described, so it is not the saved one
    # Read from the run folder, which may be shared or edited: it may not choose an endpoint.
    return lm_from_spec(LoadedLMSpec(spec), name=f"predictor {name!r} (checkpoint)")


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def saved_output(run_dir: str | Path, index: int, name: str, base: Any) -> Any | None:
    """The program stage ``index`` (``name``) of the run in ``run_dir`` returned, kept or not, rebuilt with
    ``base``'s LM clients; ``None`` if the stage has not returned yet or returned no program (a stage the
    budget stopped is read too: what it made before the budget ran out).

    ``compile`` returns only the best program; this is how a caller scores what a rejected stage made
    (``flowopt bench`` reports every stage's own test score).

    Example:
        >>> saved_output("runs/demo", 0, "search", program)  # doctest: +SKIP
    """
    path = _output_path(Path(run_dir), index, name)
    if not path.exists():
        return None
    data = read_sealed(path)
    return None if data.get("program") is None else program_from_data(data["program"], base)


def _stage_path(run_dir: Path, index: int, name: str) -> Path:
    return run_dir / "stages" / f"{index:02d}-{name}"


def _output_path(run_dir: Path, index: int, name: str) -> Path:
    return _stage_path(run_dir, index, name) / "output.json"


class RunFolder:
    """Reads and writes one compile run folder (atomic writes only).

    ``writer=False`` (a launched process other than rank 0) only reads: rank 0 writes for every process.
    """

    def __init__(self, path: str | Path, *, resume: bool, fingerprint: dict[str, Any], writer: bool = True) -> None:
        self.path = Path(path)
        self.resume = resume
        self.fingerprint = fingerprint
        self.writer = writer
        self.manifest_path = self.path / "compile.json"
        self.manifest: dict[str, Any] = {}
        if self.manifest_path.exists() and (resume or writer):  # rank 0 may have written it in this very run
            if not resume:
                raise ConfigError(f"run_dir {self.path} already holds a compile run",
                                  fix="pass resume=True to continue it, or use a new (or emptied) run_dir")
            existing = read_sealed(self.manifest_path)
            if existing.get("fingerprint") != fingerprint:
                diff = sorted(k for k in fingerprint if existing.get("fingerprint", {}).get(k) != fingerprint[k])
                raise ConfigError(
                    f"run_dir {self.path} holds a run of a different compile (differs in: {', '.join(diff)})",
                    fix="resume with the same program, data, metric name, stages and seed, or use a new run_dir")
            self.manifest = existing
        else:
            self.manifest = {"schema": RUN_SCHEMA, "fingerprint": fingerprint}

    def stage_dir(self, index: int, name: str) -> Path:
        path = _stage_path(self.path, index, name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_manifest(self) -> None:
        if not self.writer:
            return
        atomic_write_json(self.manifest_path, seal(self.manifest))

    def baseline(self) -> dict[str, Any] | None:
        return self.manifest.get("baseline") if self.resume else None

    def save_baseline(self, row: dict[str, Any]) -> None:
        self.manifest["baseline"] = row
        self.write_manifest()

    def finished(self, index: int, name: str) -> dict[str, Any] | None:
        if not self.resume:
            return None
        path = _output_path(self.path, index, name)
        if not path.exists():
            return None
        data = read_sealed(path)
        return data if data.get("finished", True) else None  # a stage the budget stopped runs again

    def save_finished(self, index: int, name: str, program: Any | None, row: dict[str, Any], *,
                      finished: bool = True) -> None:
        """The stage's row and program; ``finished=False`` (the budget stopped it): readable by
        :func:`saved_output`, but :meth:`finished` says the stage still has to run."""
        if not self.writer:
            return
        data = {"row": row, "program": None if program is None else program_to_data(program),
                "finished": finished}
        self.stage_dir(index, name)  # made if the stage wrote nothing of its own
        atomic_write_json(_output_path(self.path, index, name), seal(data))

    def save_report(self, report: dict[str, Any]) -> None:
        if not self.writer:
            return
        atomic_write_json(self.path / "report.json", report)

    def save_program(self, program: Any) -> Path:
        path = self.path / "program.json"
        if not self.writer:
            return path
        if _is_workflow(program):
            program.save(path)
        else:
            atomic_write_json(path, program_to_data(program))
        return path
