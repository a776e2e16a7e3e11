"""The DFlash method: target features injected into a linked draft context, one block drafted per round.

`DFlashDrafter` is the method behind the drafter interface (drafting.py): it owns the feature bridge (target layer
taps → draft KV) and decides when rows are injected. `BlockDrafter` drafts one block: `[id_last, mask × n]` decoded
in a single pass.

Greedy (temperature 0, and sample-and-match verification): DFlash 2 walks its candidate lattice greedily over the
selector's transition scores, DFlash v1 takes the argmax of the draft logits at each mask position.

Stochastic (rejection-sampling verification at temperature > 0): each drafted token is sampled from a distribution
q that is recorded with it, because the verifier's guarantee rests on exactly those probabilities. DFlash 2 samples
its lattice walk: at position i, q(· | previous) is the request's chain (top-k, top-p, min-p, temperature) over the
K candidates scored from the candidate actually sampled at i − 1. DFlash v1 samples each mask position from the
request's chain over the draft logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .drafting import DFLASH
from .errors import DecodeError
from .features import FeatureBridge
from .memory import SequenceMemory
from .native import DFlashApi
from .proposal import DraftSampling, Proposal, draw
from .states import WHOLE, load_seq, save_seq
from .validation import DraftSpec


class BlockDrafter:
    def __init__(self, api: DFlashApi, draft_ctx: Any, spec: DraftSpec, n_embd_draft: int, n_vocab: int) -> None:
        self._api = api
        self._ctx = draft_ctx
        self._memory = SequenceMemory(draft_ctx, "draft")
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
            removed = self._memory.remove_from(pos0)
        if not removed:
            raise self._memory.refused(f"drop its block at position {pos0}")
        return proposal.at_least(n_min, sampling)

    def _walk_lattice(self, n_max: int, p_min: float, sampling: DraftSampling | None) -> Proposal:
        ptr = self._api.get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the DFlash 2 selector produced no lattice (nextn embeddings are off?)")
        k = self._k
        rows = np.ctypeslib.as_array(ptr, shape=(n_max + 1, self._n_embd))
        # Row i ≥ 1: [candidate ids (K) | transition scores K×K, predecessor-major].
        cands = rows[1:, :k].astype(np.int64)
        scores = rows[1:, k:k + k * k].reshape(n_max, k, k)
        out = Proposal.start(sampling)
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
        out = Proposal.start(sampling)
        for i in range(1, n_max + 1):
            ptr = ll.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise DecodeError(f"the draft produced no logits for block row {i}")
            if out.add_from_logits(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)), p_min, sampling) is None:
                break
        return out

    def free(self) -> None:
        self._batch.free()



class DFlashDrafter:
    """DFlash / DFlash 2 behind the drafter interface. Features of every target decode are copied at once (they are
    valid until the next decode); they reach the draft cache at once when `eager`, else when drafting resumes or the
    bridge is full."""

    method = DFLASH

    def __init__(self, api: DFlashApi, target_ctx: Any, draft_ctx: Any, spec: DraftSpec, *, n_embd: int,
                 n_embd_draft: int, n_vocab: int, n_ubatch: int, capacity: int) -> None:
        self.capacity = capacity
        self.spec = spec
        self._ctx = draft_ctx
        self._memory = SequenceMemory(draft_ctx, "draft")
        self.bridge = FeatureBridge(api, target_ctx, draft_ctx, spec.target_layer_ids, n_embd, n_ubatch)
        self._block = BlockDrafter(api, draft_ctx, spec, n_embd_draft, n_vocab)

    def process(self, tokens: Sequence[int], pos0: int, *, eager: bool) -> None:
        bridge = self.bridge
        bridge.capture(len(tokens), pos0)
        if eager or bridge.n_pending >= bridge.capacity:
            bridge.flush()

    def catch_up(self) -> None:
        self.bridge.flush()

    def begin(self) -> None:
        pass  # the features come with every decode (process)

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        return self._block.draft(id_last, pos0, n, n_min=n_min, p_min=p_min, sampling=sampling)

    def accept(self, n_accepted: int) -> None:
        pass  # the rejected rows go with keep()

    def keep(self, n: int) -> None:
        self.bridge.drop_from(n)
        # Attention only: removing a suffix, even an empty one, always succeeds there; the result is still checked.
        self._memory.cut(n)

    def clear(self) -> None:
        self.bridge.n_pending = 0
        self._memory.clear()

    def save(self) -> np.ndarray:
        self.bridge.flush()  # pending rows become draft cache cells, which the copy then holds
        return save_seq(self._ctx, WHOLE)

    def restore(self, state: np.ndarray) -> None:
        self.bridge.n_pending = 0
        load_seq(self._ctx, state, WHOLE)

    def state_bytes(self, state: np.ndarray) -> int:
        return int(state.nbytes)

    def free(self) -> None:
        self._block.free()
        self.bridge.free()
