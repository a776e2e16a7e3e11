"""The one interface every draft method implements, in the shape of llama.cpp's `common_speculative_impl`.

A drafter owns what its method needs (DFlash: the draft context and the feature bridge; MTP: the MTP context and
the target's hidden rows) and decides when to bring it up to date. `Decoding` talks to drafters only through this
protocol:

- `process(tokens, pos0, eager=...)` after every target decode (prompt chunks and verify batches): what the method
  reads from the target must be taken now, before the next decode overwrites it. `eager` says whether the rows go
  into the drafter's own context now (a drafting request's prompt, a round that drafted — as llama.cpp does) or may
  wait for the next draft (plain requests and plain rounds cost nothing extra).
- `catch_up()` brings the drafter's context up to the target's before a draft;
- `draft(id_last, pos0, n, ...)` proposes up to n tokens after `id_last` decoded at `pos0`;
- `accept(n_accepted)` after verification; `keep(n)` when the caches are cut to n tokens; `clear()`.
- `save()` / `restore(state)` park the drafter's state beside the caches' (see sessions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .proposal import DraftSampling, Proposal

DFLASH, MTP = "dflash", "mtp"
METHODS = (DFLASH, MTP)


class Drafter(Protocol):
    method: str
    capacity: int  # the longest draft this drafter was opened for

    def process(self, tokens: Sequence[int], pos0: int, *, eager: bool) -> None: ...

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
