"""The MTP method: the target's own multi-token-prediction (nextn) head drafts, as llama.cpp's `draft-mtp` does.

The MTP context is a second context of the target model (`ctx_type = LLAMA_CONTEXT_TYPE_MTP`); its KV cache holds
the nextn layer only. Its input at position p is the pair (token_p, h_{p-1}), h being the target's nextn hidden row
(`llama_get_embeddings_nextn`, output for every row of every target decode). Drafting decodes `id_last` at pos0 with
h_{pos0-1}, takes the head's best token and its own hidden row, and chains: n drafts cost n small decodes. The
drafted cells are removed afterwards; the verify batch's rows then come in through `process`, as in llama.cpp.

Every sequence of the engine drafts in the same chained decodes: step i holds row i of each drafting sequence.
The target's hidden rows are kept per sequence and position in host memory (n_embd floats per cached token), so
that after any cut of the caches — a rejected draft, a new request sharing a prefix — the row before the cut is at
hand, and rows of plain decoding can reach the MTP context later, in one batch, only when a request drafts with MTP.
Their tokens are read from each sequence's target cache, through the views the drafter is opened with.
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
from .drafting import MTP, DraftAsk, Implementation, Rows
from .errors import ContextCreationError, DecodeError, PairMismatchError
from .gguf_meta import GGUFInfo
from .memory import DraftSequence
from .pair import LinkedPair, Threads, new_context
from .proposal import Proposal
from .rpc import raise_if_lost


@dataclass
class _Parked:
    kv: np.ndarray
    hidden: np.ndarray


class _Sequence(DraftSequence):
    """What the drafter keeps of one sequence: the target's row per position, and how far the MTP context got
    (n_known: positions whose token and target row are held)."""

    def __init__(self, ctx: Any, seq: int, n_embd: int) -> None:
        super().__init__(ctx, "MTP", seq)
        self.hidden = np.zeros((256, n_embd), dtype=np.float32)  # target row per position, grown on demand

    def grow(self, n: int) -> None:
        if n > len(self.hidden):
            hidden = np.zeros((max(n, 2 * len(self.hidden)), self.hidden.shape[1]), dtype=np.float32)
            hidden[:len(self.hidden)] = self.hidden
            self.hidden = hidden


class MTPDrafter:
    method = MTP

    def __init__(self, target_ctx: Any, mtp_ctx: Any, views: Sequence[Sequence[int]], *, n_embd: int, n_vocab: int,
                 n_batch: int, capacity: int) -> None:
        self.capacity = capacity
        self._views = views  # each sequence's target-cache tokens (read only)
        self._target = target_ctx
        self._ctx = mtp_ctx
        self._seqs = [_Sequence(mtp_ctx, seq, n_embd) for seq in range(len(views))]
        self._n_embd = n_embd
        self._n_vocab = n_vocab
        self._n_batch = n_batch
        self._zero = np.zeros(n_embd, dtype=np.float32)  # h_{-1}: what llama.cpp pairs with the first token
        self._chain = np.zeros((len(views), capacity + 1, n_embd), dtype=np.float32)
        self._pos = (ll.llama_pos * 4)()
        batch = ll.llama_batch_ext_init(mtp_ctx)
        if not batch:
            raise ContextCreationError("libllama could not create a batch for the MTP context")
        self._batch = batch

    # -- the target's rows --------------------------------------------------------------------------------------

    def process(self, rows: Sequence[Rows]) -> None:
        if not rows:
            return
        ptr = lx.llama_get_embeddings_nextn(self._target)
        if not ptr:
            raise DecodeError("the target produced no nextn hidden rows (MTP needs them for every decoded row)")
        n_batch_rows = max(r.row0 + len(r.tokens) for r in rows)
        hidden = np.ctypeslib.as_array(ptr, shape=(n_batch_rows, self._n_embd))
        for r in rows:
            n, state = len(r.tokens), self._seqs[r.seq]
            state.grow(r.pos0 + n)
            state.hidden[r.pos0:r.pos0 + n] = hidden[r.row0:r.row0 + n]
            state.known(r.pos0, n)
        eager = [r.seq for r in rows if r.eager]
        if eager:
            self.catch_up(eager)

    def catch_up(self, seqs: Sequence[int]) -> None:
        """Decode the positions the MTP context lacks, for these sequences together, in batches: (token_p, h_{p-1})."""
        while True:
            ll.llama_batch_ext_clear(self._batch)
            room, fed = self._n_batch, []
            for seq in seqs:
                state = self._seqs[seq]
                stop = min(state.n_known, state.n_fed + room)
                if stop <= state.n_fed:
                    continue
                tokens = self._views[seq]
                for p in range(state.n_fed, stop):
                    self._add(seq, int(tokens[p]), p, self._row(state, p - 1), output=False)
                room -= stop - state.n_fed
                fed.append((state, stop))
                if room == 0:
                    break
            if not fed:
                return
            self._process(f"MTP catch-up at {fed[0][0].n_fed}")
            for state, stop in fed:
                state.n_fed = stop

    def begin(self, seq: int) -> None:
        pass  # the rows come with every decode (process)

    # -- drafting -----------------------------------------------------------------------------------------------

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Every ask's chain in the same decodes: step i decodes the i-th row of each ask still drafting."""
        self.catch_up([a.seq for a in asks])
        out = [Proposal.start(a.sampling) for a in asks]
        current = [(a.id_last, self._row(self._seqs[a.seq], a.pos0 - 1)) for a in asks]
        going = [i for i, a in enumerate(asks) if a.n > 0]
        try:
            step = 0
            while going:
                ll.llama_batch_ext_clear(self._batch)
                for i in going:
                    token, h = current[i]
                    self._add(asks[i].seq, token, asks[i].pos0 + step, h, output=True)
                self._process("MTP draft step")
                still = []
                for row, i in enumerate(going):
                    ask = asks[i]
                    ptr = ll.llama_get_logits_ith(self._ctx, row)
                    if not ptr:
                        raise DecodeError("the MTP head produced no logits")
                    logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
                    token = out[i].add_from_logits(logits, ask.p_min, ask.sampling)
                    if token is None:
                        continue
                    h_ptr = lx.llama_get_embeddings_nextn_ith(self._ctx, row)
                    if not h_ptr:
                        raise DecodeError("the MTP head produced no hidden row")
                    chain = self._chain[ask.seq]
                    chain[step + 1] = np.ctypeslib.as_array(h_ptr, shape=(self._n_embd,))
                    current[i] = (token, chain[step + 1])
                    if step + 1 < ask.n:
                        still.append(i)
                going = still
                step += 1
        finally:
            refused = [a for a in asks if not self._seqs[a.seq].drop_drafts(a.pos0)]  # verify rows come next
        if refused:
            raise self._seqs[refused[0].seq].memory.refused(f"drop its drafts at position {refused[0].pos0}")
        return [p.at_least(a.n_min, a.sampling) for p, a in zip(out, asks, strict=True)]

    def accept(self, seq: int, n_accepted: int) -> None:
        pass  # the target row of every kept position is held; keep() drops the rest

    # -- the cache ----------------------------------------------------------------------------------------------

    def keep(self, seq: int, n: int) -> None:
        self._seqs[seq].keep(n)

    def clear(self, seq: int) -> None:
        self._seqs[seq].clear()

    def save(self, seq: int) -> _Parked:
        self.catch_up([seq])
        state = self._seqs[seq]
        return _Parked(state.save(), state.hidden[:state.n_known].copy())

    def restore(self, seq: int, parked: _Parked) -> None:
        state = self._seqs[seq]
        n = len(parked.hidden)
        state.restore(parked.kv, n)
        state.grow(n)
        state.hidden[:n] = parked.hidden

    def state_bytes(self, state: _Parked) -> int:
        return int(state.kv.nbytes + state.hidden.nbytes)

    def free(self) -> None:
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None

    # -- internals ----------------------------------------------------------------------------------------------

    def _row(self, state: _Sequence, p: int) -> np.ndarray:
        return state.hidden[p] if p >= 0 else self._zero

    def _add(self, seq: int, token: int, pos: int, h: np.ndarray, *, output: bool) -> None:
        batch = self._batch
        idx = ll.llama_batch_ext_add_token(batch, seq, token)
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
        raise_if_lost(self._ctx)
        if rc != 0:
            raise decode_error(what, rc, 0)


NEXTN = "nextn"  # what the pair holds once the MTP context is open


class MTPHead:
    """The MTP context, a part of the target the pair opens (pair.TargetPart): the target model again, its nextn
    head's graph, a KV cache of the nextn layer only."""

    needs = NEXTN

    def wanted(self, target: GGUFInfo, required: bool) -> bool:
        if required and target.n_nextn == 0:
            raise PairMismatchError(f"{target.path.name} has no MTP head (nextn_predict_layers is 0)")
        return target.n_nextn > 0

    def prepare_load(self, params: Any) -> None:
        params.load_mtp = True  # the nextn layers' tensors are skipped unless asked for

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        if int(ll.llama_model_n_layer_nextn(pair.target_model)) < 1:
            raise ContextCreationError("libllama reads no nextn layer in the target")
        params = ll.llama_context_default_params()
        params.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        params.n_batch = params.n_ubatch = pair.n_ubatch
        params.n_seq_max = pair.parallel
        params.kv_unified = False
        params.n_ctx = pair.n_ctx * pair.parallel
        params.n_rs_seq = 0
        threads.apply(params)
        return new_context(pair.target_model, params, "MTP")

    def link(self, pair: LinkedPair, ctx: Any) -> None:
        # The target outputs its nextn hidden row for every decoded row (before its first decode: this re-reserves
        # the graph); the MTP context for its output rows only.
        lx.llama_set_embeddings_nextn(pair.target_ctx, True, False)
        lx.llama_set_embeddings_nextn(ctx, True, True)

    def placement(self, pair: LinkedPair) -> dict[str, Any]:
        trunk = pair.target_info.n_layer - pair.target_info.n_nextn
        return {"mtp_head": pair.target_layers.get(trunk)}


def open_drafter(pair: LinkedPair, views: Sequence[Sequence[int]], capacity: int) -> MTPDrafter:
    return MTPDrafter(pair.target_ctx, pair.parts[NEXTN], views, n_embd=pair.n_embd_out, n_vocab=pair.n_vocab,
                      n_batch=pair.n_ubatch, capacity=capacity)


IMPLEMENTATION = Implementation(open_drafter, target_part=MTPHead())
