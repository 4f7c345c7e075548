"""The command line every perf script shares: ``--out STEM`` and ``--smoke``, then :func:`start_run`.

``--out`` is a file stem everywhere: ``--out benchmarks/results/NAME`` writes ``NAME.json`` and
``NAME.md`` there (extra outputs as ``NAME_<what>.<ext>``); it defaults to ``benchmarks/results/<script>``.
``--smoke`` switches the script's defaults to its smallest sizes (options given explicitly still win),
so the smoke test can run every script in seconds to minutes.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .report import PerfRun

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"
MODULE_PREFIX = "flowopt.benchmarks.perf."
NOISY_LOGGERS = ("dspy", "LiteLLM", "litellm", "httpx", "urllib3", "transformers", "trl", "optuna", "filelock",
                 "bm25s")


class PerfParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with ``--out`` and ``--smoke``; ``smoke`` maps option names to smallest sizes.

    Example:
        >>> parser = PerfParser("demo", "A demo.", smoke={"repeats": 1})
        >>> _ = parser.add_argument("--repeats", type=int, default=5)
        >>> parser.parse_args(["--smoke"]).repeats, parser.parse_args([]).repeats
        (1, 5)
    """

    def __init__(self, script: str, description: str | None, *, smoke: Mapping[str, Any]) -> None:
        summary = (description or script).strip().splitlines()[0]
        super().__init__(prog=f"python -m {MODULE_PREFIX}{script}", description=summary)
        self.script = script
        self.smoke = dict(smoke)
        self.add_argument("--out", type=Path, default=RESULTS_DIR / script,
                          help=f"file stem: writes STEM.json and STEM.md (default: benchmarks/results/{script} "
                               "in the flowopt checkout)")  # no absolute path: help text is copied into docs
        self.add_argument("--smoke", action="store_true",
                          help="smallest sizes, to check that the script runs: "
                               + (", ".join(f"{k}={v}" for k, v in self.smoke.items()) or "defaults"))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        unknown = set(self.smoke) - {action.dest for action in self._actions}
        if unknown:
            raise ValueError(f"{self.script}: smoke sizes name no option: {sorted(unknown)}")
        probe, _ = self.parse_known_args(argv)
        if probe.smoke:
            defaults = {action.dest: action.default for action in self._actions if action.dest in self.smoke}
            self.set_defaults(**self.smoke)
            try:
                parsed = super().parse_args(argv, namespace)
            finally:  # the parser's own defaults stay as declared
                self.set_defaults(**defaults)
        else:
            parsed = super().parse_args(argv, namespace)
        out: Path = parsed.out
        if out.is_dir():
            self.error(f"--out {out} is a folder; --out is a file stem: pass {out / self.script} to write "
                       f"{out / self.script}.json and .md")
        if out.suffix in (".json", ".md"):
            self.error(f"--out {out} ends in {out.suffix}; --out is a file stem: pass {out.with_suffix('')}")
        return parsed


def start_run(parser: PerfParser, argv: Sequence[str] | None = None) -> PerfRun:
    """Parse ``argv`` (default ``sys.argv[1:]``), make the output folder and start the clock and load record.

    The output folder is made (and so checked) now, not after an hour of measuring.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m", MODULE_PREFIX + parser.script, shlex.join(argv)]).strip()
    return PerfRun(script=parser.script, command=command, args=args, out=args.out)


def setup_logging(level: int = logging.INFO) -> None:
    """A script run's logging: progress and the results table to stderr, libraries' chatter kept to errors.

    It changes process-wide logging, so only a script's entry point calls it (``if __name__ ==
    "__main__": setup_logging()``), never ``main()``: a test or notebook that imports a script and calls
    ``main(argv)`` keeps its own logger levels and handlers.
    """
    logging.basicConfig(level=level, format="%(message)s")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:  # bm25s sets its logger to DEBUG when it is imported (later)
        handler.addFilter(_no_library_chatter)


def _no_library_chatter(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or record.name.split(".")[0] not in NOISY_LOGGERS
