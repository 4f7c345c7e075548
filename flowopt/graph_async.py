"""Run a graph's nodes on the event loop: each node starts as soon as the nodes it reads have finished.

:meth:`Workflow.aforward` uses it with each node's ``acall``; :meth:`Workflow.forward` uses it when it
runs under ``dspy.streamify``, sending each branch to an AnyIO worker thread, because DSPy's streaming
reaches the event loop with ``anyio.from_thread``, which works only from AnyIO's own worker threads.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

NodeResult = dict[str, Any]


async def run_when_ready(dependencies: Mapping[str, set[str]],
                         run_node: Callable[[str], Awaitable[NodeResult]]) -> dict[str, NodeResult]:
    """``{node: await run_node(node)}``, each node started once every node in its dependencies finished.

    Independent nodes run concurrently as tasks (each in a copy of the caller's context, so
    ``dspy.context`` settings reach them). The first failure cancels the nodes still running and is
    raised as itself, as the sequential run would raise it.

    Example:
        >>> async def run(node):
        ...     return {"done": node}
        >>> sorted(asyncio.run(run_when_ready({"a": set(), "b": {"a"}}, run)))
        ['a', 'b']
    """
    remaining = {node: set(deps) for node, deps in dependencies.items()}
    results: dict[str, NodeResult] = {}
    running: dict[asyncio.Future[NodeResult], str] = {}
    try:
        while remaining or running:
            for node in [n for n, deps in remaining.items() if not deps]:
                del remaining[node]
                running[asyncio.ensure_future(run_node(node))] = node
            if not running:
                raise ValueError(f"nodes {sorted(remaining)} wait on each other or on unknown nodes")
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                node = running.pop(future)
                results[node] = future.result()  # re-raises the node's error here
                for deps in remaining.values():
                    deps.discard(node)
    finally:
        for future in running:
            future.cancel()
    return results


def run_in_anyio_threads(dependencies: Mapping[str, set[str]], run_node: Callable[[str], NodeResult]
                         ) -> dict[str, NodeResult] | None:
    """Run ``run_node`` for every node in AnyIO worker threads, from inside one; None when not inside one.

    Called from an AnyIO worker thread (where ``dspy.streamify`` runs a synchronous program), it goes
    back to the event loop and starts each ready node in a worker thread of its own, with a copy of the
    caller's context. Anywhere else it returns None and the caller runs the nodes itself.
    """
    import anyio
    import anyio.from_thread
    import anyio.to_thread

    context = contextvars.copy_context()

    async def in_worker(node: str) -> NodeResult:
        return await anyio.to_thread.run_sync(context.copy().run, run_node, node)

    try:
        anyio.from_thread.run_sync(int)  # a no-op that only an AnyIO worker thread may call
    except anyio.NoEventLoopError:
        return None
    return anyio.from_thread.run(run_when_ready, dependencies, in_worker)
