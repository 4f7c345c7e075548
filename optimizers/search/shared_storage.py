"""Storage for a search shared by workers: the RDB connection, one-time tokens, and the run-folder
lock that keeps file storages (sqlite, journal) to one process.

Example:
    >>> from flowopt.optimizers.search.shared_storage import is_shared
    >>> is_shared("postgresql+psycopg://me@127.0.0.1/db"), is_shared("journal"), is_shared(None)
    (True, False, False)
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowopt.errors import ConfigError

logger = logging.getLogger(__name__)

# Two workers on an empty database both create optuna's tables; the loser's CREATE fails
# (e.g. PostgreSQL's UniqueViolation on pg_type). Opening again finds the tables made.
_OPEN_ATTEMPTS = 5


def is_shared(storage: str | None) -> bool:
    """Whether ``storage`` is an RDB URL that several workers may share."""
    return isinstance(storage, str) and "://" in storage


def open_rdb_storage(url: str, *, heartbeat_s: int, stale_after_s: int, worker: str | None = None) -> Any:
    """An optuna ``RDBStorage`` with heartbeats on (trials whose worker stops recording them for
    ``stale_after_s`` seconds are stale), retrying the table creation two workers may race on, and
    every later call across a lost connection (:class:`~.shared_retry.RetryingRDBStorage`). On
    PostgreSQL the connections carry ``application_name`` ``flowopt-search:<worker>``, so an operator
    sees in ``pg_stat_activity`` which worker holds which connection."""
    import optuna
    import sqlalchemy.exc

    from flowopt.optimizers.search.shared_retry import RetryingRDBStorage

    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}  # a pooled connection dead since a restart is replaced
    if url.startswith("postgresql") and worker is not None:
        engine_kwargs["connect_args"] = {"application_name": f"flowopt-search:{worker}"[:63]}
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RetryingRDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_s,
                                          grace_period=stale_after_s)
        except ModuleNotFoundError as err:
            raise ConfigError(f"the database driver for {url.split('://')[0]!r} is not installed ({err})",
                              fix="pip install 'flowopt[postgres]' and use a postgresql+psycopg://... URL") from err
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as err:
            if attempt == _OPEN_ATTEMPTS - 1:
                raise
            logger.info("another worker is creating the optuna tables (%s); retrying", type(err).__name__)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def once(storage: Any, key: str) -> bool:
    """True for exactly one caller per ``key`` across all workers: creating a study of that name is
    atomic (the study name is unique in the database)."""
    import optuna

    try:
        optuna.create_study(storage=storage, study_name=key)
    except optuna.exceptions.DuplicatedStudyError:
        return False
    return True


@contextlib.contextmanager
def exclusive_run_dir(run_dir: Path | None) -> Iterator[None]:
    """Hold ``run_dir/search.lock`` while a file-backed search runs: a second process on the same
    folder gets a clear error instead of failing or deleting the first one's trials."""
    if run_dir is None:
        yield
        return
    from filelock import FileLock, Timeout

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(Path(run_dir) / "search.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(f"another process is running the search in {run_dir}; its sqlite/journal study "
                          "serves one process at a time",
                          fix='to share one search between workers, pass storage="postgresql+psycopg://..." '
                              "(the same URL and study_name in every worker)") from None
    try:
        yield
    finally:
        lock.release()
