"""N-gram drafting (llama.cpp's ngram-mod, ngram-map-k, ngram-simple, ngram-map-k4v and ngram-cache): on every target,
no draft file, lossless at temperature 0 on dense and hybrid targets, alone and before DFlash in a method list, and
one owner's text never drafts for another. (ngram-cache's files and what it learns: tests/test_ngram_cache.py;
against llama-server: tests/test_llama_server_ngrams.py.)"""

from __future__ import annotations

import random

import pytest

from dflash_runtime import RequestError, load_pair
from dflash_runtime.drafters.drafting import TokenView
from dflash_runtime.drafters.ngram_map import NgramSimpleDrafter
from dflash_runtime.testing.heads import PHRASE
from dflash_runtime.testing.tiny_models import tiny_pair

NGRAMS = ("ngram-mod", "ngram-map-k", "ngram-simple", "ngram-map-k4v", "ngram-cache")
SMALL = {"ngram-mod": {"n_match": 3}, "ngram-map-k": {"size_n": 2}, "ngram-simple": {"size_n": 3, "size_m": 7},
         "ngram-map-k4v": {"size_n": 2, "size_m": 7}}  # short keys: tiny answers match early (ngram-cache: 1 to 4)
QUOTE = "".join(PHRASE) * 3  # a prompt the "phrase" head's answers copy from
PROMPTS = [QUOTE, "hello world", "Edit this text:" + QUOTE + " the quick brown fox. Edited:", "a"]


@pytest.mark.parametrize("target", ["dense", "hybrid"])
@pytest.mark.parametrize("head", ["phrase", "random"])
def test_ngram_answers_equal_plain_decoding(target: str, head: str) -> None:
    pair = tiny_pair(target, None, head=head)
    with load_pair(pair.target, None, n_ctx=1024, draft_capacity=7, method_options=SMALL) as engine:
        assert engine.methods == NGRAMS and engine.default_method is None  # drafts only when asked
        drafted = dict.fromkeys(NGRAMS, 0)
        for prompt in PROMPTS:
            base = engine.generate(prompt, max_tokens=48, speculative=False)
            for method in NGRAMS:
                for length in (1, 3, 7, "auto"):
                    result = engine.generate(prompt, max_tokens=48, method=method, draft_length=length)
                    assert result.tokens == base.tokens, (method, prompt, length)
                    assert result.stats.method == method
                    assert result.stats.drafted_by == [method] * result.stats.verify_steps
                    assert result.token_sources.count("draft") == result.stats.accepted
                    drafted[method] += result.stats.drafted
        if head == "phrase":
            assert all(drafted.values()), drafted  # the answers copy the prompt: the n-grams find it


def test_llama_cpp_defaults_draft_on_a_long_copy_and_answer_as_plain_decoding() -> None:
    """llama-server's default keys (24 tokens for ngram-mod, 12 for the others): an answer that repeats what came
    before is drafted. (ngram-simple drafts only where at least 12 tokens follow the newest earlier occurrence of
    its key, never in a repetition shorter than that, as here: see the next test; ngram-cache's context cache counts
    the prompt and each step's accepted stretch, not this answer's one-token steps, as llama-server's.)"""
    pair = tiny_pair("dense", None, head="phrase")
    with load_pair(pair.target, None, n_ctx=2048, draft_capacity=7) as engine:
        prompt = "".join(PHRASE) * 12
        base = engine.generate(prompt, max_tokens=160, speculative=False)
        for method in NGRAMS:
            result = engine.generate(prompt, max_tokens=160, method=method, draft_length=7)
            assert result.tokens == base.tokens, method
            if method not in ("ngram-simple", "ngram-cache"):
                assert result.stats.accepted > 0, method


def test_ngram_simple_drafts_what_followed_the_newest_earlier_occurrence() -> None:
    """common_ngram_simple_draft with llama-server's defaults (12-token key, up to 48 tokens): the tokens after the
    newest earlier occurrence of the last 11 and the one just sampled, none where fewer than 12 follow it."""
    history = [7, *range(100, 160), *range(100, 111)]
    drafter = NgramSimpleDrafter(TokenView(lambda: history), capacity=64)
    assert drafter.draft(111, len(history), 64).tokens == list(range(112, 160))  # 48 of the 49 after it
    assert drafter.draft(111, len(history), 5).tokens == list(range(112, 117))  # cut to the step's length
    assert drafter.draft(999, len(history), 64).tokens == []  # no earlier occurrence
    assert NgramSimpleDrafter(TokenView(lambda: history[:61]), capacity=64).draft(111, 61, 64).tokens == []  # ≤ 61
    other = [7, *range(200, 260)]
    for gap, drafted in (([], []), ([5], [5, *range(100, 111)])):  # 11 tokens follow the occurrence, then 12
        sequence = [*other, *range(100, 112), *gap, *range(100, 111)]
        assert NgramSimpleDrafter(TokenView(lambda s=sequence: s), capacity=64).draft(111, 0, 64).tokens == drafted


def test_method_lists_with_dflash_are_lossless_and_say_who_drafted() -> None:
    """ngram-mod,dflash: the n-gram draft where the answer copies the prompt, DFlash elsewhere, each step recorded."""
    pair = tiny_pair("hybrid", "dflash2", head="phrase")
    with load_pair(pair.target, pair.draft, n_ctx=1024, draft_capacity=7, method_options=SMALL) as engine:
        assert "ngram-mod,dflash" in engine.methods
        seen: set[str] = set()
        for prompt in PROMPTS:
            base = engine.generate(prompt, max_tokens=48, speculative=False)
            for method in ("ngram-mod,dflash", "ngram-map-k,dflash", "ngram-cache,ngram-map-k4v,dflash",
                           "dflash,ngram-mod"):
                for length in (3, 7, "auto"):
                    result = engine.generate(prompt, max_tokens=48, method=method, draft_length=length)
                    assert result.tokens == base.tokens, (method, prompt, length)
                    stats = result.stats
                    assert stats.method == method and len(stats.drafted_by) == stats.verify_steps
                    assert set(stats.drafted_by) <= set(method.split(","))
                    if method.startswith("dflash"):
                        assert set(stats.drafted_by) <= {"dflash"}  # DFlash always drafts: the n-grams never run
                    seen.update(stats.drafted_by)
        assert {"ngram-mod", "ngram-map-k", "ngram-cache", "dflash"} <= seen


def test_a_long_lived_engine_mixing_methods_answers_as_a_fresh_engine() -> None:
    rng = random.Random(11)
    pair = tiny_pair("hybrid", "dflash2", head="phrase")
    with load_pair(pair.target, pair.draft, n_ctx=1024, method_options=SMALL) as engine, \
            load_pair(pair.target, pair.draft, n_ctx=1024) as reference:
        prompt = engine.tokenize(QUOTE)
        for _ in range(16):
            method = rng.choice([*NGRAMS, "ngram-mod,dflash", "dflash", None])
            options = {"max_tokens": rng.randint(1, 24), "draft_length": rng.choice(["auto", 1, 3, 7])}
            result = (engine.generate(prompt, speculative=False, **options) if method is None
                      else engine.generate(prompt, method=method, **options))
            reference.reset()
            assert result.tokens == reference.generate(prompt, speculative=False, **options).tokens, method
            prompt = prompt + result.tokens
            if rng.random() < 0.4:
                prompt = prompt[: rng.randint(1, len(prompt))]
            prompt = (prompt + engine.tokenize(rng.choice(PHRASE), add_special=False))[:600]


def test_one_owners_text_never_drafts_for_another() -> None:
    """Visitor B's request drafts exactly as on a fresh engine, whatever visitor A sent before (the tables are the
    sequence's own: A's quote cannot raise B's acceptance)."""
    pair = tiny_pair("dense", None, head="phrase")
    request = dict(max_tokens=40, draft_length=7, cache_owner="b")
    with load_pair(pair.target, None, n_ctx=1024, method_options=SMALL) as fresh:
        expected = {m: fresh.generate("hello", method=m, **request).stats for m in NGRAMS}
    with load_pair(pair.target, None, n_ctx=1024, method_options=SMALL) as engine:
        for method in NGRAMS:
            engine.generate(QUOTE * 2, method=method, max_tokens=40, cache_owner="a")
            stats = engine.generate("hello", method=method, **request).stats
            assert (stats.drafted, stats.accepted, stats.drafted_by) == (
                expected[method].drafted, expected[method].accepted, expected[method].drafted_by), method


def test_bad_options_are_refused_clearly() -> None:
    pair = tiny_pair("dense", None, head="phrase")
    with pytest.raises(ValueError, match="n_match"):
        load_pair(pair.target, None, n_ctx=256, method_options={"ngram-mod": {"n_match": 0}})
    for method, options in (("ngram-simple", {"size_n": 0}), ("ngram-map-k4v", {"size_m": 1025}),
                            ("ngram-map-k4v", {"min_hits": 0})):
        with pytest.raises(ValueError, match=rf"{method} needs 1 ≤ size_n ≤ 1024, 1 ≤ size_m ≤ 1024 and min_hits"):
            load_pair(pair.target, None, n_ctx=256, method_options={method: options})
    with pytest.raises(ValueError, match=r"method_options\['ngram-map-k'\] names unknown options \['bogus'\] "
                                         r"\(options of ngram-map-k: size_n \(default 12\), size_m"):
        load_pair(pair.target, None, n_ctx=256, method_options={"ngram-map-k": {"bogus": 1}})
    with load_pair(pair.target, None, n_ctx=256) as engine, pytest.raises(RequestError, match="'dflash' is not"):
        engine.generate("hello", max_tokens=2, method="ngram-mod,dflash")
