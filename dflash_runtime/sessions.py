"""Whose tokens the caches hold: a request reuses only what its own owner put there, plus a public prefix.

A shared prefix cache answers a question about other people's text: how much of my prompt was cached, and how fast
was it prefilled? On a public Space that is an oracle on other visitors' prompts. So every cached token has an owner
(an opaque key: a visitor's session; None for a library user who passes none) and a request of another owner may
keep only the part both sides declare public (e.g. a Space's default system prompt). The previous owner's state is
parked in host memory — tokens, the target's and each drafter's state, its checkpoints — and comes back when that
owner returns, so a visitor's own multi-turn chat still reuses its prefix. Parked states are bounded in count and
bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .cache import PairCache, ParkedCache, reusable_prefix

DEFAULT_MAX_PARKED = 8
DEFAULT_MAX_PARKED_BYTES = 8 << 30


@dataclass(frozen=True)
class SessionPolicy:
    """How many owners' states are kept aside (and their total bytes); max_parked=0 keeps none."""

    max_parked: int = DEFAULT_MAX_PARKED
    max_bytes: int = DEFAULT_MAX_PARKED_BYTES

    def __post_init__(self) -> None:
        if self.max_parked < 0 or self.max_bytes < 0:
            raise ValueError(f"session limits must be ≥ 0 (got {self})")


class CacheOwners:
    def __init__(self, cache: PairCache, policy: SessionPolicy) -> None:
        self.cache = cache
        self.policy = policy
        self.owner: Hashable | None = None
        self._parked: OrderedDict[Hashable | None, ParkedCache] = OrderedDict()

    def switch(self, owner: Hashable | None, prompt: Sequence[int], public_prefix: int) -> int | None:
        """Make the caches `owner`'s before its request. Returns how many cached tokens the request may reuse
        (None: all it shares with them)."""
        if owner == self.owner:
            return None
        cache = self.cache
        parked = self._parked.pop(owner, None)  # before parking the current owner: it must not be evicted for it
        if len(cache.tokens) > cache.public_len:
            self._park(self.owner, cache.park())
        self.owner = owner
        public = min(cache.public_len, public_prefix)
        if parked is not None and reusable_prefix(parked.tokens, prompt) > min(cache.shared(prompt), public):
            cache.unpark(parked)
            return None
        return public

    def forget(self) -> None:
        """Drop every parked state (the live caches are cleared by their owner)."""
        self._parked.clear()
        self.owner = None

    def describe(self) -> dict[str, Any]:
        return {
            "max_parked": self.policy.max_parked,
            "max_bytes": self.policy.max_bytes,
            "parked": len(self._parked),
            "parked_bytes": sum(p.nbytes for p in self._parked.values()),
        }

    def _park(self, owner: Hashable | None, parked: ParkedCache) -> None:
        self._parked.pop(owner, None)
        if self.policy.max_parked == 0 or parked.nbytes > self.policy.max_bytes:
            return
        self._parked[owner] = parked
        while len(self._parked) > self.policy.max_parked or (
            sum(p.nbytes for p in self._parked.values()) > self.policy.max_bytes
        ):
            self._parked.popitem(last=False)
