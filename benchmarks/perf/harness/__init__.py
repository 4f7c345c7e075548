"""The harness of ``benchmarks/perf/``: machine record, interleaved timing, and results files.

One way for every perf script to take ``--out STEM`` and ``--smoke``, time the sides of a comparison
(interleaved repeats, medians), record the machine (CPU model, cores, memory, library versions, git
commit, load average before and after) and write ``STEM.json`` (schema ``flowopt.perf/v1``, see
:mod:`.report`) with ``STEM.md`` beside it, quoting the exact command line.

A new script ``benchmarks/perf/my_bench.py``, run as ``python -m flowopt.benchmarks.perf.my_bench``::

    import statistics

    from flowopt.benchmarks.perf.harness import (Goal, PerfParser, interleaved, markdown_table, setup_logging,
                                                 spread, start_run, timed)

    def main(argv: list[str] | None = None) -> int:
        parser = PerfParser("my_bench", __doc__, smoke={"repeats": 1, "size": 10})
        parser.add_argument("--repeats", type=int, default=5)
        parser.add_argument("--size", type=int, default=10_000)
        run = start_run(parser, argv)        # parses (with --smoke), records the load average before
        args = run.args
        runs = interleaved({"ours": lambda: timed(lambda: ours(args.size))[1],
                            "peer": lambda: timed(lambda: peer(args.size))[1]}, args.repeats, warmup=1)
        seconds = {name: spread(values) for name, values in runs.items()}
        ratio = statistics.median(runs["ours"]) / statistics.median(runs["peer"])
        rows = [[name, s["median"], s["values"]] for name, s in seconds.items()]
        run.finish("ours vs peer", results={"seconds": seconds, "ratio": ratio},
                   body=markdown_table(["side", "median s", "repeats (s)"], rows, align="lrl"),
                   goals=[Goal.at_most("time ratio ours / peer", round(ratio, 3), 1.0)])
        return 0

    if __name__ == "__main__":
        setup_logging()                      # process-wide, so the entry point's job, not main()'s
        raise SystemExit(main())

Extra outputs go beside the results (``run.sibling("_curve.png")``); :func:`read_results` reads a file
back and checks the schema. A script that adopts the harness gets a case in ``SCRIPTS`` of
``tests/benchmarks/test_perf_smoke.py`` (and leaves ``NOT_ON_HARNESS`` there), so its ``--smoke`` run is tested.
"""

from .cli import RESULTS_DIR, PerfParser, setup_logging, start_run
from .machine import describe_machine, load_average, machine_record
from .report import SCHEMA, Goal, PerfRun, markdown_table, read_results, stem_path
from .timing import interleaved, median_seconds, spread, timed

__all__ = [
    "RESULTS_DIR",
    "SCHEMA",
    "Goal",
    "PerfParser",
    "PerfRun",
    "describe_machine",
    "interleaved",
    "load_average",
    "machine_record",
    "markdown_table",
    "median_seconds",
    "read_results",
    "setup_logging",
    "spread",
    "start_run",
    "stem_path",
    "timed",
]
