"""N-gram drafting: the sequence drafts itself, as llama.cpp's `--spec-type ngram-mod` does (its lookups in the
sequence itself, `ngram-simple`, `ngram-map-k` and `ngram-map-k4v`: ngram_map.py; its lookup caches, `ngram-cache`:
ngram_cache.py).

No model and no file: the draft is what followed the last n tokens the last time they occurred in the sequence (the
prompt and the answer so far), so it wins where an answer copies its prompt — editing a text, quoting a document,
repeating a list. The drafts are deterministic (no distribution q): above temperature 0 rejection sampling treats
each as drawn from a point mass (decoding/verify.py). A port of the vendored `common/ngram-mod.cpp` and its
`common_speculative_impl_ngram_mod` in `common/speculative.cpp`, step for step, hash included, so that counts match
llama-server's: a table of 4 Mi slots, slot = hash(n_match tokens) mod size, holding the token that followed that
n-gram last (collisions overwrite). `begin` adds the prompt's n-grams, a draft adds new ones every 32 tokens and
repeats the lookup from the last n_match tokens (id_last included) for up to n_max tokens; five drafts in a row with
under a quarter accepted clear the table.

One difference from llama-server, where the tables live as long as the server: here they are the sequence's own,
rebuilt by `begin` from the request's tokens (the prompt in the cache), so one owner's text never drafts for another
and nothing needs parking; each sequence of the engine has tables of its own. Options
(`Engine(method_options={"ngram-mod": {...}})`): `n_match` (24), `n_max` (the pair's draft capacity), `n_min` (0).
A step drafts at most the request's draft length: longer drafts are cut, as llama.cpp cuts them to the room left.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .drafting import Implementation, PerSequence, TokenView
from .proposal import DraftSampling, Proposal

NGRAM_MOD = "ngram-mod"

MOD_SIZE = 4 * 1024 * 1024  # common_speculative_impl_ngram_mod's table
MOD_FACTOR = np.uint64(6364136223846793005)  # common_ngram_mod::idx, in size_t arithmetic
MOD_EMPTY = -1
MOD_CHUNK = 32  # a draft adds the new n-grams once this many tokens came
MOD_FULL = 0.25  # begin clears a table fuller than this
MOD_LOW_ACCEPTANCE, MOD_LOW_STREAK = 0.25, 5


def hashes(tokens: np.ndarray, n: int, count: int, factor: np.unsignedinteger) -> np.ndarray:
    """The rolling hash h = h * factor + t over the n tokens at each of the first `count` offsets, wrapping in the
    factor's width as the C++ does."""
    h = np.zeros(count, dtype=factor.dtype)
    for k in range(n):
        h = h * factor + tokens[k:k + count].astype(factor.dtype)
    return h


class ModTable:
    """common_ngram_mod: slot = hash(n tokens) mod size → the token that followed them last. Sparse: a dict of the
    slots in use (`used`), the others EMPTY."""

    def __init__(self, n: int, size: int = MOD_SIZE) -> None:
        self.n, self.size = n, size
        self.slots: dict[int, int] = {}

    @property
    def used(self) -> int:
        return len(self.slots)

    def add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Add the n-grams at offsets start..stop-1 of `tokens` (each followed by its next token), in order."""
        if stop <= start:
            return
        window = np.asarray(tokens[start:stop + self.n], dtype=np.int64)
        slots = hashes(window, self.n, stop - start, MOD_FACTOR) % np.uint64(self.size)
        self.slots.update(zip(slots.tolist(), window[self.n:].tolist(), strict=True))  # later ones win, as in C++

    def get(self, key: Sequence[int]) -> int:
        slot = hashes(np.asarray(key, dtype=np.int64), self.n, 1, MOD_FACTOR)[0] % np.uint64(self.size)
        return self.slots.get(int(slot), MOD_EMPTY)

    def reset(self) -> None:
        self.slots.clear()


class NgramTables:
    """What the n-gram drafters share: the sequence's token view and the capacity (one sequence's drafter, opened
    per sequence through `PerSequence`: nothing to feed or cut), and nothing to do where a method keeps nothing."""

    method: str

    def __init__(self, tokens: TokenView, capacity: int) -> None:
        self._tokens = tokens
        self.capacity = capacity

    def begin(self) -> None:
        pass

    def accept(self, n_accepted: int) -> None:
        pass

    def clear(self) -> None:
        pass


class NgramModDrafter(NgramTables):
    method = NGRAM_MOD

    def __init__(self, tokens: TokenView, capacity: int, *, n_match: int = 24, n_max: int | None = None,
                 n_min: int = 0) -> None:
        super().__init__(tokens, capacity)
        if n_match < 1 or n_min < 0 or (n_max is not None and n_max < 0):
            raise ValueError(f"ngram-mod needs n_match ≥ 1, n_max ≥ 0, n_min ≥ 0 (got {n_match}, {n_max}, {n_min})")
        self.table = ModTable(n_match)
        self.n_max = capacity if n_max is None else n_max
        self.n_min = n_min
        self.i_last = 0  # the n-grams before this offset are in the table
        self.n_draft_last = 0
        self.n_low = 0

    def begin(self) -> None:
        self.table.reset()
        self.i_last = self.n_draft_last = 0
        prompt, n = self._tokens, self.table.n
        if len(prompt) < n:
            return
        self.table.add(prompt, 0, len(prompt) - n)
        self.i_last = len(prompt) - n
        if self.table.used / self.table.size > MOD_FULL:
            self.table.reset()

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        self.n_draft_last = 0
        prompt, k = self._tokens, self.table.n
        cur = len(prompt)
        if cur < k:
            return Proposal()
        if self.i_last + MOD_CHUNK < cur:
            self.table.add(prompt, self.i_last, cur - k)
            self.i_last = cur - k
        window = [*prompt[cur - k + 1:cur], id_last]
        drafted: list[int] = []
        for i in range(self.n_max):
            token = self.table.get(window[i:i + k])
            if token == MOD_EMPTY:
                if i < self.n_min:
                    return Proposal()
                break
            window.append(token)
            drafted.append(token)
        self.n_draft_last = len(drafted)
        return Proposal(drafted[:n]).at_least(n_min, None)

    def accept(self, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < MOD_LOW_ACCEPTANCE:
                self.n_low += 1
                if self.n_low >= MOD_LOW_STREAK:
                    self.table.reset()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0

    def clear(self) -> None:
        self.table.reset()
        self.i_last = self.n_draft_last = self.n_low = 0


def _open_mod(pair: object, views: Sequence[TokenView], capacity: int, **options: int) -> PerSequence:
    return PerSequence([NgramModDrafter(view, capacity, **options) for view in views])


MOD = Implementation(_open_mod, options={"n_match": 24, "n_max": None, "n_min": 0})
