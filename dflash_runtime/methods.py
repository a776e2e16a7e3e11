"""The draft methods, one registry: what each is called, what the pair must hold for it, and where its implementation
is — the registry sits above the pair and the drafters, and nothing below it names a method.

A method is detected from the pair: a draft file that its registry line claims (`claims`, read from the file's
header; of several claimants the highest `priority` wins, and two at one priority are refused: no first-match
accidents), a part of the target that its module opens (`target_has`, from the target's header: MTP's nextn layers),
or nothing at all (`needs=""`, the n-gram methods, which draft from the sequence's own tokens). `needs` names what
the open pair then holds: the `DraftFile.needs` or `TargetPart.needs` of its module. Its line also carries what
the Space shows of it (`label`, `help`, `about`): the Space reads methods, their help and the fallbacks from here.

Every method drafts at most the pair's longest draft (`draft_capacity`), so its verify batch is that many rows plus
one. The engine hands the pair the declaration of the draft file's claimant (`draft_file`) and the target parts the
methods declare (`target_parts`), and opens a drafter for each method the open pair runs (`open_drafters`), each
with its own options; a drafter reads the sequence's tokens through the read-only view it is opened with.

A request names one method or a method list, "a,b" in order of preference (llama.cpp's `--spec-type a,b`): each step
drafts with the first member that proposes something (see drafters/method_list.py). Adding a method is one
module with its `Implementation` (drafters/drafting.py) and one line in `REGISTRY` (`register` adds one from
outside the package). A method's implementation is loaded when a pair opens, never by listing the methods: the
Space's web process lists them without loading libllama.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .drafters import ngram, ngram_cache, ngram_map
from .drafters.drafting import DFLASH, MTP, Drafter, Implementation, TokenView
from .drafters.method_list import METHOD_SEPARATOR, split
from .errors import PairMismatchError, RequestError
from .files.validation import dflash_kind, has_markov_head

if TYPE_CHECKING:
    from .files.gguf_meta import GGUFInfo
    from .pair import DraftFile, LinkedPair, TargetPart

NOTHING, NEXTN = "", "nextn"  # what a method without a file of its own needs
LEGACY_PRIORITY = 50  # a draft file that claims files itself (no `claims` on its line): between draft-simple and DFlash
NEEDS_SEPARATOR = "+"  # a method that needs several things: "dflash2+branches"
BRANCHES = "branches"  # what a pair with spare target sequences holds (LinkedPair.holds)


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how a person reads it (the Space's menus and tables)
    # What the open pair must hold (`LinkedPair.holds`): NOTHING, NEXTN (the target's MTP layers), the `needs` of the
    # draft file its module declares, or several of what a pair holds joined by "+" (a draft's kind, "branches").
    needs: str
    implementation: Callable[[], Implementation]  # its module's (loaded with libllama for the methods with a model)
    auto: bool = True  # a candidate for the pair's default method (a request that names none)
    help: str = ""  # what it is, in one line of the Space's method menu
    about: str = ""  # its label with what it is, where the label alone does not say (the Space's About box)
    source: str = ""  # what it drafts with, in words, where the Space says so ("drafting with the target's MTP head")
    # A method with a draft file of its own: whether a file's header is its draft (libllama-free: the Space's web
    # process lists methods from headers), and which claimant wins where several claim a file (highest first).
    claims: Callable[[GGUFInfo], bool] | None = None
    priority: int = 0
    # A method that opens a part of the target (its `Implementation.target_part`): whether a target has it.
    target_has: Callable[[GGUFInfo], bool] | None = None
    # A method with a draft file of its own: its draft's kind from the file's header, as the open pair names it
    # (`LinkedPair.holds`: "dflash2", ...), so that a method needing that kind is listed before the pair opens.
    kind_of: Callable[[GGUFInfo], str] | None = None
    # Whether the Space's A/B compares it unless the visitor picks other methods: an A/B runs a few methods, so
    # that it stays short (every method is offered there either way).
    compared: bool = True

    def ready(self, pair: LinkedPair) -> bool:
        """Once the contexts are open: whether the pair can run this method."""
        return holds(pair, self.needs)


def _dflash() -> Implementation:
    from .drafters import dflash  # libllama comes with it: loaded when a pair opens, not where methods are listed

    return dflash.IMPLEMENTATION


def _dspark() -> Implementation:
    from .drafters import dspark  # as _dflash

    return dspark.IMPLEMENTATION


def _mtp() -> Implementation:
    from .drafters import mtp  # as _dflash

    return mtp.IMPLEMENTATION


def _eagle3() -> Implementation:
    from .drafters import eagle3  # as _dflash

    return eagle3.IMPLEMENTATION


def _dflash_tree() -> Implementation:
    from .drafters import dflash_tree  # as _dflash

    return dflash_tree.IMPLEMENTATION


def _draft_simple() -> Implementation:
    from .drafters import draft_simple  # as _dflash

    return draft_simple.IMPLEMENTATION


def _is_dflash(draft: GGUFInfo) -> bool:
    return draft.arch == "dflash"


def _is_eagle3(draft: GGUFInfo) -> bool:
    return draft.arch == "eagle3"


def _any_model(draft: GGUFInfo) -> bool:
    return True  # any model of the target's vocabulary (validated when the pair opens), below every other claimant


def _has_nextn(target: GGUFInfo) -> bool:
    return target.n_nextn > 0


REGISTRY: tuple[Method, ...] = (
    Method(DFLASH, "DFlash 2", "draft", _dflash, claims=_is_dflash, priority=100, kind_of=dflash_kind,
           help="a small draft model writes a block of tokens in one pass, from the target's own hidden features"),
    Method("dflash-tree", "DFlash 2 tree", "dflash2+branches", _dflash_tree, auto=False,
           help="DFlash 2's block as a tree: the draft's likeliest alternatives verified beside its first choice, "
                "each on a spare target sequence"),
    Method("dspark", "DSpark", "dspark", _dspark, claims=has_markov_head, priority=110, kind_of=dflash_kind,
           help="a DFlash draft with a Markov head: each guessed token leans on the one before it, and a confidence "
                "head may end the draft where it doubts (llama.cpp's draft-dspark)"),
    Method(MTP, "MTP", NEXTN, _mtp, target_has=_has_nextn,
           help="the target's own multi-token-prediction head guesses the next tokens",
           about="MTP (the target's own multi-token-prediction head)", source="the target's MTP head"),
    Method("eagle3", "EAGLE-3", "eagle3", _eagle3, claims=_is_eagle3, priority=60,
           help="a one-layer draft model reads three of the target's layers and guesses the next tokens one by one "
                "(llama.cpp's draft-eagle3)"),
    Method("draft-simple", "Draft model", "draft-model", _draft_simple, claims=_any_model, priority=0,
           help="a small model of the target's vocabulary guesses the next tokens one by one (llama.cpp's "
                "draft-simple)"),
    Method(ngram.NGRAM_MOD, "ngram-mod", NOTHING, lambda: ngram.MOD, auto=False,
           help="no draft model: the tokens that followed the last few tokens where they occurred before, in the "
                "prompt or the answer (llama.cpp's ngram-mod)"),
    Method(ngram_map.NGRAM_MAP_K, "ngram-map-k", NOTHING, lambda: ngram_map.MAP_K, auto=False,
           help="no draft model: what followed the newest earlier occurrence of the last 12 tokens (llama.cpp's "
                "ngram-map-k)"),
    Method(ngram_map.NGRAM_SIMPLE, "ngram-simple", NOTHING, lambda: ngram_map.SIMPLE, auto=False, compared=False,
           help="no draft model: up to 48 tokens that followed the newest earlier occurrence of the last 12, found "
                "by a plain scan (llama.cpp's ngram-simple)"),
    Method(ngram_map.NGRAM_MAP_K4V, "ngram-map-k4v", NOTHING, lambda: ngram_map.MAP_K4V, auto=False, compared=False,
           help="no draft model: the last 12 tokens looked up, drafting only where one continuation followed them "
                "at least twice as often as the others together (llama.cpp's ngram-map-k4v)"),
    Method(ngram_cache.NGRAM_CACHE, "ngram-cache", NOTHING, lambda: ngram_cache.IMPLEMENTATION, auto=False,
           compared=False,
           help="no draft model: the tokens most often seen after the last 1 to 4 tokens, in this answer's text and "
                "in what your own earlier requests taught it (llama.cpp's ngram-cache, lookup decoding)"),
)
# Method lists the pair lists beside its methods when all their members run (any other list may still be asked for):
# the n-gram draft where the answer copies its prompt, DFlash everywhere else.
LISTED_METHOD_LISTS: tuple[tuple[str, ...], ...] = ((ngram.NGRAM_MOD, DFLASH),)


def register(method: Method) -> None:
    """Add a method from outside the package (before any pair opens with it); ValueError for a name taken or a
    claim priority another claimant holds."""
    global REGISTRY
    _check_line(method, REGISTRY)
    REGISTRY = (*REGISTRY, method)


def unregister(name: str) -> None:
    global REGISTRY
    REGISTRY = tuple(m for m in REGISTRY if m.name != name)


def _check_line(method: Method, others: Sequence[Method]) -> None:
    if any(m.name == method.name for m in others) or METHOD_SEPARATOR in method.name:
        raise ValueError(f"a draft method is named {method.name!r} already, or the name holds {METHOD_SEPARATOR!r}")
    if method.claims is not None and any(m.claims is not None and m.priority == method.priority for m in others):
        raise ValueError(f"claim priority {method.priority} of {method.name!r} is another method's")


def registry() -> dict[str, Method]:
    return {m.name: m for m in REGISTRY}


def names() -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY)


def label(name: str) -> str:
    """A method's or a method list's label: "A → B" for a list."""
    known = registry()
    return " → ".join(known[m].label if m in known else m for m in split(name))


def holds(pair: LinkedPair, needs: str) -> bool:
    """Whether the opened pair holds what a method needs: nothing, or every part of it (`LinkedPair.holds`)."""
    return all(part in pair.holds for part in needs_parts(needs))


def needs_parts(needs: str) -> tuple[str, ...]:
    return tuple(part for part in needs.split(NEEDS_SEPARATOR) if part)


# -- from the files' headers (no libllama) ---------------------------------------------------------------------

def claimant(draft: GGUFInfo, *, loaded: bool = False) -> Method:
    """The method whose draft a file is: of the methods that claim it, the one of highest priority;
    PairMismatchError names the drafts there are."""
    method = _claiming(draft, loaded=loaded)
    if method is None:
        kinds = ", ".join(m.label for m in REGISTRY if m.claims is not None) or "none"
        raise PairMismatchError(f"{draft.path.name} is not a draft of any method: its architecture is "
                                f"'{draft.arch}' (drafts: {kinds})")
    return method


def _claiming(draft: GGUFInfo, *, loaded: bool = False) -> Method | None:
    """The highest-priority claimant. `loaded` (when a pair opens) also asks the draft file of a line that declares
    no `claims` of its own, as modules did before claims moved to the registry line (`DraftFile.claims`, at its
    `priority` or 50: above draft-simple, below DFlash)."""
    claiming = [m for m in REGISTRY if m.claims is not None and m.claims(draft)]
    if loaded:
        for m in REGISTRY:
            if m.claims is None and m.needs != NOTHING and m.target_has is None:
                declared = m.implementation().draft_file
                if declared is not None and hasattr(declared, "claims") and declared.claims(draft):
                    claiming.append(dataclasses.replace(m, priority=getattr(declared, "priority", LEGACY_PRIORITY)))
    return max(claiming, key=lambda m: m.priority, default=None)


def from_headers(target: GGUFInfo, draft: GGUFInfo | None, *, branches: int = 0) -> tuple[str, ...]:
    """The methods (and listed method lists) a pair of these files runs, from their headers: what the Space lists before
    a pair opens (with `branches` spare target sequences, as `load_pair(branches=...)`). A draft no method claims
    adds nothing."""
    held = {m.needs for m in REGISTRY if m.target_has is not None and m.target_has(target)}
    if draft is not None:
        with contextlib.suppress(PairMismatchError):
            method = claimant(draft)
            held.add(method.needs)
            if method.kind_of is not None:
                held.add(method.kind_of(draft))
    if branches > 0:
        held.add(BRANCHES)
    return runnable(lambda needs: all(part in held for part in needs_parts(needs)))


def target_alone(target: GGUFInfo) -> tuple[str, ...]:
    """The methods with a model that a target runs without a draft file (MTP with its nextn head): where a draft
    is unusable, the pair opens without it when there is one."""
    return tuple(m.name for m in REGISTRY if m.target_has is not None and m.target_has(target))


def available(pair: LinkedPair) -> tuple[str, ...]:
    """The methods the opened pair runs, in registry order, then the listed method lists whose members all run."""
    return runnable(lambda needs: holds(pair, needs))


def runnable(holds: Callable[[str], bool]) -> tuple[str, ...]:
    """The methods of a pair that holds what `holds(needs)` says ("" always), in registry order, then the listed
    method lists whose members all run: for a pair not opened yet, from its files."""
    singles = tuple(m.name for m in REGISTRY if not m.needs or holds(m.needs))
    lists = tuple(METHOD_SEPARATOR.join(c) for c in LISTED_METHOD_LISTS if all(m in singles for m in c))
    return singles + lists


def compared(name: str) -> bool:
    """Whether the Space's A/B compares a method or listed method list unless the visitor picks others (a list:
    where every member is)."""
    lines = registry()
    return all(m in lines and lines[m].compared for m in split(name))


def default(pair: LinkedPair) -> str | None:
    """The method a request that names none drafts with: the first one the pair runs that may be a default."""
    return next((m.name for m in REGISTRY if m.auto and m.ready(pair)), None)


def capacity(pair: LinkedPair, name: str) -> int:
    """The longest draft of a method or method list the pair runs (0 for one it does not)."""
    runs = available(pair)
    members = split(name)
    return pair.longest_draft if members and all(m in runs for m in members) else 0


def check(name: str, runs: Sequence[str]) -> tuple[str, ...]:
    """The members of a method or method list name, each one the pair runs; RequestError says which is not."""
    if not isinstance(name, str) or not name.strip():
        raise RequestError(f"a draft method is a name or a comma list of names (got {name!r})")
    members = split(name)
    known = registry()
    for member in members:
        if member not in runs:
            singles = ", ".join(m for m in runs if METHOD_SEPARATOR not in m) or "none"
            why = "not available on this pair" if member in known else "unknown"
            raise RequestError(f"draft method {member!r} is {why} (available: {singles})")
    if len(set(members)) != len(members):
        raise RequestError(f"draft method list {name!r} names a method twice")
    return members


# -- opening (with libllama) -------------------------------------------------------------------------------------

def draft_file(draft: GGUFInfo) -> DraftFile:
    """The draft file declaration of the method that claims this file, for the pair to open (pair.py)."""
    method = claimant(draft, loaded=True)
    declared = method.implementation().draft_file
    if declared is None:
        raise PairMismatchError(f"draft method {method.name!r} claims {draft.path.name} but declares no draft file")
    return declared


def refuse_alone(target: GGUFInfo) -> None:
    """A target path that is a draft which cannot run alone (a DFlash draft reads its target's features):
    PairMismatchError says to open it with its target."""
    method = _claiming(target, loaded=True)
    declared = method.implementation().draft_file if method is not None else None
    if method is not None and declared is not None and not getattr(declared, "runs_alone", True):
        raise PairMismatchError(
            f"{target.path.name} is a {method.label} draft: it has no embeddings or output head of its own and "
            "must be opened together with its target, load_pair(target_path, draft_path)")


def target_parts(asked: Mapping[str, bool | None]) -> tuple[tuple[TargetPart, bool], ...]:
    """The target parts the methods declare, for the pair to open: each with whether it is required (`asked[name]`
    True) or opened where the target has it (None, the default); False leaves it closed."""
    parts = []
    for m in REGISTRY:
        if m.target_has is None or asked.get(m.name) is False:
            continue
        part = m.implementation().target_part
        if part is not None:
            parts.append((part, bool(asked.get(m.name))))
    return tuple(parts)


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


__all__ = ["METHOD_SEPARATOR", "REGISTRY", "Method", "available", "capacity", "check", "check_options",
           "claimant", "default", "draft_file", "from_headers", "label", "names",
           "open_drafters", "register", "split", "target_alone", "target_parts", "unregister"]
