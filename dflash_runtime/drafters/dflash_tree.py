"""The DFlash 2 tree method: one draft block, a tree of its likeliest continuations, verified in one target pass.

The block is drafted by the DFlash drafter (dflash.py), which also keeps feeding the draft context: this method drafts
through it and adds nothing to process. From each block's lattice a tree is grown best-first by the draft's path
probability (tree.py) within the request's `tree_nodes` verify rows and `draft_length` depth. Its spine (the likeliest
path, the chain's draft) goes into the request's own sequence; every other root-to-leaf path into a spare target
sequence of its own (`LinkedPair(branches=N)`), with its own copy of the rows it shares with the spine, because
libllama refuses a token with several sequence ids wherever it splits batches by sequence (a KV stream per sequence,
and every recurrent layer). The steps (steps.py) give the paths their sequences, copy the request's state into each
(decoding.py: the walk, the accepted path, the replay of a path off the spine).
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

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        chains = self.base.draft(asks)
        out = []
        for ask, chain, lattice in zip(asks, chains, self.base.lattices, strict=True):
            if not chain.tokens or ask.tree_nodes <= 0 or lattice.shape[0] == 0:
                out.append(chain)  # a draft that n_min / p_min dropped stays dropped
                continue
            tree = build_tree(LatticeLevels(lattice[:len(chain.tokens)], self._k), ask.tree_nodes,
                              branching=self._branching, row_cost="branch", chain_first=True)
            spine = [tree.nodes[i].token for i in tree.spine()]
            out.append(Proposal(spine, None, tree))
        return out

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
