"""A request's method list: its methods in order of preference, "a,b" (llama.cpp's `--spec-type a,b`), and how a step
drafts through them: each sequence with the first member that proposes something, every member drafting its sequences
in one call. The registry (methods.py) names the methods; this is the drafting path, which needs no registry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .drafting import Adopting, DraftAsk, Drafter, Rows
from .proposal import Proposal

METHOD_SEPARATOR = ","


def split(name: str) -> tuple[str, ...]:
    """A method's or a method list's members, in order of preference."""
    return tuple(part.strip() for part in name.split(METHOD_SEPARATOR))


class MethodList:
    """A request's methods in order of preference: a step is drafted by the first that proposes something (as
    llama.cpp's common_speculative_draft walks its implementations). The engine drafts every sequence of a step
    through the method lists' members together (see `draft_all`); `last` is the member that drafted the sequence's last
    step, which alone hears how many of its tokens were accepted. `ahead` is the member that holds rows ahead of the
    sequence's own cells (`adopt`) until the sequence's decode holds them: it alone drafts meanwhile."""

    def __init__(self, drafters: Mapping[str, Drafter], members: Sequence[str], seq: int = 0) -> None:
        self.members = [drafters[m] for m in members]
        self.method = METHOD_SEPARATOR.join(members)
        self.capacity = min(d.capacity for d in self.members)
        self.seq = seq
        self.last: Drafter | None = None
        self.ahead: Drafter | None = None

    @property
    def drafting(self) -> list[Drafter]:
        """The members that draft the next step, in order of preference."""
        return [self.ahead] if self.ahead is not None else self.members

    def adopt(self, rows: Rows) -> bool:
        """Rows of a draft tree's path accepted off its spine, to the member that drafted the tree (drafting.Adopting);
        whether it took them."""
        drafter = self.last
        if isinstance(drafter, Adopting) and drafter.adopt(rows):
            self.ahead = drafter
            return True
        return False

    def begin(self) -> None:
        for drafter in self.members:
            drafter.begin(self.seq)

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.last.accept(self.seq, n_accepted)


def draft_all(asks: Sequence[tuple[MethodList, DraftAsk]]) -> list[tuple[Proposal, str | None]]:
    """Draft every ask through its method list: each method drafts, in one call, the asks whose list reaches it (the
    first member of each list, then the next member for the asks still without a draft). Returns each ask's proposal
    (the last member's empty one when nobody drafted) and the method that drafted it (None)."""
    results: list[tuple[Proposal, str | None] | None] = [None] * len(asks)
    empty: dict[int, Proposal] = {}
    waiting = list(range(len(asks)))
    depth = 0
    while waiting:
        by_drafter: dict[int, tuple[Drafter, list[int]]] = {}
        later = []
        for i in waiting:
            listed = asks[i][0]
            members = listed.drafting
            if depth >= len(members):
                listed.last = None
                results[i] = (empty[i], None)
                continue
            drafter = members[depth]
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


__all__ = ["METHOD_SEPARATOR", "MethodList", "draft_all", "split"]
