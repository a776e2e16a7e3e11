"""The MTP method: the target's own multi-token-prediction (nextn) head drafts, as llama.cpp's `draft-mtp` does.

The MTP context is a second context of the target model (`ctx_type = LLAMA_CONTEXT_TYPE_MTP`); its KV cache holds
the nextn layer only. Its input at position p is the pair (token_p, h_{p-1}), h being the target's nextn hidden row
(`llama_get_embeddings_nextn`, output for every row of every target decode). Drafting decodes `id_last` at pos0 with
h_{pos0-1}, takes the head's best token and its own hidden row, and chains: n drafts cost n small decodes. The
drafted cells are removed afterwards; the verify batch's rows then come in through `process`, as in llama.cpp.

The target's hidden rows are kept per position in host memory (n_embd floats per cached token), so that after any
cut of the caches — a rejected draft, a new request sharing a prefix — the row before the cut is at hand, and rows
of plain decoding can reach the MTP context later, in one batch, only when a request drafts with MTP. Their tokens
are read from the target cache's own list, through the view the drafter is opened with.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll
from llama_cpp import llama_cpp_ext as lx

from .batches import decode_error
from .drafting import MTP
from .errors import ContextCreationError, DecodeError
from .memory import SequenceMemory
from .proposal import DraftSampling, Proposal
from .states import WHOLE, load_seq, save_seq


@dataclass
class _Parked:
    kv: np.ndarray
    hidden: np.ndarray


class MTPDrafter:
    method = MTP

    def __init__(self, target_ctx: Any, mtp_ctx: Any, tokens: Sequence[int], *, n_embd: int, n_vocab: int,
                 n_batch: int, capacity: int) -> None:
        self.capacity = capacity
        self._tokens = tokens  # the target cache's tokens (read only)
        self._target = target_ctx
        self._ctx = mtp_ctx
        self._memory = SequenceMemory(mtp_ctx, "MTP")
        self._n_embd = n_embd
        self._n_vocab = n_vocab
        self._n_batch = n_batch
        self._hidden = np.zeros((256, n_embd), dtype=np.float32)  # target row per position, grown on demand
        self._zero = np.zeros(n_embd, dtype=np.float32)  # h_{-1}: what llama.cpp pairs with the first token
        self._chain = np.zeros((capacity + 1, n_embd), dtype=np.float32)
        self._pos = (ll.llama_pos * 4)()
        self.n_known = 0  # positions whose token and target row are held (the target cache's length)
        self.n_fed = 0    # positions decoded into the MTP context
        batch = ll.llama_batch_ext_init(mtp_ctx)
        if not batch:
            raise ContextCreationError("libllama could not create a batch for the MTP context")
        self._batch = batch

    # -- the target's rows --------------------------------------------------------------------------------------

    def process(self, tokens: Sequence[int], pos0: int, *, eager: bool) -> None:
        n = len(tokens)
        ptr = lx.llama_get_embeddings_nextn(self._target)
        if not ptr:
            raise DecodeError("the target produced no nextn hidden rows (MTP needs them for every decoded row)")
        self._grow(pos0 + n)
        self._hidden[pos0:pos0 + n] = np.ctypeslib.as_array(ptr, shape=(n, self._n_embd))
        self.keep(pos0)
        self.n_known = pos0 + n
        if eager:
            self.catch_up()

    def catch_up(self) -> None:
        """Decode the positions the MTP context lacks, in batches: (token_p, h_{p-1})."""
        while self.n_fed < self.n_known:
            stop = min(self.n_known, self.n_fed + self._n_batch)
            ll.llama_batch_ext_clear(self._batch)
            for p in range(self.n_fed, stop):
                self._add(int(self._tokens[p]), p, self._row(p - 1), output=False)
            self._process(f"MTP catch-up at {self.n_fed}")
            self.n_fed = stop

    def begin(self) -> None:
        pass  # the rows come with every decode (process)

    # -- drafting -----------------------------------------------------------------------------------------------

    def draft(self, id_last: int, pos0: int, n: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        self.catch_up()
        out = Proposal.start(sampling)
        token, h = id_last, self._row(pos0 - 1)
        try:
            for i in range(n):
                ll.llama_batch_ext_clear(self._batch)
                self._add(token, pos0 + i, h, output=True)
                self._process("MTP draft step")
                ptr = ll.llama_get_logits_ith(self._ctx, -1)
                if not ptr:
                    raise DecodeError("the MTP head produced no logits")
                token = out.add_from_logits(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)), p_min, sampling)
                if token is None:
                    break
                h_ptr = lx.llama_get_embeddings_nextn_ith(self._ctx, -1)
                if not h_ptr:
                    raise DecodeError("the MTP head produced no hidden row")
                self._chain[i + 1] = np.ctypeslib.as_array(h_ptr, shape=(self._n_embd,))
                h = self._chain[i + 1]
        finally:
            removed = self._memory.remove_from(pos0)  # the drafted cells; verify rows come next
        if not removed:
            raise self._memory.refused(f"drop its drafts at position {pos0}")
        self.n_fed = min(self.n_fed, pos0)
        return out.at_least(n_min, sampling)

    def accept(self, n_accepted: int) -> None:
        pass  # the target row of every kept position is held; keep() drops the rest

    # -- the cache ----------------------------------------------------------------------------------------------

    def keep(self, n: int) -> None:
        self.n_known = min(self.n_known, n)
        if self.n_fed > n:
            self._memory.cut(n)
            self.n_fed = n

    def clear(self) -> None:
        self._memory.clear()
        self.n_known = self.n_fed = 0

    def save(self) -> _Parked:
        self.catch_up()
        n = self.n_known
        return _Parked(save_seq(self._ctx, WHOLE), self._hidden[:n].copy())

    def restore(self, state: _Parked) -> None:
        load_seq(self._ctx, state.kv, WHOLE)
        n = len(state.hidden)
        self._grow(n)
        self._hidden[:n] = state.hidden
        self.n_known = self.n_fed = n

    def state_bytes(self, state: _Parked) -> int:
        return int(state.kv.nbytes + state.hidden.nbytes)

    def free(self) -> None:
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None

    # -- internals ----------------------------------------------------------------------------------------------

    def _row(self, p: int) -> np.ndarray:
        return self._hidden[p] if p >= 0 else self._zero

    def _grow(self, n: int) -> None:
        if n > len(self._hidden):
            hidden = np.zeros((max(n, 2 * len(self._hidden)), self._n_embd), dtype=np.float32)
            hidden[:len(self._hidden)] = self._hidden
            self._hidden = hidden

    def _add(self, token: int, pos: int, h: np.ndarray, *, output: bool) -> None:
        batch = self._batch
        idx = ll.llama_batch_ext_add_token(batch, 0, token)
        if idx < 0:
            raise DecodeError(f"the MTP batch refused token {token} (error {idx})")
        self._pos[0] = pos
        embd = ll.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self._n_embd)
        ok = ll.llama_batch_ext_set_pos(batch, idx, self._pos) and ll.llama_batch_ext_set_embd_token(batch, idx, embd)
        if ok and output:
            ok = ll.llama_batch_ext_set_output_logits(batch, idx, True)
        if not ok:
            raise DecodeError(f"the MTP batch refused the row of position {pos}")

    def _process(self, what: str) -> None:
        rc = int(ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch))
        if rc != 0:
            raise decode_error(what, rc, 0)
