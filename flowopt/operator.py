"""The base class of every graph node: a ``dspy.Module`` that declares its typed signature.

An operator's whole state is three pieces of data: its :class:`SignatureSpec`, its settings
(:meth:`Operator.config`, JSON values only) and the state of its DSPy predictors (instructions,
field prefixes, demos). That is what the workflow JSON stores, so a node is rebuilt from a file by
calling the class with its settings and loading the predictor state: no code is ever deserialised.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any, ClassVar

import dspy

from flowopt.errors import ConfigError, WorkflowError
from flowopt.signature import SignatureSpec, default_instructions


class Operator(dspy.Module):
    """Base class for workflow nodes.

    Subclasses set ``op_name`` (the registry name), build their predictors in ``__init__``, implement
    ``forward(**inputs) -> dspy.Prediction`` with the declared output fields, and return their
    settings from :meth:`config` so that ``type(op)(op.spec, **op.config())`` rebuilds them.

    Example:
        >>> import dspy
        >>> from flowopt import Operator, register_operator
        >>> @register_operator
        ... class Shout(Operator):
        ...     op_name = "Shout"
        ...     def __init__(self, signature="text -> loud"):
        ...         super().__init__(signature)
        ...     def forward(self, text):
        ...         return dspy.Prediction(loud=text.upper())
        >>> Shout()(text="hi").loud
        'HI'
    """

    op_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _remember_built_signatures(cls.__dict__["__init__"])  # type: ignore[method-assign]

    def __init__(self, signature: str | type[dspy.Signature] | SignatureSpec,
                 instructions: str | None = None) -> None:
        super().__init__()
        self._spec = SignatureSpec.parse(signature, instructions)

    # -- declared interface -------------------------------------------------------------------
    @property
    def spec(self) -> SignatureSpec:
        """The node's typed signature, with the main predictor's current instructions.

        Optimizers rewrite a predictor's instructions in place; reading them back here keeps the
        exported JSON in step. DSPy's generated default text is stored as "" (no instructions).
        """
        main = self.main_predictor()
        if main is None:
            return self._spec
        instructions = main.signature.instructions
        if instructions == default_instructions(self._spec):
            instructions = ""
        return SignatureSpec(instructions, self._spec.inputs, self._spec.outputs)

    def config(self) -> dict[str, Any]:
        """JSON-serialisable settings; ``type(self)(self.spec, **self.config())`` rebuilds the node."""
        return {}

    async def aforward(self, **inputs: Any) -> dspy.Prediction:
        """``await op.acall(...)``: by default ``forward`` in a worker thread (with the caller's
        ``dspy.context``), so every operator runs under asyncio; operators whose work is LM calls
        override it with their predictors' ``acall``."""
        return await asyncio.to_thread(self.forward, **inputs)

    def main_predictor(self) -> dspy.Predict | None:
        """The predictor whose instructions are the node's instructions (first one by default)."""
        predictors = self.named_predictors()
        return predictors[0][1] if predictors else None

    # -- state as data ------------------------------------------------------------------------
    def predictor_state(self) -> dict[str, dict[str, Any]]:
        """Demos of every predictor, plus its signature state (instructions, field prefixes and
        descriptions) where an optimizer changed it from what the operator builds, as JSON data."""
        # An operator whose predictors still hold the signatures it was built with matches a fresh build
        # by construction; only one that an optimizer changed is compared with a fresh build (cached
        # per class, spec and settings), so serialising does not rebuild operators.
        built: dict[str, Any] = self.__dict__.get("_built_signatures", {})
        predictors = self.named_predictors()
        unchanged = bool(built) and all(built.get(name) is p.signature for name, p in predictors)
        # A class is hashable; mypy reads dspy.Module's instance-level __hash__ and thinks otherwise.
        fresh = {} if unchanged else _fresh_signature_states(type(self), self.spec,  # type: ignore[arg-type]
                                                             json.dumps(self.config(), sort_keys=True))
        state: dict[str, dict[str, Any]] = {}
        for name, predictor in predictors:
            entry: dict[str, Any] = {"demos": [_demo_to_json(d, name) for d in predictor.demos]}
            if not unchanged:
                signature = predictor.signature.dump_state()
                if fresh.get(name) != signature:
                    entry["signature"] = signature
            state[name] = entry
        return state

    def load_predictor_state(self, state: dict[str, dict[str, Any]], *, node: str | None = None) -> None:
        predictors = dict(self.named_predictors())
        for name, saved in state.items():
            if name not in predictors:
                raise WorkflowError(
                    f"saved state names predictor '{name}', which {type(self).__name__} does not have "
                    f"(it has {sorted(predictors)})", node=node,
                    fix="remove that entry from 'predictors' or fix the node's 'op'/'config'",
                )
            predictor = predictors[name]
            try:
                if "signature" in saved:
                    predictor.signature = predictor.signature.load_state(saved["signature"])
            except (KeyError, TypeError) as err:
                raise WorkflowError(f"predictor '{name}' has a malformed 'signature' state ({err})",
                                    node=node, fix="re-export the workflow with flowopt") from err
            predictor.demos = [dspy.Example(**d) for d in saved.get("demos", [])]

    @classmethod
    def from_config(cls, spec: SignatureSpec, config: dict[str, Any], *, node: str | None = None
                    ) -> Operator:
        try:
            return cls(spec, **config)
        except ConfigError as err:  # a setting of the wrong type or out of bounds: say which node
            raise ConfigError(f"node '{node}': {err.problem}", fix=err.fix) from err
        except (TypeError, ValueError) as err:  # an unknown setting name, or a check the operator does itself
            raise WorkflowError(f"bad settings for {cls.op_name or cls.__name__}: {err}", node=node,
                                fix="check the node's 'config' against the operator's parameters") from err


@functools.lru_cache(maxsize=512)
def _fresh_signature_states(cls: type[Operator], spec: SignatureSpec, config_json: str) -> dict[str, Any]:
    """``{predictor: signature state}`` of a freshly built operator (what an unoptimised node holds)."""
    return {name: p.signature.dump_state()
            for name, p in cls.from_config(spec, json.loads(config_json)).named_predictors()}


def _remember_built_signatures(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an operator's ``__init__`` so that, once the outermost one returns, the operator keeps the
    signature class each predictor was built with (what :meth:`Operator.predictor_state` compares to)."""

    @functools.wraps(init)
    def wrapped(self: Operator, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get("_init_depth", 0)
        self.__dict__["_init_depth"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__["_init_depth"] = depth
        if depth == 0:
            del self.__dict__["_init_depth"]
            self.__dict__["_built_signatures"] = {name: p.signature for name, p in self.named_predictors()}

    return wrapped


def _demo_to_json(demo: Any, predictor: str) -> dict[str, Any]:
    data = demo.toDict() if hasattr(demo, "toDict") else dict(demo)
    try:
        json.dumps(data)
    except TypeError as err:
        raise WorkflowError(
            f"a demo of predictor '{predictor}' holds a value JSON cannot store ({err})",
            fix="keep demo fields to str/int/float/bool/list/dict values",
        ) from err
    return data
