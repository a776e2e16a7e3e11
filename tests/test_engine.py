"""The speculative engine is lossless, keeps its statistics consistent, and survives bad input and cancellation."""

from __future__ import annotations

import json

import pytest
from pairs import ALL_PAIRS, PAIR_IDS, PROMPTS, pair_files

from dflash_runtime import (
    EngineClosedError,
    PromptTooLongError,
    RequestError,
    RollbackError,
    load_pair,
)
from dflash_runtime.results.stats import Stats


def check_invariants(stats: Stats, tokens: list[int], draft_length: int | None = None) -> None:
    assert stats.n_generated == len(tokens)
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True))
    # accepted_per_position is non-increasing: position i+1 is accepted only after position i
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:], strict=False))
    # every verify step emits its accepted drafts plus at most one token more
    assert stats.accepted <= stats.verify_emitted <= stats.accepted + stats.verify_steps
    # the prompt's first sample, then one token per plain step, the rest from verify steps
    assert stats.n_generated <= 1 + stats.plain_steps + stats.verify_emitted
    assert stats.n_prompt == stats.n_reused + stats.n_prefilled
    # the plain steps' time is a part of the steps' time, there exactly when plain steps ran
    assert 0 <= stats.plain_ms <= stats.verify_ms and (stats.plain_ms > 0) == (stats.plain_steps > 0)
    if stats.verify_steps:
        assert stats.mean_accepted_length == pytest.approx(stats.verify_emitted / stats.verify_steps)
        assert 1.0 <= stats.mean_accepted_length <= 1 + max(stats.draft_lengths)
    if stats.drafted:
        assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    if draft_length is not None:
        assert len(stats.accepted_per_position) <= draft_length
    json.loads(stats.to_json())


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
def test_greedy_speculative_equals_plain(target: str, draft: str, engines: dict) -> None:
    eng = engines[(target, draft, "shaped")]
    rejected = 0
    for prompt in PROMPTS:
        base = eng.generate(prompt, max_tokens=24, speculative=False)
        assert base.stats.drafted == 0
        for draft_length in (1, 2, 4, 7):
            res = eng.generate(prompt, max_tokens=24, draft_length=draft_length)
            assert res.tokens == base.tokens, (prompt, draft_length)
            assert res.text == base.text
            check_invariants(res.stats, res.tokens, draft_length)
            rejected += res.stats.drafted - res.stats.accepted
    assert rejected > 0  # rollbacks were exercised


@pytest.mark.parametrize(("target", "draft"), ALL_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("head", ["const", "random"])
def test_greedy_lossless_at_high_and_low_acceptance(target: str, draft: str, head: str, engines: dict) -> None:
    eng = engines[(target, draft, head)]
    for prompt in PROMPTS[:4]:
        base = eng.generate(prompt, max_tokens=40, speculative=False)
        res = eng.generate(prompt, max_tokens=40, draft_length=7)
        assert res.tokens == base.tokens
        check_invariants(res.stats, res.tokens)
        if head == "const":
            assert res.stats.acceptance_rate > 0.9 and res.stats.mean_accepted_length > 5
        else:
            assert res.stats.acceptance_rate < 0.2


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_seed_repeats_the_text_for_the_same_settings(target: str, engines: dict) -> None:
    """Rejection sampling draws from one host generator per request: the same seed, engine and settings (a fixed
    draft length) give the same text. Equality with plain decoding is not promised above temperature 0: batched
    verify rows and single-row decodes need not give bit-identical logits (test_distribution.py checks the law)."""
    eng = engines[(target, "dflash2", "random")]
    kw = dict(max_tokens=24, temperature=0.9, top_k=0, top_p=0.95, min_p=0.02, draft_length=4)
    for seed in range(3):
        first = eng.generate("the quick brown fox", seed=seed, **kw)
        again = eng.generate("the quick brown fox", seed=seed, **kw)
        assert first.tokens == again.tokens and first.stats.verify_mode == "sample"
        check_invariants(first.stats, first.tokens)
    texts = {tuple(eng.generate("the quick brown fox", seed=seed, **kw).tokens) for seed in range(6)}
    assert len(texts) > 1  # the seed matters


def test_stop_strings_and_max_tokens(engines: dict) -> None:
    eng = engines[("dense", "dflash2", "shaped")]
    base = eng.generate("hello world", max_tokens=30, speculative=False)
    stop = base.text[8:12]
    assert stop
    cut = base.text.index(stop)
    for spec in (False, True):
        res = eng.generate("hello world", max_tokens=30, stop=[stop], speculative=spec, draft_length=7)
        assert res.finish_reason == "stop" and res.text == base.text[:cut]
        res = eng.generate("hello world", max_tokens=5, speculative=spec, draft_length=7)
        assert res.finish_reason == "length" and len(res.tokens) == 5 and res.tokens == base.tokens[:5]


def test_streaming_events(engines: dict) -> None:
    eng = engines[("hybrid", "dflash2", "shaped")]
    events = list(eng.stream("hello world", max_tokens=30, draft_length=7))
    assert len(events) > 2
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason == "length"
    tokens = [t for e in events for t in e.tokens]
    assert "".join(e.delta for e in events) == eng.detokenize(tokens)
    gens = [e.stats.n_generated for e in events]
    assert gens == sorted(gens) and gens[-1] == 30


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_multi_turn_reuses_the_prefix(target: str) -> None:
    files = pair_files(target, "dflash2")
    turn1 = [{"role": "user", "content": "hello there"}]
    with load_pair(files.target, files.draft, n_ctx=1024, draft_capacity=7) as eng:
        first = eng.chat(turn1, max_tokens=12)
        turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
        second = eng.chat(turn2, max_tokens=12)
        full = len(eng.chat_tokens(turn2))
        assert second.stats.n_prompt == full
        assert second.stats.n_reused >= len(eng.chat_tokens(turn1)) + len(first.tokens) - 1
        assert second.stats.n_prefilled == full - second.stats.n_reused < full // 2
    with load_pair(files.target, files.draft, n_ctx=1024, draft_capacity=7) as fresh:
        again = fresh.chat(turn2, max_tokens=12)
        assert again.stats.n_reused == 0
        assert again.tokens == second.tokens


def test_chat_template_and_thinking_switch(engines: dict) -> None:
    eng = engines[("dense", "dflash2", "shaped")]
    assert eng.info()["supports_thinking"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    on = eng.render_chat(msgs, enable_thinking=True)
    off = eng.render_chat(msgs, enable_thinking=False)
    assert on != off and "<think>" in off and on.startswith("<|im_start|>system")


def test_hybrid_rollback_happens_and_stays_lossless() -> None:
    files = pair_files("hybrid", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=512, draft_capacity=7) as eng:
        base = eng.generate("hello world", max_tokens=40, speculative=False)
        res = eng.generate("hello world", max_tokens=40, draft_length=7)
        # partial acceptance: some drafts were accepted and some rolled back
        assert 0 < res.stats.accepted < res.stats.drafted
        assert res.tokens == base.tokens


def test_hybrid_without_snapshots_fails_loudly() -> None:
    files = pair_files("hybrid", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=512, draft_capacity=7, n_rs_seq=0) as eng:
        assert eng.pair.n_rs_seq == 0
        with pytest.raises(RollbackError, match="n_rs_seq"):
            eng.generate("hello world", max_tokens=40, draft_length=7)
        # the engine recovered: plain decoding still gives the right text
        fresh = load_pair(files.target, n_ctx=512)
        assert eng.generate("hello world", max_tokens=20, speculative=False).tokens == \
            fresh.generate("hello world", max_tokens=20).tokens
        fresh.close()


def test_bad_input_is_refused_before_decoding(engines: dict) -> None:
    eng = engines[("dense", "dflash2", "shaped")]
    with pytest.raises(PromptTooLongError, match="context holds 1024"):
        eng.generate([5 + i % 300 for i in range(1100)], max_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        eng.generate("", max_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        eng.generate([], max_tokens=4)
    with pytest.raises(RequestError, match="temperature"):
        eng.generate("hi", temperature=-0.5)
    with pytest.raises(RequestError, match="max_tokens"):
        eng.generate("hi", max_tokens=0)
    with pytest.raises(RequestError, match="draft_length"):
        eng.generate("hi", draft_length=8)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.generate([10**7], max_tokens=2)
    with pytest.raises(RequestError, match="top_p"):
        eng.generate("hi", top_p=0.0, temperature=1.0)
    assert eng.generate("hello world", max_tokens=3).finish_reason == "length"  # still serving


def test_generation_stops_when_the_context_is_full() -> None:
    files = pair_files("hybrid", "dflash2")
    with load_pair(files.target, files.draft, n_ctx=64, draft_capacity=7) as eng:
        prompt = eng.tokenize("hello world")
        base = eng.generate(prompt, max_tokens=500, speculative=False)
        res = eng.generate(prompt, max_tokens=500, draft_length=7)
        assert base.finish_reason == res.finish_reason == "length"
        assert "context is full" in res.finish_detail
        assert res.tokens == base.tokens and len(prompt) + len(res.tokens) == eng.n_ctx + 1


def test_use_after_close() -> None:
    files = pair_files("dense", "dflash2")
    eng = load_pair(files.target, files.draft, n_ctx=256, draft_capacity=3)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineClosedError):
        eng.generate("hi")


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_cancelled_stream_leaves_the_engine_consistent(target: str) -> None:
    files = pair_files(target, "dflash2")
    with load_pair(files.target, files.draft, n_ctx=512, draft_capacity=7) as eng:
        stream = eng.stream("the quick brown fox", max_tokens=200, draft_length=7)
        for i, _ in enumerate(stream):
            if i == 3:
                eng.cancel()
        assert _.finish_reason == "cancelled"
        abandoned = eng.stream("one two three", max_tokens=200, draft_length=4)
        next(abandoned), next(abandoned)
        abandoned.close()  # closing the generator releases the engine too
        answer = eng.generate("what is the capital of france?", max_tokens=30, draft_length=7)
    with load_pair(files.target, files.draft, n_ctx=512, draft_capacity=7) as fresh:
        assert fresh.generate("what is the capital of france?", max_tokens=30, draft_length=7).tokens == answer.tokens
