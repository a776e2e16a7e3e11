"""The page's live speed-up against what the A/B measures, on the offline demo's pair, in a GPU-like cost regime.

On a GPU a verify of a few rows costs about what a one-row step costs, and the adaptive draft length then rarely takes
a plain step: the estimate must still show early and hold. The CPU plays that regime with batches (verifies, draft
blocks) on two threads and one-row decodes on one. For each of five prompts, one try: plain decoding, the speculative
answer (its statistics fed to the page's estimator after every step, as the page feeds them), plain decoding again,
all on one engine and back to back, so a loaded machine slows the three alike; the A/B's ratio is the answer's speed
over the plain runs' mean, each speed computed as the A/B computes it. The estimate must show within the first 64
tokens, and its interval must hold the A/B's ratio, give or take the A/B's own uncertainty (half the gap between its
two plain runs, relative), on four of the five prompts at least (the rate an interval of about 95 % holds at), the
fifth missing by less than its interval again.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from space_client import demo_pair

from dflash_runtime import load_pair
from dflash_runtime.space.page.speedup import Estimate, LiveSpeedUp
from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT
from dflash_runtime.space.web.service import decode_speed

PROMPTS = ("Explain speculative decoding in three sentences.",
           "Write a Python function that checks whether a string is a palindrome.",
           "List five facts about the planet Mars.",
           "Translate 'the quick brown fox jumps over the lazy dog' into French and German.",
           "Write a haiku about the sea.")  # fmt: skip
MAX_TOKENS = 192
SHOWN_BY = 64
N_CTX = 4096  # the offline demo's


def page_stats(stats: Any) -> dict[str, Any]:
    """An engine snapshot as the page's statistics carry it: decode speed as the Space computes it."""
    out: Mapping[str, Any] = stats.to_dict()
    return {**out, "decode_tok_s": decode_speed(out)}


def answer(engine: Any, prompt: str, live: LiveSpeedUp | None = None, **options: Any) -> tuple[dict[str, Any], int]:
    """The answer's last statistics, and how many tokens it had written when the estimate first showed."""
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    last: dict[str, Any] = {}
    shown = MAX_TOKENS + 1
    for event in engine.stream_chat(messages, max_tokens=MAX_TOKENS, temperature=0.0, **options):
        last = page_stats(event.stats)
        if live is not None:
            live.add(last)
            if shown > MAX_TOKENS and isinstance(live.current(last), Estimate):
                shown = last["n_generated"]
    return last, shown


def test_the_live_estimate_shows_early_and_holds_the_ab_ratio_where_a_verify_costs_a_plain_step() -> None:
    tries = []
    pair = demo_pair()
    with load_pair(pair.target, pair.draft, n_ctx=N_CTX, draft_capacity=7, n_threads=1, n_threads_batch=2) as engine:
        engine.generate("warm up", max_tokens=16)  # the first request pays allocations: measured by nobody
        for prompt in PROMPTS:
            before, _ = answer(engine, prompt, speculative=False)
            live = LiveSpeedUp()
            speculative, shown = answer(engine, prompt, live)
            after, _ = answer(engine, prompt, speculative=False)
            plain = statistics.mean([before["decode_tok_s"], after["decode_tok_s"]])
            ratio = speculative["decode_tok_s"] / plain
            ab_margin = ratio * abs(before["decode_tok_s"] - after["decode_tok_s"]) / (2 * plain)
            estimate = live.current(speculative)
            assert isinstance(estimate, Estimate), f"{prompt!r}: no estimate at the end ({estimate})"
            tries.append((prompt, shown, estimate, ratio, ab_margin, speculative["plain_steps"]))
    for prompt, shown, estimate, measured, ab_margin, plain_steps in tries:
        print(f"{prompt!r}: shown at {shown} tokens; estimate {estimate.ratio:.3f}× ± {estimate.margin:.3f} on "
              f"{estimate.plain_steps} timed of {plain_steps} plain steps, A/B {measured:.3f}× ± {ab_margin:.3f}")
    assert all(shown <= SHOWN_BY for _, shown, _, _, _, _ in tries), "a figure within the first 64 tokens"
    missed = [(prompt, round(e.ratio, 3), round(e.margin, 3), round(m, 3), round(a, 3),
               round(abs(e.ratio - m) / (e.margin + a), 2))
              for prompt, _, e, m, a, _ in tries if abs(e.ratio - m) > e.margin + a]
    # About 95 % intervals: five hold their A/B's ratio with a probability of about 0.77, four or five with about
    # 0.98. So one of five may miss, by little (an estimate off by twice its interval is not noise); two may not.
    assert len(missed) <= 1 and all(far <= 2 for *_, far in missed), (
        f"intervals that do not hold the A/B's ratio: {missed}")
