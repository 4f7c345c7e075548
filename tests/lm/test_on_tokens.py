"""The decode loop's ``on_tokens`` hook: tokens reach the caller step by step, and False cancels a row."""

from __future__ import annotations

from flowopt.lm.sampling import RowSettings


def test_on_tokens_sees_every_completion_token_in_order(tiny_local):
    seen: list[int] = []
    sample = tiny_local.complete_ids(tiny_local.render("hello there"), RowSettings(max_new_tokens=8),
                                     on_tokens=seen.extend)
    assert seen == sample.completion_ids and len(seen) >= 1


def test_returning_false_cancels_the_row_after_that_step(tiny_local):
    seen: list[int] = []

    def stop_after_two(ids: list[int]) -> bool:
        seen.extend(ids)
        return len(seen) < 2

    prompt = tiny_local.render("hello there")
    full = tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=8))
    cut = tiny_local.complete_ids(prompt, RowSettings(max_new_tokens=8), on_tokens=stop_after_two)
    assert len(full.completion_ids) > 2  # so the cancellation is what shortens it
    assert cut.completion_ids == full.completion_ids[:2] == seen


def test_complete_many_streams_each_row_to_its_own_hook(tiny_local):
    rows = [RowSettings(max_new_tokens=6, temperature=1.0, seed=s) for s in (1, 2)]
    streams: list[list[int]] = [[], []]
    samples = tiny_local.complete_many(tiny_local.render("hello there"), rows,
                                       on_tokens=lambda index, ids: streams[index].extend(ids))
    assert streams == [s.completion_ids for s in samples]
