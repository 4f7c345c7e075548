"""Atomic file writes: a reader never sees a half-written file, a crash never corrupts an old one.

A write that runs out of space (``ENOSPC``, a quota's ``EDQUOT``, or ``EFBIG`` under a file-size limit)
raises :class:`~flowopt.errors.DiskFullError` naming the file, the bytes it needed and what was free;
the temporary file is removed and the previous version of the file is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowopt.errors import DiskFullError, exception_chain

_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def free_bytes(folder: str | os.PathLike[str]) -> int | None:
    """Bytes free to this user on the filesystem holding ``folder`` (its nearest existing parent)."""
    place = Path(folder).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return shutil.disk_usage(place).free
    except OSError:
        return None


@contextlib.contextmanager
def space_errors(path: str | os.PathLike[str] | None, needed: int | None = None, *,
                 folder: bool = False) -> Iterator[None]:
    """Turn an out-of-space error raised inside the block into a :class:`DiskFullError`.

    ``path`` is the file being written (``needed`` bytes, when known), or with ``folder=True`` a folder
    that other libraries write somewhere under (optuna's SQLite ``search.db``, PEFT's safetensors), whose
    exceptions do not say which file failed. ``None`` converts nothing.

    Example:
        >>> with space_errors("out/model.bin", needed=10):
        ...     pass
    """
    if path is None:
        yield
        return
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        found = _space_cause(err)
        if found is None:
            raise
        code, cause = found
        detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0] if folder else None
        raise _disk_full(Path(path), needed, code, detail=detail) from err


def _space_cause(err: Exception) -> tuple[int, Exception] | None:
    """The out-of-space errno behind ``err`` and the exception that carries it, ``err`` or what caused it:
    optuna wraps a write's SQLAlchemy error in its own ``StorageInternalError``, whose text says only that
    the commit failed."""
    for cause in exception_chain(err):
        if isinstance(cause, Exception) and (code := _space_errno(cause)) is not None:
            return code, cause
    return None


def _space_errno(err: Exception) -> int | None:
    """The out-of-space errno behind ``err``, or None. Writers in Rust (safetensors, which PEFT saves
    adapters with) raise their own exception type carrying the OS error only in the text."""
    if isinstance(err, OSError):
        code = err.errno
    else:
        found = re.search(r"\(os error (\d+)\)", str(err))
        code = int(found.group(1)) if found else None
        if code is None and "database or disk is full" in str(err):  # SQLite's SQLITE_FULL, via sqlalchemy
            code = errno.ENOSPC
    return code if code in _SPACE_ERRNOS else None


def _disk_full(path: Path, needed: int | None, code: int, *, detail: str | None = None) -> DiskFullError:
    """The error for a write of ``needed`` bytes to file ``path`` (or, with ``detail``, into folder ``path``)."""
    where = path if detail is None else path / "_"
    free = free_bytes(where.parent)
    want = f"{_size(needed)} needed" if needed is not None else "space needed unknown"
    have = f"{_size(free)} free" if free is not None else "free space unknown"
    target = f"{path}" if detail is None else f"in {path} ({detail})"
    if code == errno.EFBIG:
        cause = "the process's file-size limit (ulimit -f / RLIMIT_FSIZE) was reached"
        fix = "raise the file-size limit (ulimit -f unlimited) and rerun with resume"
    else:
        cause = "no space left on the device" if code == errno.ENOSPC else "the disk quota is exhausted"
        amount = f"at least {_size(needed)}" if needed is not None else "space"
        kept = "the previous version of the file is intact" if detail is None else "files written before are intact"
        fix = (f"free {amount} on the filesystem holding {where.parent} (or point the run folder, --out or "
               f"FLOWOPT_CACHE_DIR elsewhere) and rerun with resume: {kept}")
    return DiskFullError(f"could not write {target}: {cause} ({want}, {have})", path=str(path), needed=needed,
                         free=free, fix=fix)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write_bytes(folder / "a.bin", b"abc").read_bytes()
        b'abc'
    """
    target = Path(path)
    with space_errors(target, len(data)):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, hex, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
