"""The workload the LocalLM perf scripts share: GSM8K test prompts and the two ways of calling an LM.

Prompts are the first questions of the official GSM8K test file in file order (checksum-verified by
:func:`flowopt.benchmarks.datasets.verify_file`), so every script and every run sees the same text.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from flowopt.benchmarks.datasets import verify_file


def gsm8k_rows(count: int) -> list[dict[str, str]]:
    """The first ``count`` GSM8K test records: ``{"question", "gold"}`` (the final number, commas removed)."""
    lines = verify_file("gsm8k/test.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][:count]
    return [{"question": r["question"], "gold": r["answer"].split("####")[-1].strip().replace(",", "")}
            for r in rows]


def gsm8k_prompts(count: int) -> list[str]:
    """The first ``count`` GSM8K test questions as plain completion prompts (``Question: ...\\nAnswer:``)."""
    return [f"Question: {r['question']}\nAnswer:" for r in gsm8k_rows(count)]


def calls_one_at_a_time(lm: Any, texts: list[str]) -> tuple[int, float]:
    """Call the ``dspy.LM`` ``lm`` on each text in turn; (completion tokens, seconds)."""
    began = time.perf_counter()
    for text in texts:
        lm(text)
    produced = sum(h["usage"]["completion_tokens"] for h in lm.history[-len(texts):])
    return produced, time.perf_counter() - began


def calls_at_once(lm: Any, texts: list[str]) -> tuple[int, float]:
    """Call ``lm`` on every text from its own thread, all released together; (completion tokens, seconds)."""
    barrier = threading.Barrier(len(texts))
    errors: list[BaseException] = []

    def call(text: str) -> None:
        barrier.wait()
        try:
            lm(text)
        except BaseException as err:  # re-raised below: a thread's exception would otherwise only be printed
            errors.append(err)

    threads = [threading.Thread(target=call, args=(t,)) for t in texts]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    produced = sum(h["usage"]["completion_tokens"] for h in lm.history[-len(texts):])
    return produced, time.perf_counter() - began
