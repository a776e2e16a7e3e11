"""Adaptive drafting: lossless whatever it decides, drops to plain decoding when drafts fail, comes back when they
pay, and keeps the draft cache complete across the rounds it skips."""

from __future__ import annotations

import pytest
from pairs import ALL_PAIRS, PAIR_IDS, PROMPTS

from dflash_runtime import load_pair
from dflash_runtime.decoding.controller import AdaptiveLength
from dflash_runtime.testing.tiny_models import REGIME_TOKEN, tiny_pair


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("head", ["shaped", "const", "random"])
def test_auto_is_lossless(target: str, draft: str, head: str, engines: dict) -> None:
    eng = engines[(target, draft, head)]
    for prompt in PROMPTS[:6]:
        base = eng.generate(prompt, max_tokens=40, speculative=False)
        res = eng.generate(prompt, max_tokens=40, draft_length="auto")
        assert res.tokens == base.tokens, prompt
        assert res.stats.controller["policy"] == "auto"
        assert len(res.stats.draft_lengths) == res.stats.target_steps


@pytest.fixture(scope="module")
def regime_engine():
    # Wide enough that drafting pays on a CPU when drafts are accepted (at width 128 plain decoding always wins).
    p = tiny_pair("dense", "dflash2", head="regime", n_embd=512, dims="scaled")
    with load_pair(p.target, p.draft, n_ctx=2048, draft_capacity=7) as eng:
        yield eng


def test_controller_moves_down_and_back_up(regime_engine) -> None:
    eng = regime_engine
    low = eng.generate("hello world", max_tokens=160, draft_length="auto")
    high = eng.generate("hello world" + REGIME_TOKEN, max_tokens=160, draft_length="auto",
                        cache_owner="another visitor")  # a policy of its own: it starts where a fresh one does
    assert low.tokens == eng.generate("hello world", max_tokens=160, speculative=False).tokens
    assert high.tokens == eng.generate("hello world" + REGIME_TOKEN, max_tokens=160, speculative=False).tokens
    down = low.stats.draft_lengths[len(low.stats.draft_lengths) // 2:]
    assert low.stats.acceptance_rate < 0.1
    assert down.count(0) >= 0.8 * len(down), down          # drafting stopped paying: mostly plain rounds
    up = high.stats.draft_lengths[len(high.stats.draft_lengths) // 2:]
    assert high.stats.acceptance_rate > 0.9
    assert sum(up) / len(up) >= 3, up                      # ...and came back once drafts were accepted
    view = high.stats.controller
    assert view["policy"] == "auto" and len(view["cost_ms_by_length"]) == 8
    assert view["acceptance_by_position"][0] > 0.5


def test_first_draft_after_a_plain_stretch_matches_a_fresh_engine(regime_engine) -> None:
    """Plain rounds leave their features pending; the first drafting round must see a draft cache as complete as a
    fresh engine's that prefilled the same tokens: same drafts, so the same tokens, sources and acceptance."""
    p = tiny_pair("hybrid", "dflash2", head="shaped")
    prompt = "the quick brown fox jumps over the lazy dog."
    options = dict(max_tokens=24, draft_length=7)
    with load_pair(p.target, p.draft, n_ctx=1024, draft_capacity=7) as eng:
        plain = eng.generate(prompt, max_tokens=50, speculative=False)  # 49 plain rounds
        continued = eng.tokenize(prompt) + plain.tokens
        warm = eng.generate(continued, **options)
    with load_pair(p.target, p.draft, n_ctx=1024, draft_capacity=7) as fresh:
        cold = fresh.generate(continued, **options)
    assert warm.stats.n_reused > 0 and cold.stats.n_reused == 0
    assert warm.tokens == cold.tokens
    assert warm.token_sources == cold.token_sources
    assert warm.stats.accepted_per_position == cold.stats.accepted_per_position
    assert warm.stats.accepted > 0


def test_policy_logic_without_a_model() -> None:
    """The decision rule itself, on synthetic costs: plain when drafts fail, long drafts when they pass."""
    pol = AdaptiveLength(7)
    lengths = []
    for _ in range(200):
        n = pol.choose(0, 99)
        lengths.append(n)
        pol.observe(n, n, 0, 0.001 * (1 + 0.5 * n))  # never accepted, each drafted row costs half a plain step
    assert lengths[0] == 7 and lengths[-50:].count(0) >= 45
    assert pol.probe_interval == pol.probe_max  # failed probes backed off
    pol.begin_request()  # a new request probes at once
    for _ in range(60):
        n = pol.choose(0, 99)
        lengths.append(n)
        pol.observe(n, n, n, 0.001 * (1 + 0.5 * n))  # always accepted
    assert lengths[-20:] == [7] * 20
    assert pol.describe()["best_length"] == 7


def test_the_cost_model_sees_the_rows_of_the_decode_it_pays_for() -> None:
    """Beside a plain request that runs throughout, every decode of a drafting request holds both requests' rows,
    evened out with filler rows: 2 × (n + 1) for a round of length n. Its cost model is keyed by those rows (it
    used to see n + 1 plus the rows of lower-numbered sequences, counted before the filler)."""
    p = tiny_pair("dense", "dflash2", head="const")
    with load_pair(p.target, p.draft, n_ctx=1024, draft_capacity=7, parallel=2) as eng:
        plain = eng.stream(PROMPTS[0], max_tokens=400, speculative=False)
        next(plain)  # its prompt is in: from here on it decodes one row a step
        drafting = eng.stream(PROMPTS[1], max_tokens=60, draft_length="auto", cache_owner="drafting")
        for event in drafting:
            assert next(plain).finish_reason is None  # one event each a step: both in every decode
            if event.finish_reason is not None:
                break
        plain.close()
        policy = eng.draft_policy("drafting", "dflash", "auto")  # the one the request gave back
    assert policy is not None
    lengths = {n for n, cost in enumerate(policy["cost_ms_by_length"]) if cost is not None}
    assert max(lengths) > 0
    assert set(policy["decode_rows_costed"]) == {2 * (n + 1) for n in lengths}
