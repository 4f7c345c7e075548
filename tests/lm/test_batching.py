"""DynamicBatcher: concurrent callers are batched, each gets its own result or the batch's error."""

from __future__ import annotations

import threading
import time

import pytest

from flowopt.lm.batching import DynamicBatcher


def _run_concurrently(fn, args):
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(args))

    def worker(i, arg):
        barrier.wait()
        try:
            results[i] = fn(arg)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [results[i] for i in range(len(args))]


def test_each_caller_gets_its_own_result_from_shared_batches():
    seen: list[list[int]] = []

    def run(group, items):
        seen.append(list(items))
        time.sleep(0.02)
        return [x * 10 for x in items]

    batcher = DynamicBatcher(run, max_batch_size=8, wait_ms=50)
    assert _run_concurrently(batcher.submit, list(range(8))) == [x * 10 for x in range(8)]
    assert max(len(b) for b in seen) > 1  # they really were served together
    assert sorted(x for b in seen for x in b) == list(range(8))
    batcher.close()


def test_max_batch_size_is_respected():
    batcher = DynamicBatcher(lambda g, xs: list(xs), max_batch_size=3, wait_ms=50)
    assert _run_concurrently(batcher.submit, list(range(10))) == list(range(10))
    assert max(batcher.batch_sizes) <= 3
    batcher.close()


def test_groups_are_never_mixed():
    batches: list[tuple[object, list[int]]] = []

    def run(group, items):
        batches.append((group, list(items)))
        return [(group, x) for x in items]

    batcher = DynamicBatcher(run, max_batch_size=16, wait_ms=50)
    out = _run_concurrently(lambda x: batcher.submit(x, group=x % 2), list(range(8)))
    assert out == [(x % 2, x) for x in range(8)]
    assert all(all(x % 2 == group for x in items) for group, items in batches)
    batcher.close()


def test_an_error_reaches_every_caller_of_the_batch_and_the_worker_survives():
    def run(group, items):
        if "bad" in items:
            raise ValueError("boom")
        return list(items)

    batcher = DynamicBatcher(run, max_batch_size=4, wait_ms=50)
    out = _run_concurrently(batcher.submit, ["bad", "bad"])
    assert all(isinstance(r, ValueError) for r in out)
    assert batcher.submit("fine") == "fine"
    batcher.close()
    with pytest.raises(RuntimeError):
        batcher.submit("late")
