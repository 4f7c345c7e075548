"""The benchmark data files: where they are (the packaged folder, or ``$FLOWOPT_DATA_DIR``), their
SHA-256 checked against the packaged ``SHA256SUMS`` before any is read, and JSON Lines reading.

Example:
    >>> from flowopt.benchmarks.data_files import verify_file
    >>> verify_file("gsm8k/test.jsonl").name
    'test.jsonl'
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

from flowopt.errors import DataError
from flowopt.io import file_sha256 as sha256  # a module name: the tests count the calls

logger = logging.getLogger(__name__)

#: Environment variable that overrides the data folder.
DATA_DIR_ENV = "FLOWOPT_DATA_DIR"
#: Name of the checksum file (``sha256sum`` format) inside the packaged data folder.
CHECKSUMS_FILE = "SHA256SUMS"
PACKAGED_DATA = Path(__file__).resolve().parent / "data"


def data_dir() -> Path:
    """The data folder: ``$FLOWOPT_DATA_DIR`` if set, else the one shipped in the package.

    Example:
        >>> data_dir().name
        'data'
    """
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override).expanduser().resolve() if override else PACKAGED_DATA


@lru_cache(maxsize=1)
def expected_checksums() -> Mapping[str, str]:
    """The packaged ``SHA256SUMS``: data file (relative path) -> its sha256."""
    path = PACKAGED_DATA / CHECKSUMS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(
            f"the benchmark checksum file {path} cannot be read ({err})",
            fix="reinstall flowopt so that its package data (flowopt/benchmarks/data) is present",
        ) from err
    sums: dict[str, str] = {}
    for line in lines:
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip().lstrip("*")] = digest.lower()
    return MappingProxyType(sums)


_verified: dict[Path, tuple[int, int]] = {}
_verify_lock = threading.Lock()


def verify_file(relpath: str) -> Path:
    """Path of the data file ``relpath`` (e.g. ``"gsm8k/test.jsonl"``) after checking its SHA-256.

    The check runs once per file per process (again if the file's size or mtime changes).

    Raises:
        DataError: the file is missing, not listed in ``SHA256SUMS``, or its checksum differs.

    Example:
        >>> verify_file("gsm8k/test.jsonl").name
        'test.jsonl'
    """
    expected = expected_checksums().get(relpath)
    if expected is None:
        raise DataError(
            f"benchmark data file {relpath!r} has no checksum in {PACKAGED_DATA / CHECKSUMS_FILE}",
            fix="add its sha256 to SHA256SUMS (see benchmarks/data/README.md) before reading it",
        )
    path = data_dir() / relpath
    try:
        stat = path.stat()
    except OSError as err:
        raise DataError(
            f"benchmark data file {path} is missing ({err.strerror})",
            fix=f"reinstall flowopt, or point {DATA_DIR_ENV} at a complete copy of flowopt/benchmarks/data "
            f"(currently {os.environ.get(DATA_DIR_ENV) or 'unset'})",
        ) from err
    key = (stat.st_size, stat.st_mtime_ns)
    with _verify_lock:
        if _verified.get(path) == key:
            return path
        actual = sha256(path)
        if actual != expected:
            raise DataError(
                f"benchmark data file {path} fails its checksum: expected sha256 {expected}, got {actual}",
                fix="restore the original file (reinstall flowopt, or in a source checkout run "
                f"`git checkout benchmarks/data/{relpath}`), or unset {DATA_DIR_ENV} if it points at "
                "a modified copy",
            )
        _verified[path] = key
    logger.debug("verified %s (sha256 %s)", path, actual)
    return path


def read_jsonl(relpath: str) -> list[dict[str, Any]]:
    """The records of the data file ``relpath`` (one JSON object a line), after checking its checksum."""
    path = verify_file(relpath)
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({err.msg})",
                    fix="restore the original data file",
                ) from err
    return records
