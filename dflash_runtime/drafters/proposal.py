"""What a drafter proposes and what the verifier reads: the drafted tokens, the distributions they were sampled from,
and the names of the two sources an emitted token can come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the drafters' side stays free of libllama: the Space's web process lists methods through it
    from ..native.sampling import SamplerDistribution

DRAFT, TARGET = "draft", "target"  # an accepted draft token; the target's own sample that ends a verify walk
CONFIDENCE_TOP_K = 10  # a greedy draft's confidence: the softmax over its top candidates, as llama.cpp's draft sampler


@dataclass
class Proposal:
    """Drafted tokens and, when they were sampled, the distribution each was sampled from (token ids, probs); with a
    draft tree, the tokens (and their q) are its spine, the linear draft."""

    tokens: list[int] = field(default_factory=list)
    q: list[tuple[np.ndarray, np.ndarray]] | None = None
    tree: Any = None  # a tree.DraftTree (tree.py builds on this module): `tokens` is then the tree's spine

    @classmethod
    def start(cls, sampling: DraftSampling | None) -> Proposal:
        """An empty proposal; a sampled one records each token's distribution."""
        return cls(q=[] if sampling is not None else None)

    def at_least(self, n_min: int, sampling: DraftSampling | None) -> Proposal:
        """This proposal, or an empty one when it is shorter than `n_min` (llama.cpp's draft n_min)."""
        return self if len(self.tokens) >= n_min else Proposal.start(sampling)

    def add_from_logits(self, logits: np.ndarray, p_min: float, sampling: DraftSampling | None) -> int | None:
        """Draft one token from a position's logits and append it: the argmax, or a sample of the request's sampler
        (its distribution recorded). None, and nothing appended, when the draft is less confident than `p_min`."""
        if sampling is not None:
            ids, probs = sampling.distribution(logits)
            if p_min > 0.0 and float(probs.max()) < p_min:
                return None
            token = int(ids[draw(probs, sampling.rng)])
            assert self.q is not None
            self.q.append((ids, probs))
        else:
            token = int(np.argmax(logits))
            if p_min > 0.0:
                top = logits[np.argpartition(logits, -CONFIDENCE_TOP_K)[-CONFIDENCE_TOP_K:]]
                if 1.0 / float(np.exp(top - logits[token]).sum()) < p_min:
                    return None
        self.tokens.append(token)
        return token


@dataclass
class DraftSampling:
    """What a stochastic draft needs: the request's sampler as probabilities, and the request's random generator."""

    distribution: SamplerDistribution
    rng: np.random.Generator


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn from `probs` (non-negative, summing to about 1) by inverting its cumulative sum."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(probs) - 1)
