"""The EAGLE-3 method: a one-layer draft reading three target layers, as llama.cpp's `--spec-type draft-eagle3`.

An EAGLE-3 draft (architecture `eagle3`) has two graphs in one context. Its encoder fuses the target's hidden rows at
three layers (`target_layers`: the input of layer l, or the target's last hidden row for l = n_layer) into one row
g_p per position (`fc`; read back through the nextn embeddings). Its decoder, at position p, reads the pair
(token_{p+1}, g_p) — the token *after* the one whose target rows made g_p — and outputs logits for token_{p+2} and
its own pre-norm row, which stands in for g at the next position as it goes on. It borrows the target's token
embedding (and head, when it has none of its own) through `ctx_other`.

So a sequence's draft cache holds positions 0..n-2 of its n target tokens; the last, whose next token is the one the
target has just sampled (`id_last`), is the seed of every draft: (id_last, g_{pos0-1}) at pos0 - 1, then
(d_i, h_i) at pos0 - 1 + i; n drafts cost n small decodes, every drafting sequence's rows in the same ones. The seed
and drafted cells are removed afterwards (the verify rows then come in through `process`, as in llama.cpp), which
leaves the draft cache at what the target's tokens say. g rows are encoded after every target decode (llama.cpp's
`process`) and kept per sequence and position in host memory, so that after any cut of the caches the row before it
is at hand; the decoder's cells are caught up when the request drafts (`eager`) or when it resumes drafting.
Each step drafts the draft's argmax under p_min, as llama.cpp's top-10 sampler does (or samples the request's
sampler at temperature > 0: see proposal.py). The decodes and the bookkeeping are MTP's too (row_drafter.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll
from llama_cpp import llama_cpp_ext as lx

from ..errors import ContextCreationError, DecodeError, PairMismatchError
from ..files.gguf_meta import GGUFInfo
from ..files.validation import check_vocab
from ..native.batches import decode_error
from ..native.ext import DFlashApi, dflash_api
from ..native.rpc import raise_if_lost
from ..pair import LinkedPair, Threads
from .drafting import Implementation, Rows, TokenView
from .row_drafter import RowDecoder, RowDrafter

EAGLE3 = "eagle3"
N_TAPS = 3  # libllama's EAGLE-3 reads exactly three target layers


@dataclass(frozen=True)
class Eagle3Spec:
    """What the pair checked of an EAGLE-3 draft: its taps, widths and draft vocabulary."""

    target_layer_ids: tuple[int, ...]
    n_embd_target: int
    n_embd: int
    n_draft_vocab: int  # the rows of its head (the target's vocabulary when it has no d2t)


class Eagle3File:
    """An EAGLE-3 draft, as the pair opens it (pair.DraftFile)."""

    needs = EAGLE3
    kind = "an EAGLE-3 draft (architecture 'eagle3')"

    def validate(self, target: GGUFInfo, draft: GGUFInfo, capacity: int) -> Eagle3Spec:
        name = draft.path.name
        raw = draft.key("target_layers")
        if not isinstance(raw, list) or len(raw) != N_TAPS:
            raise PairMismatchError(f"{name}: an EAGLE-3 draft names exactly {N_TAPS} target layers "
                                    f"(eagle3.target_layers is {raw!r})")
        ids = tuple(int(x) for x in raw)
        bad = [i for i in ids if not 0 <= i <= target.n_layer]
        if bad:
            raise PairMismatchError(f"{name} reads target layers {bad}, outside 0..{target.n_layer} (the target's "
                                    "layer inputs, and its last hidden row at n_layer)")
        hidden = int(draft.key("target_hidden_size", 0) or 0)
        if hidden != target.n_embd:
            raise PairMismatchError(f"{name} was trained on a target of hidden size {hidden}, "
                                    f"{target.path.name} has {target.n_embd}")
        if draft.n_layer != 1:
            raise PairMismatchError(f"{name}: an EAGLE-3 draft has one decoder layer (block_count is {draft.n_layer})")
        check_vocab(target, draft, "an EAGLE-3 draft uses its target's tokenizer")
        if capacity < 1:
            raise PairMismatchError(f"a draft capacity of {capacity} tokens leaves no room for a drafted token")
        d2t = draft.tensor_shapes.get("d2t")
        return Eagle3Spec(ids, target.n_embd, draft.n_embd, int(d2t[0]) if d2t else target.n_vocab)

    def prepare_target(self, pair: LinkedPair) -> None:
        # Taps must be on before the first decode: enabling them re-reserves the compute graph.
        n_layer = int(ll.llama_model_n_layer(pair.target_model))
        for lid in pair.spec.target_layer_ids:
            if lid < n_layer:
                dflash_api().set_embeddings_layer_inp(pair.target_ctx, lid, True)
            else:  # the last hidden row, every decoded row (as the MTP head reads it)
                lx.llama_set_embeddings_nextn(pair.target_ctx, True, False)

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        # A target ubatch's rows encode (and catch up) in one pass, every sequence's draft row in one ubatch.
        params = pair.side_context_params(threads)
        if pair.batch_invariant:  # the target's attention kernels (as llama-server's -fa reaches both contexts)
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = pair.linked_draft_context(params, "EAGLE-3 draft", pair.spec.target_layer_ids)
        # g rows (encoder) and the decoder's pre-norm rows, for the output rows only.
        lx.llama_set_embeddings_nextn(ctx, True, True)
        return ctx

    def describe(self, spec: Eagle3Spec) -> dict[str, Any]:
        return {"draft_kind": EAGLE3, "block_size": None, "target_layer_ids": list(spec.target_layer_ids)}


class Encoder:
    """EAGLE-3's rows: the three tapped target layers of every decoded row, fused into its g row by the draft's
    encoder graph (a `row_drafter.RowSource`)."""

    def __init__(self, api: DFlashApi, target_ctx: Any, draft_ctx: Any, spec: Eagle3Spec, *,
                 n_layer_target: int) -> None:
        self._api = api
        self._target = target_ctx
        self._ctx = draft_ctx
        self._spec = spec
        self._n_layer_target = n_layer_target
        self._n_ubatch = int(ll.llama_n_ubatch(draft_ctx))
        self._features = np.zeros((self._n_ubatch, N_TAPS * spec.n_embd_target), dtype=np.float32)
        self._pos = (ll.llama_pos * 4)()
        batch = ll.llama_batch_ext_init(draft_ctx)
        if not batch:
            raise ContextCreationError("libllama could not create a batch for the EAGLE-3 encoder")
        self._batch = batch

    def rows(self, decoded: Sequence[Rows]) -> list[np.ndarray]:
        """The g rows of the last target decode's tapped rows (they are valid until the next decode)."""
        n_rows = max(r.row0 + len(r.tokens) for r in decoded)
        width = self._spec.n_embd_target
        layers = []
        for lid in self._spec.target_layer_ids:
            ptr = (self._api.get_embeddings_layer_inp(self._target, lid) if lid < self._n_layer_target
                   else lx.llama_get_embeddings_nextn(self._target))
            if not ptr:
                raise DecodeError(f"target layer {lid} rows were not extracted (taps not enabled?)")
            layers.append(np.ctypeslib.as_array(ptr, shape=(n_rows, width)))
        out = []
        for r in decoded:
            g = np.empty((len(r.tokens), self._spec.n_embd), dtype=np.float32)
            for start in range(0, len(r.tokens), self._n_ubatch):
                n = min(self._n_ubatch, len(r.tokens) - start)
                src = r.row0 + start
                for k, layer in enumerate(layers):
                    self._features[:n, k * width:(k + 1) * width] = layer[src:src + n]
                g[start:start + n] = self._encode(n)
            out.append(g)
        return out

    def _encode(self, n: int) -> np.ndarray:
        """g rows of the first n feature rows: the draft's encoder graph (positions are placeholders to it)."""
        batch = self._batch
        ll.llama_batch_ext_clear(batch)
        base = self._features.ctypes.data
        stride = self._features.strides[0]
        f32p = ctypes.POINTER(ctypes.c_float)
        first = int(ll.llama_memory_seq_pos_max(ll.llama_get_memory(self._ctx), 0)) + 1  # as llama.cpp places them
        for i in range(n):
            embd = ll.llama_embd(ctypes.cast(base + i * stride, f32p), 1, self._features.shape[1])
            idx = ll.llama_batch_ext_add_embd(batch, 0, embd)
            if idx < 0:
                raise DecodeError(f"the EAGLE-3 encoder batch refused feature row {i} (error {idx})")
            self._pos[0] = self._pos[1] = self._pos[2] = first + i
            if not (ll.llama_batch_ext_set_pos(batch, idx, self._pos)
                    and ll.llama_batch_ext_set_output_embd(batch, idx, True)):
                raise DecodeError(f"the EAGLE-3 encoder batch refused the row {i}")
        rc = int(ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_ENCODE, batch))
        raise_if_lost(self._ctx)
        if rc != 0:
            raise decode_error("EAGLE-3 encoder", rc, n)
        ptr = lx.llama_get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the EAGLE-3 encoder produced no g rows")
        return np.ctypeslib.as_array(ptr, shape=(n, self._spec.n_embd))

    def free(self) -> None:
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None


def open_drafter(pair: LinkedPair, views: Sequence[TokenView], capacity: int) -> RowDrafter:
    """Cell p of the decoder: (token_{p+1}, g_p), every drafting sequence's draft in the same decodes."""
    n_ubatch = int(ll.llama_n_ubatch(pair.draft_ctx))
    encoder = Encoder(dflash_api(), pair.target_ctx, pair.draft_ctx, pair.spec,
                      n_layer_target=int(ll.llama_model_n_layer(pair.target_model)))
    decoder = RowDecoder(pair.draft_ctx, "EAGLE-3", views, width=pair.spec.n_embd, n_vocab=pair.n_vocab,
                         n_batch=n_ubatch, capacity=capacity, lag=1)
    return RowDrafter(EAGLE3, decoder, encoder, capacity)


IMPLEMENTATION = Implementation(open_drafter, draft_file=Eagle3File())
