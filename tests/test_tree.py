"""Draft trees over a DFlash 2 block: how they are grown, and that their verifiers keep the target's distribution.

The distribution tests use a target given as a table (a distribution for every prefix, over a small vocabulary), so the
exact joint distribution of the first tokens is known, and a draft whose distributions are far from the target's (each
position's q depends on the candidate its parent took, as a DFlash 2 lattice's do). The verifier under test reads the
target's "rows" through the same callables the engine's would. They have power: the deliberately broken variants —
siblings drawn with replacement but verified as drawn without, the residual left unnormalised, every sibling verified
against the unremoved q, the linear draft's rule applied to a chosen tree — fail them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from test_distribution import Z_LIMIT, chi_square_z

from dflash_runtime.decoding.controller import TreeOrLinear
from dflash_runtime.decoding.verify import TreeRejection
from dflash_runtime.drafters.proposal import DRAFT, TARGET, draw
from dflash_runtime.drafters.tree import (
    ROOT,
    Candidates,
    DraftTree,
    LatticeLevels,
    Node,
    TreeWalk,
    TreeWalker,
    build_tree,
)

VOCAB = 6
LENGTH = 3  # tokens whose joint distribution is compared
SAMPLES = 4_000
BROKEN_SAMPLES = 2_000  # the broken variants fail with z > 10 at this many


class TableTarget:
    """A target whose next-token distribution depends on the whole prefix (seeded by it), over VOCAB tokens."""

    def __init__(self, seed: int, first: Sequence[float] | None = None) -> None:
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
            out = np.asarray(self._first, dtype=np.float64)
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


class TableDraft:
    """A draft of `depth` positions whose distribution at position i depends on the candidate the parent took (as a
    DFlash 2 lattice's), drawn far from any target's: `first` fixes position 1's."""

    def __init__(self, depth: int, seed: int, first: Sequence[float] | None = None) -> None:
        self.depth = depth
        rng = np.random.default_rng(seed)
        self._q = rng.dirichlet(np.full(VOCAB, 0.5), size=(depth + 1, VOCAB))
        if first is not None:
            self._q[1, 0] = np.asarray(first, dtype=np.float64) / sum(first)

    def candidates(self, i: int, pred: int) -> Candidates:
        return Candidates(np.arange(VOCAB), self._q[i, pred], np.arange(VOCAB))


# the draft's likeliest first token is the target's least likely: a rule that trusts q over-accepts it
FAR = (TableTarget(1, [0.04, 0.4, 0.25, 0.2, 0.06, 0.05]), TableDraft(3, 4, [0.6, 0.1, 0.1, 0.1, 0.05, 0.05]))
# a first candidate the draft is sure of that the target gives 0.3
SURE = (TableTarget(2, [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]), TableDraft(3, 5, [0.995, 0.001, 0.001, 0.001, 0.001, 0.001]))
CASES = {"far": FAR, "sure": SURE}
BUDGET = 16  # depth 3: the spine (3), then forks at the root (2 rows each) and deeper: "far" has ≥ 3 at the root


def rows_of(target: TableTarget, tree: DraftTree) -> dict[int, np.ndarray]:
    """Each node's target row: the target's distribution after the node's path (ROOT: after nothing)."""
    return {ROOT: target.p([]), **{i: target.p(tree.tokens(i)) for i in range(len(tree))}}


def answers(target: TableTarget, make_tree: Callable[[np.random.Generator], DraftTree],
            make_walker: Callable[[Callable[[int], tuple[np.ndarray, np.ndarray]], np.random.Generator], TreeWalker],
            n: int, seed: int) -> Counter:
    """`n` answers of LENGTH tokens: a tree drawn afresh for each, one walk of it, then plain sampling of the tokens
    the walk did not give."""
    rng = np.random.default_rng(seed)
    counts: Counter = Counter()
    for _ in range(n):
        tree = make_tree(rng)
        rows = rows_of(target, tree)
        walker = make_walker(lambda row, rows=rows: (np.arange(VOCAB), rows[row]), rng)
        out = [token for token, _ in walker.walk(tree, lambda node: node)]
        while len(out) < LENGTH:
            out.append(draw(target.p(out), rng))
        counts[tuple(out[:LENGTH])] += 1
    return counts


def z_of(target: TableTarget, make_tree: Callable[[np.random.Generator], DraftTree],
         make_walker: Callable[..., TreeWalker] = TreeRejection, n: int = SAMPLES) -> float:
    return chi_square_z(answers(target, make_tree, make_walker, n, seed=7), target.joint(LENGTH), n)[0]


def drawn_tree(draft: TableDraft) -> Callable[[np.random.Generator], DraftTree]:
    return lambda rng: build_tree(draft, BUDGET, rng=rng)


def test_a_drawn_tree_has_siblings_at_every_depth_and_its_spine_is_the_linear_draw() -> None:
    _, draft = FAR
    tree = build_tree(draft, BUDGET, rng=np.random.default_rng(0))
    assert len(tree.children(ROOT)) >= 3 and tree.depth == 3
    assert all(len(path) == 3 for path in tree.paths())  # every path runs to the spine's depth
    for index, node in enumerate(tree.nodes):
        assert node.q is not None
        ids, probs = node.q
        siblings = list(tree.children(node.parent).values())
        earlier = {tree.nodes[i].token for i in siblings[:siblings.index(index)]}
        assert not earlier & set(ids.tolist()) and np.isclose(probs.sum(), 1.0)  # drawn with the earlier removed
    first = [tree.nodes[i] for i in tree.spine()]
    assert [len(n.q[0]) for n in first] == [VOCAB] * 3  # the spine: first draws, from the whole of q


@pytest.mark.parametrize("case", list(CASES))
def test_recursive_rejection_over_a_drawn_tree_keeps_the_targets_distribution(case: str) -> None:
    target, draft = CASES[case]
    assert z_of(target, drawn_tree(draft)) < Z_LIMIT


def siblings_with_replacement(draft: TableDraft, shape: Sequence[int]) -> Callable[[np.random.Generator], DraftTree]:
    """Deliberately broken: `shape[d]` children per node at depth d, drawn with replacement from q (a repeat
    replaced by the likeliest candidate left, so that siblings differ) but recorded as drawn without replacement."""

    def make(rng: np.random.Generator) -> DraftTree:
        tree = DraftTree()

        def grow(parent: int, depth: int, slot: int) -> None:
            if depth > draft.depth:
                return
            c = draft.candidates(depth, slot)
            left = np.ones(VOCAB, dtype=bool)
            for _ in range(shape[depth - 1]):
                token = draw(c.probs, rng)
                if not left[token]:
                    token = int(np.argmax(np.where(left, c.probs, -1.0)))
                q = (c.ids[left], c.probs[left] / c.probs[left].sum())
                left[token] = False
                grow(tree.add(Node(token, parent, depth, 0.0, token, q)), depth + 1, token)

        grow(ROOT, 1, 0)
        return tree

    return make


class UnnormalisedResidual(TreeRejection):
    """Deliberately broken: after a rejection the next sibling is tried against max(0, p − q), not normalised."""

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node = ROOT
        while True:
            p_ids, p = self._distribution(row_of(node))
            for child in tree.children(node).values():
                drafted = tree.nodes[child]
                assert drafted.q is not None
                q = {int(t): float(v) for t, v in zip(*drafted.q, strict=True)}
                p_x = float(p[np.flatnonzero(p_ids == drafted.token)].sum())
                if self._rng.random() * q[drafted.token] < p_x:
                    yield drafted.token, DRAFT
                    node = child
                    break
                p = np.maximum(p - np.array([q.get(int(t), 0.0) for t in p_ids]), 0.0)
            else:
                yield int(p_ids[draw(p, self._rng)]), TARGET
                return


class UnremovedQ(TreeRejection):
    """Deliberately broken: every sibling verified against the node's whole q, as if its earlier siblings were not
    removed (the q the first sibling was drawn from)."""

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        whole = DraftTree()
        for node in tree.nodes:
            first = tree.nodes[next(iter(tree.children(node.parent).values()))]
            whole.add(Node(node.token, node.parent, node.depth, node.logp, node.slot, first.q))
        yield from super().walk(whole, row_of)


def test_broken_tree_verifiers_fail_the_distribution_test() -> None:
    target, draft = FAR
    n = BROKEN_SAMPLES
    zs = {
        "with replacement, verified as without": z_of(target, siblings_with_replacement(draft, (4, 2, 1)), n=n),
        "residual not renormalised": z_of(target, drawn_tree(draft), UnnormalisedResidual, n=n),
        "unremoved q": z_of(target, drawn_tree(draft), UnremovedQ, n=n),
    }
    assert min(zs.values()) > Z_LIMIT, zs


def test_every_node_keeps_at_least_what_the_linear_rule_keeps_with_its_first_sibling() -> None:
    """At the root a linear draft keeps its draft with probability Σ min(p, q); the tree's first sibling is that draw
    under that rule, and each further one adds the residual's chance ("sure": the draft's certainty leaves the root
    without forks most of the time, "far": never)."""
    for case, (target, draft) in CASES.items():
        p, q = target.p([]), draft.candidates(1, 0).probs
        rng = np.random.default_rng(3)
        kept = 0
        n = 2_000
        for _ in range(n):
            tree = build_tree(draft, BUDGET, rng=rng)
            rows = rows_of(target, tree)
            walk = TreeRejection(lambda row, rows=rows: (np.arange(VOCAB), rows[row]), rng).walk(tree, lambda i: i)
            kept += next(walk)[1] == DRAFT
        linear_keeps = float(np.minimum(p, q).sum())
        sigma = np.sqrt(linear_keeps * (1 - linear_keeps) / n)
        assert kept / n > linear_keeps + (4 * sigma if case == "far" else -4 * sigma), (case, kept / n, linear_keeps)


class CountedDraws:
    """A random generator that counts the uniforms drawn from it."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.n = 0

    def random(self) -> float:
        self.n += 1
        return float(self._rng.random())


def test_a_drawn_tree_spends_one_draw_per_node() -> None:
    _, draft = FAR
    for budget in (3, 7, BUDGET, 20):
        rng = CountedDraws(budget)
        tree = build_tree(draft, budget, rng=rng)  # type: ignore[arg-type]
        assert rng.n == len(tree) > 0


def lattice_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    cands = np.stack([rng.choice(50, size=k, replace=False) for _ in range(n)]).astype(np.float32)
    scores = rng.normal(0.0, 2.0, size=(n, k * k)).astype(np.float32)
    return np.concatenate([cands, scores], axis=1)


def test_a_chosen_lattice_tree_holds_the_linear_draft_and_forks_best_first_within_its_budget() -> None:
    rng = np.random.default_rng(5)
    k, n = 4, 7
    rows = lattice_rows(rng, n, k)
    levels = LatticeLevels(rows, k)
    # the linear draft's greedy lattice walk (dflash.BlockDrafter): argmax of the scores from the predecessor's slot
    linear_draft, pred = [], 0
    for i in range(n):
        s = rows[i, k + pred * k:k + (pred + 1) * k]
        pred = int(np.argmax(s))
        linear_draft.append(int(rows[i, pred]))
    for budget in (1, 4, 16, 40):
        tree = build_tree(levels, budget)
        spine = [tree.nodes[i].token for i in tree.spine()]
        assert spine == linear_draft[:min(budget, n)]
        for path in tree.paths():
            assert len(path) == len(spine)  # every path runs to the spine's depth
        for index, node in enumerate(tree.nodes):
            assert node.q is None and node.parent < index and node.depth == len(tree.path(index)) <= n
            siblings = [tree.nodes[i] for i in tree.children(node.parent).values()]
            assert len({s.token for s in siblings}) == len(siblings) <= 4
            assert [s.logp for s in siblings] == sorted((s.logp for s in siblings), reverse=True)
    # the forks' costs (own root row and copies down to the fork) fit the budget beside the spine
    for budget in (8, 12, 16):
        tree = build_tree(levels, budget)
        forks = [next(i for i in p if i not in tree.spine()) for p in tree.paths()[1:]]
        assert n + sum(tree.nodes[i].depth + 1 for i in forks) <= budget
    assert len(build_tree(levels, 40).paths()) > 3 and len(build_tree(levels, 40, paths=2).paths()) == 3
    assert len(build_tree(levels, 40, branching=1).paths()) == 1


class SureDraft:
    """A draft whose confidence falls along the block (for p_min): position i's best candidate has probability
    1 − 0.1 i."""

    depth = 6

    def candidates(self, i: int, pred: int) -> Candidates:
        best = 1.0 - 0.1 * i
        probs = np.array([best, *([(1.0 - best) / 3] * 3)])
        return Candidates(np.arange(4), probs, np.arange(4))


def test_the_spine_stops_where_the_linear_draft_would() -> None:
    for rng in (None, np.random.default_rng(1)):
        assert build_tree(SureDraft(), 20, p_min=0.65, rng=rng).depth == 3  # 0.9, 0.8, 0.7 kept; 0.6 < 0.65


def test_at_temperature_0_the_walk_keeps_the_longest_path_the_target_agrees_with() -> None:
    tree = build_tree(TableDraft(3, 9), 9)
    spine = [tree.nodes[i].token for i in tree.spine()]
    other = next(t for t in tree.children(ROOT) if t != spine[0])  # the target's greedy text leaves the spine at once
    below = tree.children(tree.child(ROOT, other))  # type: ignore[arg-type]
    greedy = {(): other, (other,): next(iter(below))}

    def argmax(node: int) -> int:
        return greedy.get(tuple(tree.tokens(node)) if node != ROOT else (), VOCAB - 1)

    walked = list(TreeWalk(argmax).walk(tree, lambda node: node))
    assert [s for _, s in walked][:2] == [DRAFT, DRAFT] and walked[-1][1] == TARGET
    assert [t for t, _ in walked][:2] == [other, next(iter(below))]  # a linear draft would accept nothing


class LinearRuleOnTree:
    """Deliberately broken: the linear draft's rejection rule along a chosen tree's spine, as if its tokens had been
    drawn from the draft's q — kept with probability min(1, p/q), else a sample of max(0, p − q)."""

    def __init__(self, draft: TableDraft, rows: Callable[[int], np.ndarray], rng: np.random.Generator) -> None:
        self._draft, self._rows, self._rng = draft, rows, rng

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node, slot = ROOT, 0
        for child in tree.spine():
            p = self._rows(row_of(node))
            q = self._draft.candidates(tree.nodes[child].depth, slot).probs
            token = tree.nodes[child].token
            if self._rng.random() * q[token] < p[token]:
                yield token, DRAFT
                node, slot = child, tree.nodes[child].slot
                continue
            residual = np.maximum(p - q, 0.0)
            yield draw(residual / residual.sum(), self._rng), TARGET
            return
        yield draw(self._rows(row_of(node)), self._rng), TARGET


def test_a_chosen_tree_is_exact_under_the_walk_and_not_under_the_linear_rule() -> None:
    target, draft = FAR
    tree = build_tree(draft, BUDGET)
    assert len(tree.children(ROOT)) >= 3
    rows = rows_of(target, tree)
    walk = z_of(target, lambda rng: tree, lambda dist, rng: TreeWalk(lambda row: draw(dist(row)[1], rng)))
    broken = z_of(target, lambda rng: tree, lambda dist, rng: LinearRuleOnTree(draft, rows.__getitem__, rng))
    assert walk < Z_LIMIT < broken, (walk, broken)


def test_the_tree_or_linear_choice_follows_measured_tokens_per_second() -> None:
    for tree_rate, linear_rate, winner in ((2.0, 1.0, "tree"), (1.0, 1.2, "linear")):
        arms = TreeOrLinear(probe_every=8)
        chosen = []
        for _ in range(64):
            arm = arms.choose()
            chosen.append(arm)
            arms.observe(arm, 4, 4 / (tree_rate if arm == "tree" else linear_rate))
        later = chosen[8:]
        assert later.count(winner) >= len(later) * 7 // 8, chosen  # the loser only at probes
        assert 0 < later.count("linear" if winner == "tree" else "tree") <= len(later) // 8 + 1
        assert arms.describe()["tree_or_linear"] in ("tree", "linear")


def test_no_tree_is_tried_where_the_linear_draft_already_fills_its_steps() -> None:
    """A linear draft whose drafts the target takes whole leaves a tree nothing to add: after the linear draft's
    warm-up the tree is never tried, however fast a tree would be measured; as the linear steps stop filling, the tree
    is tried."""
    arms = TreeOrLinear(probe_every=4)
    chosen = []
    for step in range(96):
        arm = arms.choose()
        chosen.append(arm)
        full = step < 48
        if arm == "linear":
            arms.observe(arm, 8 if full else 3, 0.01, ceiling=8)  # a depth-7 linear draft: 8 tokens at most
        else:
            arms.observe(arm, 5, 0.001)
    assert chosen[:48] == ["linear"] * 48 and arms.steps["tree"] > 0
    assert chosen[48:].count("tree") > 24  # once there is room, the (faster) tree runs
    assert TreeOrLinear().fill() is None and TreeOrLinear().tree_has_room()
