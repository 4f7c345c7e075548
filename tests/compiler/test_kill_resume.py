"""Kill a compile with SIGKILL in the middle of the search, resume it, compare with an uninterrupted run.

A call counts as completed when DSPy's disk cache holds its result: those are never paid again. Calls in
flight at the kill (at most ``num_threads``) are lost and paid again by the resumed run. The killed run's
completed calls are read from the cache itself, not from a log: no log line can be written in the same
instant as the cache entry, so a SIGKILL between the two made a log disagree with the cache (the
"Right contains one more item" failure under load: a call cached but never logged).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("kill_worker.py")
THREADS = 4  # kill_worker's num_threads: the most LM calls in flight at any moment


def _start(tmp: Path, tag: str, cache: Path, *, resume: bool = False) -> tuple[subprocess.Popen, Path, Path]:
    log, out = tmp / f"{tag}.calls", tmp / f"{tag}.json"
    env = {**os.environ, "DSPY_CACHEDIR": str(cache)}
    args = [sys.executable, str(WORKER), str(tmp / f"run-{tag.split('-')[0]}"), str(log), str(out)]
    proc = subprocess.Popen([*args, *(["--resume"] if resume else [])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, log, out


def _calls(log: Path) -> list[str]:
    # Only whole lines: a line being written at the moment of reading is not a call yet.
    text = log.read_text() if log.exists() else ""
    return text[: text.rfind("\n") + 1].split()


def _cached_calls(cache: Path) -> list[str]:
    """The keys of every LM call whose result DSPy stored on disk in ``cache`` (what a rerun gets back)."""
    from dspy.clients.cache import Cache

    store = Cache(enable_disk_cache=True, enable_memory_cache=False, disk_cache_dir=str(cache)).disk_cache
    try:
        return [str(key) for key in store]
    finally:
        store.close()


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out.decode()


def test_kill_in_search_then_resume_equals_uninterrupted_and_pays_nothing_twice(tmp_path):
    # Reference: one uninterrupted run with its own empty DSPy cache.
    proc, ref_log, ref_out = _start(tmp_path, "ref", Path(tempfile.mkdtemp(dir=tmp_path)))
    _finish(proc)
    ref = json.loads(ref_out.read_text())
    ref_calls = _calls(ref_log)
    assert len(ref_calls) == len(set(ref_calls))  # every real call is a distinct request
    before_search = sum(r["lm_calls"] for r in ref["report"]["stages"] if r["name"] != "search")
    kill_at = before_search + (len(ref_calls) - before_search) // 2
    assert len(ref_calls) - before_search > 20  # the search does real work, so the kill lands inside it

    cache = Path(tempfile.mkdtemp(dir=tmp_path))
    proc, killed_log, _ = _start(tmp_path, "job-killed", cache)
    deadline = time.monotonic() + 180
    while len(_calls(killed_log)) < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    killed = _cached_calls(cache)
    in_flight = len(_calls(Path(f"{killed_log}.sent"))) - len(killed)
    assert before_search <= len(killed) < len(ref_calls)
    assert 0 <= in_flight <= THREADS
    assert (tmp_path / "run-job" / "stages" / "01-search" / "search.db").exists()

    proc, resumed_log, resumed_out = _start(tmp_path, "job-resumed", cache, resume=True)
    _finish(proc)
    resumed = json.loads(resumed_out.read_text())
    resumed_calls = _calls(resumed_log)

    assert resumed["program"] == ref["program"]  # the same final program as the uninterrupted run
    assert not set(killed) & set(resumed_calls)  # nothing completed before the kill is paid again
    assert sorted(killed + resumed_calls) == sorted(ref_calls)
    rows = {r["name"]: r for r in resumed["report"]["stages"]}
    assert rows["baseline"]["resumed"] and rows["demos"]["resumed"]
    assert rows["search"]["candidates_tried"] == ref["report"]["stages"][2]["candidates_tried"]
