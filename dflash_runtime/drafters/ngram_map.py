"""N-gram drafting by looking the last n tokens up in the sequence itself: llama.cpp's `--spec-type ngram-simple`,
`ngram-map-k` and `ngram-map-k4v`, ports of the vendored `common/ngram-map.cpp` step for step (hashes included), so
that drafts and counts match llama-server's.

- `ngram-simple`: the newest earlier occurrence of the last size_n tokens (a plain backward scan); the draft is the
  size_m tokens after it, or fewer where the sequence ends sooner — none when fewer than size_n are left.
- `ngram-map-k`: the newest earlier occurrence of the last size_n tokens (through a hash map of 256 Ki slots, first
  writer wins, and a scan of what the map does not cover yet); the draft is the size_m tokens after it, no more than
  were accepted the last time that key drafted.
- `ngram-map-k4v`: the same key lookup, and for a key seen min_hits times, up to four different m-grams that followed
  its earlier occurrences, counted; it drafts only where one of them is at least twice as frequent as the others
  together (as llama.cpp does, the tokens it drafts are those after the newest occurrence, whichever m-gram won).

As for ngram-mod (ngram.py), the tables are the sequence's own, rebuilt by `begin` from the request's tokens: one
owner's text never drafts for another. Options (`Engine(method_options={"ngram-simple": {...}})`), llama-server's
`--spec-ngram-{simple,map-k4v}-{size-n,size-m,min-hits}` under their names, with its defaults: `size_n` (12), `size_m`
(48), `min_hits` (1; ngram-simple takes it and, as llama.cpp, leaves it unused). ngram-map-k: `size_n` (12), `size_m`
(the pair's capacity). A step drafts at most the request's draft length: longer drafts are cut, as llama-server cuts
them to the room left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .drafting import Implementation, PerSequence, TokenView
from .ngram import NgramTables, hashes
from .proposal import DraftSampling, Proposal

NGRAM_SIMPLE, NGRAM_MAP_K, NGRAM_MAP_K4V = "ngram-simple", "ngram-map-k", "ngram-map-k4v"

MAP_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAP_FACTOR = np.uint32(2654435761)  # LCG_FACTOR of ngram-map.cpp, in uint32 arithmetic
MAX_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES: the m-grams counted after one key
MAX_SIZE = 1024  # llama-server's bound on size_n and size_m
SIZES = {"size_n": 12, "size_m": 48, "min_hits": 1}  # llama-server's defaults (common_params_speculative_ngram_map)


def _check(method: str, size_n: int, size_m: int, min_hits: int) -> None:
    if not (1 <= size_n <= MAX_SIZE and 1 <= size_m <= MAX_SIZE and 1 <= min_hits < 2**16):
        raise ValueError(f"{method} needs 1 ≤ size_n ≤ {MAX_SIZE}, 1 ≤ size_m ≤ {MAX_SIZE} and min_hits ≥ 1, as "
                         f"llama-server (got size_n={size_n}, size_m={size_m}, min_hits={min_hits})")


class NgramSimpleDrafter(NgramTables):
    """common_ngram_simple_draft: no state between drafts."""

    method = NGRAM_SIMPLE

    def __init__(self, tokens: TokenView, capacity: int, *, size_n: int = SIZES["size_n"],
                 size_m: int = SIZES["size_m"], min_hits: int = SIZES["min_hits"]) -> None:
        super().__init__(tokens, capacity)
        _check(NGRAM_SIMPLE, size_n, size_m, min_hits)
        self.n, self.m = size_n, size_m

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        k, m = self.n, self.m
        cur = len(self._tokens)
        if cur <= k + m + 1:
            return Proposal()
        inp = np.asarray(self._tokens[:cur], dtype=np.int64)
        pattern = np.append(inp[cur - k + 1:], id_last)
        # the newest start j in 1 .. cur-k-1 where the pattern occurs (offset 0 means no match in the C++)
        starts = np.flatnonzero(inp[1:cur - k] == pattern[0]) + 1
        match = next((int(j) for j in starts[::-1] if np.array_equal(inp[j:j + k], pattern)), 0)
        if match == 0:
            return Proposal()
        copy = min(m, cur - (match + k))
        if copy < k:  # as llama.cpp: a draft shorter than the key is not made
            return Proposal()
        return Proposal(inp[match + k:match + k + copy].tolist()[:n]).at_least(n_min, None)


@dataclass
class _Value:
    """common_ngram_map_value: an m-gram after a key, where it starts, how often it followed, its last acceptance."""

    value_idx: int = 0  # 0: an unused slot
    value_num: int = 0
    n_accepted: int = -1


@dataclass
class _Key:
    """common_ngram_map_key: where the key n-gram occurs, its hits, and the m-grams counted after it."""

    key_idx: int
    stat_idx: int = 0  # the occurrences before this offset are counted in `values`
    key_num: int = 0
    values: list[_Value] = field(default_factory=list)


class NgramMapDrafter(NgramTables):
    """common_ngram_map: `key_only` (ngram-map-k) drafts the m-gram after the key's newest occurrence; otherwise
    (ngram-map-k4v) the most frequent of the m-grams counted after it decides whether to draft."""

    def __init__(self, tokens: TokenView, capacity: int, *, key_only: bool, size_n: int, size_m: int,
                 min_hits: int = SIZES["min_hits"]) -> None:
        super().__init__(tokens, capacity)
        self.method = NGRAM_MAP_K if key_only else NGRAM_MAP_K4V
        self.key_only = key_only
        _check(self.method, size_n, size_m, min_hits)
        self.n, self.m, self.min_hits = size_n, size_m, min_hits
        self.clear()

    def clear(self) -> None:
        self.keys: list[_Key] = []
        self.key_map: dict[int, int] = {}  # hash slot → offset of an n-gram (absent: 0 in the C++)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.last_draft: tuple[int, int] | None = None  # (key, value) that drafted last

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
        match = self._find(key, cur)
        if match == 0:
            return Proposal()
        offset = next((i for i, s in enumerate(self.keys) if list(inp[s.key_idx:s.key_idx + k]) == key), None)
        if offset is None:
            offset = len(self.keys)
            self.keys.append(_Key(match, values=[_Value(n_accepted=m) for _ in range(MAX_VALUES)]))
        entry = self.keys[offset]
        entry.key_num = min(entry.key_num + 1, MAX_COUNT)
        slot = 0  # key_only drafts with values[0] alone
        if not self.key_only:
            if entry.key_num < self.min_hits:
                return Proposal()
            slot = self._count_values(entry, key, match)
            if slot is None:
                return Proposal()
        drafted = list(inp[match + k:match + k + min(m, entry.values[slot].n_accepted)])
        self.last_draft = (offset, slot)
        return Proposal(drafted[:n]).at_least(n_min, None)

    def accept(self, n_accepted: int) -> None:
        if self.last_draft is not None:
            offset, slot = self.last_draft
            self.keys[offset].values[slot].n_accepted = n_accepted

    def _find(self, key: list[int], cur: int) -> int:
        """The key's match through the hash map, else the scans; then the new n-grams go into the map (0: none)."""
        k, m = self.n, self.m
        top = cur - k - m - 1  # the newest offset a key may start at
        match = 0  # offset 0 means no match, as in the C++
        slot = int(hashes(np.asarray(key, dtype=np.int64), k, 1, MAP_FACTOR)[0]) % MAP_SIZE
        at = self.key_map.get(slot, 0)
        if at != 0 and at < top and list(self._tokens[at:at + k]) == key:
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
        return match

    def _count_values(self, entry: _Key, key: list[int], match: int) -> int | None:
        """Count the m-grams after the key's occurrences from `stat_idx` through `match` (that one included again
        next time, as in the C++); the slot of the one to draft, or None where none stands out."""
        inp, k, m = self._tokens, self.n, self.m
        for i in range(entry.stat_idx, match + 1):
            if list(inp[i:i + k]) != key:
                continue
            start = i + k
            for value in entry.values:
                if value.value_idx == 0:  # a new m-gram after the key
                    value.value_idx, value.value_num, value.n_accepted = start, 0, m
                    break
                if list(inp[start:start + m]) == list(inp[value.value_idx:value.value_idx + m]):
                    break
            else:
                continue  # four m-grams counted already: this one is not
            value.value_num = min(value.value_num + 1, MAX_COUNT)
        entry.stat_idx = match
        counts = [v.value_num for v in entry.values]
        best = max(range(MAX_VALUES), key=lambda v: (counts[v], -v))  # the first of the most frequent (or slot 0)
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return None
        return best

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
        slots = (hashes(window, self.n, start - floor, MAP_FACTOR) % np.uint32(MAP_SIZE)).tolist()
        for j in range(start, floor, -1):
            self.key_map.setdefault(slots[j - floor - 1], j)


def _open_simple(pair: object, views: Sequence[TokenView], capacity: int, **options: int) -> PerSequence:
    return PerSequence([NgramSimpleDrafter(view, capacity, **options) for view in views])


def _open_map_k(pair: object, views: Sequence[TokenView], capacity: int, *, size_n: int = 12,
                size_m: int | None = None) -> PerSequence:
    return PerSequence([NgramMapDrafter(view, capacity, key_only=True, size_n=size_n,
                                        size_m=capacity if size_m is None else size_m) for view in views])


def _open_map_k4v(pair: object, views: Sequence[TokenView], capacity: int, **options: int) -> PerSequence:
    sizes = {**SIZES, **options}
    return PerSequence([NgramMapDrafter(view, capacity, key_only=False, **sizes) for view in views])


SIMPLE = Implementation(_open_simple, options=dict(SIZES))
MAP_K = Implementation(_open_map_k, options={"size_n": 12, "size_m": None})
MAP_K4V = Implementation(_open_map_k4v, options=dict(SIZES))
