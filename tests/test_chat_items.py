"""What a /chat item carries (dflash_runtime/space/page/items.py), on a real answer's statistics: the counts added up
over the items are the answer's totals, a figure that did not change is not sent again, the last item is complete,
and an item's size does not grow with the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from space_client import add_up, rebuilt, reference_engine, trimmed

from dflash_runtime.space.page.items import GROWING, GROWING_PER_POSITION, ITEM_OWN, item_stats

MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]


def answer_items(max_tokens: int, **options: Any) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """A real answer's /chat items (each step's statistics as the engine reports them), and its final statistics."""
    items: list[tuple[str, dict[str, Any]]] = []
    before: dict[str, Any] = {}
    final: dict[str, Any] = {}
    with reference_engine(n_ctx=4096) as engine:
        for event in engine.stream_chat(MESSAGES, max_tokens=max_tokens, **options):
            stats = event.stats.to_dict()
            finished = event.finish_reason is not None
            own = {"source_runs": [[len(event.delta), "target"]], "draft_lengths": []}
            items.append((event.delta, item_stats(stats, before, own, finished)))
            before = final = stats
    return items, final


@pytest.fixture(scope="module")
def sampled() -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    return answer_items(256, temperature=2.0, seed=7, draft_length=7)


def test_the_counts_added_up_are_the_answers_totals(sampled: Any) -> None:
    items, final = sampled
    assert len(items) > 50
    sums: dict[str, Any] = {}
    for _, stats in items:
        sums = add_up(sums, stats["added"])
    for key in ("n_generated", "drafted", "accepted", "verify_steps", "target_steps"):
        assert sums[key] == final[key], key
    for key in ("decode_ms", "verify_ms", "draft_ms"):
        assert sums[key] == pytest.approx(final[key], abs=1e-6 * len(items))
    for key in GROWING_PER_POSITION:  # a position never accepted: a trailing 0 in the totals, never "added"
        assert trimmed(sums[key]) == trimmed(final[key]), key
    assert rebuilt([(text, {**stats}) for text, stats in items])[-1][1]["n_generated"] == final["n_generated"]


def test_an_item_sends_only_what_changed(sampled: Any) -> None:
    items, final = sampled
    first, middle, last = items[0][1], items[len(items) // 2][1], items[-1][1]
    assert first["method"] == "dflash" and first["n_prompt"] == final["n_prompt"]  # the first: every figure
    for key in ("method", "n_prompt", "draft_capacity", "verify_mode", "speculative"):
        assert key not in middle, key  # unchanged since the first
    for key in (*GROWING, *GROWING_PER_POSITION, "drafted_by", "controller"):
        assert key not in middle, key  # counts come as what they grew by, under "added"; the rest at the end
    assert middle["added"]["n_generated"] >= 1
    complete = {key: value for key, value in final.items() if key not in ITEM_OWN}
    assert {key: last[key] for key in complete} == complete  # the last: complete, drafted_by included
    assert len(last["drafted_by"]) == final["verify_steps"]


def test_an_items_size_does_not_grow_with_the_answer() -> None:
    """A long answer's items are no bigger than a short one's: its bytes grow linearly with its length (the totals'
    digits stay out of the items between the first and the last)."""
    items, _ = answer_items(1024, temperature=2.0, seed=3, draft_length=7)
    sizes = [len(json.dumps(stats)) for _, stats in items[1:-1]]
    early, late = sizes[: len(sizes) // 8], sizes[-len(sizes) // 8:]
    assert sum(late) / len(late) <= 1.02 * sum(early) / len(early), (sum(early) / len(early), sum(late) / len(late))
