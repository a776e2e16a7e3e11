"""Draft methods behind one interface: DFlash and the target's own MTP head, chosen per request, each lossless, on one
long-lived engine; and one name per draft-length idea (old spellings still work, with a warning)."""

from __future__ import annotations

import random
import warnings

import pytest

from dflash_runtime import DFlashDraftModel, DFlashLlama, PairMismatchError, RequestError, load_pair, methods
from dflash_runtime.testing.tiny_models import tiny_pair

NGRAMS = ("ngram-mod", "ngram-map-k", "ngram-simple", "ngram-map-k4v", "ngram-cache")  # every pair runs them
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog.", "one two three four five", "a"]


@pytest.fixture(scope="module")
def mtp_target():
    return tiny_pair("hybrid", None, head="shaped", mtp_layers=1)


@pytest.fixture(scope="module")
def both():
    return tiny_pair("hybrid", "dflash2", head="shaped", mtp_layers=1)


def test_an_engine_lists_the_methods_its_pair_can_run(mtp_target, both) -> None:
    with load_pair(mtp_target.target, None, n_ctx=256) as engine:
        assert engine.methods == ("mtp", *NGRAMS) and engine.default_method == "mtp"
        assert engine.info()["methods"] == ["mtp", *NGRAMS] and engine.info()["mtp_error"] is None
    with load_pair(both.target, both.draft, n_ctx=256) as engine:
        assert engine.methods == ("dflash", "mtp", *NGRAMS, "ngram-mod,dflash")
        assert engine.default_method == "dflash"
    with load_pair(both.target, both.draft, n_ctx=256, mtp=False) as engine:
        assert engine.methods == ("dflash", *NGRAMS, "ngram-mod,dflash")
    plain = tiny_pair("hybrid", "dflash2", head="shaped")
    with load_pair(plain.target, None, n_ctx=256) as engine:
        assert engine.methods == NGRAMS  # the n-grams run anywhere, drafting only when asked
        assert engine.default_method is None
        result = engine.generate("hello", max_tokens=4)  # no draft, no MTP head: plain decoding
        assert result.stats.method is None and result.stats.drafted == 0
        with pytest.raises(RequestError, match="not available"):
            engine.generate("hello", max_tokens=4, method="mtp")
    with pytest.raises(PairMismatchError, match="no MTP head"):
        load_pair(plain.target, None, n_ctx=256, mtp=True)


@pytest.mark.parametrize("head", ["shaped", "phrase", "random"])
def test_mtp_answers_equal_plain_decoding(head: str) -> None:
    pair = tiny_pair("hybrid", None, head=head, mtp_layers=1)
    with load_pair(pair.target, None, n_ctx=1024, draft_capacity=7) as engine:
        for prompt in PROMPTS:
            base = engine.generate(prompt, max_tokens=40, speculative=False)
            for length in (1, 3, 7, "auto"):
                result = engine.generate(prompt, max_tokens=40, method="mtp", draft_length=length)
                assert result.tokens == base.tokens, (head, prompt, length)
                assert result.stats.method == "mtp" and result.stats.draft_length == length
                assert result.token_sources.count("draft") == result.stats.accepted
                if head == "shaped" and length != "auto":
                    assert result.stats.acceptance_rate > 0.5  # the head predicts the shaped target well


def test_both_methods_on_one_engine_answer_as_a_fresh_engine(both) -> None:
    """Requests switch methods, lengths and plain decoding at random on one engine: every answer is the target's."""
    rng = random.Random(7)
    words = ("fox", "dog", "one", "two", "three", "hello", "world", "the")
    with load_pair(both.target, both.draft, n_ctx=1024) as engine, \
            load_pair(both.target, both.draft, n_ctx=1024) as reference:
        prompt = engine.tokenize("hello world")
        used = set()
        for _ in range(20):
            method = rng.choice(["dflash", "mtp", None])
            options = {"max_tokens": rng.randint(1, 16), "draft_length": rng.choice(["auto", 0, 1, 3, 7])}
            if method is None:
                result = engine.generate(prompt, speculative=False, **options)
            else:
                result = engine.generate(prompt, method=method, **options)
                used.add(method)
                assert result.stats.method == method
                if options["draft_length"] == 0:
                    assert result.stats.drafted == 0
            reference.reset()
            expected = reference.generate(prompt, max_tokens=options["max_tokens"], speculative=False)
            assert result.tokens == expected.tokens, (method, options)
            # Next: continue this text, or go back into it (rollbacks, checkpoint restores on the hybrid target).
            prompt = prompt + result.tokens
            if rng.random() < 0.4:
                prompt = prompt[: rng.randint(1, len(prompt))]
            prompt = (prompt + engine.tokenize(" " + rng.choice(words), add_special=False))[:600]
        assert used == {"dflash", "mtp"}


def test_old_spellings_still_work_with_a_deprecation_warning(both) -> None:
    with pytest.warns(DeprecationWarning, match="draft_capacity"):
        engine = load_pair(both.target, both.draft, n_ctx=256, draft_max=5)
    with engine:
        assert engine.draft_capacity == 5
        with pytest.warns(DeprecationWarning, match="draft_length"):
            result = engine.generate("hello", max_tokens=6, draft_max=3)
        assert result.stats.draft_length == 3
        with pytest.warns(DeprecationWarning, match="draft_length"):
            assert result.stats.draft_policy == 3
        with pytest.warns(DeprecationWarning, match="draft_capacity"):
            assert engine.draft_max == 5
        with pytest.raises(RequestError, match="not both"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            engine.generate("hello", max_tokens=2, draft_max=3, draft_length=2)
    with pytest.warns(DeprecationWarning, match="draft_length"):
        load_pair(both.target, both.draft, n_ctx=256, draft_policy=2).close()


def test_the_drop_in_runs_mtp_on_a_target_alone(mtp_target, both) -> None:
    llm = DFlashLlama(model_path=str(mtp_target.target), n_ctx=512, verbose=False)
    try:
        assert llm.methods == ("mtp", *NGRAMS)
        response = llm.create_completion("hello world", max_tokens=16, temperature=0, draft_length=3)
        stats = response["dflash_stats"]
        assert stats["method"] == "mtp" and stats["drafted"] > 0
        plain = llm.create_completion("hello world", max_tokens=16, temperature=0, speculative=False)
        assert response["choices"][0]["text"] == plain["choices"][0]["text"]
    finally:
        llm.close()
    llm = DFlashLlama(model_path=str(both.target), draft_model=DFlashDraftModel(str(both.draft)), n_ctx=512,
                      verbose=False)
    try:
        assert llm.methods == ("dflash", "mtp", *NGRAMS, "ngram-mod,dflash")
        mtp = llm.create_completion("hello world", max_tokens=16, temperature=0, method="mtp")["dflash_stats"]
        assert mtp["method"] == "mtp"
    finally:
        llm.close()


def test_the_registry_names_each_method_once_and_the_engine_opens_what_it_lists(both) -> None:
    """One registry: names, labels and needs; an engine lists what its pair holds and refuses the rest clearly."""
    assert set(methods.names()) >= {"dflash", "mtp"} and len(set(methods.names())) == len(methods.names())
    assert {m.name: m.needs for m in methods.REGISTRY}["dflash"] == "draft"
    assert methods.label("mtp,dflash") == "MTP → DFlash 2"
    assert methods.runnable(lambda needs: needs == "nextn")[:1] == ("mtp",)
    with load_pair(both.target, both.draft, n_ctx=256) as engine:
        assert engine.capacity("mtp,dflash") == engine.capacity("dflash") == 7 == methods.capacity(engine.pair, "mtp")
        for bad, match in (("nope", "'nope' is unknown"), ("dflash,nope", "'nope' is unknown"),
                           ("dflash,dflash", "names a method twice"), ("", "a name or a comma list")):
            with pytest.raises(RequestError, match=match):
                engine.generate("hello", max_tokens=2, method=bad)
    with pytest.raises(ValueError, match="unknown methods"):
        load_pair(both.target, both.draft, n_ctx=256, method_options={"nope": {}})
    # Every method says which of its options it does not know, before anything opens (the models are not loaded).
    for method in methods.names():
        with pytest.raises(ValueError, match=rf"method_options\['{method}'\] names unknown options \['bogus'\]"):
            load_pair(both.target, both.draft, n_ctx=256, method_options={method: {"bogus": 1}})


@pytest.mark.parametrize("methods", ["mtp,dflash", "dflash,mtp"])
def test_a_method_list_drafts_with_its_first_member_that_drafts_and_answers_as_plain_decoding(both, methods) -> None:
    """A method list is lossless and its stats say which member drafted each verify step (here the first always
    can)."""
    first = methods.split(",")[0]
    with load_pair(both.target, both.draft, n_ctx=1024) as engine:
        for prompt in PROMPTS:
            base = engine.generate(prompt, max_tokens=30, speculative=False)
            for length in (1, 3, "auto"):
                result = engine.generate(prompt, max_tokens=30, method=methods.replace(",", ", "), draft_length=length)
                assert result.tokens == base.tokens, (methods, prompt, length)
                assert result.stats.method == methods
                assert result.stats.drafted_by == [first] * result.stats.verify_steps
                assert result.token_sources.count("draft") == result.stats.accepted
