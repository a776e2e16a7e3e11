"""The one interface every draft method implements, in the shape of llama.cpp's `common_speculative_impl`, and what
a method declares to the registry (methods.py).

A drafter owns what its method needs (DFlash: the draft context and the feature bridge; MTP: the MTP context and
the target's hidden rows; n-gram: its tables) and decides when to bring it up to date. It reads the sequence's
tokens (the target cache's, id_last excluded) through the read-only `TokenView` it was opened with, as llama.cpp
hands its drafters the prompt. `Decoding` talks to drafters only through this protocol:

- `process(tokens, pos0, eager=...)` after every target decode (prompt chunks and verify batches): what the method
  reads from the target must be taken now, before the next decode overwrites it. `eager` says whether the rows go
  into the drafter's own context now (a drafting request's prompt, a round that drafted — as llama.cpp does) or may
  wait for the next draft (plain requests and plain rounds cost nothing extra).
- `begin()` once the prompt of a request that drafts with this method is in the cache (llama.cpp's `begin`);
- `catch_up()` brings the drafter's context up to the target's before a draft;
- `draft(id_last, pos0, n, ...)` proposes up to n tokens after `id_last` decoded at `pos0`; a proposal without
  distributions (`q` None) is deterministic, and the verifier treats each token as drawn from a point mass;
- `accept(n_accepted)` after verification; `keep(n)` when the caches are cut to n tokens; `clear()`.
- `save()` / `restore(state)` park the drafter's state beside the caches' (see sessions.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload

if TYPE_CHECKING:
    from .pair import LinkedPair
    from .proposal import DraftSampling, Proposal

DFLASH, MTP = "dflash", "mtp"


class TokenView(Sequence[int]):
    """A read-only view of a token list that its owner may replace: every read goes to the owner's current list."""

    def __init__(self, source: Callable[[], Sequence[int]]) -> None:
        self._source = source

    def __len__(self) -> int:
        return len(self._source())

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        return self._source()[i]


class Drafter(Protocol):
    method: str
    capacity: int  # the longest draft this drafter was opened for

    def process(self, tokens: Sequence[int], pos0: int, *, eager: bool) -> None: ...

    def begin(self) -> None: ...

    def catch_up(self) -> None: ...

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal: ...

    def accept(self, n_accepted: int) -> None: ...

    def keep(self, n: int) -> None: ...

    def clear(self) -> None: ...

    def save(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def state_bytes(self, state: Any) -> int: ...

    def free(self) -> None: ...


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how a person reads it (the Space's menus and tables)
    needs: str  # "draft" (a DFlash draft GGUF), "nextn" (the target's MTP layers) or "" (nothing)
    open: Callable[..., Drafter]  # (the opened pair, the cache's tokens, **its options) → its drafter
    auto: bool = True  # a candidate for the pair's default method (a request that names none)

    def wanted(self, pair: LinkedPair) -> bool:
        """From the headers, before any context opens: whether the pair is sized for this method."""
        return {"draft": pair.spec is not None, "nextn": pair.wants_mtp, "": True}[self.needs]

    def ready(self, pair: LinkedPair) -> bool:
        """Once the contexts are open: whether the pair can run this method."""
        return holds(pair, self.needs)


def holds(pair: LinkedPair, needs: str) -> bool:
    """Whether the opened pair holds what a method needs: a draft context, an MTP context, or nothing."""
    return {"draft": pair.draft_ctx is not None, "nextn": pair.mtp_ctx is not None, "": True}[needs]
