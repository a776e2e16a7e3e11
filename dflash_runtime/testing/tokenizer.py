"""The shared vocabulary of the tiny models: a small byte-level BPE (GPT-2 style, `qwen2` pre-tokenizer).

Every generated target and draft carries the same vocabulary, so a pair always matches token for token.
The merges are learned here, deterministically, on a fixed corpus; `TinyVocab.encode` is a plain-Python
reference encoder used to check that the merges are coherent (each merged token encodes to itself).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from functools import cache

N_MERGES = 160

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
MASK = "<|mask|>"

# Control tokens are never rendered by detokenize; <think> / </think> are plain added text, as in Qwen3.
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
TEXT_ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE)

# Qwen3-style ChatML: `enable_thinking=false` appends an empty thinking block to the generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Words repeat so that frequent ones (" the", " hello", " world", ...) become single tokens.
CORPUS = """\
the quick brown fox jumps over the lazy dog. hello world! hello there, how are you? i am fine, thank you.
the draft proposes tokens and the target verifies them. the target accepts the tokens it would have chosen.
a block diffusion draft fills the whole block at once; the target checks the block in one batch.
what is the capital of france? paris is the capital of france. the answer is 42.
one two three four five six seven eight nine ten. it's a test, isn't it? we'll see what they've done.
hello world, hello model, hello user. the world is big and the model is small.
"""

# The qwen2 pre-tokenizer of llama.cpp, written for Python's `re` (letters = [^\W\d_], digits = \d).
PRETOKENIZER = re.compile(
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+"
    r"|\d"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


class TokenType(IntEnum):
    """GGUF `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    CONTROL = 3
    USER_DEFINED = 4


@cache
def byte_to_symbol() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE works on these symbols)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(shifted)
            shifted += 1
    return mapping


@cache
def symbol_to_byte() -> dict[str, int]:
    return {symbol: b for b, symbol in byte_to_symbol().items()}


def to_symbols(text: str) -> str:
    """Text → the byte-level symbol string that GPT-2 vocabularies store."""
    table = byte_to_symbol()
    return "".join(table[b] for b in text.encode("utf-8"))


def from_symbols(symbols: str) -> bytes:
    table = symbol_to_byte()
    return bytes(table[s] for s in symbols)


@dataclass(frozen=True)
class TinyVocab:
    """Tokens (ids are list indices), their GGUF types and the ranked merges."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def id_of(self, token: str) -> int:
        return self._index()[token]

    def id_of_text(self, text: str) -> int:
        """Id of the normal token whose text is `text` (KeyError if the text is not one token)."""
        return self.id_of(to_symbols(text))

    def token_text(self, token_id: int) -> bytes:
        """The bytes a token stands for (added tokens: their literal text)."""
        token = self.tokens[token_id]
        if self.token_types[token_id] == TokenType.NORMAL:
            return from_symbols(token)
        return token.encode("utf-8")

    @property
    def added_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.token_types) if kind != TokenType.NORMAL)

    def encode(self, text: str) -> list[int]:
        """Reference BPE encoding of plain text (no added tokens): pre-tokenize, then merge by rank."""
        ids: list[int] = []
        for word in PRETOKENIZER.findall(text):
            ids.extend(self.id_of(piece) for piece in self._merge_word(to_symbols(word)))
        return ids

    def _merge_word(self, word: str) -> list[str]:
        ranks = self._ranks()
        pieces = list(word)
        while len(pieces) > 1:
            pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(itertools.pairwise(pieces))]
            rank, i = min(pairs)
            if rank == len(ranks):
                break
            pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces

    def _index(self) -> dict[str, int]:
        return _token_index(self.tokens)

    def _ranks(self) -> dict[tuple[str, str], int]:
        return _merge_ranks(self.merges)


@cache
def _token_index(tokens: tuple[str, ...]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tokens)}


@cache
def _merge_ranks(merges: tuple[str, ...]) -> dict[tuple[str, str], int]:
    return {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}  # type: ignore[misc]


def _most_frequent_pair(words: Counter[tuple[str, ...]]) -> tuple[str, str] | None:
    pairs: Counter[tuple[str, str]] = Counter()
    for word, count in words.items():
        for pair in itertools.pairwise(word):
            pairs[pair] += count
    if not pairs:
        return None
    # ties broken lexicographically so the vocabulary never depends on dict order
    return min(pairs, key=lambda pair: (-pairs[pair], pair))


def _apply_merge(words: Counter[tuple[str, ...]], pair: tuple[str, str]) -> Counter[tuple[str, ...]]:
    merged: Counter[tuple[str, ...]] = Counter()
    for word, count in words.items():
        out: list[str] = []
        i = 0
        while i < len(word):
            if word[i : i + 2] == pair:
                out.append(pair[0] + pair[1])
                i += 2
            else:
                out.append(word[i])
                i += 1
        merged[tuple(out)] += count
    return merged


def learn_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training over the pre-tokenized corpus, deterministic."""
    words = Counter(tuple(to_symbols(word)) for word in PRETOKENIZER.findall(corpus))
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pair = _most_frequent_pair(words)
        if pair is None:
            break
        merges.append(pair)
        words = _apply_merge(words, pair)
    return merges


@cache
def build_vocab(extra_tokens: int = 0) -> TinyVocab:
    """256 byte tokens, the learned merges, then the added tokens (`extra_tokens` more control tokens at the end)."""
    merges = learn_merges(CORPUS, N_MERGES)
    normal = [byte_to_symbol()[b] for b in range(256)]
    for a, b in merges:
        if a + b not in normal:  # two merge paths may spell the same token; ids must stay unique
            normal.append(a + b)
    extras = [f"<|extra_{i}|>" for i in range(extra_tokens)]
    added = [ENDOFTEXT, IM_START, IM_END, THINK_OPEN, THINK_CLOSE, MASK, *extras]
    types = [TokenType.NORMAL] * len(normal) + [
        TokenType.USER_DEFINED if token in TEXT_ADDED_TOKENS else TokenType.CONTROL for token in added
    ]
    return TinyVocab(
        tokens=tuple(normal + added),
        token_types=tuple(int(kind) for kind in types),
        merges=tuple(f"{a} {b}" for a, b in merges),
    )


def is_plain_text_token(vocab: TinyVocab, token_id: int) -> bool:
    """True for normal tokens made of printable ASCII, spaces and newlines (what generated text may contain)."""
    if vocab.token_types[token_id] != TokenType.NORMAL:
        return False
    raw = vocab.token_text(token_id)
    return all(32 <= b < 127 or b == 10 for b in raw)
