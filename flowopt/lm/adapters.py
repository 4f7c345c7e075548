"""LoRA adapters of a LocalLM: attach, pin, disable, unload, save, and the state calls run with.

Two states are kept apart:

- the **default** (:attr:`AdapterSet.active_adapter`): the weights an unpinned call (``local.lm``,
  ``complete_ids`` without ``adapter=``) runs with. It is the base model until a user loads an adapter
  with ``activate=True`` or calls :meth:`AdapterSet.set_adapter`; weights stages attach theirs with
  ``activate=False``, so compiling never changes what the caller's program runs with;
- the **selected** adapter: what a direct forward pass on ``model`` computes with (training code picks it
  with :meth:`AdapterSet.select_adapter`). Pinned calls switch to their weights under the lock and switch
  back to the selection afterwards (:meth:`AdapterSet.using_adapter`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError, LMError
from flowopt.io import space_errors
from flowopt.lm.loading import dir_fingerprint


class AdapterSet:
    """LocalLM's adapter side (see the module docstring for the default and the selected adapter)."""

    _model: Any
    lock: threading.RLock
    _fingerprint: str
    quantize: str | None

    def _init_adapters(self) -> None:
        self._adapters: dict[str, dict[str, Any]] = {}  # name -> {"path": str | None, "fingerprint": str}
        self._default: str | None = None
        self._disabled = 0
        self._peft_active: str | None = None  # PEFT's active adapter
        self._layers_on = False  # adapter layers enabled
        # PEFT freezes the base weights when the first adapter goes on and leaves them frozen when the last
        # comes off; these are the ones that were trainable before, thawed again by unload_adapter.
        self._trainable_base: list[Any] = []

    @property
    def adapters(self) -> list[str]:
        """Names of the attached LoRA adapters."""
        return list(self._adapters)

    @property
    def active_adapter(self) -> str | None:
        """The adapter unpinned calls use now (None: the base weights, also inside :meth:`adapter_disabled`)."""
        return self._state()

    def _state(self) -> str | None:
        return None if self._disabled else self._default

    def _selected(self) -> str | None:
        """What a direct forward pass computes with now."""
        return self._peft_active if self._adapters and self._layers_on else None

    def _check_name(self, name: str | None) -> str:
        if name is None or name not in self._adapters:
            raise ConfigError(f"no adapter named {name!r}", fix=f"attached adapters: {self.adapters}")
        return name

    def _apply(self, state: str | None) -> None:
        """Make the model compute with ``state`` (None: base weights); the caller holds the lock."""
        if not self._adapters:
            return
        peft = self._model.base_model
        if state is None:
            if self._layers_on:
                peft.disable_adapter_layers()
                self._layers_on = False
            return
        if state != self._peft_active:
            self._model.set_adapter(state)  # also marks only this adapter's weights trainable
            self._peft_active = state
        if not self._layers_on:
            peft.enable_adapter_layers()
            self._layers_on = True

    @contextlib.contextmanager
    def using_adapter(self, state: Any = ...) -> Iterator[None]:
        """Hold the lock and compute with ``state`` (an adapter's name, None for the base weights, ``...``
        for the default) within the block; the selection is restored after it.

        Example:
            >>> with local.using_adapter(None):  # doctest: +SKIP
            ...     reference = local.token_logprobs(prompt_ids, completion_ids)
        """
        with self.lock:
            state = self._state() if state is ... else state
            if state is not None:
                self._check_name(state)
            before = self._selected()
            self._apply(state)
            try:
                yield
            finally:
                self._apply(before)

    def select_adapter(self, name: str | None) -> None:
        """Make direct forward passes on ``model`` (training) use ``name``; unpinned calls keep their default."""
        with self.lock:
            if name is not None:
                self._check_name(name)
            self._apply(name)

    def set_adapter(self, name: str) -> None:
        """Make ``name`` the adapter unpinned calls use (and select it for direct forward passes)."""
        with self.lock:
            self._default = self._check_name(name)
            self._apply(None if self._disabled else name)

    def load_adapter(self, path: str | os.PathLike[str], name: str | None = None, *, activate: bool = True,
                     trainable: bool = False) -> str:
        """Attach a saved PEFT adapter folder under ``name`` (default: the folder name); returns the name.

        ``activate=True`` makes it the default of unpinned calls (:meth:`set_adapter`).
        """
        from peft import PeftModel

        folder = Path(path).expanduser()
        if not (folder / "adapter_config.json").is_file():
            raise ConfigError(f"no PEFT adapter at {str(path)!r} (adapter_config.json missing)",
                              fix="pass a folder written by save_adapter() or PeftModel.save_pretrained()")
        name = name or folder.resolve().name
        with self.lock:
            if name in self._adapters:
                raise ConfigError(f"an adapter named {name!r} is already attached",
                                  fix="pass another name= or unload_adapter() it first")
            before = self._selected()
            try:
                if not self._adapters:
                    self._trainable_base = self._trainable_parameters()
                    self._model = PeftModel.from_pretrained(self._model, str(folder), adapter_name=name,
                                                            is_trainable=trainable)
                else:
                    self._model.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
            except (OSError, ValueError, RuntimeError, KeyError) as exc:
                raise LMError(f"could not load adapter {folder}: {exc}",
                              fix="check that it was trained for this base model") from exc
            self._adapters[name] = {"path": str(folder.resolve()), "fingerprint": dir_fingerprint(folder)}
            self._after_attach(name, activate, before)
        return name

    def add_adapter(self, name: str = "default", config: Any = None, *, activate: bool = True) -> Any:
        """Attach a fresh, trainable LoRA (``peft.LoraConfig``; default r=8 on all linear layers).

        Returns :attr:`model` (the ``PeftModel``) for the optimizer. With ``activate=True`` it becomes the
        default of unpinned calls and is selected; else select it for training with :meth:`select_adapter`.
        Call :meth:`mark_weights_changed` after updating it so DSPy's cache does not serve earlier results.
        """
        from peft import LoraConfig, get_peft_model

        config = config or LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                      task_type="CAUSAL_LM")
        with self.lock:
            if name in self._adapters:
                raise ConfigError(f"an adapter named {name!r} is already attached", fix="pass another name=")
            before = self._selected()
            if not self._adapters:
                self._trainable_base = self._trainable_parameters()
                self._model = get_peft_model(self._model, config, adapter_name=name)
            else:
                self._model.add_adapter(name, config)
            self._adapters[name] = {"path": None, "fingerprint": uuid.uuid4().hex[:12]}
            self._after_attach(name, activate, before)
            return self._model

    def _trainable_parameters(self) -> list[Any]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def _after_attach(self, name: str, activate: bool, before: str | None) -> None:
        # After attaching, PEFT computes with ``name`` (first adapter) or with its previous active one;
        # set it explicitly so which weights are trainable is known, then restore the selection.
        self._model.set_adapter(name)
        self._peft_active, self._layers_on = name, True
        if activate:
            self._default = name
        target = name if activate else before
        self._apply(None if self._disabled else target)

    def unload_adapter(self, name: str | None = None) -> None:
        """Remove an adapter (default: the default one). If it was the default, the most recently attached
        remaining adapter becomes the default; with none left, the plain transformers model is restored."""
        with self.lock:
            name = self._check_name(name or self._default)
            selected = self._selected()
            del self._adapters[name]
            if not self._adapters:
                self._model = self._model.unload()  # drops the LoRA layers, no merge
                for parameter in self._trainable_base:
                    parameter.requires_grad_(True)
                self._trainable_base = []
                self._default, self._peft_active, self._layers_on = None, None, False
                return
            self._model.delete_adapter(name)
            if self._default == name:
                self._default = list(self._adapters)[-1]
            keep = selected if selected != name else self._state()
            # PEFT picked some remaining adapter: name one explicitly, then restore the selection.
            self._peft_active = keep or list(self._adapters)[-1]
            self._model.set_adapter(self._peft_active)
            self._apply(keep)

    def save_adapter(self, path: str | os.PathLike[str], name: str | None = None) -> Path:
        """Save an adapter (default: the default one) as a PEFT folder at exactly ``path``; returns it.

        The folder is written beside ``path`` and moved into place, so a crash leaves either the old
        folder or the new one, never half of each. Later specs (and :meth:`adapter_path`) name it.
        """
        with self.lock:
            name = self._check_name(name or self._default)
            target = Path(path).expanduser()
            with space_errors(target, self._adapter_bytes(name), folder=True):
                self._save_folder(target, name)
            self._adapters[name]["path"] = str(target.resolve())
            return target

    def _adapter_bytes(self, name: str) -> int:
        """The size of adapter ``name``'s weights: about what its saved folder needs on disk."""
        marker = f".{name}."
        return sum(p.numel() * p.element_size() for key, p in self._model.named_parameters() if marker in key)

    def _save_folder(self, target: Path, name: str) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            self._model.save_pretrained(str(tmp), selected_adapters=[name])
            # PEFT writes non-default adapters into a subfolder named after them.
            saved = tmp if (tmp / "adapter_config.json").is_file() else tmp / name
            old = target.with_name(f".{target.name}.old")
            if target.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(target, old)
            os.replace(saved, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def mark_saved(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        """Record that adapter ``name``'s current weights are on disk at ``path``, written by another
        process holding the same weights (rank 0 of a distributed run saves for every rank)."""
        with self.lock:
            self._adapters[self._check_name(name or self._default)]["path"] = str(Path(path).resolve())

    def adapter_path(self, name: str | None = None) -> Path | None:
        """The folder adapter ``name`` (default: the default one) was loaded from or last saved to; None
        while its weights exist only in memory (fresh, or trained since it was saved)."""
        with self.lock:
            path = self._adapters[self._check_name(name or self._default)]["path"]
            return None if path is None else Path(path)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[Any]:
        """Within the block unpinned calls and direct forward passes on :attr:`model` use the base weights
        (the GRPO reference model). Model-wide, nestable.

        Example:
            >>> with local.adapter_disabled():  # doctest: +SKIP
            ...     ref = local.token_logprobs(prompt_ids, completion_ids)
        """
        with self.lock:
            self._disabled += 1
            before = self._selected()
            self._apply(None)
        try:
            yield self
        finally:
            with self.lock:
                self._disabled -= 1
                self._apply(before)

    def cache_tag(self) -> str:
        """Suffix of the DSPy model string that changes whenever the weights of unpinned calls change.

        DSPy's cache keys on the request (model string included), not on the engine, so two checkpoints
        named alike, or one model before and after an adapter switch, must not share a model string.
        """
        import hashlib

        parts = [self._fingerprint]
        if self.quantize is not None:  # quantized decoding answers differently from the exact weights
            parts.append(f"quantize:{self.quantize}")
        state = self._state()
        if state is not None:
            parts.append(f"{state}:{self._adapters[state]['fingerprint']}")
        if not any(parts):
            return ""
        return "@" + hashlib.sha1("|".join(parts).encode()).hexdigest()[:10]

    def mark_weights_changed(self, adapter: Any = ...) -> None:
        """Tell the LM that ``adapter``'s weights (default: the default adapter's, or the base weights'
        without one) were updated in place, e.g. by an optimizer step, so DSPy's cache stops answering
        with results of the old weights."""
        with self.lock:
            name = self._default if adapter is ... else adapter
            if name is not None:
                entry = self._adapters[self._check_name(name)]
                entry["fingerprint"] = uuid.uuid4().hex[:12]
                entry["path"] = None  # no longer what is on disk
            else:
                self._fingerprint = uuid.uuid4().hex[:12]
