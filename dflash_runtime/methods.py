"""The draft methods, one registry: what each is called, what the pair must hold for it, and how its drafter opens.

A method is detected from the pair: a DFlash draft GGUF (`needs="draft"`), the target's own nextn (MTP) layers
(`needs="nextn"`), or nothing at all (`needs=""`, the n-gram methods, which draft from the sequence's own tokens).
Every method drafts at most the pair's `draft_capacity` tokens, so its verify batch is that many rows plus one; the
pair sizes the target's ubatch and recurrent snapshots for the methods it may run (`wanted`, read from the headers
before any context opens) and the engine opens a drafter for each one it can run (`ready`, once the contexts are
open). A drafter reads the sequence's tokens through the read-only view it is opened with.

A request names one method or a chain, "a,b" in order of preference (llama.cpp's `--spec-type a,b`): each step
drafts with the first member that proposes something (see `Chain`). Adding a method is one module with its
`Method(...)` and one line in `REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import TYPE_CHECKING

from .drafting import DFLASH, MTP, DraftAsk, Drafter, Method, TokenView, holds
from .errors import RequestError

if TYPE_CHECKING:
    from .pair import LinkedPair
    from .proposal import Proposal

CHAIN_SEPARATOR = ","


def _open_dflash(pair: LinkedPair, views: Sequence[TokenView]) -> Drafter:
    from .dflash import DFlashDrafter

    assert pair.api is not None and pair.spec is not None
    return DFlashDrafter(pair.api, pair.target_ctx, pair.draft_ctx, pair.spec, n_embd=pair.n_embd,
                         n_embd_draft=pair.n_embd_draft, n_vocab=pair.n_vocab, n_ubatch=pair.n_ubatch,
                         capacity=pair.capacity(DFLASH), n_seq=len(views))


def _open_mtp(pair: LinkedPair, views: Sequence[TokenView]) -> Drafter:
    from .mtp import MTPDrafter

    return MTPDrafter(pair.target_ctx, pair.mtp_ctx, views, n_embd=pair.n_embd_out, n_vocab=pair.n_vocab,
                      n_batch=pair.n_ubatch, capacity=pair.capacity(MTP))


def _methods_of(module: str) -> tuple[Method, ...]:
    """The `METHODS` a method's own module declares (its one line in REGISTRY)."""
    return tuple(import_module(f"{__package__}.{module}").METHODS)


REGISTRY: tuple[Method, ...] = (
    Method(DFLASH, "DFlash 2", "draft", _open_dflash),
    Method(MTP, "MTP", "nextn", _open_mtp),
    *_methods_of("ngram"),
)
# Chains the pair lists beside its methods when all their members run (any other chain may still be asked for):
# the n-gram draft where the answer copies its prompt, DFlash everywhere else.
LISTED_CHAINS: tuple[tuple[str, ...], ...] = (("ngram-mod", DFLASH),)


def registry() -> dict[str, Method]:
    return {m.name: m for m in REGISTRY}


def names() -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY)


def label(name: str) -> str:
    """A method's or a chain's label: "A → B" for a chain."""
    known = registry()
    return " → ".join(known[m].label if m in known else m for m in split(name))


def split(name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in name.split(CHAIN_SEPARATOR))


def available(pair: LinkedPair) -> tuple[str, ...]:
    """The methods the opened pair runs, in registry order, then the listed chains whose members all run."""
    return runnable(lambda needs: holds(pair, needs))


def runnable(holds: Callable[[str], bool]) -> tuple[str, ...]:
    """The methods of a pair that holds what `holds(needs)` says ("draft", "nextn"; "" always), in registry order,
    then the listed chains whose members all run: for a pair not opened yet, from its files."""
    singles = tuple(m.name for m in REGISTRY if not m.needs or holds(m.needs))
    chains = tuple(CHAIN_SEPARATOR.join(c) for c in LISTED_CHAINS if all(m in singles for m in c))
    return singles + chains


def default(pair: LinkedPair) -> str | None:
    """The method a request that names none drafts with: the first one the pair runs that may be a default."""
    return next((m.name for m in REGISTRY if m.auto and m.ready(pair)), None)


def check(name: str, runs: Sequence[str]) -> tuple[str, ...]:
    """The members of a method or chain name, each one the pair runs; RequestError says which is not."""
    if not isinstance(name, str) or not name.strip():
        raise RequestError(f"a draft method is a name or a comma list of names (got {name!r})")
    members = split(name)
    known = registry()
    for member in members:
        if member not in runs:
            singles = ", ".join(m for m in runs if CHAIN_SEPARATOR not in m) or "none"
            why = "not available on this pair" if member in known else "unknown"
            raise RequestError(f"draft method {member!r} is {why} (available: {singles})")
    if len(set(members)) != len(members):
        raise RequestError(f"draft method chain {name!r} names a method twice")
    return members


class Chain:
    """A request's methods in order of preference: a step is drafted by the first that proposes something (as
    llama.cpp's common_speculative_draft walks its implementations). The engine drafts every sequence of a step
    through the chains' members together (see `draft_all`); `last` is the member that drafted the sequence's last
    step, which alone hears how many of its tokens were accepted."""

    def __init__(self, drafters: Mapping[str, Drafter], members: Sequence[str], seq: int = 0) -> None:
        self.members = [drafters[m] for m in members]
        self.method = CHAIN_SEPARATOR.join(members)
        self.capacity = min(d.capacity for d in self.members)
        self.seq = seq
        self.last: Drafter | None = None

    def begin(self) -> None:
        for drafter in self.members:
            drafter.begin(self.seq)

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.last.accept(self.seq, n_accepted)


def draft_all(asks: Sequence[tuple[Chain, DraftAsk]]) -> list[tuple[Proposal, str | None]]:
    """Draft every ask through its chain: each method drafts, in one call, the asks whose chain reaches it (the first
    member of each chain, then the next member for the asks still without a draft). Returns each ask's proposal (the
    last member's empty one when nobody drafted) and the method that drafted it (None)."""
    results: list[tuple[Proposal, str | None] | None] = [None] * len(asks)
    empty: dict[int, Proposal] = {}
    waiting = list(range(len(asks)))
    depth = 0
    while waiting:
        by_drafter: dict[int, tuple[Drafter, list[int]]] = {}
        later = []
        for i in waiting:
            chain = asks[i][0]
            if depth >= len(chain.members):
                chain.last = None
                results[i] = (empty[i], None)
                continue
            drafter = chain.members[depth]
            by_drafter.setdefault(id(drafter), (drafter, []))[1].append(i)
            later.append(i)
        waiting = []
        for drafter, members in by_drafter.values():
            drafter.catch_up([asks[i][1].seq for i in members])
            proposals = drafter.draft([asks[i][1] for i in members])
            for i, proposal in zip(members, proposals, strict=True):
                if proposal.tokens:
                    asks[i][0].last = drafter
                    results[i] = (proposal, drafter.method)
                else:
                    empty[i] = proposal
                    waiting.append(i)
        still = set(waiting)
        waiting = [i for i in later if i in still]
        depth += 1
    return [r for r in results if r is not None]


__all__ = ["CHAIN_SEPARATOR", "REGISTRY", "Chain", "Method", "available", "check", "default", "draft_all", "label",
           "names"]
