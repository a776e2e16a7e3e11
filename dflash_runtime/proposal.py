"""What a drafter proposes and what the verifier reads: the drafted tokens, the distributions they were sampled from,
and the names of the two sources an emitted token can come from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import ChainProbabilities

DRAFT, TARGET = "draft", "target"  # an accepted draft token; the target's own sample that ends a verify walk


@dataclass
class Proposal:
    """Drafted tokens and, when they were sampled, the distribution each was sampled from (token ids, probs)."""

    tokens: list[int] = field(default_factory=list)
    q: list[tuple[np.ndarray, np.ndarray]] | None = None

    def cut(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], None if self.q is None else self.q[:n])


@dataclass
class DraftSampling:
    """What a stochastic draft needs: the request's chain as probabilities, and the request's random generator."""

    chain: ChainProbabilities
    rng: np.random.Generator
