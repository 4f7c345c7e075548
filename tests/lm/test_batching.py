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


def _trickle(batcher, gaps_s):
    """Submit one job after each gap (seconds) from one thread; return the futures."""
    futures = []
    for gap in gaps_s:
        time.sleep(gap)
        futures.append(batcher.submit_async(len(futures)))
    return futures


def test_callers_returning_spread_out_still_share_one_batch():
    """Arrivals about 20 ms apart (a 200 ms quiet window leaves room for a loaded machine): one batch,
    although the last arrives well after a fixed 200 ms window from the first would have closed."""
    batcher = DynamicBatcher(lambda g, xs: list(xs), max_batch_size=16, wait_ms=200)
    futures = _trickle(batcher, [0.0] + [0.04] * 7)
    assert [f.result(timeout=10) for f in futures] == list(range(8))
    assert batcher.batch_sizes == [8]
    batcher.close()


def test_a_steady_trickle_is_cut_at_the_longest_wait():
    """Arrivals every 20 ms or more never leave a 200 ms window quiet; the batch still runs
    max_wait_factor x wait_ms after its first job (400 ms here), so nobody waits for the trickle to end."""
    batcher = DynamicBatcher(lambda g, xs: list(xs), max_batch_size=64, wait_ms=200, max_wait_factor=2)
    futures = _trickle(batcher, [0.0] + [0.02] * 39)  # at least 780 ms of arrivals
    assert [f.result(timeout=10) for f in futures] == list(range(40))
    assert len(batcher.batch_sizes) >= 2 and max(batcher.batch_sizes) <= 21  # 400 ms / 20 ms + 1
    batcher.close()


def test_the_longest_wait_is_checked():
    with pytest.raises(ValueError, match="max_wait_factor"):
        DynamicBatcher(lambda g, xs: list(xs), max_wait_factor=0.5)
