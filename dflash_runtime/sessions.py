"""Whose tokens the caches hold: a request reuses only what its own owner put there, plus a public prefix.

A shared prefix cache answers a question about other people's text: how much of my prompt was cached, and how fast
was it prefilled? On a public Space that is an oracle on other visitors' prompts. So every cached token has an owner
(an opaque key: a visitor's session; None for a library user who passes none) and a request of another owner may
keep only the part both sides declare public (e.g. a Space's default system prompt).

What an owner switch costs must not tell the new owner anything of the previous one either, so it does the same work
whatever the previous owner left:
- the new owner's own parked state comes back when it has one that reaches further than the public prefix (a copy
  of its own tokens: its cost depends on its own history only);
- else the public prefix comes back from its *public base*: a copy of the caches right after those tokens, taken once
  by the first request that declared them (or by `Engine.keep_public`) and never evicted by other owners' requests;
- else the caches start empty.
The previous owner's state is parked (tokens, the target's and each drafter's state, its checkpoints) either when it
asks (`Engine.park()`, inside its own request's time) or, with `SessionPolicy(park_on_switch=True)` (a library
user's default), lazily at the switch, where the copy's cost lands in the next owner's request. Parked states are
bounded in count and bytes, least recently used first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .cache import PairCache, ParkedCache, reusable_prefix

DEFAULT_MAX_PARKED = 8
DEFAULT_MAX_PARKED_BYTES = 8 << 30
MAX_PUBLIC_BASES = 4  # distinct public prefixes kept (a Space has one per thinking mode)


@dataclass(frozen=True)
class SessionPolicy:
    """How many owners' states are kept aside (and their total bytes); max_parked=0 keeps none.

    `park_on_switch`: park the previous owner's state when another owner's request begins (its cost then lands in
    that request); False keeps only the states parked explicitly with `Engine.park()` — what a multi-tenant service
    wants, so that nobody's request pays for, or times, somebody else's state.

    `protect_s`: a state parked less than this long ago is not evicted to make room for another owner's; the newcomer's
    state is then not kept instead. 0 (the default) is plain least-recently-used; a public service sets minutes, so
    that a burst of new owners (one caller opening many sessions) cannot push out the states of recent visitors."""

    max_parked: int = DEFAULT_MAX_PARKED
    max_bytes: int = DEFAULT_MAX_PARKED_BYTES
    park_on_switch: bool = True
    protect_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_parked < 0 or self.max_bytes < 0 or self.protect_s < 0:
            raise ValueError(f"session limits must be ≥ 0 (got {self})")


class CacheOwners:
    def __init__(self, cache: PairCache, policy: SessionPolicy) -> None:
        self.cache = cache
        self.policy = policy
        self.owner: Hashable | None = None
        self._dirty = False  # the live caches hold more of the owner's than its parked copy (if any)
        self._parked: OrderedDict[Hashable | None, ParkedCache] = OrderedDict()
        self._parked_at: dict[Hashable | None, float] = {}  # when each was parked (time.monotonic)
        self._public: OrderedDict[tuple[int, ...], ParkedCache] = OrderedDict()

    def switch(self, owner: Hashable | None, prompt: Sequence[int], public_prefix: int) -> int | None:
        """Make the caches `owner`'s before its request. Returns how many cached tokens the request may reuse
        (None: all it shares with them)."""
        if owner == self.owner:
            self._dirty = True
            return None
        cache = self.cache
        parked = self._parked.pop(owner, None)  # before parking the current owner: it must not be evicted for it
        self._parked_at.pop(owner, None)
        if self._dirty and self.policy.park_on_switch and len(cache.tokens) > cache.public_len:
            self._park(self.owner, cache.park())
        self.owner, self._dirty = owner, True
        base = self._public.get(tuple(prompt[:public_prefix])) if public_prefix else None
        public = len(base.tokens) if base is not None else min(cache.public_len, public_prefix)
        if parked is not None and reusable_prefix(parked.tokens, prompt) > min(cache.shared(prompt), public):
            cache.unpark(parked)
            return None
        if base is not None:
            self._public.move_to_end(tuple(base.tokens))
            cache.unpark(base)
            return public
        if not public:
            cache.clear()  # the same work whatever the previous owner left
        return public

    def needs_public_base(self, prompt: Sequence[int], public_prefix: int) -> bool:
        """Whether no copy of the caches after this prompt's public prefix is kept yet."""
        return 0 < public_prefix <= len(prompt) and tuple(prompt[:public_prefix]) not in self._public

    def keep_public_base(self) -> None:
        """Keep a copy of the caches as they are now — right after a public prefix — as that prefix's base."""
        cache = self.cache
        base = cache.park()
        base = replace(base, public_len=len(base.tokens))
        self._public[tuple(base.tokens)] = base
        while len(self._public) > MAX_PUBLIC_BASES:
            self._public.popitem(last=False)

    def park(self) -> None:
        """Park the current owner's state now (see the module doc)."""
        if self._dirty and len(self.cache.tokens) > self.cache.public_len:
            self._park(self.owner, self.cache.park())
        self._dirty = False

    def forget(self) -> None:
        """Drop every parked state and public base (the live caches are cleared by their owner)."""
        self._parked.clear()
        self._parked_at.clear()
        self._public.clear()
        self.owner, self._dirty = None, False

    def describe(self) -> dict[str, Any]:
        return {
            "max_parked": self.policy.max_parked,
            "max_bytes": self.policy.max_bytes,
            "park_on_switch": self.policy.park_on_switch,
            "parked": len(self._parked),
            "parked_bytes": sum(p.nbytes for p in self._parked.values()),
            "public_bases": [len(tokens) for tokens in self._public],
        }

    def _park(self, owner: Hashable | None, parked: ParkedCache) -> None:
        self._parked.pop(owner, None)
        self._parked_at.pop(owner, None)
        policy = self.policy
        if policy.max_parked == 0 or parked.nbytes > policy.max_bytes:
            return
        now = time.monotonic()
        # Make room, least recently used first, but never by evicting a state parked within protect_s.
        while self._parked and (len(self._parked) + 1 > policy.max_parked or (
                sum(p.nbytes for p in self._parked.values()) + parked.nbytes > policy.max_bytes)):  # fmt: skip
            oldest = next(iter(self._parked))
            if now - self._parked_at[oldest] < policy.protect_s:
                return  # the recent states stay; this one is not kept
            del self._parked[oldest], self._parked_at[oldest]
        self._parked[owner] = parked
        self._parked_at[owner] = now
