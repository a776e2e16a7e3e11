"""The page's live speed-up against what the A/B measures, on the offline demo's pair and settings.

For each of three prompts, one try: plain decoding, the speculative answer (its statistics fed to the page's
estimator after every step, as the page feeds them), plain decoding again, all on one engine and back to back, so a
loaded machine slows the three alike; the A/B's ratio is the answer's speed over the plain runs' mean, each speed
computed as the A/B computes it. The answer's final estimate must be within 25 % of that ratio in every try.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from space_client import reference_engine

from dflash_runtime.space.page.speedup import Estimate, LiveSpeedUp
from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT
from dflash_runtime.space.web.service import decode_speed

# Three of the page's examples whose answers on the demo pair take plain steps early enough (the demo's target follows
# stretches of phrases: a stretch the draft predicts takes none), from about 50 to over 100 in 256 tokens.
PROMPTS = ("Explain speculative decoding in three sentences.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Translate 'the quick brown fox jumps over the lazy dog' into French and German.")  # fmt: skip
MAX_TOKENS = 256
TOLERANCE = 0.25
N_CTX = 4096  # the offline demo's


def page_stats(stats: Any) -> dict[str, Any]:
    """An engine snapshot as the page's statistics carry it: decode speed as the Space computes it."""
    out: Mapping[str, Any] = stats.to_dict()
    return {**out, "decode_tok_s": decode_speed(out)}


def answer(engine: Any, prompt: str, live: LiveSpeedUp | None = None, **options: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    last: dict[str, Any] = {}
    for event in engine.stream_chat(messages, max_tokens=MAX_TOKENS, temperature=0.0, **options):
        last = page_stats(event.stats)
        if live is not None:
            live.add(last)
    return last


def test_the_final_live_estimate_is_within_a_quarter_of_the_ab_ratio_for_the_same_prompt() -> None:
    tries = []
    with reference_engine(N_CTX) as engine:
        engine.generate("warm up", max_tokens=16)  # the first request pays allocations: measured by nobody
        for prompt in PROMPTS:
            before = answer(engine, prompt, speculative=False)
            live = LiveSpeedUp()
            speculative = answer(engine, prompt, live)
            after = answer(engine, prompt, speculative=False)
            plain = statistics.mean([before["decode_tok_s"], after["decode_tok_s"]])
            ratio = speculative["decode_tok_s"] / plain
            estimate = live.current(speculative)
            assert isinstance(estimate, Estimate), f"{prompt!r}: no estimate at the end ({estimate})"
            tries.append((prompt, estimate.ratio, estimate.margin, ratio, estimate.plain_steps,
                          speculative["plain_steps"]))  # fmt: skip
    for prompt, estimated, margin, measured, timed, plain_steps in tries:
        print(f"{prompt!r}: estimate {estimated:.3f}× ± {margin:.3f} on {timed} timed of {plain_steps} plain steps, "
              f"A/B {measured:.3f}×, off by {estimated / measured - 1:+.1%}")
    off = [abs(estimated / measured - 1) for _, estimated, _, measured, _, _ in tries]
    assert all(o <= TOLERANCE for o in off), f"estimates off by {[f'{o:.1%}' for o in off]} (tolerance 25 %)"
