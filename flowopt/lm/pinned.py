"""A ``dspy.LM`` bound to one LoRA adapter of a ``LocalLM``, whatever adapter is active model-wide.

Several adapters live on one LocalLM: after BootstrapFinetune, GRPO attaches and trains its own on
the same LocalLM, while the caller's program keeps using the LocalLM's default weights; if the
compiler then keeps the fine-tuned program (GRPO did not beat it), that program must still run, and be
saved, with the fine-tuned adapter. So each weights stage hands its program an :class:`AdapterLM`: its
calls run with its adapter (LocalLM batches calls per adapter state, so they never mix with others),
its cache key names the adapter's weights, and its workflow-IR entry names the adapter's folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError, FlowoptError, LMError
from flowopt.lm.engine import LocalDSPyLM, LocalEngine
from flowopt.lm.shared import shared_local_lm
from flowopt.lm_spec import lm_to_spec


class PinnedEngine(LocalEngine):
    """``LocalEngine`` whose calls always use ``adapter`` (``LocalLM.complete_ids(adapter=...)``)."""

    def __init__(self, local: Any, adapter: str) -> None:
        super().__init__(local, adapter=adapter)

    def dump_state(self) -> dict[str, Any]:
        spec = self.local.to_spec()
        path = self.local.adapter_path(self.adapter)
        spec["adapter"] = None if path is None else str(path)
        return spec

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> PinnedEngine:
        """Rebuild a saved engine: the process's shared base model with the saved adapter folder attached
        (not made the default; :func:`saved_adapter_lm`)."""
        if not state.get("adapter"):
            raise LMError("a saved pinned LM names no adapter folder (its adapter was never saved)",
                          fix="save the adapter (local.save_adapter) before saving the program")
        base = shared_local_lm({**state, "adapter": None})
        return cls(base, saved_adapter_lm(base, state["adapter"]).adapter)

    def __deepcopy__(self, memo: dict[int, Any]) -> PinnedEngine:
        return self


class AdapterLM(LocalDSPyLM):
    """The student LM of a trained program: ``local`` with adapter ``adapter`` (saved at ``path``).

    A :class:`~flowopt.lm.engine.LocalDSPyLM` whose calls are pinned to the adapter, whose cache tag
    names the adapter's weights (its SHA-256) and whose spec names the adapter's folder.

    Example:
        >>> lm = AdapterLM(local, "finetune", path="run/stages/00-finetune/adapter", sha256="ab12...")  # doctest: +SKIP
        >>> lm.to_spec()["adapter"]  # doctest: +SKIP
        '/abs/run/stages/00-finetune/adapter'
    """

    def __init__(self, local: Any, adapter: str, *, path: str | Path, sha256: str, **kwargs: Any) -> None:
        self.adapter = adapter
        self.adapter_path = str(Path(path).resolve())
        self.sha256 = sha256
        kwargs.setdefault("temperature", local.temperature)
        kwargs.setdefault("max_tokens", local.max_new_tokens)
        super().__init__(local, engine=PinnedEngine(local, adapter), **kwargs)

    @classmethod
    def load_state(cls, state: dict[str, Any], *, allow_custom_lm_class: bool = False) -> AdapterLM:
        """Rebuild a program's saved AdapterLM (``program.load(path, allow_unsafe_lm_state=True)``): DSPy
        rebuilds the engine (:meth:`PinnedEngine.load_state`), the settings are the saved ones, and adapter
        weights other than the saved ones (the ``@<sha256>`` tag of ``model``) raise :class:`LMError`."""
        loaded = LocalDSPyLM.load_state(state, allow_custom_lm_class=allow_custom_lm_class)
        engine = loaded.engine
        path = engine.local.adapter_path(engine.adapter) if isinstance(engine, PinnedEngine) else None
        if path is None:
            raise LMError(f"a saved AdapterLM's engine ({type(engine).__name__}) pins no saved adapter folder",
                          fix="save the program again from its AdapterLM")
        sha256 = adapter_sha256(path)
        saved = str(state.get("model", "")).partition("@")[2]
        if saved and not sha256.startswith(saved):
            raise LMError(f"the adapter at {path} has sha256 {sha256[:12]}, not the {saved} the program recorded",
                          fix="restore the stage's adapter folder, or re-run that stage")
        return cls(engine.local, engine.adapter, path=path, sha256=sha256, model_type=loaded.model_type,
                   cache=loaded.cache, num_retries=loaded.num_retries, **loaded.kwargs)

    def cache_tag(self) -> str:
        # DSPy's cache keys on the model string: name the adapter's weights, not the adapter's name.
        return f"@{self.sha256[:12]}"

    def weights_spec(self) -> dict[str, Any]:
        """The LocalLM's spec with this adapter's folder."""
        local = self._local
        if local.source is None:
            raise ConfigError(f"LocalLM {local.name!r} wraps an in-memory model and cannot be described",
                              fix="save it with save_pretrained(folder) and train LocalLM(folder)")
        try:
            spec = dict(local.to_spec())
        except ConfigError:  # the default adapter exists only in memory: describe the base alone
            spec = {"model": f"local/{local.name}", "source": local.source, "chat": local.chat,
                    "max_new_tokens": local.max_new_tokens, "temperature": local.temperature}
        spec["adapter"] = self.adapter_path
        return spec


def adapter_sha256(folder: str | Path) -> str:
    """sha256 of an adapter folder's weights file (what the IR records to pin the adapter)."""
    digest = hashlib.sha256()
    with open(Path(folder) / "adapter_model.safetensors", "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def saved_adapter_lm(local: Any, folder: str | Path, *, sha256: str | None = None) -> AdapterLM:
    """An :class:`AdapterLM` on ``local`` for the adapter saved in ``folder``: the attached adapter last saved
    there if there is one, else the folder attached now (pinned, not made the default). ``sha256``, when
    given, is what the program recorded; other weights raise :class:`LMError` rather than run unnoticed.

    Example:
        >>> lm = saved_adapter_lm(local, "run/stages/01-grpo/adapter")  # doctest: +SKIP
    """
    path = Path(folder).resolve()
    if not (path / "adapter_model.safetensors").is_file():
        raise LMError(f"no adapter weights at {path} (adapter_model.safetensors missing)",
                      fix="point the program at the adapter folder its weights stage saved, or re-run that stage")
    actual = adapter_sha256(path)
    if sha256 is not None and actual != sha256:
        raise LMError(f"the adapter at {path} has sha256 {actual[:12]}, not the {sha256[:12]} the program recorded",
                      fix="restore the stage's adapter folder, or re-run that stage")
    name = next((n for n in local.adapters if local.adapter_path(n) == path), None)
    if name is None:
        name = f"saved-{actual[:12]}"
        if name not in local.adapters:
            local.load_adapter(path, name, activate=False)
    return AdapterLM(local, name, path=path, sha256=actual)


def bind_saved_adapter(saved: Any, base_lm: Any, weights: Any) -> Any:
    """The LM a saved workflow's ``lms`` entry runs on when the caller's program binds ``base_lm`` to it.

    The caller's LM wins (a checkpoint in a shared run folder cannot redirect it), with one exception: an
    entry that differs from ``base_lm``'s LocalLM only in its adapter is a weights stage's output (GRPO
    trained from the fine-tuned program), so it runs on that same LocalLM with the saved adapter, checked
    against the sha256 the program recorded; binding the caller's LM would run the input's weights. When
    the caller's entry is itself a description (a loaded program), such an entry keeps its own.
    """
    from flowopt.lm.engine import local_of

    if not isinstance(saved, dict) or not saved.get("adapter"):
        return base_lm
    if isinstance(base_lm, dict):  # not built yet: it is built from whichever description is kept
        return saved if _only_adapter_differs(base_lm, saved) else base_lm
    local = local_of(base_lm)
    if local is None:
        return base_lm
    try:
        current = lm_to_spec(base_lm)
    except FlowoptError:
        return base_lm  # the base LM cannot be described, so nothing shows the entry is another one
    if not _only_adapter_differs(current, saved):
        return base_lm
    recorded = weights.get("sha256") if isinstance(weights, dict) else None
    return saved_adapter_lm(local, saved["adapter"], sha256=recorded)


def _only_adapter_differs(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return (first.get("adapter") != second.get("adapter")
            and {**first, "adapter": None} == {**second, "adapter": None})
