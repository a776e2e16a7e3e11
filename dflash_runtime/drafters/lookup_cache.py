"""llama.cpp's lookup caches (common/ngram-cache.cpp), ported: a table from n-grams of 1 to 4 tokens to the tokens
seen after each and how often, the drafts three such tables make together, and the files llama.cpp keeps them in.

- `update` adds the n-grams that end in a sequence's last `nnew` tokens (common_ngram_cache_update); `merge` adds
  one table's counts to another's (common_ngram_cache_merge).
- `draft` (common_ngram_cache_draft) extends a sequence token by token: the longest of the last 1..4 tokens that the
  context table (the request's own text) has seen often enough, else that the dynamic table has (stricter), each
  candidate weighed by how often the static table saw it after the last 2 tokens; else the static table's own
  choice; it stops at the first position none of them settles.
- `load` / `save` read and write llama.cpp's files (common_ngram_cache_load / _save): for each n-gram its 4 tokens
  (int32, -1 past its length), the number of followers (int32), then each follower's token and count (int32 pairs),
  little-endian. `create_static` makes the table `llama-lookup-create` makes of a text's tokens: its 2-grams.

Where candidates weigh the same, llama.cpp takes the first in its std::unordered_map's iteration order, and a file
lists followers in that order; so `Followers` keeps the order libstdc++ gives them (`std_order`: buckets of a prime
count, each new bucket and each new key at the front, the growth libstdc++'s prime rehash policy follows), and a
draft or a file is llama.cpp's token for token. The counts' products are int32 as in C++ (wrapping on overflow, as
x86 does), which a large static table can reach.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path

import numpy as np

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, LLAMA_NGRAM_STATIC
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: an n-gram's unused slots, and "no draft"
# The thresholds below which a table drafts nothing at n-gram length 1..4: (fewest times seen, lowest share in %).
LAX = ((2, 66), (2, 50), (1, 50), (1, 50))  # the context table's (and the static table's, at length 2)
STRICT = ((4, 75), (3, 66), (2, 66), (2, 66))  # the dynamic table's
# libstdc++'s bucket counts as an unordered_map grows (_Prime_rehash_policy at load factor 1: 13 at the first key,
# then the next prime of its list past twice the count, each time the keys outnumber the buckets).
GROWTH = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061, 712697, 1447153,
          2938679, 5967347, 12117689, 24607243, 49969847, 101473717, 206062531, 418451333, 849749479, 1725587117,
          3504151727)
SIZE_T = (1 << 64) - 1  # std::hash<int> is the int as a size_t

Ngram = tuple[int, int, int, int]  # common_ngram: the tokens, TOKEN_NULL past the n-gram's length


class LookupFileError(ValueError):
    """A file that is not a lookup cache as llama.cpp writes one."""


def std_order(keys: Iterable[int]) -> list[int]:
    """The iteration order of a libstdc++ std::unordered_map<int, ...> after `keys` (distinct) were inserted in this
    order into an empty one (or a copy of one: a copy keeps the order and the bucket count)."""
    buckets = limit = 0
    heads: list[int] = []  # buckets in the order they got their first key (iteration: newest first)
    groups: dict[int, list[int]] = {}  # each bucket's keys, oldest first (iteration: newest first)

    def place(key: int) -> None:
        b = (key & SIZE_T) % buckets
        group = groups.get(b)
        if group is None:
            groups[b] = [key]
            heads.append(b)
        else:
            group.append(key)

    growth = iter(GROWTH)
    for size, key in enumerate(keys, 1):
        if size > limit:  # the rehash re-places the keys in their current order
            buckets = limit = next(growth)
            old = [k for b in reversed(heads) for k in reversed(groups[b])]
            heads.clear()
            groups.clear()
            for k in old:
                place(k)
        place(key)
    return [k for b in reversed(heads) for k in reversed(groups[b])]


class Followers:
    """common_ngram_cache_part: the tokens seen after one n-gram and how often, in llama.cpp's order (`__iter__`).
    `counts` keeps the order the tokens came in, from which that order follows (`std_order`)."""

    __slots__ = ("_order", "counts")

    def __init__(self, counts: dict[int, int] | None = None) -> None:
        self.counts: dict[int, int] = {} if counts is None else counts
        self._order: list[int] = []

    def add(self, token: int, count: int = 1) -> None:
        self.counts[token] = self.counts.get(token, 0) + count

    def copy(self) -> Followers:
        return Followers(dict(self.counts))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if len(self._order) != len(self.counts):  # tokens are never removed: a new one changes the order
            self._order = std_order(self.counts)
        counts = self.counts
        return ((t, counts[t]) for t in self._order)

    def __len__(self) -> int:
        return len(self.counts)


Table = MutableMapping[Ngram, Followers]  # common_ngram_cache (its own order does not matter: n-grams are unique)


def ngram(tokens: Sequence[int]) -> Ngram:
    padded = (*tokens, TOKEN_NULL, TOKEN_NULL, TOKEN_NULL, TOKEN_NULL)
    return padded[0], padded[1], padded[2], padded[3]


def update(table: Table, tokens: Sequence[int], nnew: int, ngram_min: int = NGRAM_MIN,
           ngram_max: int = NGRAM_MAX) -> None:
    """Count the n-grams of `ngram_min`..`ngram_max` tokens that end before each of the last `nnew` tokens."""
    size = len(tokens)
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(size - nnew, n), size):
            key = ngram(tokens[i - n:i])
            followers = table.get(key)
            if followers is None:
                table[key] = followers = Followers()
            followers.add(tokens[i])


def merge(target: Table, add: Mapping[Ngram, Followers]) -> None:
    """Add `add`'s counts to `target`'s (an n-gram new to `target` comes with its followers in `add`'s order)."""
    for key, followers in add.items():
        mine = target.get(key)
        if mine is None:
            target[key] = followers.copy()
        else:
            for token, count in followers:
                mine.add(token, count)


def create_static(tokens: Sequence[int]) -> dict[Ngram, Followers]:
    """The static table of a text, as `llama-lookup-create` makes it: its 2-grams."""
    table: dict[Ngram, Followers] = {}
    update(table, tokens, len(tokens), NGRAM_STATIC, NGRAM_STATIC)
    return table


def _i32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def _primary(table: Mapping[Ngram, Followers], keys: Sequence[Ngram | None], static: Followers | None,
             thresholds: Sequence[tuple[int, int]]) -> int:
    """The token the longest n-gram of `keys` (by length 1..4) settles in this table (try_draft with a primary
    table), or TOKEN_NULL."""
    weights = static.counts if static is not None else {}
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        followers = table.get(key) if key is not None else None
        if followers is None:
            continue
        best, best_count, best_static, total = TOKEN_NULL, 0, 0, 0
        for token, count in followers:
            weight = 100 * weights[token] if token in weights else 1
            if _i32(count * weight) > _i32(best_count * best_static):
                best, best_count, best_static = token, count, weight
            total = _i32(total + count)
        fewest, share = thresholds[i]
        if total < fewest or _i32(100 * best_count) < _i32(share * total):
            continue
        if best != TOKEN_NULL:
            return best
    return TOKEN_NULL


def _static(static: Followers | None) -> int:
    """The static table's own choice after the last 2 tokens (try_draft with the static table alone)."""
    if static is None:
        return TOKEN_NULL
    best, best_count, total = TOKEN_NULL, 0, 0
    for token, count in static:
        if count > best_count:
            best, best_count = token, count
        total = _i32(total + count)
    fewest, share = LAX[NGRAM_STATIC - 1]
    if total < fewest or _i32(100 * best_count) < _i32(share * total):
        return TOKEN_NULL
    return best


def draft(inp: Sequence[int], n_draft: int, context: Mapping[Ngram, Followers], dynamic: Mapping[Ngram, Followers],
          static: Mapping[Ngram, Followers]) -> list[int]:
    """Up to `n_draft` tokens after `inp` (whose last token is the one just sampled), as common_ngram_cache_draft
    makes them. An n-gram longer than the sequence so far finds nothing (llama.cpp reads before its start there)."""
    seq = list(inp)
    size = len(seq)
    drafted: list[int] = []
    if size < NGRAM_STATIC:
        return drafted
    while len(drafted) < n_draft:
        followers_static = static.get(ngram(seq[-NGRAM_STATIC:]))
        keys = [ngram(seq[-n:]) if n <= len(seq) else None for n in range(NGRAM_MIN, NGRAM_MAX + 1)]
        token = _primary(context, keys, followers_static, LAX)
        if token == TOKEN_NULL:
            token = _primary(dynamic, keys, followers_static, STRICT)
        if token == TOKEN_NULL:
            token = _static(followers_static)
        if token == TOKEN_NULL:
            break
        drafted.append(token)
        seq.append(token)
    return drafted


def load(path: str | os.PathLike[str]) -> dict[Ngram, Followers]:
    """A lookup cache file as llama.cpp reads it; LookupFileError where it is not one (llama.cpp aborts there)."""
    data = Path(path).read_bytes()
    if len(data) % 4:
        raise LookupFileError(f"{path} is not a lookup cache: {len(data)} bytes is not a whole number of int32s")
    words = np.frombuffer(data, dtype="<i4").tolist()
    table: dict[Ngram, Followers] = {}
    at, end = 0, len(words)
    while at < end:
        if at + 5 > end:
            raise LookupFileError(f"{path} is not a lookup cache: it ends inside an n-gram's header (int32 #{at})")
        key = ngram(words[at:at + 4])
        count = words[at + 4]
        pairs = words[at + 5:at + 5 + 2 * count]
        if count <= 0 or len(pairs) != 2 * count:
            raise LookupFileError(f"{path} is not a lookup cache: the n-gram at int32 #{at} lists {count} followers"
                                  f"{' (the file ends first)' if count > 0 else ''}")
        followers = Followers()
        for token, n in zip(pairs[0::2], pairs[1::2], strict=True):
            if n <= 0:
                raise LookupFileError(f"{path} is not a lookup cache: a count of {n} at the n-gram at int32 #{at}")
            followers.counts.setdefault(token, n)  # a repeated token keeps its first count, as emplace does
        table.setdefault(key, followers)
        at += 5 + 2 * count
    return table


def save(table: Mapping[Ngram, Followers], path: str | os.PathLike[str]) -> None:
    """Write a lookup cache file (common_ngram_cache_save's layout; the n-grams in the table's order), replacing the
    file at once: a reader sees the old file or the new one."""
    words: list[int] = []
    for key, followers in table.items():
        words.extend(key)
        words.append(len(followers))
        for token, count in followers:
            words.append(token)
            words.append(count)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(np.asarray(words, dtype="<i4").tobytes())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
