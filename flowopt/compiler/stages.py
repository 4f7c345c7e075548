"""The stage registry: names used in ``compile(stages=[...])`` mapped to :class:`Stage` classes.

Built-in stages (``labeled``, ``demos``, ``search``, ``structure``, ``finetune``, ``grpo``) and
third-party ones are found through the ``flowopt.stages`` entry-point group, so the core never
imports a higher layer; :func:`register_stage` adds a user's own class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from flowopt.compiler.stage import Stage
from flowopt.errors import ConfigError
from flowopt.plugins import Registry

StageT = TypeVar("StageT", bound=type[Stage])

#: ``search`` alone: its candidates already hold DSPy's (zero-shot, labeled, the unshuffled bootstrap that
#: ``demos`` would return, shuffled bootstraps), so a ``demos`` stage before it repeats work (measured in
#: benchmarks/results/search_generalisation.md: 0.55x BootstrapFewShotWithRandomSearch's LM calls for
#: search alone, 0.63x for demos + search, at the same held-out score).
DEFAULT_STAGES = ("search",)


def _stage_name(cls: object) -> str:
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ConfigError(f"{cls!r} is not a Stage subclass", fix="subclass flowopt.compiler.Stage")
    if not cls.name:
        raise ConfigError(f"stage class {cls.__name__} has no name", fix='set name: ClassVar[str] = "mystage"')
    return cls.name


STAGES: Registry[type[Stage]] = Registry("stage", "flowopt.stages", _stage_name,
                                         how_to_add="register yours with flowopt.register_stage")


def register_stage(cls: StageT) -> StageT:
    """Register a stage class under its ``name``. Usable as a decorator.

    Example:
        >>> from dataclasses import dataclass
        >>> from typing import ClassVar
        >>> from flowopt.compiler import Stage, get_stage, register_stage
        >>> @register_stage
        ... @dataclass(frozen=True)
        ... class Noop(Stage):
        ...     name: ClassVar[str] = "noop"
        ...     def run(self, program, ctx):
        ...         return program
        >>> get_stage("noop") is Noop
        True
    """
    STAGES.register(cls)
    return cls


def get_stage(name: str) -> type[Stage]:
    """The stage class registered as ``name``; raises :class:`ConfigError` listing the known names."""
    return STAGES.get(name)


def stage_names() -> list[str]:
    """Every registered or declared stage name, sorted."""
    return sorted(STAGES.names())


StageSpec = Stage | str | tuple[str, Mapping[str, Any]]


def resolve_stages(stages: Sequence[StageSpec] | None) -> list[Stage]:
    """Turn names, ``(name, settings)`` pairs and stage objects into stage objects (default: search)."""
    if stages is None:
        stages = DEFAULT_STAGES
    if isinstance(stages, str | Stage):
        stages = [stages]
    out: list[Stage] = []
    for spec in stages:
        if isinstance(spec, Stage):
            out.append(spec)
        elif isinstance(spec, str):
            out.append(_build(get_stage(spec), {}, spec))
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
            out.append(_build(get_stage(spec[0]), dict(spec[1]), spec[0]))
        elif isinstance(spec, type) and issubclass(spec, Stage):
            out.append(_build(spec, {}, spec.name))
        else:
            raise ConfigError(f"cannot use {spec!r} as a stage",
                              fix='pass a name ("demos"), a (name, settings) pair or a Stage object')
    if not out:
        raise ConfigError("the stage list is empty", fix='pass stages=["search"] or leave it out')
    return out


def _build(cls: type[Stage], settings: dict[str, Any], name: str) -> Stage:
    try:
        return cls(**settings)
    except TypeError as err:
        raise ConfigError(f"bad settings for stage {name!r}: {err}",
                          fix=f"check the settings against {cls.__name__}'s fields") from err
