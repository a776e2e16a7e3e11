"""One block draft on the draft context: `[id_last, mask × n]` decoded in a single pass.

DFlash 2 reads a candidate lattice from the nextn rows and walks it greedily over the selector's transition scores;
DFlash v1 takes the argmax of the draft logits at each mask position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .errors import DecodeError, RollbackError
from .native import DFlashApi
from .validation import DraftSpec

V1_TOP_K = 10  # v1 confidence is the softmax over the top candidates, as in llama.cpp's draft sampler


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

    def draft(self, id_last: int, pos0: int, n_max: int, *, n_min: int = 0, p_min: float = 0.0) -> list[int]:
        """Draft up to n_max tokens following id_last (decoded at pos0); the block's cells are removed afterwards."""
        block = self._block[:n_max + 1]
        block[0] = id_last
        block[1:] = self._spec.mask_token_id
        self._batch.fill(block, pos0, outputs="none" if self._spec.is_dflash2 else "all")
        try:
            self._batch.decode(self._ctx, "draft block")
            tokens = self._walk_lattice(n_max, p_min) if self._spec.is_dflash2 else self._argmax(n_max, p_min)
        finally:
            # The block's K/V must go before the verify rows' features are injected at the same positions.
            if not ll.llama_memory_seq_rm(self._mem, 0, pos0, -1):
                raise RollbackError(f"the draft cache refused to drop its block at position {pos0}")
        return tokens if len(tokens) >= n_min else []

    def _walk_lattice(self, n_max: int, p_min: float) -> list[int]:
        ptr = self._api.get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the DFlash 2 selector produced no lattice (nextn embeddings are off?)")
        k = self._k
        rows = np.ctypeslib.as_array(ptr, shape=(n_max + 1, self._n_embd))
        # Row i ≥ 1: [candidate ids (K) | transition scores K×K, predecessor-major].
        cands = rows[1:, :k]
        scores = rows[1:, k:k + k * k].reshape(n_max, k, k)
        out: list[int] = []
        pred = 0
        for i in range(n_max):
            s = scores[i, pred]
            best = int(np.argmax(s))
            if p_min > 0.0 and 1.0 / float(np.exp(s - s[best]).sum()) < p_min:
                break
            out.append(int(cands[i, best]))
            pred = best
        return out

    def _argmax(self, n_max: int, p_min: float) -> list[int]:
        out: list[int] = []
        for i in range(1, n_max + 1):
            ptr = ll.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise DecodeError(f"the draft produced no logits for block row {i}")
            logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            best = int(np.argmax(logits))
            if p_min > 0.0:
                top = logits[np.argpartition(logits, -V1_TOP_K)[-V1_TOP_K:]]
                if 1.0 / float(np.exp(top - logits[best]).sum()) < p_min:
                    break
            out.append(best)
        return out

    def free(self) -> None:
        self._batch.free()
