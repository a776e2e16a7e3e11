"""One block draft on the draft context: `[id_last, mask × n]` decoded in a single pass.

Greedy (temperature 0, and sample-and-match verification): DFlash 2 walks its candidate lattice greedily over the
selector's transition scores, DFlash v1 takes the argmax of the draft logits at each mask position.

Stochastic (rejection-sampling verification at temperature > 0): each drafted token is sampled from a distribution
q that is recorded with it, because the verifier's guarantee rests on exactly those probabilities. DFlash 2 samples
its lattice walk: at position i, q(· | previous) is the request's chain (top-k, top-p, min-p, temperature) over the
K candidates scored from the candidate actually sampled at i − 1. DFlash v1 samples each mask position from the
request's chain over the draft logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .errors import DecodeError, RollbackError
from .native import DFlashApi
from .sampling import ChainProbabilities, draw
from .validation import DraftSpec

V1_TOP_K = 10  # v1 confidence is the softmax over the top candidates, as in llama.cpp's draft sampler


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


class BlockDrafter:
    def __init__(self, api: DFlashApi, draft_ctx: Any, spec: DraftSpec, n_embd_draft: int, n_vocab: int) -> None:
        self._api = api
        self._ctx = draft_ctx
        self._mem = ll.llama_get_memory(draft_ctx)
        self._spec = spec
        self._n_embd = n_embd_draft
        self._n_vocab = n_vocab
        self._k = spec.selector_top_k
        self._batch = TokenBatch(spec.block_size)
        self._block = np.full(spec.block_size, spec.mask_token_id, dtype=np.int32)

    def draft(self, id_last: int, pos0: int, n_max: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        """Draft up to n_max tokens following id_last (decoded at pos0); the block's cells are removed afterwards."""
        block = self._block[:n_max + 1]
        block[0] = id_last
        block[1:] = self._spec.mask_token_id
        self._batch.fill(block, pos0, outputs="none" if self._spec.is_dflash2 else "all")
        try:
            self._batch.decode(self._ctx, "draft block")
            if self._spec.is_dflash2:
                proposal = self._walk_lattice(n_max, p_min, sampling)
            else:
                proposal = self._per_position(n_max, p_min, sampling)
        finally:
            # The block's K/V must go before the verify rows' features are injected at the same positions. A failed
            # removal is raised here only when nothing else is being raised: it must not hide a decode error.
            removed = ll.llama_memory_seq_rm(self._mem, 0, pos0, -1)
        if not removed:
            raise RollbackError(f"the draft cache refused to drop its block at position {pos0}")
        return proposal if len(proposal.tokens) >= n_min else Proposal(q=[] if sampling else None)

    def _walk_lattice(self, n_max: int, p_min: float, sampling: DraftSampling | None) -> Proposal:
        ptr = self._api.get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the DFlash 2 selector produced no lattice (nextn embeddings are off?)")
        k = self._k
        rows = np.ctypeslib.as_array(ptr, shape=(n_max + 1, self._n_embd))
        # Row i ≥ 1: [candidate ids (K) | transition scores K×K, predecessor-major].
        cands = rows[1:, :k].astype(np.int64)
        scores = rows[1:, k:k + k * k].reshape(n_max, k, k)
        out = Proposal(q=[] if sampling else None)
        pred = 0
        for i in range(n_max):
            s = scores[i, pred]
            if sampling is None:
                best = int(np.argmax(s))
                if p_min > 0.0 and 1.0 / float(np.exp(s - s[best]).sum()) < p_min:
                    break
                out.tokens.append(int(cands[i, best]))
                pred = best
                continue
            ids, probs = sampling.chain(s.astype(np.float32), cands[i].astype(np.int32))
            if p_min > 0.0 and float(probs.max()) < p_min:
                break
            pick = draw(probs, sampling.rng)
            token = int(ids[pick])
            out.tokens.append(token)
            out.q.append((ids, probs))  # type: ignore[union-attr]
            pred = int(np.flatnonzero(cands[i] == token)[0])
        return out

    def _per_position(self, n_max: int, p_min: float, sampling: DraftSampling | None) -> Proposal:
        out = Proposal(q=[] if sampling else None)
        for i in range(1, n_max + 1):
            ptr = ll.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise DecodeError(f"the draft produced no logits for block row {i}")
            logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            if sampling is not None:
                ids, probs = sampling.chain(logits)
                if p_min > 0.0 and float(probs.max()) < p_min:
                    break
                out.tokens.append(int(ids[draw(probs, sampling.rng)]))
                out.q.append((ids, probs))  # type: ignore[union-attr]
                continue
            best = int(np.argmax(logits))
            if p_min > 0.0:
                top = logits[np.argpartition(logits, -V1_TOP_K)[-V1_TOP_K:]]
                if 1.0 / float(np.exp(top - logits[best]).sum()) < p_min:
                    break
            out.tokens.append(best)
        return out

    def free(self) -> None:
        self._batch.free()

