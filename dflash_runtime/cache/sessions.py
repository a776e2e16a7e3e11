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
  by the first request that declared them (`public_prefix=`, the prefill stopping there: `keep_public_base`), and
  never evicted by other owners' requests;
- else the caches start empty.
The previous owner's state is parked (tokens, the target's and each drafter's state, its checkpoints) either when it
asks (`Engine.park(owner)`, inside its own request's time) or, with `SessionPolicy(park_on_switch=True)` (a library
user's default), lazily at the switch, where the copy's cost lands in the next owner's request. Parked states are
bounded in count and bytes, least recently used first out.

An engine of several sequences (`parallel`) gives each running request its own sequence, and an owner keeps its
sequence between requests while others are free: a switch happens only when sequences run out (see `CacheOwners`).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .pair_cache import PairCache, ParkedCache, reusable_prefix

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
    that a burst of new owners (one caller opening many sessions) cannot push out the states of recent visitors.

    `group_of` and `per_group`: owners grouped (e.g. a service's sessions by the client that opened them) keep at most
    `per_group` parked states per group, a group at its share making room from its own oldest; and room for a new
    state is made from the group that holds the most, so no group fills the store.

    `active_share`: the share of `max_parked` kept for states in active use — an owner that came back to its state at
    least once (its next request reused it). While such states hold no more than that share, room for a new state is
    made from the states nobody came back to first, so that a crowd of one-off requests (many owners, many groups)
    cannot evict the conversations that are being used. 0 (the default) treats all states alike."""

    max_parked: int = DEFAULT_MAX_PARKED
    max_bytes: int = DEFAULT_MAX_PARKED_BYTES
    park_on_switch: bool = True
    protect_s: float = 0.0
    group_of: Callable[[Hashable | None], Hashable] | None = None
    per_group: int = 0
    active_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.active_share <= 1.0:
            raise ValueError(f"active_share must be in [0, 1] (got {self})")
        if self.max_parked < 0 or self.max_bytes < 0 or self.protect_s < 0 or self.per_group < 0:
            raise ValueError(f"session limits must be ≥ 0 (got {self})")


class CacheOwners:
    """The owners of the engine's sequences (one `PairCache` each): which owner's tokens a sequence holds, which
    sequences run a request now, and the states kept aside (parked states, public bases).

    A request gets an idle sequence: the one holding its owner's tokens when there is one (the sequence it shares
    the most with, then the most recent), else an empty one, else the least recently used — among equals, one next
    to the running sequences, so that a step's sequences stay consecutive (see `_busy_neighbours`); only the last
    case switches a sequence from one owner to another. With one sequence this is the owner switch of the module doc at
    every change of owner; with several, a visitor keeps its own sequence while there are enough of them, and its
    state goes to host memory only when sequences run out."""

    def __init__(self, caches: Sequence[PairCache], policy: SessionPolicy) -> None:
        self.caches = list(caches)
        self.policy = policy
        n = len(self.caches)
        self._owners: list[Hashable | None] = [None] * n
        self._dirty = [False] * n  # the live sequence holds more of its owner's than its parked copy (if any)
        self._busy = [False] * n
        self._released = [0] * n  # when each sequence was last released (a counter): least recently used first
        self._clock = 0
        self._parked: OrderedDict[Hashable | None, ParkedCache] = OrderedDict()
        self._parked_at: dict[Hashable | None, float] = {}  # when each was parked (time.monotonic)
        self._public: OrderedDict[tuple[int, ...], ParkedCache] = OrderedDict()
        self._active: set[Hashable | None] = set()  # owners that came back to their state (see active_share)

    @property
    def running(self) -> int:
        return sum(self._busy)

    def acquire(self, owner: Hashable | None, prompt: Sequence[int],
                public_prefix: int) -> tuple[PairCache, int | None]:
        """An idle sequence for `owner`'s request, made its owner's. Returns it and how many cached tokens the request
        may reuse (None: all it shares with it)."""
        idle = [s for s, busy in enumerate(self._busy) if not busy]
        if not idle:
            raise RuntimeError("no idle sequence: the engine admits at most as many requests as it has sequences")
        own = [s for s in idle if self._owners[s] == owner and self.caches[s].tokens]
        if own:
            seq = max(own, key=lambda s: (self.caches[s].shared(prompt), self._released[s]))
            self._busy[seq], self._dirty[seq] = True, True
            self._active.add(owner)
            return self.caches[seq], None
        seq = min(idle, key=lambda s: (bool(self.caches[s].tokens), -self._busy_neighbours(s), self._released[s]))
        self._busy[seq] = True
        return self.caches[seq], self._switch(seq, owner, prompt, public_prefix)

    def owner_of(self, seq: int) -> Hashable | None:
        """Whose tokens sequence `seq` holds (whose request runs on it, while one does)."""
        return self._owners[seq]

    def keeps(self, owner: Hashable | None) -> bool:
        """Whether anything of `owner`'s is kept: a sequence of its, or its parked state."""
        return owner in self._parked or owner in self._owners

    def idle(self) -> list[PairCache]:
        """The sequences no request runs on now."""
        return [cache for cache, busy in zip(self.caches, self._busy, strict=True) if not busy]

    def _busy_neighbours(self, seq: int) -> int:
        """Running sequences next to `seq`. libllama decodes a batch of per-sequence KV streams in ubatches of
        consecutive sequence ids (llama_batch_allocr::split_equal, `sequential`): a step whose running sequences
        leave gaps runs one pass of the model per run of consecutive ids, so a request takes a sequence next to
        the running ones."""
        return sum(1 for s in (seq - 1, seq + 1) if 0 <= s < len(self._busy) and self._busy[s])

    def release(self, cache: PairCache) -> None:
        """The sequence's request ended: it stays its owner's until another owner needs it."""
        self._clock += 1
        self._busy[cache.seq], self._released[cache.seq] = False, self._clock

    def _switch(self, seq: int, owner: Hashable | None, prompt: Sequence[int], public_prefix: int) -> int | None:
        cache = self.caches[seq]
        parked = self._parked.pop(owner, None)  # before parking the current owner: it must not be evicted for it
        self._parked_at.pop(owner, None)
        if self._dirty[seq] and self.policy.park_on_switch and len(cache.tokens) > cache.public_len:
            self._park(self._owners[seq], cache.park())
        self._owners[seq], self._dirty[seq] = owner, True
        base = self._public.get(tuple(prompt[:public_prefix])) if public_prefix else None
        public = len(base.tokens) if base is not None else min(cache.public_len, public_prefix)
        if parked is not None and reusable_prefix(parked.tokens, prompt) > min(cache.shared(prompt), public):
            cache.unpark(parked)
            self._active.add(owner)
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

    def keep_public_base(self, cache: PairCache) -> None:
        """Keep a copy of a sequence as it is now — right after a public prefix — as that prefix's base."""
        base = cache.park()
        base = replace(base, public_len=len(base.tokens))
        self._public[tuple(base.tokens)] = base
        while len(self._public) > MAX_PUBLIC_BASES:
            self._public.popitem(last=False)

    def park(self, owner: Hashable | None = None, *, current: bool = True) -> None:
        """Park `owner`'s live state now (see the module doc); with one sequence and no owner named, its current
        owner's. A sequence that is running a request is parked as it stands between two steps."""
        for seq, cache in enumerate(self.caches):
            mine = self._owners[seq] == owner or (current and owner is None and len(self.caches) == 1)
            if mine and self._dirty[seq] and len(cache.tokens) > cache.public_len:
                self._park(self._owners[seq], cache.park())
                self._dirty[seq] = False

    def forget(self) -> None:
        """Drop every parked state and public base (the live caches are cleared by their owner)."""
        self._parked.clear()
        self._parked_at.clear()
        self._public.clear()
        self._active.clear()
        n = len(self.caches)
        self._owners, self._dirty = [None] * n, [False] * n

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
        if policy.group_of is not None and policy.per_group:
            group = policy.group_of(owner)
            own = [other for other in self._parked if policy.group_of(other) == group]
            for oldest in own[: max(0, len(own) + 1 - policy.per_group)]:  # a group at its share: its own oldest go
                del self._parked[oldest], self._parked_at[oldest]
        # Make room, least recently used first, but never by evicting a state parked within protect_s.
        while self._parked and (len(self._parked) + 1 > policy.max_parked or (
                sum(p.nbytes for p in self._parked.values()) + parked.nbytes > policy.max_bytes)):  # fmt: skip
            oldest = self._evictable()
            if now - self._parked_at[oldest] < policy.protect_s:
                return  # the recent states stay; this one is not kept
            del self._parked[oldest], self._parked_at[oldest]
        self._parked[owner] = parked
        self._parked_at[owner] = now
        live = set(self._owners)
        self._active = {o for o in self._active if o in self._parked or o in live}

    def _evictable(self) -> Hashable | None:
        """The parked state to evict first: the least recently parked, of the group holding the most (with groups),
        of the states nobody came back to while the active ones keep to their share (`active_share`)."""
        group_of, candidates = self.policy.group_of, list(self._parked)
        if self.policy.active_share:
            active = [owner for owner in candidates if owner in self._active]
            idle = [owner for owner in candidates if owner not in self._active]
            if len(active) > self.policy.active_share * self.policy.max_parked:
                candidates = active  # over their share: the active states make room among themselves
            elif idle:
                candidates = idle
        if group_of is None:
            return candidates[0]
        sizes = Counter(group_of(owner) for owner in candidates)
        most = max(sizes.values())
        return next(owner for owner in candidates if sizes[group_of(owner)] == most)
