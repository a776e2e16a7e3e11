"""N-gram drafting: the sequence drafts itself, as llama.cpp's `--spec-type ngram-mod` and `ngram-map-k` do.

No model and no file: the draft is what followed the last n tokens the last time they occurred in the sequence (the
prompt and the answer so far), so it wins where an answer copies its prompt — editing a text, quoting a document,
repeating a list. The drafts are deterministic (no distribution q): above temperature 0 rejection sampling treats
each as drawn from a point mass (verify.py). Ports of the vendored `common/ngram-mod.cpp`, `common/ngram-map.cpp`
and their `common_speculative_impl_*` in `common/speculative.cpp`, step for step, hashes included, so that counts
match llama-server's:

- `ngram-mod`: a table of 4 Mi slots, slot = hash(n_match tokens) mod size, holding the token that followed that
  n-gram last (collisions overwrite). `begin` adds the prompt's n-grams, a draft adds new ones every 32 tokens and
  chains lookups from the last n_match tokens (id_last included) for up to n_max tokens; five drafts in a row with
  under a quarter accepted clear the table.
- `ngram-map-k`: the newest earlier occurrence of the last size_n tokens (through a hash map of 256 Ki slots, first
  writer wins, and a scan of what the map does not cover yet); the draft is the size_m tokens after it, no more than
  were accepted the last time that key drafted.

One difference from llama-server, where the tables live as long as the server: here they are the sequence's own,
rebuilt by `begin` from the request's tokens (the prompt in the cache), so one owner's text never drafts for another
and nothing needs parking; each sequence of the engine has tables of its own. Options
(`Engine(method_options={"ngram-mod": {...}})`): ngram-mod `n_match` (24), `n_max` (the pair's draft capacity),
`n_min` (0); ngram-map-k `size_n` (12), `size_m` (the pair's capacity).
A step drafts at most the request's draft length: longer drafts are cut, as llama.cpp cuts them to the room left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .drafting import Implementation, PerSequence, TokenView
from .proposal import DraftSampling, Proposal

NGRAM_MOD, NGRAM_MAP_K = "ngram-mod", "ngram-map-k"

MOD_SIZE = 4 * 1024 * 1024  # common_speculative_impl_ngram_mod's table
MOD_FACTOR = np.uint64(6364136223846793005)  # common_ngram_mod::idx, in size_t arithmetic
MOD_EMPTY = -1
MOD_CHUNK = 32  # a draft adds the new n-grams once this many tokens came
MOD_FULL = 0.25  # begin clears a table fuller than this
MOD_LOW_ACCEPTANCE, MOD_LOW_STREAK = 0.25, 5

MAP_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAP_FACTOR = np.uint32(2654435761)  # LCG_FACTOR of ngram-map.cpp, in uint32 arithmetic
MAP_MAX_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT


def _hashes(tokens: np.ndarray, n: int, count: int, factor: np.unsignedinteger) -> np.ndarray:
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
        slots = _hashes(window, self.n, stop - start, MOD_FACTOR) % np.uint64(self.size)
        self.slots.update(zip(slots.tolist(), window[self.n:].tolist(), strict=True))  # later ones win, as in C++

    def get(self, key: Sequence[int]) -> int:
        slot = _hashes(np.asarray(key, dtype=np.int64), self.n, 1, MOD_FACTOR)[0] % np.uint64(self.size)
        return self.slots.get(int(slot), MOD_EMPTY)

    def reset(self) -> None:
        self.slots.clear()


class _Tables:
    """What both n-gram drafters share: the sequence's token view and the capacity (one sequence's drafter, opened
    per sequence through `PerSequence`: nothing to feed, cut or park)."""

    method: str

    def __init__(self, tokens: TokenView, capacity: int) -> None:
        self._tokens = tokens
        self.capacity = capacity


class NgramModDrafter(_Tables):
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


@dataclass
class _Key:
    key_idx: int  # where the key n-gram occurs in the sequence
    key_num: int = 0  # hits
    n_accepted: int = 0  # accepted tokens of its last draft (values[0] of common_ngram_map_key)


class NgramMapKDrafter(_Tables):
    """common_ngram_map with key_only (ngram-map-k): the draft is the m-gram after the key's newest occurrence."""

    method = NGRAM_MAP_K

    def __init__(self, tokens: TokenView, capacity: int, *, size_n: int = 12, size_m: int | None = None) -> None:
        super().__init__(tokens, capacity)
        self.n = size_n
        self.m = capacity if size_m is None else size_m
        if self.n < 1 or self.m < 1:
            raise ValueError(f"ngram-map-k needs size_n ≥ 1 and size_m ≥ 1 (got {self.n}, {self.m})")
        self.clear()

    def clear(self) -> None:
        self.keys: list[_Key] = []
        self.key_map: dict[int, int] = {}  # hash slot → offset of an n-gram (absent: 0 in the C++)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.last_draft: int | None = None  # the key that drafted last

    def begin(self) -> None:
        self.clear()
        self.size_last_begin = len(self._tokens)

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        self.last_draft = None
        inp, k, m = self._tokens, self.n, self.m
        cur = len(inp)
        if cur < 2 * k + m:
            return Proposal()
        key = [*inp[cur - k + 1:cur], id_last]
        top = cur - k - m - 1  # the newest offset a key may start at
        match = 0  # offset 0 means no match, as in the C++
        slot = int(_hashes(np.asarray(key, dtype=np.int64), k, 1, MAP_FACTOR)[0]) % MAP_SIZE
        at = self.key_map.get(slot, 0)
        if at != 0 and at < top and list(inp[at:at + k]) == key:
            match = at
        begin = self.size_last_begin
        if match == 0 and begin > k + m + 1:
            match = self._scan(key, begin - k - m - 1, self.key_map_last_idx)
        if match == 0:
            match = self._scan(key, top, max(begin, self.key_map_last_idx))
        if begin > k + m + 1:
            self._index(begin - k - m - 1, self.key_map_last_idx)
        self._index(top, max(begin, self.key_map_last_idx))
        self.key_map_last_idx = max(top, self.key_map_last_idx)
        if match == 0:
            return Proposal()
        offset = next((i for i, s in enumerate(self.keys) if list(inp[s.key_idx:s.key_idx + k]) == key), None)
        if offset is None:
            offset = len(self.keys)
            self.keys.append(_Key(match, n_accepted=m))
        entry = self.keys[offset]
        entry.key_num = min(entry.key_num + 1, MAP_MAX_COUNT)
        drafted = list(inp[match + k:match + k + min(m, entry.n_accepted)])
        self.last_draft = offset
        return Proposal(drafted[:n]).at_least(n_min, None)

    def accept(self, n_accepted: int) -> None:
        if self.last_draft is not None:
            self.keys[self.last_draft].n_accepted = n_accepted

    def _scan(self, key: list[int], start: int, floor: int) -> int:
        """The first offset from `start` down to (not including) `floor` where the key occurs, or 0."""
        inp, k = self._tokens, self.n
        for j in range(start, floor, -1):
            if list(inp[j:j + k]) == key:
                return j
        return 0

    def _index(self, start: int, floor: int) -> None:
        """Map the hash of the n-gram at each offset from `start` down to `floor` (excluded); first writer wins."""
        if start <= floor:
            return
        window = np.asarray(self._tokens[floor + 1:start + self.n], dtype=np.int64)
        slots = (_hashes(window, self.n, start - floor, MAP_FACTOR) % np.uint32(MAP_SIZE)).tolist()
        for j in range(start, floor, -1):
            self.key_map.setdefault(slots[j - floor - 1], j)


def _open_mod(pair: object, views: Sequence[TokenView], capacity: int, **options: int) -> PerSequence:
    return PerSequence([NgramModDrafter(view, capacity, **options) for view in views])


def _open_map_k(pair: object, views: Sequence[TokenView], capacity: int, **options: int) -> PerSequence:
    return PerSequence([NgramMapKDrafter(view, capacity, **options) for view in views])


MOD = Implementation(_open_mod, options={"n_match": 24, "n_max": None, "n_min": 0})
MAP_K = Implementation(_open_map_k, options={"size_n": 12, "size_m": None})
