"""Verification of a draft against the target's verify rows, token by token.

Every emitted token is a sample of the target's distribution given the tokens before it, so the output has the
target's distribution exactly (token for token at temperature 0):

- `MatchVerifier` (temperature 0, and `verify="match"` above it): row i is sampled with the request's own sampler and
  the draft token is kept while the sample equals it. A draft token x survives with probability p(x).
- `RejectionVerifier` (`verify="sample"`, temperature > 0; Leviathan et al. 2023, Chen et al. 2023): a draft token x,
  sampled from q, is kept with probability min(1, p(x) / q(x)); on rejection the token comes from the normalised
  residual max(0, p − q); after a fully accepted draft the bonus token comes from p at the next row. A draft token
  survives with probability Σ min(p, q), close to 1 when q ≈ p. A deterministic draft (the proposal has no q, e.g.
  an n-gram lookup) was drawn from a point mass on its token: it is kept with probability p(x), and on rejection the
  token comes from p with x removed, renormalised.

A draft tree (drafters/tree.py) has a verifier of its own: `TreeWalk` for a chosen tree (the walk that samples each
node's row and follows the child holding the sample), `TreeRejection` for a tree drawn from q (recursive rejection
sampling over each node's siblings, the residual renormalised after each rejection; one `rejection_stage` is the
linear draft's step too).

Rows are those of the last target decode, from `first_row` on. `walk()` yields (token, source) lazily, so sampling
stops where the caller stops reading (end of generation, a stop string): "draft" for an accepted draft token,
"target" for the target's own sample that ends the walk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..drafters.proposal import DRAFT, TARGET, Proposal, draw
from ..drafters.tree import ROOT, DraftTree, TreeWalk, TreeWalker
from ..native.batches import logits_row
from ..native.sampling import Sampler, SamplerDistribution


class Verifier(Protocol):
    mode: str

    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        """(token, source) pairs from the rows of the last target decode, from `first_row` on."""
        ...


class MatchVerifier:
    mode = "match"

    def __init__(self, sampler: Sampler, target_ctx: Any) -> None:
        self._sampler = sampler
        self._ctx = target_ctx

    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        drafts = proposal.tokens
        for i in range(len(drafts) + 1):
            token = self._sampler.sample(self._ctx, first_row + i)
            if i < len(drafts) and token == drafts[i]:
                yield token, DRAFT
                continue
            yield token, TARGET
            return


class RejectionVerifier:
    mode = "sample"

    def __init__(self, distribution: SamplerDistribution, rng: np.random.Generator, target_ctx: Any,
                 n_vocab: int) -> None:
        self._distribution = distribution
        self._rng = rng
        self._ctx = target_ctx
        self._n_vocab = n_vocab

    def target_distribution(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        return target_distribution(self._ctx, row, self._n_vocab, self._distribution)

    def walk(self, proposal: Proposal, first_row: int = 0) -> Iterator[tuple[int, str]]:
        drafts, q = proposal.tokens, proposal.q
        if q is not None and len(q) != len(drafts):
            raise ValueError("rejection sampling needs the distribution of every draft token, or of none")
        for i, token in enumerate(drafts):
            p_ids, p_probs = self.target_distribution(first_row + i)
            residual = rejection_stage(token, None if q is None else q[i], p_ids, p_probs, self._rng)
            if residual is None:
                yield token, DRAFT
                continue
            yield int(p_ids[draw(residual, self._rng)]), TARGET
            return
        p_ids, p_probs = self.target_distribution(first_row + len(drafts))
        yield int(p_ids[draw(p_probs, self._rng)]), TARGET


class TreeRejection:
    """Recursive rejection sampling over a drawn tree (Jeon et al. 2024; SpecTr / SpecInfer's multi-draft rule): at
    each node reached, p is the target's row there under the request's sampler; the children are tried in the order
    they were drawn, child i kept with probability min(1, p_i(x_i) / q_i(x_i)) — q_i the distribution it was drawn
    from, its earlier siblings removed — and on its rejection p_(i+1) is the normalised residual max(0, p_i − q_i);
    a kept child is emitted and its node is next; when every child is rejected (or there is none) a sample of what
    is left of p ends the walk. Every stage is rejection sampling of p_i with proposal q_i, so the node emits a sample
    of p (docs/how-it-works.md has the proof); the first stage is the linear draft's own rule, so no node keeps less
    than a linear draft would with the first child alone. A chosen child (no recorded q) is a point mass: kept with
    probability p_i(x). `distribution(row)`: a row of the last target decode under the request's sampler."""

    def __init__(self, distribution: Callable[[int], tuple[np.ndarray, np.ndarray]],
                 rng: np.random.Generator) -> None:
        self._distribution = distribution
        self._rng = rng

    def walk(self, tree: DraftTree, row_of: Callable[[int], int]) -> Iterator[tuple[int, str]]:
        node = ROOT
        while True:
            p_ids, p_probs = self._distribution(row_of(node))
            for child in tree.children(node).values():
                drafted = tree.nodes[child]
                residual = rejection_stage(drafted.token, drafted.q, p_ids, p_probs, self._rng)
                if residual is None:
                    yield drafted.token, DRAFT
                    node = child
                    break
                p_probs = residual
            else:
                yield int(p_ids[draw(p_probs, self._rng)]), TARGET
                return


def rejection_stage(token: int, q: tuple[np.ndarray, np.ndarray] | None, p_ids: np.ndarray, p_probs: np.ndarray,
                    rng: np.random.Generator) -> np.ndarray | None:
    """One stage of rejection sampling of p (probabilities over p_ids) with a token drawn from q (ids, probs; None:
    a point mass on the token, a deterministic draft): None when the token is kept — with probability
    min(1, p(x) / q(x)) — else the residual max(0, p − q), normalised, over p_ids."""
    p_x = _prob_of(token, p_ids, p_probs)
    if q is None:
        if rng.random() < p_x:  # accept with probability min(1, p(x) / 1)
            return None
        residual = np.where(p_ids == token, 0.0, p_probs)  # max(0, p − δx): p without x
    else:
        q_ids, q_probs = q
        q_x = _prob_of(token, q_ids, q_probs)
        if q_x <= 0.0:
            raise ValueError(f"draft token {token} was not in the distribution it was sampled from")
        if rng.random() * q_x < p_x:  # accept with probability min(1, p(x) / q(x))
            return None
        residual = np.maximum(p_probs - _on_support(p_ids, q_ids, q_probs), 0.0)
    total = float(residual.sum())
    return residual / total if total > 0.0 else p_probs  # total 0 only through rounding: then p = q


def target_distribution(ctx: Any, row: int, n_vocab: int,
                        distribution: SamplerDistribution) -> tuple[np.ndarray, np.ndarray]:
    """A row of the last target decode as the request's sampler makes it: (token ids, probabilities)."""
    return distribution(logits_row(ctx, row, n_vocab, f"the target produced no logits for verify row {row}"))


def _prob_of(token: int, ids: np.ndarray, probs: np.ndarray) -> float:
    hit = np.flatnonzero(ids == token)
    return float(probs[hit[0]]) if hit.size else 0.0


def _on_support(p_ids: np.ndarray, q_ids: np.ndarray, q_probs: np.ndarray) -> np.ndarray:
    """q's probabilities laid out over p's ids (0 where q has none); q's mass outside p's support has no residual."""
    out = np.zeros(p_ids.shape[0], dtype=np.float64)
    order = np.argsort(p_ids, kind="stable")
    where = np.searchsorted(p_ids, q_ids, sorter=order)
    where = np.clip(where, 0, len(order) - 1)
    slots = order[where]
    found = p_ids[slots] == q_ids
    out[slots[found]] = q_probs[found]
    return out


@dataclass(frozen=True)
class Verifiers:
    """How an engine builds its verifiers: `match(sampler, target_ctx)`, `sample(distribution, rng, target_ctx,
    n_vocab)`, and for draft trees `tree(sample_row)` (`sample_row(row)`: a sample of a row of the last target decode
    under the request's sampler), and for drawn trees `tree_sample(distribution, rng)` (`distribution(row)`: a row of
    the last target decode as the request's sampler makes it). Pass another set to `Engine(verifiers=...)` to check
    a variant."""

    match: Callable[[Sampler, Any], Verifier] = MatchVerifier
    sample: Callable[[SamplerDistribution, np.random.Generator, Any, int], Verifier] = RejectionVerifier
    tree: Callable[[Callable[[int], int]], TreeWalker] = TreeWalk
    tree_sample: Callable[[Callable[[int], tuple[np.ndarray, np.ndarray]], np.random.Generator],
                          TreeWalker] = TreeRejection


__all__ = ["DRAFT", "TARGET", "MatchVerifier", "RejectionVerifier", "TreeRejection", "TreeWalk", "Verifier",
           "Verifiers", "rejection_stage"]
