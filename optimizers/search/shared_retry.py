"""A shared study's storage that survives its database: dropped connections are retried with backoff.

A PostgreSQL server that restarts (a failover, ``pg_ctl restart``), or a backend terminated under one
worker (``pg_terminate_backend``, an idle-connection reaper, a proxy timeout), breaks every pooled
connection at once. optuna's ``RDBStorage`` raises on the first statement that meets a dead connection;
:class:`RetryingRDBStorage` instead reconnects (SQLAlchemy's ``pool_pre_ping`` replaces dead pooled
connections) and repeats the call, backing off from 0.1 s to 2 s, for up to ``retry_s`` seconds.

What a repeat does when the first attempt committed and only its reply was lost with the connection:

* reads, heartbeats and attribute writes are idempotent;
* a state change finds the trial already in that state: a finished trial counts as done (optuna raises
  ``UpdateFinishedTrialError`` on the repeat, taken as success when the state matches); a repeated claim
  (``RUNNING``) reads as lost, and the trial, which no worker then beats for, goes stale and is requeued
  through the heartbeat path, exactly as when a worker dies holding it;
* not covered: a repeated ``create_new_trial`` makes a second trial (a candidate enqueued twice), and a
  repeated ``create_new_study`` behind a one-time decision (``shared_storage.once``) reads as taken by
  another worker, so the decision waits until ``wait_timeout_s``. Both need a cut in the instant between
  the commit and its reply; the restart test does not hit it, and nothing here detects it.

Example:
    >>> from flowopt.optimizers.search.shared_retry import is_connection_error
    >>> is_connection_error(ValueError("no"))
    False
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from optuna.storages import RDBStorage

from flowopt.errors import exception_chain

logger = logging.getLogger(__name__)

RETRY_S = 60.0  # how long a call keeps trying before the error reaches the search
_FIRST_WAIT_S, _MAX_WAIT_S = 0.1, 2.0

# Every storage call the search makes (optuna's BaseStorage and BaseHeartbeat API).
_RETRIED = (
    "create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr", "get_study_id_from_name",
    "get_study_name_from_id", "get_study_directions", "get_study_user_attrs", "get_study_system_attrs",
    "get_all_studies", "create_new_trial", "set_trial_param", "get_trial_id_from_study_id_trial_number",
    "get_trial_number_from_id", "get_trial_param", "set_trial_state_values", "set_trial_intermediate_value",
    "set_trial_user_attr", "set_trial_system_attr", "get_trial", "get_all_trials", "get_n_trials",
    "get_best_trial", "get_trial_params", "get_trial_user_attrs", "get_trial_system_attrs", "record_heartbeat",
    "_get_stale_trial_ids", "_get_trials",  # (optuna's cache in front of the storage reads through _get_trials)
)


def is_connection_error(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a lost or refused database connection."""
    import sqlalchemy.exc as sa

    # optuna wraps SQLAlchemy's error in StorageInternalError: look down the chain.
    return any(isinstance(seen, sa.OperationalError | sa.InterfaceError)
               or (isinstance(seen, sa.DBAPIError) and seen.connection_invalidated)
               for seen in exception_chain(err))


class RetryingRDBStorage(RDBStorage):
    """optuna's ``RDBStorage`` whose calls outlive a database restart or a terminated connection.

    Example:
        >>> storage = RetryingRDBStorage("sqlite:///:memory:")  # doctest: +SKIP
        >>> storage.retry_s  # doctest: +SKIP
        60.0
    """

    retry_s: float = RETRY_S

    def _retrying(self, name: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_s
        wait, failures = _FIRST_WAIT_S, 0
        while True:
            try:
                result = call(*args, **kwargs)
            except Exception as err:
                if failures and name == "set_trial_state_values" and _already_in_state(self, err, args, kwargs):
                    result = True  # the first attempt committed; its reply was lost with the connection
                elif not is_connection_error(err) or time.monotonic() + wait > deadline:
                    raise
                else:
                    failures += 1
                    if failures == 1:
                        logger.warning("database connection lost in %s (%s); retrying for up to %.0f s", name,
                                       type(err).__name__, self.retry_s)
                    time.sleep(wait)
                    wait = min(wait * 2, _MAX_WAIT_S)
                    continue
            if failures:
                logger.warning("database connection back after %d retries of %s", failures, name)
            return result


def _already_in_state(storage: RDBStorage, err: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    import optuna

    if not isinstance(err, optuna.exceptions.UpdateFinishedTrialError):
        return False
    trial_id, state = args[0], kwargs.get("state", args[1] if len(args) > 1 else None)
    return bool(RDBStorage.get_trial(storage, trial_id).state == state)


def _wrap(name: str) -> Callable[..., Any]:
    method = getattr(RDBStorage, name)

    @functools.wraps(method)
    def retried(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        return self._retrying(name, functools.partial(method, self), *args, **kwargs)

    return retried


for _name in _RETRIED:
    setattr(RetryingRDBStorage, _name, _wrap(_name))
