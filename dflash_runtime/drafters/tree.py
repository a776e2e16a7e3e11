"""Draft trees over a DFlash 2 block, and the walk that verifies a chosen tree exactly at any temperature.

A DFlash 2 block gives, for every drafted position, K candidate tokens and transition scores from each candidate of
the position before (the lattice, dflash.py). A linear draft keeps one path through it. A tree keeps more: `build_tree`
takes the linear draft first (its spine: the first child at every node), then new paths best-first by the
draft's estimate of how likely the target goes there, within a budget of verify rows, each new path running down to
the spine's depth.

A node's children come one at a time from the draft's distribution q at that node (the softmax of the selector's
scores from the node's own candidate; above temperature 0, the request's sampler over them):
- chosen (temperature 0, and sample-and-match above it): the likeliest candidate not taken yet. DDTree's tree. Such
  a tree is verified by `TreeWalk`: at each node a sample x of the target's row with the request's own sampler,
  following the child whose token is x, else emitting x and stopping. Every emitted token is a sample of the target
  given the tokens before it — the tree only decides whether the next token's row is already computed — so the walk
  is exact whatever the tree, and at temperature 0 it is the greedy walk.
- drawn (temperature > 0 with rejection sampling): a sample of q with the siblings already drawn removed and the
  rest renormalised — the order Gumbel-top-k gives (Plackett–Luce), drawn one sibling at a time so that a node spends
  one random draw per child it keeps. Each drawn node records the exact distribution it was drawn from, and the tree
  is verified by recursive rejection sampling (verify.TreeRejection), which uses q: the first sibling is the linear
  draft's own rule, each further one adds the residual's chance. Whether a node gets another child is decided before
  that child is drawn (from the tree so far and the budget), never from the child itself: the verifier's proof needs
  it.

How the target sees a tree: every root-to-leaf path is a sequence (`DraftTree.paths`). libllama restricts attention to
cells that share a sequence with the row, so a node carrying the ids of all paths through it would attend exactly to
its ancestors — but libllama's sequential batch split (used for a context with a KV stream per sequence, and for
every recurrent layer) refuses a token with several sequence ids, so each path is decoded as its own sequence, with
the rows it shares with other paths copied, and as wide as the spine's (`decoding/steps.py`, `Steps._branch`).

This module is pure (no libllama): it builds trees and walks them over callables that read the target's rows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .proposal import DRAFT, TARGET, draw

ROOT = -1  # the root: id_last, whose row gives the distribution of the first drafted token
DEFAULT_BRANCHING = 4  # children per node at most (DDTree's top-k; the lattice holds K candidates per position)
Distribution = tuple[np.ndarray, np.ndarray]  # (token ids, probabilities summing to 1)


@dataclass(frozen=True)
class Candidates:
    """A node's possible children: token ids, the draft's probabilities for them (summing to 1), and each one's
    candidate index at its position (the next position's predecessor in the lattice)."""

    ids: np.ndarray
    probs: np.ndarray
    slots: np.ndarray


class Levels(Protocol):
    """The draft's distributions by position: `candidates(i, pred)` gives position i's candidates given that the
    parent took candidate `pred` of position i − 1 (0 for the root)."""

    depth: int

    def candidates(self, i: int, pred: int) -> Candidates: ...


@dataclass(frozen=True)
class Node:
    token: int
    parent: int  # index of the parent node, ROOT for a first drafted token
    depth: int  # 1 for the first drafted token
    logp: float  # log of the draft's probability of the path root → this node (the best-first key)
    slot: int  # the candidate index this node took at its position (the transition scores' predecessor)
    q: Distribution | None = None  # drawn: the distribution it was drawn from, earlier siblings removed


@dataclass
class DraftTree:
    """Nodes in the order they were added (a parent always before its children); `children(i)` in the order they
    were chosen or drawn; `child(i, token)` is the node that follows node i with `token` (ROOT: the root)."""

    nodes: list[Node] = field(default_factory=list)
    _children: dict[int, dict[int, int]] = field(default_factory=dict)

    def add(self, node: Node) -> int:
        index = len(self.nodes)
        self.nodes.append(node)
        self._children.setdefault(node.parent, {})[node.token] = index
        return index

    def __len__(self) -> int:
        return len(self.nodes)

    def child(self, parent: int, token: int) -> int | None:
        return self._children.get(parent, {}).get(token)

    def children(self, parent: int) -> dict[int, int]:
        return dict(self._children.get(parent, {}))

    def path(self, index: int) -> list[int]:
        """The node indices from the root's child down to `index`."""
        out = []
        while index != ROOT:
            out.append(index)
            index = self.nodes[index].parent
        return out[::-1]

    def tokens(self, index: int) -> list[int]:
        return [self.nodes[i].token for i in self.path(index)]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self._children]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices), the spine first."""
        spine = self.spine()
        leaves = sorted(self.leaves(), key=lambda i: (i != (spine[-1] if spine else ROOT), i))
        return [self.path(leaf) for leaf in leaves]

    def spine(self) -> list[int]:
        """The path of first children: the linear draft (chosen: the likeliest at every node; drawn: the first
        sibling drawn at every node, a sample of the linear draft's own walk)."""
        out: list[int] = []
        node = ROOT
        while kids := self._children.get(node):
            node = next(iter(kids.values()))
            out.append(node)
        return out

    def first_paths(self, n: int) -> DraftTree:
        """The tree of the first `n` paths only (the spine first), its nodes and every node's children in the same
        order."""
        keep = sorted({i for path in self.paths()[:n] for i in path})
        index = {ROOT: ROOT, **{old: new for new, old in enumerate(keep)}}
        out = DraftTree()
        for old in keep:
            node = self.nodes[old]
            out.add(Node(node.token, index[node.parent], node.depth, node.logp, node.slot, node.q))
        return out

    @property
    def depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)


class _Children:
    """One node's children as they are taken: the likeliest candidate left (`rng` None), or a draw from the
    candidates left, renormalised (the distribution drawn from is recorded with the child)."""

    def __init__(self, candidates: Candidates, rng: np.random.Generator | None) -> None:
        self.c = candidates
        self._rng = rng
        self._left = candidates.probs > 0.0

    def worth(self) -> float:
        """The draft's estimate of the chance that the target's next token is the next child: the likeliest left
        (chosen), or the expected probability of a draw from what is left (drawn) — known before the child is."""
        left = self.c.probs[self._left]
        if left.size == 0:
            return 0.0
        if self._rng is None:
            return float(left.max())
        return float((left * left).sum() / left.sum())

    def take(self) -> tuple[int, float, int, Distribution | None]:
        """The next child: its token, the draft's probability of it, its slot, and the distribution it was drawn
        from (None: chosen)."""
        left = np.flatnonzero(self._left)
        if self._rng is None:
            pick, q = int(left[np.argmax(self.c.probs[left])]), None
        else:
            weights = self.c.probs[left]
            weights = weights / weights.sum()
            pick = int(left[draw(weights, self._rng)])
            q = (self.c.ids[left].copy(), weights)
        self._left[pick] = False
        return int(self.c.ids[pick]), float(self.c.probs[pick]), int(self.c.slots[pick]), q


def build_tree(levels: Levels, budget: int, *, branching: int = DEFAULT_BRANCHING,
               rng: np.random.Generator | None = None, p_min: float = 0.0, paths: int | None = None) -> DraftTree:
    """The linear draft and, best-first, new paths that leave it, at most `levels.depth` deep.

    The spine comes first: the first child at every depth (chosen, or drawn with `rng`), stopping where the draft is
    less sure than `p_min` (the linear draft's rule). `budget` counts verify rows beside the spine's root row: the spine
    costs its length, and a new path leaving a node at depth d − 1 costs d + 1 — its own root row, its copy of the d −
    1 rows it shares and its first node; it then runs down to the spine's depth in rows its sequence holds anyway (the
    decode's sequences are as wide as the spine's, see steps.Steps._branch). New paths are taken by the draft's
    estimate of reaching them (the path's probability times `_Children.worth`), at most `branching` children per node
    and `paths` paths beside the spine."""
    if budget < 0 or branching < 1:
        raise ValueError(f"a tree needs budget ≥ 0 and branching ≥ 1 (got {budget}, {branching})")
    tree = DraftTree()
    children: dict[int, _Children] = {}

    def at(node: int) -> _Children:
        if node not in children:
            depth, slot = (0, 0) if node == ROOT else (tree.nodes[node].depth, tree.nodes[node].slot)
            children[node] = _Children(levels.candidates(depth + 1, slot), rng)
        return children[node]

    def grow(parent: int) -> int:
        token, prob, slot, q = at(parent).take()
        depth, base = (0, 0.0) if parent == ROOT else (tree.nodes[parent].depth, tree.nodes[parent].logp)
        return tree.add(Node(token, parent, depth + 1, base + math.log(prob), slot, q))

    node = ROOT
    for _ in range(min(levels.depth, budget)):
        if p_min > 0.0 and float(at(node).c.probs.max()) < p_min:
            break
        node = grow(node)
    deepest = len(tree)
    heap: list[tuple[float, int, int]] = []  # (−(log path probability + log worth), tie, node)
    tie = 0

    def offer(node: int) -> None:
        nonlocal tie
        depth = 0 if node == ROOT else tree.nodes[node].depth
        worth = at(node).worth() if depth < deepest and len(tree.children(node)) < branching else 0.0
        if worth > 0.0:
            tie += 1
            base = 0.0 if node == ROOT else tree.nodes[node].logp
            heapq.heappush(heap, (-(base + math.log(worth)), tie, node))

    for node in [ROOT, *range(len(tree))]:
        offer(node)
    used, made = deepest, 0
    room = math.inf if paths is None else paths
    while heap and made < room:
        _, _, node = heapq.heappop(heap)
        depth = 0 if node == ROOT else tree.nodes[node].depth
        if used + depth + 2 > budget:
            continue  # too deep a fork for what is left; a shallower one may still fit
        used += depth + 2
        made += 1
        new = [grow(node)]
        while tree.nodes[new[-1]].depth < deepest:
            new.append(grow(new[-1]))
        for index in (node, *new):
            offer(index)
    return tree


@dataclass
class LatticeLevels:
    """A DFlash 2 block's lattice as `Levels`: row i (of the block's mask positions) holds K candidate ids, then the
    K × K transition scores, predecessor-major; position 1's predecessor is the anchor's slot 0 (as the linear
    draft's walk starts). The draft's distribution is the softmax of the scores, or with `distribution` (the request's
    sampler as probabilities, sampling.SamplerDistribution) what the sampler makes of them — as the linear draft's own
    walk draws."""

    rows: np.ndarray
    k: int
    distribution: Callable[[np.ndarray, np.ndarray], Distribution] | None = None

    @property
    def depth(self) -> int:
        return int(self.rows.shape[0])

    def candidates(self, i: int, pred: int) -> Candidates:
        row = self.rows[i - 1]
        cands = row[:self.k].astype(np.int64)
        scores = row[self.k + pred * self.k:self.k + (pred + 1) * self.k]
        if self.distribution is None:
            z = scores.astype(np.float64)
            probs = np.exp(z - z.max())
            return Candidates(cands, probs / probs.sum(), np.arange(self.k))
        ids, probs = self.distribution(scores.astype(np.float32), cands.astype(np.int32))
        slots = np.array([int(np.flatnonzero(cands == token)[0]) for token in ids], dtype=np.int64)
        return Candidates(ids.astype(np.int64), probs, slots)


class TreeWalker(Protocol):
    """What verifies a tree: (token, source) pairs, reading the target's row for each node through `row_of(node)`
    (ROOT: the root's row)."""

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]: ...


class TreeWalk:
    """The exact verifier of a chosen tree: at each node a sample x of the target's row with the request's sampler;
    the child whose token is x is followed ("draft"), else x ends the walk ("target"). `sample(row)` samples a row of
    the last target decode with the request's sampler (at temperature 0: its argmax)."""

    def __init__(self, sample: Callable[[int], int]) -> None:
        self._sample = sample

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node = ROOT
        while True:
            token = self._sample(row_of(node))
            child = tree.child(node, token)
            if child is None:
                yield token, TARGET
                return
            yield token, DRAFT
            node = child


def accepted_path(tree: DraftTree, tokens: Sequence[int]) -> list[int]:
    """The node indices a walk that emitted `tokens` went through (its accepted drafts)."""
    out: list[int] = []
    node = ROOT
    for token in tokens:
        child = tree.child(node, token)
        if child is None:
            break
        out.append(child)
        node = child
    return out


__all__ = ["ROOT", "Candidates", "DraftTree", "LatticeLevels", "Levels", "Node", "TreeWalk", "TreeWalker",
           "accepted_path", "build_tree"]
