"""flowopt serve under sustained load: concurrent clients, cancelled streams, malformed bodies, memory.

Starts ``flowopt serve`` in a child process (a small random model by default, or the embedded Gemma) and
sends ``--requests`` requests from ``--clients`` concurrent clients (httpx, asyncio). Request ``i`` is,
by ``i % 10``: 0 a malformed body (bad JSON, a wrong type, a missing field, in turn), 1 a streamed chat
completion the client abandons after its first chunk (the server must free its batch slot), 2-3 a chat
completion streamed to the end, 4-6 a plain chat completion, 7-9 a plain text completion. It reports the
share of well-formed, uncancelled requests answered (the goal is all), the status codes (no 500), the
p50/p99 latency of answered requests, the time to first chunk of streams, and the server's RSS after
warm-up (the first tenth of the requests) and at the end (the goal: within 10%).

    python -m flowopt.benchmarks.perf.serve_load --clients 64 --requests 2000
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from flowopt.benchmarks.perf.harness import Goal, PerfParser, markdown_table, setup_logging, start_run
from flowopt.lm.serve_process import serve_subprocess

logger = logging.getLogger(__name__)

SMOKE = {"clients": 8, "requests": 60, "max_tokens": 8}
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "answer", "question"]
MALFORMED: list[Any] = ["{not json", {"model": "tiny", "messages": "hello"}, {"model": "tiny"},
                        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}]


def _tiny_model(folder: Path) -> Path:
    from flowopt.optimizers.weights.tiny import tiny_causal_lm

    model, tokenizer = tiny_causal_lm(WORDS, hidden_size=64, layers=2, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _server_rss(port: int) -> int:
    """RSS in bytes of the child process listening on ``port`` (found among this process's children)."""
    me = os.getpid()
    children = []
    for task in Path(f"/proc/{me}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(pid) for pid in text]
    for pid in children:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if str(port) in cmdline:
            status = Path(f"/proc/{pid}/status").read_text()
            return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    raise RuntimeError(f"no child process serves port {port}")


def _body(i: int, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4))
    if i % 10 >= 7:
        return {"model": model, "prompt": f"question {words} answer", "max_tokens": max_tokens, "temperature": 0.0}
    return {"model": model, "messages": [{"role": "user", "content": f"question {words}"}], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": i, "stream": stream}


async def _one(client: Any, base: str, i: int, model: str, max_tokens: int) -> dict[str, Any]:
    kind = i % 10
    start = time.monotonic()
    if kind == 0:
        bad = MALFORMED[(i // 10) % len(MALFORMED)]
        content = bad if isinstance(bad, str) else json.dumps(bad)
        reply = await client.post(f"{base}/chat/completions", content=content,
                                  headers={"content-type": "application/json"})
        return {"kind": "malformed", "status": reply.status_code, "seconds": time.monotonic() - start}
    if kind in (1, 2, 3):
        first: float | None = None
        async with client.stream("POST", f"{base}/chat/completions", json=_body(i, model, max_tokens, True)) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                first = first if first is not None else time.monotonic() - start
                if kind == 1:
                    break  # the client goes away mid-generation
            status = reply.status_code
        return {"kind": "cancelled" if kind == 1 else "stream", "status": status, "first_s": first,
                "seconds": time.monotonic() - start}
    path = "completions" if kind >= 7 else "chat/completions"
    reply = await client.post(f"{base}/{path}", json=_body(i, model, max_tokens, False))
    ok = reply.status_code == 200 and bool(reply.json().get("choices"))
    return {"kind": "plain", "status": reply.status_code, "answered": ok, "seconds": time.monotonic() - start}


async def _load(base: str, port: int, model: str, *, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[dict[str, Any]] = []
    warm = max(1, requests // 10)
    rss: dict[str, int] = {}

    async def client_loop(client: Any) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                results.append(await _one(client, base, i, model, max_tokens))
            except httpx.HTTPError as err:
                results.append({"kind": "transport", "status": 0, "error": repr(err), "seconds": 0.0})
            if len(results) == warm and "warm" not in rss:
                rss["warm"] = _server_rss(port)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.monotonic() - started
    await asyncio.sleep(1.0)  # cancelled rows end at the server's next decode step
    rss["end"] = _server_rss(port)
    return {"results": results, "wall_s": wall, "rss": rss}


def _summary(load: dict[str, Any]) -> dict[str, Any]:
    results = load["results"]
    kinds = Counter(r["kind"] for r in results)
    statuses = Counter(str(r["status"]) for r in results)
    wellformed = [r for r in results if r["kind"] in ("plain", "stream")]
    answered = [r for r in wellformed if r["status"] == 200 and r.get("answered", True)]
    seconds = sorted(r["seconds"] for r in answered)
    firsts = sorted(r["first_s"] for r in results if r["kind"] == "stream" and r.get("first_s") is not None)

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None

    malformed_4xx = sum(r["kind"] == "malformed" and 400 <= r["status"] < 500 for r in results)
    return {"requests": len(results), "kinds": dict(kinds), "statuses": dict(statuses),
            "wellformed": len(wellformed), "answered": len(answered),
            "answered_share": round(len(answered) / max(1, len(wellformed)), 4),
            "malformed_4xx": malformed_4xx, "server_errors": sum(str(s).startswith("5") for s in statuses.elements()),
            "transport_errors": kinds.get("transport", 0),
            "latency_s": {"p50": pct(seconds, 0.5), "p99": pct(seconds, 0.99),
                          "mean": round(statistics.fmean(seconds), 4) if seconds else None},
            "stream_first_chunk_s": {"p50": pct(firsts, 0.5), "p99": pct(firsts, 0.99)},
            "wall_s": round(load["wall_s"], 2), "requests_per_s": round(len(results) / load["wall_s"], 2),
            "rss_bytes": load["rss"],
            "rss_end_over_warm": round(load["rss"]["end"] / load["rss"]["warm"], 4)}


def main(argv: list[str] | None = None) -> int:
    parser = PerfParser("serve_load", __doc__, smoke=SMOKE)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random model built here) or a model the "
                                                        "server takes (gemma-3-270m, a folder)")
    run = start_run(parser, argv)
    args = run.args
    with tempfile.TemporaryDirectory(prefix="flowopt-serve-load-") as tmp:
        model = str(_tiny_model(Path(tmp) / "model")) if args.model == "tiny" else args.model
        name = "tiny" if args.model == "tiny" else Path(args.model).name
        with serve_subprocess(model, "--name", name, log=Path(tmp) / "serve.log") as base:
            port = int(base.rsplit(":", 1)[1].split("/")[0])
            load = asyncio.run(_load(base, port, name, clients=args.clients, requests=args.requests,
                                     max_tokens=args.max_tokens))
    summary = _summary(load)
    rows = [["requests (well-formed / cancelled / malformed)",
             f"{summary['requests']} ({summary['wellformed']} / {summary['kinds'].get('cancelled', 0)} / "
             f"{summary['kinds'].get('malformed', 0)})"],
            ["well-formed answered", f"{summary['answered']} ({summary['answered_share']:.1%})"],
            ["status codes", ", ".join(f"{k}: {v}" for k, v in sorted(summary["statuses"].items()))],
            ["latency p50 / p99 (s)", f"{summary['latency_s']['p50']} / {summary['latency_s']['p99']}"],
            ["stream first chunk p50 / p99 (s)",
             f"{summary['stream_first_chunk_s']['p50']} / {summary['stream_first_chunk_s']['p99']}"],
            ["throughput (requests/s)", summary["requests_per_s"]],
            ["server RSS after warm-up / at the end (MiB)",
             f"{summary['rss_bytes']['warm'] / 2**20:.0f} / {summary['rss_bytes']['end'] / 2**20:.0f} "
             f"({summary['rss_end_over_warm']:.3f}x)"]]
    body = [f"{args.clients} concurrent clients, {args.requests} requests, max_tokens {args.max_tokens}, model "
            f"{args.model}.", "", *markdown_table(["measure", "value"], rows, align="lr")]
    goals = [Goal.at_least("well-formed, uncancelled requests answered", summary["answered_share"], 1.0),
             Goal.at_most("responses with status 5xx", summary["server_errors"], 0),
             Goal.at_most("server RSS at the end / after warm-up", summary["rss_end_over_warm"], 1.10)]
    run.finish("flowopt serve under load", summary, body, goals=goals)
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(main())
