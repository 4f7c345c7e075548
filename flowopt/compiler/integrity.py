"""Checks that keep a compile run folder trustworthy: where it may live, and that what it holds is intact.

* :func:`check_run_dir` refuses a ``run_dir`` that cannot hold a run (empty, a file, below a file,
  read-only, under ``/proc``...) before anything is written or any LM is called.
* :func:`seal` and :func:`open_sealed` store a SHA-256 digest with each checkpoint and refuse one
  that no longer matches it (edited, truncated, binary, emptied), naming the file and the fix.
* :func:`check_sqlite` refuses a damaged SQLite file (the search's ``search.db``) the same way.

Example:
    >>> from flowopt.compiler.integrity import open_sealed, seal
    >>> data = seal({"row": {"score": 0.5}})
    >>> open_sealed(data, "output.json")
    {'row': {'score': 0.5}}
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError

DIGEST_KEY = "sha256"
_SYSTEM_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


def check_run_dir(run_dir: Any) -> Path:
    """The run folder as a path, or a :class:`ConfigError` saying why it cannot hold a run (nothing is
    created here)."""
    if not isinstance(run_dir, str | os.PathLike):
        raise ConfigError(f"run_dir must be a folder path, got a {type(run_dir).__name__}",
                          fix='pass run_dir="runs/my-run" (or leave it out to keep nothing on disk)')
    text = os.fspath(run_dir)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("run_dir is empty, which would write the run into the current folder",
                          fix='pass a folder of its own, e.g. run_dir="runs/my-run"')
    if "\x00" in text:
        raise ConfigError("run_dir contains a NUL character", fix="pass a plain folder path")
    path = Path(text).expanduser()
    resolved = path.resolve()
    for root in _SYSTEM_ROOTS:
        if resolved == root or root in resolved.parents:
            raise ConfigError(f"run_dir {path} is under {root}, a system folder that cannot hold files",
                              fix='pass a folder in your workspace, e.g. run_dir="runs/my-run"')
    if resolved.exists() and not resolved.is_dir():
        raise ConfigError(f"run_dir {path} is a file, not a folder", fix="pass a folder path, or move the file")
    existing = resolved
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run_dir {path} is below {existing}, which is a file", fix="pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK) or _read_only_filesystem(existing):
        raise ConfigError(f"run_dir {path} cannot be written ({existing} is read-only)",
                          fix="pass a folder you can write to, or change its permissions")
    return path


def _read_only_filesystem(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def digest(payload: dict[str, Any]) -> str:
    """SHA-256 of the payload's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` plus its digest, ready to write."""
    return {**payload, DIGEST_KEY: digest(payload)}


def read_sealed(path: Path) -> dict[str, Any]:
    """Read a checkpoint written from :func:`seal`; refuse it if it is not exactly what was written."""
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _damaged(path, f"it cannot be read as JSON ({type(err).__name__})") from None
    return open_sealed(data, path)


def open_sealed(data: Any, path: str | Path) -> dict[str, Any]:
    """The payload of sealed ``data``; :class:`ConfigError` when the digest is missing or differs."""
    if not isinstance(data, dict) or not isinstance(data.get(DIGEST_KEY), str):
        raise _damaged(path, "it has no checkpoint digest")
    payload = {k: v for k, v in data.items() if k != DIGEST_KEY}
    try:
        actual = digest(payload)
    except ValueError:
        actual = ""
    if actual != data[DIGEST_KEY]:
        raise _damaged(path, "its content does not match its SHA-256 digest (edited or damaged)")
    return payload


def check_sqlite(path: Path) -> None:
    """Refuse a SQLite file that SQLite itself reports as damaged (a missing file is fine)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as handle:
            header = handle.read(16)
        if header != b"SQLite format 3\x00":
            raise sqlite3.DatabaseError("not a SQLite database")
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = connection.execute("PRAGMA quick_check").fetchall()
        finally:
            connection.close()
        if rows != [("ok",)]:
            raise sqlite3.DatabaseError("; ".join(str(r[0]) for r in rows[:3]))
    except (sqlite3.DatabaseError, OSError) as err:
        raise _damaged(path, f"SQLite reports it damaged ({err})") from None


def _damaged(path: str | Path, why: str) -> ConfigError:
    return ConfigError(f"checkpoint {path} is refused: {why}",
                       fix=f"delete {path} to compute that step again on resume, or start in a new run_dir")
