"""The offline demo's pair writes words, not one repeated string, and its DFlash 2 draft is right as often as
published DFlash 2 drafts are, position by position: high at the first position, falling with depth, about 3.6 tokens
per verify at draft length 7 (llama.cpp's DFlash 2 runs of the real pair)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
from space_client import reference_engine

from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT
from dflash_runtime.testing.tokenizer import build_vocab
from dflash_runtime.testing.words import CHAIN, PUNCTUATION, word_chain, word_tokens

PROMPTS = ("Explain speculative decoding in three sentences.", "List five facts about the planet Mars.")
MAX_TOKENS = 384
WINDOW, MOST_REPEATS = 16, 4


def test_every_path_of_the_chain_spells_words() -> None:
    """A token that starts a two-token word has one way on, its second piece; no other token starts a word in two
    ways, so whatever the chain picks, the text splits into CHAIN's words."""
    vocab = build_vocab()
    chain = word_chain(vocab)
    firsts = [word_tokens(vocab, word)[0] for word in CHAIN]
    assert len(firsts) == len(set(firsts)), "a first token that starts two words"
    for word in CHAIN:
        tokens = word_tokens(vocab, word)
        assert len(tokens) <= 2
        if len(tokens) == 2:
            row = chain.log_odds[chain.ids.index(tokens[0])]
            assert int(row.argmax()) == chain.ids.index(tokens[1]) and sorted(row)[-2] < row.max() - 8
    assert len(set(chain.usual)) <= 22, "the usual successors fit the draft's candidates at width 512"


@pytest.fixture(scope="module")
def answers() -> list[tuple[Any, Any]]:
    out = []
    with reference_engine(4096) as engine:
        for prompt in PROMPTS:
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
            fixed = engine.chat(messages, max_tokens=MAX_TOKENS, method="dflash", draft_length=7)
            plain = engine.chat(messages, max_tokens=MAX_TOKENS, speculative=False)
            out.append((fixed, plain))
    return out


def test_the_answers_are_words_without_a_loop(answers: list[tuple[Any, Any]]) -> None:
    words = set(CHAIN) - set(PUNCTUATION)
    for fixed, plain in answers:
        assert fixed.tokens == plain.tokens, "lossless at temperature 0"
        written = re.findall(r"[a-z]+", fixed.text)
        assert written and sum(w in words for w in written) >= 0.98 * len(written), fixed.text
        assert len(set(written)) >= 15, f"a handful of words: {sorted(set(written))}"
        windows = Counter(tuple(fixed.tokens[i : i + WINDOW]) for i in range(len(fixed.tokens) - WINDOW + 1))
        assert max(windows.values()) <= MOST_REPEATS, fixed.text


def test_acceptance_by_position_has_the_published_shape(answers: list[tuple[Any, Any]]) -> None:
    """At draft length 7: about 3.6 tokens per verify (3 to 4.5 here), the first position accepted in most steps,
    each later one, given the ones before it, in most too, and the last position in under half of the steps."""
    accepted = [0] * 7
    verifies = emitted = 0
    for fixed, _ in answers:
        stats = fixed.stats
        verifies += stats.verify_steps
        emitted += stats.verify_emitted
        for i, count in enumerate(stats.accepted_per_position):
            accepted[i] += count
    per_verify = emitted / verifies
    reached = [verifies, *accepted[:-1]]
    given_before = [a / r for a, r in zip(accepted, reached, strict=True)]
    shape = {"tokens_per_verify": round(per_verify, 2), "by_position": [round(a / verifies, 2) for a in accepted],
             "given_before": [round(g, 2) for g in given_before]}
    assert 3.0 <= per_verify <= 4.5, shape
    assert 0.65 <= accepted[0] / verifies <= 0.95, shape
    assert all(0.5 <= g <= 0.95 for g in given_before), shape
    assert accepted[-1] / verifies < 0.5 and accepted[-1] < accepted[0] / 2, shape
