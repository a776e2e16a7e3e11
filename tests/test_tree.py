"""Draft trees over a DFlash 2 block: how they are grown, and that their walk keeps the target's distribution.

The distribution tests use a target given as a table (a distribution for every prefix, over a small vocabulary), so the
exact joint distribution of the first tokens is known; the walk under test reads the target's "rows" through the same
callables the engine's would. They have power: a deliberately broken tree verifier — the chain's min(1, p/q) rule
applied along the tree's likeliest path, passed in as the walker — fails every one of them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from test_distribution import Z_LIMIT, chi_square_z

from dflash_runtime.drafters.proposal import DRAFT, TARGET, draw
from dflash_runtime.drafters.tree import (
    ROOT,
    DraftTree,
    LatticeLevels,
    MarginalLevels,
    TreeWalk,
    TreeWalker,
    build_tree,
)

VOCAB = 5
LENGTH = 3  # tokens whose joint distribution is compared
SAMPLES = 12_000


class TableTarget:
    """A target whose next-token distribution depends on the whole prefix (seeded by it), over VOCAB tokens."""

    def __init__(self, seed: int, first: dict[int, float] | None = None) -> None:
        self._seed = seed
        self._first = first
        self._table: dict[tuple[int, ...], np.ndarray] = {}

    def p(self, prefix: Sequence[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in self._table:
            self._table[key] = self._distribution(key)
        return self._table[key]

    def _distribution(self, prefix: tuple[int, ...]) -> np.ndarray:
        if not prefix and self._first is not None:
            out = np.full(VOCAB, 0.0)
            for token, prob in self._first.items():
                out[token] = prob
            return out / out.sum()
        rng = np.random.default_rng([self._seed, len(prefix), *prefix])
        return rng.dirichlet(np.full(VOCAB, 0.8))

    def joint(self, length: int) -> dict[tuple[int, ...], float]:
        out = {}
        for seq in itertools.product(range(VOCAB), repeat=length):
            prob = 1.0
            for i, token in enumerate(seq):
                prob *= float(self.p(seq[:i])[token])
            out[seq] = prob
        return out


def draw_answers(target: TableTarget, tree: DraftTree, make_walker: Callable[[Callable[[int], int]], TreeWalker],
                 n: int, seed: int) -> Counter:
    """`n` answers of LENGTH tokens: one tree walk (the walker reads node i's row as the target's distribution after
    the node's path), then plain sampling for the tokens the walk did not give."""
    rng = np.random.default_rng(seed)
    rows: dict[int, np.ndarray] = {ROOT: target.p([])}
    rows.update({i: target.p(tree.tokens(i)) for i in range(len(tree))})
    walker = make_walker(lambda row: draw(rows[row], rng))
    counts: Counter = Counter()
    for _ in range(n):
        out = [token for token, _ in walker.walk(tree, lambda node: node)]
        while len(out) < LENGTH:
            out.append(draw(target.p(out), rng))
        counts[tuple(out[:LENGTH])] += 1
    return counts


class ChainRuleOnTree:
    """Deliberately broken: the chain's rejection rule along the tree's likeliest path, as if the path's tokens had
    been sampled from the draft's marginals q — kept with probability min(1, p/q), else a sample of max(0, p − q)."""

    def __init__(self, q: Sequence[np.ndarray], rows: Callable[[int], np.ndarray], rng: np.random.Generator) -> None:
        self._q, self._rows, self._rng = q, rows, rng

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node = ROOT
        for depth in range(tree.depth + 1):
            p = self._rows(row_of(node))
            kids = tree.children(node)
            if not kids:
                break
            best = max(kids.values(), key=lambda i: tree.nodes[i].logp)
            token, q = tree.nodes[best].token, self._q[depth]
            if self._rng.random() * q[token] < p[token]:
                yield token, DRAFT
                node = best
                continue
            residual = np.maximum(p - q, 0.0)
            yield draw(residual / residual.sum(), self._rng), TARGET
            return
        yield draw(self._rows(row_of(node)), self._rng), TARGET


def marginal_tree(q: Sequence[np.ndarray], budget: int) -> DraftTree:
    ids = [np.arange(VOCAB)] * len(q)
    return build_tree(MarginalLevels(ids, list(q)), budget, branching=3)


SOFT_Q = [np.array([0.6, 0.2, 0.1, 0.05, 0.05]), np.array([0.1, 0.5, 0.3, 0.05, 0.05])]
SURE_Q = [np.array([0.999, 0.00025, 0.00025, 0.00025, 0.00025]), np.array([0.1, 0.5, 0.3, 0.05, 0.05])]
CASES = {
    # the draft's likeliest first token is the target's least likely: a rule that trusts q over-accepts it
    "soft": (TableTarget(1, {0: 0.05, 1: 0.4, 2: 0.25, 3: 0.2, 4: 0.1}), SOFT_Q, 6),
    # a first candidate the draft is sure of (q ≈ 1) that the target gives 0.3
    "sure": (TableTarget(2, {0: 0.3, 1: 0.3, 2: 0.2, 3: 0.1, 4: 0.1}), SURE_Q, 5),
    # a tree of the first token's candidates only
    "flat": (TableTarget(3), [SOFT_Q[0]], 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_tree_walk_keeps_the_targets_distribution(case: str) -> None:
    target, q, budget = CASES[case]
    tree = marginal_tree(q, budget)
    assert len(tree.paths()) > 1  # a real tree, not a chain
    counts = draw_answers(target, tree, TreeWalk, SAMPLES, seed=7)
    z, _ = chi_square_z(counts, target.joint(LENGTH), SAMPLES)
    assert z < Z_LIMIT, z


def test_a_broken_tree_verifier_fails_the_distribution_test() -> None:
    zs = {}
    for case, (target, q, budget) in CASES.items():
        tree = marginal_tree(q, budget)
        rng = np.random.default_rng(11)
        rows = {ROOT: target.p([]), **{i: target.p(tree.tokens(i)) for i in range(len(tree))}}

        def broken(sample: Callable[[int], int], q: Sequence[np.ndarray] = q,
                   rows: dict = rows, rng: np.random.Generator = rng) -> TreeWalker:
            return ChainRuleOnTree(q, rows.__getitem__, rng)

        counts = draw_answers(target, tree, broken, SAMPLES, seed=7)
        zs[case] = chi_square_z(counts, target.joint(LENGTH), SAMPLES)[0]
    # "soft": q(0) = 0.6 against p(0) = 0.05; "sure": right at the first token (min(1, p/q) ≈ p when q ≈ 1), wrong at
    # the second, where the tree's tokens were not drawn from the marginal q the rule divides by
    assert min(zs.values()) > Z_LIMIT, zs


def test_at_temperature_0_the_walk_keeps_the_longest_path_the_target_agrees_with() -> None:
    q = [np.array([0.5, 0.3, 0.2, 0.0, 0.0])] * 3
    tree = marginal_tree(q, 9)
    greedy = {(): 1, (1,): 0, (1, 0): 2, (1, 0, 2): 4}  # the target's argmax after each prefix

    def argmax(node: int) -> int:
        return greedy[tuple(tree.tokens(node)) if node != ROOT else ()]

    walked = list(TreeWalk(argmax).walk(tree, lambda node: node))
    assert walked[-1][1] == TARGET and all(s == DRAFT for _, s in walked[:-1])
    tokens = [t for t, _ in walked]
    assert tokens == [1, 0, 2, 4][:len(tokens)]
    assert tokens[0] == 1 and tree.child(ROOT, 1) is not None  # the chain (token 0 first) would accept nothing
    assert len(tokens) >= 3


def lattice_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    cands = np.stack([rng.choice(50, size=k, replace=False) for _ in range(n)]).astype(np.float32)
    scores = rng.normal(0.0, 2.0, size=(n, k * k)).astype(np.float32)
    return np.concatenate([cands, scores], axis=1)


def test_a_lattice_tree_is_grown_best_first_within_its_budget_and_holds_the_chains_draft() -> None:
    rng = np.random.default_rng(5)
    k, n = 4, 7
    rows = lattice_rows(rng, n, k)
    levels = LatticeLevels(rows, k)
    # the chain's greedy lattice walk (dflash.BlockDrafter): argmax of the scores from the predecessor's slot
    chain, pred = [], 0
    for i in range(n):
        s = rows[i, k + pred * k:k + (pred + 1) * k]
        pred = int(np.argmax(s))
        chain.append(int(rows[i, pred]))
    for budget in (1, 4, 16, 40):
        tree = build_tree(levels, budget)
        assert len(tree) == min(budget, len(tree)) and len(tree) <= budget
        spine = [tree.nodes[i].token for i in tree.spine()]
        assert spine == chain[:len(spine)]
        logps = [node.logp for node in tree.nodes]
        assert logps == sorted(logps, reverse=True)  # best-first: a parent's path is at least as likely as a child's
        for index, node in enumerate(tree.nodes):
            assert node.parent < index and node.depth == len(tree.path(index)) <= n
            siblings = [tree.nodes[i].token for i in tree.children(node.parent).values()]
            assert len(siblings) == len(set(siblings))
    assert len(build_tree(levels, 16)) == 16
    line = build_tree(levels, n, branching=1)
    assert [line.nodes[i].token for i in line.spine()] == chain


def test_with_a_copy_of_the_shared_rows_per_path_the_budget_counts_every_row() -> None:
    rng = np.random.default_rng(6)
    levels = LatticeLevels(lattice_rows(rng, 6, 4), 4)
    for budget in (3, 8, 16):
        shared = build_tree(levels, budget)
        branch = build_tree(levels, budget, row_cost="branch")
        assert shared.shared_rows() == 1 + len(shared) <= budget + 1
        assert branch.branch_rows() <= budget + 1
        assert branch.branch_rows() >= branch.shared_rows()
    chain = build_tree(levels, 5, branching=1, row_cost="branch")
    assert chain.branch_rows() == chain.shared_rows() == 6


def test_the_tree_or_chain_choice_follows_measured_tokens_per_second() -> None:
    from dflash_runtime.controller import TreeOrChain

    for tree_rate, chain_rate, winner in ((2.0, 1.0, "tree"), (1.0, 1.2, "chain")):
        arms = TreeOrChain(probe_every=8)
        chosen = []
        for _ in range(64):
            arm = arms.choose()
            chosen.append(arm)
            arms.observe(arm, 4, 4 / (tree_rate if arm == "tree" else chain_rate))
        later = chosen[8:]
        assert later.count(winner) >= len(later) * 7 // 8, chosen  # the loser only at probes
        assert 0 < later.count("chain" if winner == "tree" else "tree") <= len(later) // 8 + 1
        assert arms.describe()["tree_or_chain"] in ("tree", "chain")


def test_no_tree_is_tried_where_the_chain_already_fills_its_steps() -> None:
    """A chain whose drafts the target takes whole leaves a tree nothing to add: after the chain's warm-up the tree is
    never tried, however fast a tree would be measured; as the chain's steps stop filling, the tree is tried."""
    from dflash_runtime.controller import TreeOrChain

    arms = TreeOrChain(probe_every=4)
    chosen = []
    for step in range(96):
        arm = arms.choose()
        chosen.append(arm)
        full = step < 48
        if arm == "chain":
            arms.observe(arm, 8 if full else 3, 0.01, ceiling=8)  # a depth-7 chain: 8 tokens at most
        else:
            arms.observe(arm, 5, 0.001)
    assert chosen[:48] == ["chain"] * 48 and arms.steps["tree"] > 0
    assert chosen[48:].count("tree") > 24  # once there is room, the (faster) tree runs
    assert TreeOrChain().fill() is None and TreeOrChain().tree_has_room()
