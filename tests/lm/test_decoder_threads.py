"""CUDA-graph tree state per thread: the decode loop's thread and a caller's thread each get their own.

torch keeps the trees of ``mode="reduce-overhead"`` in a ``threading.local`` filled only in the thread that
imported ``torch._inductor.cudagraph_trees``; on an H200, transformers' compiled ``generate`` in the main thread
failed (``assert torch._C._is_key_in_tls``) after LocalLM's decode thread had captured graphs. This checks the
state that :func:`cuda_graph_thread_state` gives a thread; the graphs themselves need a GPU
(``benchmarks/results/decode_side_by_side_h200.md`` ran both in one process).
"""

import threading

from flowopt.lm.decoder import cuda_graph_thread_state


def test_each_thread_gets_its_own_tree_state_and_keeps_it():
    from torch._inductor import cudagraph_trees

    seen: dict[str, object] = {}

    def worker(name: str) -> None:
        assert not hasattr(cudagraph_trees.local, "tree_manager_containers")  # torch leaves a new thread without
        cuda_graph_thread_state()
        first = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
        cuda_graph_thread_state()  # idempotent: a second call keeps the thread's trees
        assert cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers") is first
        cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_locks")[0].acquire(blocking=False)
        seen[name] = first

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen) == {"a", "b"} and seen["a"] is not seen["b"]
