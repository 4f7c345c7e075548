"""A full disk or a file-size limit under a correct caller: a clear DiskFullError, nothing half-written.

Real limits, no mocks: ``RLIMIT_FSIZE`` (the kernel's EFBIG) in-process for single writes, and a real
small tmpfs (ENOSPC), mounted in a user namespace (``unshare -Urm``, no root needed), for a whole compile
whose run folder fills up: first while a JSON checkpoint is written, then while optuna's SQLite
``search.db`` grows. Resuming after space is freed must give the uninterrupted run's program.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flowopt.errors import DiskFullError, FlowoptError
from flowopt.io import atomic_write_json, space_errors

WORKER = Path(__file__).with_name("disk_full_worker.py")


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Lower this process's soft RLIMIT_FSIZE; writes past it fail with EFBIG instead of SIGXFSZ."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_write_past_the_file_size_limit_names_the_file_and_keeps_the_old_version(tmp_path):
    target = tmp_path / "checkpoint.json"
    atomic_write_json(target, {"step": 1})
    before = target.read_bytes()
    with file_size_limit(4096), pytest.raises(DiskFullError) as caught:
        atomic_write_json(target, {"step": 2, "payload": "x" * 10_000})
    err = caught.value
    assert err.path == str(target) and err.needed is not None and err.needed > 10_000
    assert "checkpoint.json" in str(err) and "ulimit -f" in str(err)  # names the file, the cause and the fix
    assert isinstance(err, OSError) and isinstance(err, FlowoptError)
    assert target.read_bytes() == before  # the last good version is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]  # no temporary file left


def test_other_write_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(PermissionError), space_errors(tmp_path / "x.json", 10):
        raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(RuntimeError, match="unrelated"), space_errors(tmp_path, folder=True):
        raise RuntimeError("unrelated (os error 2)")  # ENOENT is not a space error


def test_a_full_disk_under_optunas_own_error_is_still_a_disk_full_error(tmp_path):
    # optuna wraps a failed commit in StorageInternalError, whose text only says the commit failed; the SQLite
    # error that says why is its cause.
    import sqlite3

    from optuna.exceptions import StorageInternalError

    with pytest.raises(DiskFullError, match="database or disk is full") as caught, space_errors(tmp_path, folder=True):
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as err:
            raise StorageInternalError("An exception is raised during the commit.") from err
    assert caught.value.path == str(tmp_path)


def test_an_adapter_save_past_the_limit_keeps_the_saved_adapter(tmp_path):
    from flowopt.lm.local import LocalLM
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(["alpha", "beta", "gamma"], seed=0)
    local = LocalLM.from_model(model, tokenizer, name="tiny", max_new_tokens=2)
    try:
        local.add_adapter("default")
        folder = local.save_adapter(tmp_path / "adapter")
        saved = {p.name: p.read_bytes() for p in folder.iterdir()}
        weights = max(len(b) for b in saved.values())
        with file_size_limit(weights // 2), pytest.raises(DiskFullError) as caught:
            local.save_adapter(tmp_path / "adapter")
        assert caught.value.path == str(tmp_path / "adapter") and caught.value.needed
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == saved  # the old adapter, whole
        assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no half-written folder beside it
    finally:
        local.close()


def _namespace_tmpfs_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k none /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()}"


def test_a_compile_on_a_filling_disk_stops_cleanly_and_resumes_to_the_same_program(tmp_path):
    reason = _namespace_tmpfs_works()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    small, roomy, out = tmp_path / "small", tmp_path / "roomy", tmp_path / "seen.json"
    small.mkdir()
    roomy.mkdir()
    # 20 kB free: the search's first JSON pool file does not fit; 60 kB: the pools fit, search.db does not.
    script = (f"mount -t tmpfs -o size=512k none {small} && exec {sys.executable} {WORKER} {small} {roomy} "
              f"{out} 20000 60000")
    env = {**os.environ, "DSPY_CACHEDIR": str(tmp_path / "dspy-cache")}
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(out.read_text())
    json_run, db_run = seen["runs"]
    for run in (json_run, db_run):
        assert run["error"]["type"] == "DiskFullError", run["error"]
        assert "no space left on the device" in run["error"]["message"]
        assert run["broken_json"] == [] and run["temp_files"] == []  # every file left is whole
        assert run["resumed"] == seen["reference"]  # resume after freeing space = the uninterrupted run
    assert json_run["error"]["path"].endswith(".json") and json_run["error"]["needed"] > 0
    assert "database or disk is full" in db_run["error"]["message"]
    assert db_run["error"]["path"].endswith("stages/01-search")
