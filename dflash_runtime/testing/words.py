"""The `words` head's language: a first-order Markov chain over English words, written for this project (CHAIN), in
the tiny vocabulary's tokens.

CHAIN gives, for each word, the words that may follow it and how often, as counts in a text would. Every word is one
token of the vocabulary, or two whose first piece starts no other word here, so the chain keeps words whole: whatever
path it takes, it writes English words (without meaning: a chain with one word's memory writes word salad). Each
token's most frequent successor is its "usual" one, which the DFlash 2 draft proposes; the usual successors are few
enough (22) to be the draft's candidates at every block position at width 512, and go round one long loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import numpy as np

from .tokenizer import TinyVocab

CHAIN: dict[str, dict[str, int]] = {
    # the usual successors (listed first) go round one long loop: "the quick brown fox jumps over a lazy dog, and
    # small draft proposes tokens of the ..."; the others leave it for a word or two
    "the": {"quick": 6, "target": 2, "lazy": 1, "block": 1, "small": 1, "world": 1, "capital": 1, "model": 1},
    "quick": {"brown": 6, "fox": 2, "model": 1, "draft": 1},
    "brown": {"fox": 6, "dog": 3},
    "fox": {"jumps": 6, ".": 2, "and": 1, "is": 1},
    "jumps": {"over": 6, ".": 1},
    "over": {"a": 6, "the": 3},
    "a": {"lazy": 6, "quick": 2, "block": 2, "small": 1, "model": 1},
    "lazy": {"dog": 6, "fox": 2, "model": 1},
    "dog": {",": 6, ".": 2, "jumps": 2, "is": 1},
    ",": {"and": 6, "hello": 2, "the": 2, "you": 1},
    "and": {"small": 6, "the": 3, "a": 2, "it": 1, "you": 1},
    "small": {"draft": 6, "model": 3, "block": 1, "dog": 1},
    "draft": {"proposes": 6, ".": 2, "is": 1, "model": 1},
    "proposes": {"tokens": 6, "eight": 2, "six": 1, "nine": 1, "a": 1},
    "tokens": {"of": 6, ".": 3, ",": 2, "and": 2},
    "of": {"the": 6, "france": 2, "eight": 1, "tokens": 1},
    ".": {"the": 6, "hello": 2, "how": 1, "you": 1, "a": 1},
    "target": {".": 6, "is": 2, "and": 1, "proposes": 1},
    "block": {".": 6, "of": 3, ",": 1},
    "hello": {",": 6, "world": 3, "model": 1},
    "world": {",": 6, ".": 2, "is": 1, "of": 1},
    "model": {".": 6, "proposes": 2, "is": 1},
    "eight": {"tokens": 1},
    "nine": {"tokens": 1},
    "six": {"tokens": 1},
    "how": {"the": 6, "is": 2, "quick": 1},
    "have": {"a": 6, "six": 2, "nine": 1, "it": 1},
    "it": {".": 6, "is": 2, "?": 1},
    "capital": {"of": 1},
    "france": {".": 6, "is": 2, "?": 1},
    "is": {"a": 6, "the": 3, "it": 1, "small": 1},
    "?": {"the": 6, "you": 2, "it": 1},
    "you": {",": 6, "have": 4, "?": 1},
}
PUNCTUATION = (".", ",", "?")

FLOOR = -6.0  # log-odds of a successor the chain never takes: e^-6 ≈ 0.25 %
BOND = 4.0  # "log-odds" of a word's second piece after its first: more than certain, so no context splits a word


@dataclass(frozen=True)
class WordChain:
    """The chain over `ids` (vocabulary ids): `log_odds[i, j]` = log P(ids[j] follows ids[i]), FLOOR where it never
    does; `usual[i]` is the index of ids[i]'s most frequent successor; `pieces` the indices of tokens that continue a
    word (the second token of a two-token word)."""

    ids: tuple[int, ...]
    log_odds: np.ndarray
    usual: tuple[int, ...]
    pieces: tuple[int, ...]


def word_tokens(vocab: TinyVocab, word: str) -> list[int]:
    return vocab.encode(word if word in PUNCTUATION else " " + word)


@cache
def word_chain(vocab: TinyVocab) -> WordChain:
    spelled = {word: word_tokens(vocab, word) for word in CHAIN}
    ids = tuple(dict.fromkeys(token for tokens in spelled.values() for token in tokens))
    index = {token: i for i, token in enumerate(ids)}
    counts = np.zeros((len(ids), len(ids)))
    pieces = []
    for word, successors in CHAIN.items():
        tokens = spelled[word]
        for a, b in itertools.pairwise(tokens):  # inside a word: the only way on
            pieces.append((index[a], index[b]))
        for successor, count in successors.items():
            counts[index[tokens[-1]], index[spelled[successor][0]]] += count
    with np.errstate(invalid="ignore"):
        odds = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        log_odds = np.maximum(np.log(odds), FLOOR).astype(np.float32)
    for a, b in pieces:
        counts[a, b] = 1.0
        log_odds[a, :] = FLOOR
        log_odds[a, b] = BOND
    usual = tuple(int(np.argmax(row)) for row in counts)  # CHAIN lists the most frequent successor first
    return WordChain(ids=ids, log_odds=log_odds, usual=usual, pieces=tuple(b for _, b in pieces))
