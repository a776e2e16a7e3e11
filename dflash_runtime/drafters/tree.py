"""Draft trees over a DFlash 2 block, and the walk that verifies one exactly at any temperature.

A DFlash 2 block gives, for every drafted position, K candidate tokens and transition scores from each candidate of
the position before (the lattice, dflash.py). The chain keeps one path through it. A tree keeps the likeliest
continuations: `build_tree` grows it best-first by the draft's path probability (the product of the transition
probabilities along the path, each the softmax of the selector's scores from the parent's candidate) up to a budget
of nodes and a depth, taking at most `branching` children per node.

`TreeWalk` verifies a tree: at each node (the root being `id_last`'s row) it draws x from the target's row for that
node with the request's own sampler, follows the child whose token is x when there is one, and otherwise emits x and
stops. Every emitted token is a sample of the target given the tokens before it — the tree decides only whether the
row for the next token has already been computed — so the output has the target's distribution exactly, and at
temperature 0 the walk is the greedy walk. The chain's rejection rule, min(1, p/q), is not exact here: it assumes the
draft token was sampled from q, while the tree's tokens are the draft's likeliest, chosen deterministically (a
candidate with q = 0.6 and p = 0.3 would be kept with probability 0.6 instead of 0.3). docs/how-it-works.md gives
the proof.

How the target sees a tree: every root-to-leaf path is a sequence (`DraftTree.paths`). libllama restricts attention to
cells that share a sequence with the row, so a node carrying the ids of all paths through it attends exactly to its
ancestors — but libllama's sequential batch split (used for a context with a KV stream per sequence, and for every
recurrent layer) refuses a token with several sequence ids, so each path is decoded as its own sequence, with the
rows it shares with other paths copied (`DraftTree.branch_rows` counts the rows that costs).

This module is pure (no libllama): it builds trees and walks them over callables that read the target's rows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .proposal import DRAFT, TARGET

ROOT = -1  # the root: id_last, whose row gives the distribution of the first drafted token
DEFAULT_BRANCHING = 4  # children per node at most (DDTree's top-k; the lattice holds K candidates per position)


class Levels(Protocol):
    """The draft's distributions by position: `candidates(i, pred)` gives position i's candidate ids and their
    log-probabilities given that the parent took candidate `pred` of position i − 1 (0 for the root)."""

    depth: int

    def candidates(self, i: int, pred: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class Node:
    token: int
    parent: int  # index of the parent node, ROOT for a first drafted token
    depth: int  # 1 for the first drafted token
    logp: float  # the draft's log-probability of the path root → this node
    slot: int  # the candidate index this node took at its position (the transition scores' predecessor)


@dataclass
class DraftTree:
    """Nodes best-first (a parent always before its children); `child(i, token)` is the node that follows node i with
    `token` (ROOT: the root)."""

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
        """Every root-to-leaf path (node indices), the spine first: the path of the best leaf's ancestors is the
        draft's likeliest, the one the chain would propose."""
        spine = self.spine()
        leaves = sorted(self.leaves(), key=lambda i: (i != (spine[-1] if spine else ROOT), i))
        return [self.path(leaf) for leaf in leaves]

    def spine(self) -> list[int]:
        """The path that follows the likeliest child at every node (the chain's draft)."""
        out: list[int] = []
        node = ROOT
        while kids := self._children.get(node):
            node = max(kids.values(), key=lambda i: self.nodes[i].logp)
            out.append(node)
        return out

    def first_paths(self, n: int) -> DraftTree:
        """The tree of the first `n` paths only (the spine first), its nodes in the same order."""
        keep = sorted({i for path in self.paths()[:n] for i in path})
        index = {ROOT: ROOT, **{old: new for new, old in enumerate(keep)}}
        out = DraftTree()
        for old in keep:
            node = self.nodes[old]
            out.add(Node(node.token, index[node.parent], node.depth, node.logp, node.slot))
        return out

    @property
    def depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)

    def shared_rows(self) -> int:
        """Verify rows of one pass where a shared node carries every sequence through it: the root and each node."""
        return 1 + len(self.nodes)

    def branch_rows(self) -> int:
        """Verify rows when every path is its own sequence with its own copy of the rows it shares: the root and the
        path, for every path (0 for an empty tree)."""
        return sum(1 + len(p) for p in self.paths())


def build_tree(levels: Levels, budget: int, *, branching: int = DEFAULT_BRANCHING,
               row_cost: str = "shared", chain_first: bool = False) -> DraftTree:
    """The draft's likeliest continuations, best-first by path probability, at most `levels.depth` deep.

    `budget` counts verify rows beside the first path's root row: the nodes when shared nodes carry several sequences
    (`row_cost="shared"`), or the rows of every path with its shared rows copied (`row_cost="branch"`: a new path
    costs its whole length and a root row of its own). A chain of n tokens costs n either way. A node takes at most
    `branching` children; a child whose token a better sibling already took is skipped (the walk follows a token,
    so siblings' tokens must differ). `chain_first`: the draft's greedy path (the chain's draft) first, as deep as
    the budget allows, so that the tree holds the chain and accepts at least what it would."""
    if budget < 0 or branching < 1:
        raise ValueError(f"a tree needs budget ≥ 0 and branching ≥ 1 (got {budget}, {branching})")
    if row_cost not in ("shared", "branch"):
        raise ValueError(f"row_cost is 'shared' or 'branch' (got {row_cost!r})")
    tree = DraftTree()
    heap: list[tuple[float, int, int, int, int, int]] = []  # (−logp, tie, parent, depth, token, slot)
    tie = 0

    def push(parent: int, depth: int, base: float, pred: int) -> None:
        nonlocal tie
        if depth > levels.depth:
            return
        ids, logps = levels.candidates(depth, pred)
        order = np.argsort(-logps, kind="stable")[:branching]
        for slot in order:
            tie += 1
            heapq.heappush(heap, (-(base + float(logps[slot])), tie, parent, depth, int(ids[slot]), int(slot)))

    used = 0
    if chain_first:
        parent, base, pred = ROOT, 0.0, 0
        for depth in range(1, min(levels.depth, budget) + 1):
            ids, logps = levels.candidates(depth, pred)
            push(parent, depth, base, pred)
            slot = int(np.argmax(logps))
            base += float(logps[slot])
            parent, pred = tree.add(Node(int(ids[slot]), parent, depth, base, slot)), slot
            used += 1
        if len(tree):
            push(parent, len(tree) + 1, base, pred)
    else:
        push(ROOT, 1, 0.0, 0)
    while heap and used < budget:
        neg, _, parent, depth, token, slot = heapq.heappop(heap)
        if tree.child(parent, token) is not None:
            continue
        cost = 1 if row_cost == "shared" else _branch_cost(tree, parent, depth)
        if used + cost > budget:
            continue
        used += cost
        index = tree.add(Node(token, parent, depth, -neg, slot))
        push(index, depth + 1, -neg, slot)
    return tree


def _branch_cost(tree: DraftTree, parent: int, depth: int) -> int:
    """Rows a new node adds when every path is its own sequence: one where it extends a leaf's path (or starts the
    first path), else a new path — its own copy of the root's row and of the `depth` rows down to it."""
    if not tree.children(parent) and (parent != ROOT or not len(tree)):
        return 1
    return depth + 1


@dataclass
class LatticeLevels:
    """A DFlash 2 block's lattice as `Levels`: row i (of the block's mask positions) holds K candidate ids, then the
    K × K transition scores, predecessor-major; position 1's predecessor is the anchor's slot 0 (as the chain's walk
    starts). `temperature` scales the scores before the softmax (1: the selector's own)."""

    rows: np.ndarray
    k: int
    temperature: float = 1.0

    @property
    def depth(self) -> int:
        return int(self.rows.shape[0])

    def candidates(self, i: int, pred: int) -> tuple[np.ndarray, np.ndarray]:
        row = self.rows[i - 1]
        ids = row[:self.k].astype(np.int64)
        scores = row[self.k + pred * self.k:self.k + (pred + 1) * self.k].astype(np.float64) / self.temperature
        return ids, scores - _logsumexp(scores)


@dataclass
class MarginalLevels:
    """Per-position distributions that do not depend on the parent (the draft's marginals: a DFlash v1 block's
    logits, or a test's): position i's candidate ids and probabilities."""

    ids: Sequence[np.ndarray]
    probs: Sequence[np.ndarray]

    @property
    def depth(self) -> int:
        return len(self.ids)

    def candidates(self, i: int, pred: int) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(divide="ignore"):
            return np.asarray(self.ids[i - 1]), np.log(np.asarray(self.probs[i - 1], dtype=np.float64))


def _logsumexp(x: np.ndarray) -> float:
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum()))


class TreeWalker(Protocol):
    """What verifies a tree: (token, source) pairs, reading the target's row for each node through `row_of(node)`
    (ROOT: the root's row)."""

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]: ...


class TreeWalk:
    """The exact tree verifier: at each node a sample x of the target's row with the request's sampler; the child
    whose token is x is followed ("draft"), else x ends the walk ("target"). `sample(row)` samples a row of the last
    target decode with the request's chain (at temperature 0: its argmax)."""

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


__all__ = ["ROOT", "DraftTree", "LatticeLevels", "Levels", "MarginalLevels", "Node", "TreeWalk", "TreeWalker",
           "accepted_path", "build_tree"]
