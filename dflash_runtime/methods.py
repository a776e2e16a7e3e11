"""The draft methods, one registry: what each is called, what the pair must hold for it, and where its implementation
is — the registry sits above the pair and the drafters, and nothing below it names a method.

A method is detected from the pair: a draft file that its module claims (`needs` is then the `DraftFile.needs` of
its module: "draft" for a DFlash draft), the target's own nextn (MTP) layers (`needs="nextn"`), or nothing at all
(`needs=""`, the n-gram methods, which draft from the sequence's own tokens). Every method drafts at most the
pair's longest draft (`draft_capacity`), so its verify batch is that many rows plus one. The engine hands the pair
the draft files the methods declare (`draft_files`) and opens a drafter for each method the open pair runs
(`open_drafters`), each with its own options; a drafter reads the sequence's tokens through the read-only view it
is opened with.

A request names one method or a chain, "a,b" in order of preference (llama.cpp's `--spec-type a,b`): each step
drafts with the first member that proposes something (see `Chain`). Adding a method is one module with its
`Implementation` (drafting.py) and one line in `REGISTRY`. A method's implementation is loaded when a pair opens,
never by listing the methods: the Space's web process lists them without loading libllama.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import ngram
from .drafting import DFLASH, MTP, DraftAsk, Drafter, Implementation, TokenView
from .errors import RequestError

if TYPE_CHECKING:
    from .pair import DraftFile, LinkedPair
    from .proposal import Proposal

CHAIN_SEPARATOR = ","
NOTHING, NEXTN = "", "nextn"  # what a method without a file of its own needs
TREE_BRANCHES = "draft+branches"  # a DFlash 2 draft, and spare target sequences for a tree's paths


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how a person reads it (the Space's menus and tables)
    needs: str  # NOTHING, NEXTN (the target's MTP layers), or the `needs` of the draft file its module declares
    implementation: Callable[[], Implementation]  # its module's (loaded with libllama for the methods with a model)
    auto: bool = True  # a candidate for the pair's default method (a request that names none)

    def ready(self, pair: LinkedPair) -> bool:
        """Once the contexts are open: whether the pair can run this method."""
        return holds(pair, self.needs)


def _dflash() -> Implementation:
    from . import dflash  # libllama comes with it: loaded when a pair opens, not where methods are listed

    return dflash.IMPLEMENTATION


def _mtp() -> Implementation:
    from . import mtp  # as _dflash

    return mtp.IMPLEMENTATION


def _dflash_tree() -> Implementation:
    from . import dflash_tree  # as _dflash

    return dflash_tree.IMPLEMENTATION


def _draft_simple() -> Implementation:
    from . import draft_simple  # as _dflash

    return draft_simple.IMPLEMENTATION


REGISTRY: tuple[Method, ...] = (
    Method(DFLASH, "DFlash 2", "draft", _dflash),
    Method("dflash-tree", "DFlash 2 tree", TREE_BRANCHES, _dflash_tree, auto=False),
    Method(MTP, "MTP", NEXTN, _mtp),
    Method("draft-simple", "Draft model", "draft-model", _draft_simple),
    Method(ngram.NGRAM_MOD, "ngram-mod", NOTHING, lambda: ngram.MOD, auto=False),
    Method(ngram.NGRAM_MAP_K, "ngram-map-k", NOTHING, lambda: ngram.MAP_K, auto=False),
)
# Chains the pair lists beside its methods when all their members run (any other chain may still be asked for):
# the n-gram draft where the answer copies its prompt, DFlash everywhere else.
LISTED_CHAINS: tuple[tuple[str, ...], ...] = ((ngram.NGRAM_MOD, DFLASH),)


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


def holds(pair: LinkedPair, needs: str) -> bool:
    """Whether the opened pair holds what a method needs: nothing, an MTP context, or a draft of that file kind."""
    if needs == NOTHING:
        return True
    if needs == NEXTN:
        return pair.mtp_ctx is not None
    if needs == TREE_BRANCHES:
        return bool(pair.branch_seqs) and holds(pair, "draft") and bool(getattr(pair.spec, "is_dflash2", False))
    return pair.draft_ctx is not None and pair.draft_file is not None and pair.draft_file.needs == needs


def available(pair: LinkedPair) -> tuple[str, ...]:
    """The methods the opened pair runs, in registry order, then the listed chains whose members all run."""
    return runnable(lambda needs: holds(pair, needs))


def runnable(holds: Callable[[str], bool]) -> tuple[str, ...]:
    """The methods of a pair that holds what `holds(needs)` says ("" always), in registry order, then the listed
    chains whose members all run: for a pair not opened yet, from its files."""
    singles = tuple(m.name for m in REGISTRY if not m.needs or holds(m.needs))
    chains = tuple(CHAIN_SEPARATOR.join(c) for c in LISTED_CHAINS if all(m in singles for m in c))
    return singles + chains


def default(pair: LinkedPair) -> str | None:
    """The method a request that names none drafts with: the first one the pair runs that may be a default."""
    return next((m.name for m in REGISTRY if m.auto and m.ready(pair)), None)


def capacity(pair: LinkedPair, name: str) -> int:
    """The longest draft of a method or chain the pair runs (0 for one it does not)."""
    runs = available(pair)
    members = split(name)
    return pair.longest_draft if members and all(m in runs for m in members) else 0


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


# -- opening (with libllama) -------------------------------------------------------------------------------------

def draft_files() -> tuple[DraftFile, ...]:
    """What the methods with a model of their own declare about their files, for the pair to open (pair.py)."""
    files = (m.implementation().draft_file for m in REGISTRY if m.needs not in (NOTHING, NEXTN, TREE_BRANCHES))
    return tuple(f for f in files if f is not None)


def check_options(method_options: Mapping[str, Mapping[str, Any]]) -> None:
    """`Engine(method_options=...)` before anything opens: ValueError names an unknown method or option."""
    known = registry()
    unknown = sorted(set(method_options) - set(known))
    if unknown:
        raise ValueError(f"method_options names unknown methods {unknown} (known: {', '.join(known)})")
    for name, options in method_options.items():
        takes = known[name].implementation().options
        if not isinstance(options, Mapping):
            raise ValueError(f"method_options[{name!r}] must be a mapping of option names to values")
        bad = sorted(set(options) - set(takes))
        if bad:
            listed = ", ".join(f"{k} (default {v!r})" for k, v in takes.items()) or "none"
            raise ValueError(f"method_options[{name!r}] names unknown options {bad} (options of {name}: {listed})")


def open_drafters(pair: LinkedPair, views: Sequence[TokenView],
                  method_options: Mapping[str, Mapping[str, Any]]) -> dict[str, Drafter]:
    """A drafter for every method the open pair runs, each with its options (checked by `check_options`)."""
    drafters: dict[str, Drafter] = {}
    try:
        for method in REGISTRY:
            if method.ready(pair):
                drafters[method.name] = method.implementation().open(
                    pair, views, capacity(pair, method.name), **method_options.get(method.name, {}))
    except BaseException:
        for drafter in drafters.values():
            drafter.free()
        raise
    return drafters


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


__all__ = ["CHAIN_SEPARATOR", "REGISTRY", "Chain", "Method", "available", "capacity", "check", "check_options",
           "default", "draft_all", "draft_files", "label", "names", "open_drafters"]
