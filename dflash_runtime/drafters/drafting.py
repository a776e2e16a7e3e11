"""The one interface every draft method implements, in the shape of llama.cpp's `common_speculative_impl`, and what
a method declares to the registry (methods.py).

A drafter serves every sequence of the engine, as llama.cpp's implementations are built with `n_seq`: it owns what
its method needs (DFlash: the draft context and a feature bridge per sequence; MTP: the MTP context and the target's
hidden rows per sequence; n-gram: a table per sequence) and decides when to bring it up to date. It reads each
sequence's tokens (the target cache's, id_last excluded) through the read-only `TokenView`s it was opened with, one
per sequence, as llama.cpp hands its drafters the prompt. The engine talks to drafters only through this protocol:

- `process(rows)` after every target decode (prompt chunks and verify batches), with each sequence's `Rows` in that
  decode: what the method reads from the target must be taken now, before the next decode overwrites it. `eager`
  says whether a sequence's rows go into the drafter's own context now (a drafting request's prompt, a round that
  drafted — as llama.cpp does) or may wait for the next draft (plain requests and rounds cost nothing extra).
- `begin(seq)` once the prompt of a request that drafts with this method is in the sequence (llama.cpp's `begin`);
- `catch_up(seqs)` brings the drafter's context up to the target's for these sequences before they draft;
- `draft(asks)` proposes, for each `DraftAsk`, up to n tokens after `id_last` decoded at `pos0` of its sequence, in
  one pass for all of them where the method can; a proposal without distributions (`q` None) is deterministic, and
  the verifier treats each token as drawn from a point mass;
- `accept(seq, n_accepted)` after verification; `keep(seq, n)` when a sequence is cut to n tokens; `clear(seq)`.
- `save(seq)` / `restore(seq, state)` park a sequence's drafter state beside its caches' (see sessions.py).

A method whose state is per sequence and whose drafting has no pass to share (n-grams) writes a `SequenceDrafter`
for one sequence and opens it through `PerSequence`. A `TokenView` also says whose requests its sequence runs now
(`owner`): what a method keeps across requests (ngram-cache's dynamic cache) is kept by owner, serves no other,
and lives as long as the engine keeps that owner's conversation (`keeps`).

A method's module declares what it opens in one `Implementation`: how its drafter opens, the options it takes, and,
for a method with a model of its own, its `DraftFile` (its drafts' checks, what the target does for them, their
context) or its `TargetPart` (a context of the target model: MTP's nextn head), which the pair opens (pair.py). The
registry line (methods.py) names the method and says what the rest of the project reads without loading it: its
label and help, which draft files it claims (and at which priority), whether a target holds its part.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

if TYPE_CHECKING:
    from ..pair import DraftFile, TargetPart
    from .proposal import DraftSampling, Proposal

DFLASH, MTP = "dflash", "mtp"


class TokenView(Sequence[int]):
    """A read-only view of a sequence's tokens, a list its cache may replace: every read goes to the current list.
    `owner` names whose requests the sequence runs now (their `cache_owner`; None for none, or without `owner_of`);
    `keeps(owner)` whether the engine still keeps anything of an owner's (a sequence or a parked state: see
    cache/sessions.py), so that what a method keeps by owner lives no longer (True without `keeps`)."""

    def __init__(self, source: Callable[[], Sequence[int]], owner_of: Callable[[], Hashable | None] | None = None,
                 keeps: Callable[[Hashable | None], bool] | None = None) -> None:
        self._source = source
        self._owner_of = owner_of
        self._keeps = keeps

    @property
    def owner(self) -> Hashable | None:
        return self._owner_of() if self._owner_of is not None else None

    def keeps(self, owner: Hashable | None) -> bool:
        return self._keeps(owner) if self._keeps is not None else True

    def __len__(self) -> int:
        return len(self._source())

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        return self._source()[i]


@dataclass(frozen=True)
class Rows:
    """One sequence's rows in the last target decode: its tokens at positions pos0.., from batch index row0 on."""

    seq: int
    tokens: Sequence[int]
    pos0: int
    row0: int
    eager: bool = False


@dataclass(frozen=True)
class DraftAsk:
    """What one sequence asks of a drafter this step."""

    seq: int
    id_last: int
    pos0: int
    n: int
    n_min: int = 0
    p_min: float = 0.0
    sampling: DraftSampling | None = None
    tree_nodes: int = 0  # a draft tree's row budget (dflash_tree.py); 0: a linear draft
    tree_paths: int = 0  # the most paths beside the spine the step can decode (its free spare target sequences)
    # The request's fixed draft length before the room left in max_tokens cut it to n (at most what the context
    # holds); 0: n. A block drafter whose rows see one another drafts a block this long and keeps n, as llama.cpp does.
    n_asked: int = 0

    @property
    def width(self) -> int:
        """The drafts a block holds for this ask: n, or the longer draft it was cut from."""
        return max(self.n, self.n_asked)


class Drafter(Protocol):
    method: str
    capacity: int  # the longest draft this drafter was opened for

    def process(self, rows: Sequence[Rows]) -> None: ...

    def begin(self, seq: int) -> None: ...

    def catch_up(self, seqs: Sequence[int]) -> None: ...

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]: ...

    def accept(self, seq: int, n_accepted: int) -> None: ...

    def keep(self, seq: int, n: int) -> None: ...

    def clear(self, seq: int) -> None: ...

    def save(self, seq: int) -> Any: ...

    def restore(self, seq: int, state: Any) -> None: ...

    def state_bytes(self, state: Any) -> int: ...

    def free(self) -> None: ...


@runtime_checkable
class Adopting(Protocol):
    """A drafter that can take a sequence's rows ahead of its own target cells: the rows of a draft tree's path
    accepted off its spine, decoded in a spare target sequence after exactly the sequence's tokens (`rows.row0` in
    the last target decode, at the sequence's next positions from `rows.pos0`). The sequence's next decode holds the
    path's tokens again, before id_last; such a drafter does not take those rows twice. `adopt` says whether it took
    them: then it alone drafts the next step, after them (the method list's other members know nothing of them)."""

    def adopt(self, rows: Rows) -> bool: ...


class SequenceDrafter(Protocol):
    """A drafter of one sequence (the multi-sequence protocol without `seq`), for `PerSequence`."""

    method: str
    capacity: int

    def begin(self) -> None: ...

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal: ...

    def accept(self, n_accepted: int) -> None: ...

    def clear(self) -> None: ...


class PerSequence:
    """A `Drafter` made of one `SequenceDrafter` per sequence: what the method keeps is the sequence's own, and each
    sequence drafts by itself (a method with nothing to read from the target and no pass to share). `on_free` runs
    when the engine closes (ngram-cache writes its file)."""

    def __init__(self, drafters: Sequence[SequenceDrafter], on_free: Callable[[], None] | None = None) -> None:
        self.drafters = list(drafters)
        self._on_free = on_free
        self.method = self.drafters[0].method
        self.capacity = self.drafters[0].capacity

    def process(self, rows: Sequence[Rows]) -> None:
        pass  # drafts read the sequence's tokens, not the target's rows

    def begin(self, seq: int) -> None:
        self.drafters[seq].begin()

    def catch_up(self, seqs: Sequence[int]) -> None:
        pass

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        return [self.drafters[a.seq].draft(a.id_last, a.pos0, a.n, n_min=a.n_min, p_min=a.p_min,
                                           sampling=a.sampling) for a in asks]

    def accept(self, seq: int, n_accepted: int) -> None:
        self.drafters[seq].accept(n_accepted)

    def keep(self, seq: int, n: int) -> None:
        pass  # a request only ever cuts its own rejected drafts, which were never added; begin rebuilds the rest

    def clear(self, seq: int) -> None:
        self.drafters[seq].clear()

    def save(self, seq: int) -> None:
        return None  # begin rebuilds the state from the sequence: nothing to park

    def restore(self, seq: int, state: None) -> None:
        pass

    def state_bytes(self, state: None) -> int:
        return 0

    def free(self) -> None:
        if self._on_free is not None:
            self._on_free()


@dataclass(frozen=True)
class Implementation:
    """What a method's module declares: how its drafter opens — (the opened pair, each sequence's `TokenView`, the
    longest draft, **its options) → a `Drafter` —, the names of the options it takes and their defaults (for
    `Engine(method_options=...)`), its draft file when it has a model of its own, or the part of the target it
    opens (None for both: it drafts from the target's rows or from the tokens alone)."""

    open: Callable[..., Drafter]
    options: Mapping[str, Any] = field(default_factory=dict)
    draft_file: DraftFile | None = None
    target_part: TargetPart | None = None
