"""The ``flowopt`` command: ``flowopt bench ...`` runs a benchmark, ``flowopt serve ...`` serves a local model.

The entry point lives in the top layer because ``bench`` needs every layer below it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from flowopt.errors import FlowoptError, Interrupted

logger = logging.getLogger("flowopt")


def bench_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    description = "Score a baseline program, compile it, and score the compiled program on the report split."
    parser = (sub.add_parser("bench", help="run a benchmark protocol", description=description)
              if sub is not None else argparse.ArgumentParser(prog="flowopt bench", description=description))
    parser.add_argument("protocol", nargs="?", help="gsm8k-dspy, gsm8k-aflow, hotpotqa-aflow, hotpotqa-closedbook")
    parser.add_argument("--list", action="store_true", help="list protocols and programs, then exit")
    parser.add_argument("--lm", default="gemma-3-270m",
                        help="model: gemma-3-270m (embedded, CPU), a local model folder, or any litellm "
                             "name such as openai/gpt-4o-mini (default: %(default)s)")
    parser.add_argument("--api-base", default=None, help="OpenAI-compatible endpoint (vLLM, Ollama, flowopt serve)")
    parser.add_argument("--program", default="cot",
                        help="predict, cot or workflow (default: %(default)s), or a saved program (an earlier "
                             "run's compiled.json) for the stages to continue from")
    parser.add_argument("--stages", default="search",
                        help="comma-separated compile stages (labeled, demos, search, structure, finetune, grpo), "
                             "or 'none' to score the baseline only (default: %(default)s)")
    parser.add_argument("--train", type=int, default=20, help="training examples (default: %(default)s)")
    parser.add_argument("--dev", type=int, default=20, help="validation examples for compile (default: %(default)s)")
    parser.add_argument("--test", type=int, default=50, help="report-split examples (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=8,
                        help="candidate programs the search stage tries (default: %(default)s)")
    parser.add_argument("--demos", type=int, default=None,
                        help="most demos per predictor for the labeled, demos and search stages; a small model "
                             "reading long examples (HotpotQA's passages) needs few (default: each stage's own, "
                             "DSPy's 16)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="structure stage: most search rounds, each scoring one edited workflow on the dev "
                             "split (default: the stage's own, 20)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="completion token limit per LM call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=4,
                        help="parallel threads for scoring and for compile() (default: %(default)s)")
    parser.add_argument("--lm-batch", type=int, default=16,
                        help="local models: most concurrent calls generated as one batch; raise it with "
                             "--threads on a GPU (default: %(default)s)")
    parser.add_argument("--lm-compile", choices=("auto", "on", "off"), default="auto",
                        help="local models: compile the decode step with torch.compile (auto: on CUDA only, where "
                             "CUDA graphs pay; each batch-size bucket compiles once, seconds each)")
    parser.add_argument("--lm-quantize", choices=("int8", "int4"), default=None,
                        help="local models on CPU: decode steps of up to 16 rows through int8 linears and an int8 or "
                             "int4 output projection (weight-only up to 4 rows, int8 activations up to 16: faster "
                             "decoding for 1-16 concurrent calls; greedy outputs can change, so off by default; "
                             "prefill, larger batches, training and scoring keep the exact weights: "
                             "benchmarks/results/decode_quantized_steps_cpu.md)")
    parser.add_argument("--max-lm-calls", type=int, default=None, help="compile budget: LM calls")
    parser.add_argument("--max-cost-usd", type=float, default=None, help="compile budget: dollars")
    parser.add_argument("--max-wall-s", type=float, default=None, help="compile budget: wall time")
    weights = parser.add_argument_group("weights stages (finetune, grpo)")
    weights.add_argument("--student", default=None,
                         help="model to train: a local model name or folder (default: the --lm model if local)")
    weights.add_argument("--teacher", default=None,
                         help="finetune teacher: an LM name such as openai/gpt-4o-mini (default: the program itself)")
    weights.add_argument("--labels", choices=("none", "only", "mix"), default="none",
                         help="finetune on the gold labels: 'only' (no teacher), 'mix' (with passing teacher "
                              "traces) or 'none' (default: %(default)s)")
    weights.add_argument("--exclude-demos", action="store_true",
                         help="finetune on prompts without the demos earlier stages attached, and drop them "
                              "from the fine-tuned program (DSPy's BootstrapFinetune(exclude_demos=True))")
    weights.add_argument("--epochs", type=int, default=3, help="finetune epochs (default: %(default)s)")
    weights.add_argument("--grpo-steps", type=int, default=20, help="GRPO optimizer steps (default: %(default)s)")
    weights.add_argument("--group-size", type=int, default=4,
                         help="GRPO samples per question (default: %(default)s)")
    weights.add_argument("--grpo-batch", type=int, default=4,
                         help="GRPO questions per step (default: %(default)s)")
    parser.add_argument("--out", default="runs/bench", help="output folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or log lines: only the final table")
    return parser


def _no_bm25s_debug(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.split(".")[0] != "bm25s"


class _TruncationNotes(logging.Filter):
    """Shows DSPy's per-call "LM response was truncated" warning once and counts the rest.

    A short ``--max-tokens`` (8 for HotpotQA's span answers) truncates most calls on purpose, and DSPy
    warns on every one: thousands of identical lines that bury the progress bars.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("LM response was truncated"):
            return True
        self.hidden += 1
        if self.hidden > 1:
            return False
        record.msg = f"{record.getMessage()} (shown once; with a short --max-tokens this is expected)"
        record.args = ()
        return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="flowopt", description="flowopt: a compiler for LLM programs")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_parser(sub)
    sub.add_parser("serve", help="serve a local model over an OpenAI-compatible API (see flowopt serve -h)",
                   add_help=False)
    if argv[:1] == ["serve"]:  # serve owns its arguments
        from flowopt.lm.serve import cli_main

        return cli_main(argv[1:])
    args = parser.parse_args(argv)
    quiet = getattr(args, "quiet", False) and not args.verbose
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    truncations = _TruncationNotes()
    if not args.verbose:  # bm25s sets its own logger to DEBUG when it is imported (later): filter at the handler
        for handler in logging.getLogger().handlers:
            handler.addFilter(_no_bm25s_debug)
        # On the logger itself: DSPy prints through its own handler, not the root one.
        logging.getLogger("dspy.clients.lm").addFilter(truncations)
    try:
        from flowopt.benchmarks.runner import run_bench

        return run_bench(args)
    except Interrupted as err:  # SIGINT/SIGTERM inside a compile: stopped at a safe point, resumable
        logger.error("%s", err)
        return err.exit_code
    except FlowoptError as err:
        logger.error("%s", err)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a compile (loading, test scoring): every file is written whole
        logger.error("stopped by SIGINT. Fix: rerun the same command with --resume to continue")
        return 130
    finally:
        logging.getLogger("dspy.clients.lm").removeFilter(truncations)
        if truncations.hidden > 1:
            logger.warning("%d LM responses were truncated at --max-tokens %s (one warning shown)",
                           truncations.hidden, getattr(args, "max_tokens", "?"))


if __name__ == "__main__":
    raise SystemExit(main())
