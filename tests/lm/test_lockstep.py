"""LockstepBatcher: one batch per round of waiting rollouts, sorted by rollout key, whatever the timing;
errors to every caller; unknown callers, late, ended, nested and hung rollouts never dead-lock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from flowopt.lm.batching import LockstepBatcher


def _run(batcher: LockstepBatcher, bodies: dict[tuple[int, int], Callable]) -> dict:
    results: dict = {}

    def worker(key):
        try:
            results[key] = bodies[key](batcher, key)
        except Exception as err:  # recorded for the assertions
            results[key] = err
        finally:
            batcher.finished()

    threads = [threading.Thread(target=worker, args=(k,)) for k in bodies]
    for t in threads:
        t.start()
    batcher.serve()
    for t in threads:
        t.join(timeout=10)
    return results


def test_a_batch_waits_for_every_live_rollout_and_is_sorted_by_key():
    seen: list[list[str]] = []

    def run_batch(items):
        seen.append(list(items))
        return [item.upper() for item in items]

    batcher = LockstepBatcher(run_batch, live=4, timeout_s=5)

    def two_calls(b, key):
        time.sleep(0.01 * (3 - key[1]))  # arrive in reverse order
        first = b.submit(key, f"a{key[1]}")
        second = b.submit(key, f"b{key[1]}")
        return first, second

    results = _run(batcher, {(0, j): two_calls for j in range(4)})
    assert seen == [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]]
    assert results[(0, 2)] == ("A2", "B2")
    assert batcher.batch_sizes == [4, 4]


def test_finished_rollouts_no_longer_hold_a_batch_back():
    batcher = LockstepBatcher(lambda items: [i * 10 for i in items], live=3, timeout_s=5)

    def body(b, key):
        out = [b.submit(key, key[1])]
        if key[1] == 0:  # only the first rollout makes a second call
            out.append(b.submit(key, 7))
        return out

    results = _run(batcher, {(0, j): body for j in range(3)})
    assert results[(0, 0)] == [0, 70] and results[(0, 2)] == [20]
    assert batcher.batch_sizes == [3, 1]


def test_an_error_in_the_batch_reaches_every_caller_of_that_batch():
    def run_batch(items):
        raise RuntimeError("model failed")

    batcher = LockstepBatcher(run_batch, live=2, timeout_s=5)
    results = _run(batcher, {(0, j): (lambda b, key: b.submit(key, 1)) for j in range(2)})
    assert all(isinstance(r, RuntimeError) and "model failed" in str(r) for r in results.values())


def test_a_cut_batch_serves_the_rest_next():
    batcher = LockstepBatcher(lambda items: list(items), live=5, max_batch_size=2, timeout_s=5)
    results = _run(batcher, {(0, j): (lambda b, key: b.submit(key, key[1])) for j in range(5)})
    assert [results[(0, j)] for j in range(5)] == [0, 1, 2, 3, 4]
    assert batcher.batch_sizes == [2, 2, 1]


def test_calls_from_unknown_threads_are_served_after_a_timeout():
    batcher = LockstepBatcher(lambda items: [i + 1 for i in items], live=1, timeout_s=0.05)
    out = {}
    outsider = threading.Thread(target=lambda: out.setdefault("x", batcher.submit(None, 41)))

    def body(b, key):
        outsider.start()
        outsider.join(timeout=5)  # the rollout waits on a call the batcher cannot attribute
        return b.submit(key, 1)

    results = _run(batcher, {(0, 0): body})
    assert out["x"] == 42 and results[(0, 0)] == 2


def _composition_run_batch(seen: list[list]):
    """A run_batch whose every result names its batch: any change in a batch's rows changes the results."""
    def run_batch(items):
        seen.append(list(items))
        return [f"{item}@{'+'.join(map(str, items))}" for item in items]
    return run_batch


def _two_calls(late: dict[tuple[int, int], float]):
    def body(b, key):
        time.sleep(late.get(key, 0.0))  # late for the first batch
        first = b.submit(key, f"a{key[1]}")
        time.sleep(late.get(key, 0.0))  # and for the second
        return first, b.submit(key, f"b{key[1]}")
    return body


def test_a_rollout_later_than_the_timeout_still_joins_its_batch():
    results = {}
    for late in ({}, {(0, 2): 0.3}):  # 0.3 s: six times the timeout
        seen: list[list] = []
        batcher = LockstepBatcher(_composition_run_batch(seen), live=4, timeout_s=0.05)
        results[bool(late)] = _run(batcher, {(0, j): _two_calls(late) for j in range(4)})
        assert batcher.batch_sizes == [4, 4]
        assert seen == [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]]
    assert results[True] == results[False]
    assert results[True][(0, 2)] == ("a2@a0+a1+a2+a3", "b2@b0+b1+b2+b3")


def test_a_rollout_that_ends_late_without_a_call_frees_the_others():
    seen: list[list] = []
    batcher = LockstepBatcher(_composition_run_batch(seen), live=3, timeout_s=0.05)

    def quits(b, key):
        time.sleep(0.3)

    def fails(b, key):
        time.sleep(0.3)
        raise ValueError("the program failed before its first call")

    body = _two_calls({})
    results = _run(batcher, {(0, 0): body, (0, 1): quits, (0, 2): fails})
    # The first batch waited for both late rollouts to end: it holds rollout 0's call only, once.
    assert batcher.batch_sizes == [1, 1]
    assert results[(0, 0)] == ("a0@a0", "b0@b0")
    assert results[(0, 1)] is None and isinstance(results[(0, 2)], ValueError)


def test_a_rollout_waiting_on_an_unknown_thread_gets_its_call_served_alone():
    seen: list[list] = []
    batcher = LockstepBatcher(_composition_run_batch(seen), live=2, timeout_s=0.05)

    def via_outsider(b, key):
        out = {}
        outsider = threading.Thread(target=lambda: out.setdefault("x", b.submit(None, "u")))
        outsider.start()
        outsider.join(timeout=5)
        return out["x"], b.submit(key, "k1")

    results = _run(batcher, {(0, 0): lambda b, key: b.submit(key, "k0"), (0, 1): via_outsider})
    # The unknown call ran by itself after the timeout; rollout 0's call waited for rollout 1's.
    assert seen == [["u"], ["k0", "k1"]]
    assert results[(0, 1)] == ("u@u", "k1@k0+k1") and results[(0, 0)] == "k0@k0+k1"


def test_parallel_calls_of_one_rollout_count_it_as_waiting_once():
    seen: list[list] = []
    batcher = LockstepBatcher(_composition_run_batch(seen), live=2, timeout_s=0.05)

    def two_threads(b, key):  # a Workflow's parallel nodes: both threads carry the rollout's key
        out = {}
        other = threading.Thread(target=lambda: out.setdefault("y", b.submit(key, "y")))
        other.start()
        x = b.submit(key, "x")
        other.join(timeout=5)
        return x, out["y"]

    def late(b, key):
        deadline = time.monotonic() + 5
        while len(b._pending) < 2 and time.monotonic() < deadline:  # both of rollout 0's calls wait
            time.sleep(0.01)
        time.sleep(0.2)  # then four times the timeout more
        return b.submit(key, "z")

    _run(batcher, {(0, 0): two_threads, (0, 1): late})
    # Rollout 0's two pending calls did not stand in for the late rollout 1.
    assert batcher.batch_sizes == [3]
    assert sorted(seen[0]) == ["x", "y", "z"] and seen[0][2] == "z"


def test_a_call_from_inside_run_batch_fails_instead_of_waiting_on_itself():
    def run_batch(items):
        return [batcher.submit((0, 0), item) for item in items]

    batcher = LockstepBatcher(run_batch, live=1, timeout_s=0.05)
    results = _run(batcher, {(0, 0): lambda b, key: b.submit(key, 1)})
    assert isinstance(results[(0, 0)], RuntimeError) and "serving thread" in str(results[(0, 0)])
    assert batcher.errors == [results[(0, 0)]]


def test_a_call_after_serve_returned_fails_instead_of_hanging():
    batcher = LockstepBatcher(lambda items: list(items), live=0)
    batcher.serve()
    with pytest.raises(RuntimeError, match="outlived its rollout"):
        batcher.submit((0, 0), 1)


def test_a_hung_rollout_is_warned_about_and_the_batch_still_waits(caplog):
    release = threading.Event()
    seen: list[list] = []
    batcher = LockstepBatcher(_composition_run_batch(seen), live=2, timeout_s=0.05, warn_after_s=0.1)

    def hung(b, key):
        release.wait(timeout=10)  # a program stuck in non-LM work
        return b.submit(key, "late")

    timer = threading.Timer(0.5, release.set)
    timer.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flowopt.lm.batching"):
        results = _run(batcher, {(0, 0): lambda b, key: b.submit(key, "early"), (0, 1): hung})
    elapsed = time.monotonic() - started
    timer.join()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "1 of 2 running rollouts wait" in warnings[0] and "hung" in warnings[0]
    assert 2 <= len(warnings) <= elapsed / 0.1 + 1  # once per warn_after_s while stuck, not on every wake-up
    assert batcher.batch_sizes == [2] and results[(0, 1)] == "late@early+late"
