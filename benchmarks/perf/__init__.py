"""Performance scripts, each run as a module: ``python -m flowopt.benchmarks.perf.NAME [--smoke] [--out STEM]``.

Every script records through :mod:`flowopt.benchmarks.perf.harness` (machine, timing, results files);
``tests/benchmarks/test_perf_smoke.py`` (``-m slow``) runs each one at its ``--smoke`` sizes.
"""
