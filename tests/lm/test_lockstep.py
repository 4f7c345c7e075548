"""LockstepBatcher: one batch per round of waiting rollouts, sorted by rollout key, errors to every caller."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
