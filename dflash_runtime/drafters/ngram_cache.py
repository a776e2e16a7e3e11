"""ngram-cache: llama.cpp's lookup decoding (`--spec-type ngram-cache`, its `common_speculative_impl_ngram_cache`),
drafting from three lookup caches (lookup_cache.py) as llama-server does, token for token:

- the context cache, the request's own text: before each draft, the tokens since the last one (and the token just
  sampled) are counted as llama-server counts them, the n-grams within that stretch only;
- the dynamic cache (`lookup_cache_dynamic`, llama-server's `-lcd`): a file's table, read when the engine opens (a
  missing file is an empty one), under what the owner's own earlier requests taught it;
- the static cache (`lookup_cache_static`, `-lcs`): a file's table, read when the engine opens and never changed —
  made by `llama-lookup-create` from a corpus, or by `lookup_cache.create_static` here (the same file).

A draft is up to 8 tokens (llama-server's fixed n_draft), cut to the request's draft length.

What the dynamic cache learns, and for whom (`DynamicCaches`): every request's n-grams (its prompt and answer as far
as it drafted, all of them, as `llama-lookup` counts its own) are kept under the request's owner (its `cache_owner`,
None for a library user who names none) and merged into that owner's dynamic cache when its next request begins —
in its own request's time, as `llama-lookup` merges its own at its end. A request drafts from its owner's cache only:
the file's table under what that owner taught it, never another owner's. An owner's cache lives as long as the
engine keeps its conversation (a sequence of its, or its parked state: cache/sessions.py, whose limits and fairness
decide), 16 owners' at most besides the default owner's (least recently used first out), each up to 32 Ki n-grams
learnt (past that it starts over). The default owner's grows as llama-lookup's file does and is written back to the
file when the engine closes; no other owner's ever is. (llama-server reads `-lcd` and never writes it: a file the
engine wrote is what the server reads for the next request.)

Options (`Engine(method_options={"ngram-cache": {...}})`), llama-server's, by the names of its parameters:
`lookup_cache_static` and `lookup_cache_dynamic`, file paths (None, the default: no file).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .drafting import Implementation, PerSequence, TokenView
from .lookup_cache import NGRAM_MAX, Followers, LookupFileError, Ngram, draft, load, save, update
from .ngram import NgramTables
from .proposal import DraftSampling, Proposal

NGRAM_CACHE = "ngram-cache"
N_DRAFT = 8  # create_state_ngram_cache: llama-server drafts up to 8 tokens (its --spec-draft-n-max is not read)
KEPT_OWNERS = 16  # owners whose dynamic caches are kept besides the default owner's (least recently used first out)
MAX_LEARNED = 32 * 1024  # n-grams an owner's requests may add to its cache (about 15 MB); past that it starts over

log = logging.getLogger(__name__)


class Layered(Mapping[Ngram, Followers]):
    """An owner's dynamic cache: its own n-grams (`overlay`: the file's, with what its requests added) over the
    file's table."""

    def __init__(self, overlay: Mapping[Ngram, Followers], base: Mapping[Ngram, Followers]) -> None:
        self.overlay, self.base = overlay, base

    def get(self, key: Ngram, default: Any = None) -> Any:
        found = self.overlay.get(key)
        return found if found is not None else self.base.get(key, default)

    def __getitem__(self, key: Ngram) -> Followers:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[Ngram]:
        yield from self.overlay
        yield from (key for key in self.base if key not in self.overlay)

    def __len__(self) -> int:
        return len(self.overlay) + sum(1 for key in self.base if key not in self.overlay)


class Learning:
    """One request's n-grams, counted as it drafts (`table`); `done` once the request is over."""

    __slots__ = ("done", "table")

    def __init__(self) -> None:
        self.table: dict[Ngram, Followers] = {}
        self.done = False


@dataclass
class OwnerCache:
    """An owner's dynamic cache: the n-grams its requests taught it (with the file's counts added; never changed once
    made, as a running request may draft from it), and its requests not merged in yet."""

    overlay: dict[Ngram, Followers] = field(default_factory=dict)
    learning: list[Learning] = field(default_factory=list)


class DynamicCaches:
    """The dynamic caches of a method's sequences: the file's table (`seed`), and each owner's cache over it. Its
    calls come from the engine's steps (every drafter call is), one at a time."""

    def __init__(self, seed: Mapping[Ngram, Followers], path: Path | None) -> None:
        self.seed, self.path = seed, path
        self._owners: OrderedDict[Hashable | None, OwnerCache] = OrderedDict()

    def start(self, owner: Hashable | None, keeps: Callable[[Hashable | None], bool]
              ) -> tuple[Mapping[Ngram, Followers], Learning]:
        """A request of `owner` begins: its dynamic cache (the owner's finished requests merged in now, in this
        request's time) and where its own n-grams go. The caches of owners whose conversations the engine no longer
        keeps (`keeps`) go, and past KEPT_OWNERS the least recently used."""
        cache = self._owners.pop(owner, None)
        self._owners[owner] = cache = OwnerCache() if cache is None else cache  # the most recent
        others = [o for o in self._owners if o is not None and o != owner]
        gone = [o for o in others if not keeps(o)]
        kept = [o for o in others if o not in gone]
        for old in gone + kept[:max(0, len(kept) + 1 - KEPT_OWNERS)]:
            del self._owners[old]
        self._merge(owner, cache)
        learning = Learning()
        cache.learning.append(learning)
        return (Layered(cache.overlay, self.seed) if cache.overlay else self.seed), learning

    def _merge(self, owner: Hashable | None, cache: OwnerCache) -> None:
        """Merge the owner's finished requests into its cache (lookup_cache.merge over the file's table), into a new
        table: a running request of the owner may be drafting from the old one."""
        done = [learning for learning in cache.learning if learning.done]
        if not done:
            return
        cache.learning = [learning for learning in cache.learning if not learning.done]
        overlay, copied = dict(cache.overlay), set()
        for learning in done:
            for key, followers in learning.table.items():
                mine = overlay.get(key) if key in copied else None
                if mine is None:
                    old = overlay.get(key)
                    old = self.seed.get(key) if old is None else old
                    if old is None:
                        overlay[key] = followers.copy()
                        copied.add(key)
                        continue
                    overlay[key] = mine = old.copy()
                    copied.add(key)
                for token, count in followers:
                    mine.add(token, count)
        if owner is not None and len(overlay) > MAX_LEARNED:
            overlay = {}  # it starts over from the file's table
        cache.overlay = overlay

    def close(self) -> None:
        """The engine closes: the default owner's cache, with its last requests, back to the file."""
        cache = self._owners.get(None)
        if self.path is None or cache is None:
            return
        for learning in cache.learning:
            learning.done = True
        self._merge(None, cache)
        if not cache.overlay:
            return
        try:
            save(Layered(cache.overlay, self.seed), self.path)
        except OSError as error:  # the engine is closing: say so, and close all the same
            log.warning("ngram-cache: could not write the dynamic lookup cache %s: %s", self.path, error)


class NgramCacheDrafter(NgramTables):
    """One sequence's lookup decoding: its context cache and its owner's dynamic cache (see the module doc)."""

    method = NGRAM_CACHE

    def __init__(self, tokens: TokenView, capacity: int, static: Mapping[Ngram, Followers],
                 dynamic: DynamicCaches) -> None:
        super().__init__(tokens, capacity)
        self.static, self.caches = static, dynamic
        self.learning: Learning | None = None
        self.clear()

    def clear(self) -> None:
        if self.learning is not None:
            self.learning.done = True  # what it counted is its owner's, merged at the owner's next request
        self.learning = None
        self.dynamic: Mapping[Ngram, Followers] = self.caches.seed
        self.context: dict[Ngram, Followers] = {}
        self.cache_size = 0  # the tokens counted into the context cache (llama-server's sinfo.cache_size)
        self.learnt = 0  # the tokens counted into `learning`

    def begin(self) -> None:
        self.clear()
        self.dynamic, self.learning = self.caches.start(self._tokens.owner, self._tokens.keeps)

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        prompt = self._tokens
        cur = len(prompt)
        if self.cache_size < cur + 1:
            chunk = [*prompt[self.cache_size:cur], id_last]
            update(self.context, chunk, len(chunk))
            self.cache_size = cur + 1
        if self.learning is not None and cur + 1 > self.learnt:  # every n-gram ending in what came since
            start = max(0, self.learnt - NGRAM_MAX)
            update(self.learning.table, [*prompt[start:cur], id_last], cur + 1 - self.learnt)
            self.learnt = cur + 1
        tail = [*prompt[max(0, cur - NGRAM_MAX):cur], id_last]  # all a draft reads of the sequence
        return Proposal(draft(tail, N_DRAFT, self.context, self.dynamic, self.static)[:n]).at_least(n_min, None)


def _path(name: str, value: object) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ValueError(f"ngram-cache's {name} is a file path or None (got {value!r})")
    return Path(value)


def _read(name: str, path: Path) -> dict[Ngram, Followers]:
    try:
        return load(path)
    except (OSError, LookupFileError) as error:
        raise ValueError(f"ngram-cache cannot read its {name} {path}: {error}") from error


def _open(pair: object, views: Sequence[TokenView], capacity: int, *, lookup_cache_static: object = None,
          lookup_cache_dynamic: object = None) -> PerSequence:
    static_path = _path("lookup_cache_static", lookup_cache_static)
    dynamic_path = _path("lookup_cache_dynamic", lookup_cache_dynamic)
    static = _read("lookup_cache_static", static_path) if static_path is not None else {}
    seed: dict[Ngram, Followers] = {}
    if dynamic_path is not None:
        if dynamic_path.exists():
            seed = _read("lookup_cache_dynamic", dynamic_path)
        elif not dynamic_path.parent.is_dir():
            raise ValueError(f"ngram-cache's lookup_cache_dynamic {dynamic_path}: no folder {dynamic_path.parent} to "
                             "write it in")
    caches = DynamicCaches(seed, dynamic_path)
    return PerSequence([NgramCacheDrafter(view, capacity, static, caches) for view in views], on_free=caches.close)


IMPLEMENTATION = Implementation(_open, options={"lookup_cache_static": None, "lookup_cache_dynamic": None})
