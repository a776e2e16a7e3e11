"""The DFlash 2 tree method: one draft block, a tree grown from its lattice, verified in one target pass.

The block is drafted by the DFlash drafter (dflash.py), which also keeps feeding the draft context: this method drafts
through it and adds nothing to process. From each block's lattice the tree is grown (tree.py) within the request's
`tree_nodes` verify rows and `draft_length` depth: its spine is the linear draft's own — the greedy walk, or above
temperature 0 with rejection sampling the walk drawn from the request's sampler, stopping where the linear draft would
(p_min) and dropped where it would be (n_min) — and the other paths leave it where the draft is least sure. At
temperature 0 (and with sample-and-match) the children are chosen, the likeliest first; with rejection sampling they
are drawn without replacement, each with the distribution it was drawn from. The spine goes into the request's own
sequence; every other root-to-leaf path into a spare target sequence of its own (`LinkedPair(branches=N)`), with its
own copy of the rows it shares with the spine, because libllama refuses a token with several sequence ids wherever
it splits batches by sequence (a KV stream per sequence, and every recurrent layer). The steps (decoding/steps.py)
give the paths their sequences, and the request's state to each (cache/spares.py); decoding/request.py walks the tree.
A path accepted off the spine is adopted: its rows' features go to the DFlash drafter at once (`adopt`), so that the
next step drafts after it, and decodes its tokens in the request's sequence before id_last (no decode of its own).

A tree of one path is a linear draft, and is proposed as one (verified, counted and timed as a linear step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..pair import LinkedPair
from .dflash import DFlashDrafter, opened_drafter
from .drafting import DraftAsk, Implementation, Rows, TokenView
from .proposal import Proposal
from .tree import DEFAULT_BRANCHING, LatticeLevels, build_tree

DFLASH_TREE = "dflash-tree"


class TreeDrafter:
    """Drafts trees through the pair's DFlash drafter; its caches are that drafter's (cut, parked, cleared there)."""

    method = DFLASH_TREE

    def __init__(self, base: DFlashDrafter, *, branching: int = DEFAULT_BRANCHING) -> None:
        self.base = base
        self.capacity = base.capacity
        self._k = base.spec.selector_top_k
        self._branching = branching

    def process(self, rows: Sequence[Rows]) -> None:
        pass  # the DFlash drafter processes every decode

    def begin(self, seq: int) -> None:
        pass

    def catch_up(self, seqs: Sequence[int]) -> None:
        self.base.catch_up(seqs)

    def adopt(self, rows: Rows) -> bool:
        return self.base.adopt(rows)

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        blocks = self.base.draft(asks, trees=True)  # a tree's ask: its lattice only (no walk, no random draws)
        return [self._tree(ask, lattice) if ask.tree_nodes > 0 else block
                for ask, block, lattice in zip(asks, blocks, self.base.lattices, strict=True)]

    def _tree(self, ask: DraftAsk, lattice: Any) -> Proposal:
        sampling = ask.sampling
        levels = LatticeLevels(lattice, self._k, distribution=sampling.distribution if sampling is not None else None)
        tree = build_tree(levels, ask.tree_nodes, branching=self._branching, p_min=ask.p_min, paths=ask.tree_paths,
                          rng=sampling.rng if sampling is not None else None)
        spine = tree.spine()
        if len(spine) < max(1, ask.n_min):
            return Proposal.start(sampling)  # what n_min drops of the linear draft
        q = [tree.nodes[i].q for i in spine] if sampling is not None else None
        return Proposal([tree.nodes[i].token for i in spine], q, tree if len(tree) > len(spine) else None)

    def accept(self, seq: int, n_accepted: int) -> None:
        pass

    def keep(self, seq: int, n: int) -> None:
        pass

    def clear(self, seq: int) -> None:
        pass

    def save(self, seq: int) -> None:
        return None

    def restore(self, seq: int, state: None) -> None:
        pass

    def state_bytes(self, state: Any) -> int:
        return 0

    def free(self) -> None:
        pass


def open_drafter(pair: LinkedPair, views: Sequence[TokenView], capacity: int, *,
                 branching: int = DEFAULT_BRANCHING) -> TreeDrafter:
    return TreeDrafter(opened_drafter(pair), branching=branching)


IMPLEMENTATION = Implementation(open_drafter, options={"branching": DEFAULT_BRANCHING})


__all__ = ["DFLASH_TREE", "TreeDrafter"]
