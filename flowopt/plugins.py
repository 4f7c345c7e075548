"""One registry for every extension point found by name: operators, tools, stages, pruners.

A :class:`Registry` maps names to plugins of one kind. A plugin gets there two ways: registered in process
(``register_operator(MyOp)``), or declared by an installed package under the registry's entry-point group
(``[project.entry-points."flowopt.stages"]``), loaded the first time its name is asked for, so the core
never imports a higher layer and a name nobody asks for costs no import. An unknown name is a flowopt error
naming it, the known names and how to add one.

Example:
    >>> from flowopt.plugins import Registry
    >>> def colour_name(item: object) -> str:
    ...     return str(item)
    >>> colours = Registry("colour", "example.colours", colour_name, how_to_add="register yours")
    >>> colours.register("red")
    'red'
    >>> colours.get("red"), colours.names()
    ('red', ['red'])
    >>> colours.get("blue")
    Traceback (most recent call last):
    flowopt.errors.ConfigError: unknown colour 'blue'. Fix: use one of ['red'] or register yours
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from flowopt.errors import ConfigError, FlowoptError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Plugins of one ``kind`` by name, from :meth:`register` and the entry-point ``group``.

    ``name_of`` checks that an object is a plugin of this kind (raising :class:`ConfigError` naming what
    is wrong when it is not) and returns the name it registers under; ``how_to_add`` ends the fix of an
    unknown name (``"register yours with flowopt.register_stage"``). Registering a different object under
    a taken name replaces it, with a warning unless it is the same class defined again (a reloaded module).
    :meth:`names` lists registered names in registration order, then declared ones not yet loaded.

    Example:
        >>> stages = Registry("stage", "flowopt.stages", lambda cls: cls.name, how_to_add="register it")
        >>> "search" in stages.names()  # declared by this package's entry points, not yet imported
        True
    """

    def __init__(self, kind: str, group: str, name_of: Callable[[object], str], *, how_to_add: str) -> None:
        self.kind = kind
        self.group = group
        self.how_to_add = how_to_add
        self._name_of = name_of
        self._items: dict[str, T] = {}
        self._lock = threading.Lock()
        self._entry_points: dict[str, EntryPoint] | None = None

    def register(self, item: T) -> T:
        """Add ``item`` under the name ``name_of`` gives it; returns ``item`` (usable as a decorator)."""
        name = self._name_of(item)
        self._store(name, item)
        return item

    def _store(self, name: str, item: T) -> None:
        with self._lock:
            existing = self._items.get(name)
            if existing is not None and existing is not item and not _same_definition(existing, item):
                logger.warning("%s %r re-registered: %s replaces %s", self.kind, name, item, existing)
            self._items[name] = item

    def get(self, name: str, *, error: Callable[..., FlowoptError] = ConfigError) -> T:
        """The plugin registered or declared as ``name``.

        An unknown name raises ``error(problem, fix=...)`` (a :class:`ConfigError` unless the caller names
        a more specific one); a declared one that cannot be imported, or is not of this kind, raises
        :class:`ConfigError` naming the entry point.
        """
        with self._lock:
            item = self._items.get(name)
        if item is not None:
            return item
        declared = self._declared().get(name)
        if declared is None:
            raise error(f"unknown {self.kind} {name!r}", fix=f"use one of {self.names()} or {self.how_to_add}")
        return self._load(name, declared)

    def names(self) -> list[str]:
        """Every registered name (in registration order), then every declared one not yet loaded (sorted)."""
        with self._lock:
            registered = list(self._items)
        return registered + sorted(set(self._declared()) - set(registered))

    def _declared(self) -> dict[str, EntryPoint]:
        # Read once: scanning the installed packages' metadata takes milliseconds, and names are looked up often.
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in entry_points(group=self.group)}
        return self._entry_points

    def _load(self, name: str, declared: EntryPoint) -> T:
        try:
            item = declared.load()  # importing the module may register the plugin itself (a decorator)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{self.kind} {name!r} is declared ({declared.value}) but cannot be loaded: {err}",
                              fix=f"install the package that provides it, or pick another {self.kind}") from err
        try:
            own_name = self._name_of(item)
        except ConfigError as err:
            raise ConfigError(f"entry point {declared.value} for {self.kind} {name!r}: {err.problem}",
                              fix=err.fix) from None
        with self._lock:
            self._items.setdefault(own_name, item)
            # The entry point's name finds the plugin too, should it register under another name.
            return self._items.setdefault(name, item)


def _same_definition(old: object, new: object) -> bool:
    """Whether ``new`` is ``old`` defined again (the same class from a re-imported module) or equal to it."""
    if isinstance(old, type) and isinstance(new, type):
        return (old.__module__, old.__qualname__) == (new.__module__, new.__qualname__)
    return old == new
